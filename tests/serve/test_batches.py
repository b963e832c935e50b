"""RequestRunner: the requests a Triton instance is handed, run as pipeline calls and split back.

A real pipeline underneath (the trained YOLOv8n bundle with a letterbox stage, on the CPU), watched
by a spy that records each call's input shapes."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from deepjit_compiler.errors import RuntimeInputError
from deepjit_compiler.runtime.cpu import CpuPipeline
from deepjit_compiler.runtime.run import run_bundle
from deepjit_compiler.serve.batches import RequestRunner, box_mapping
from deepjit_compiler.surgery.references import letterbox_numpy


class Spy:
    def __init__(self, pipe):
        self.pipe, self.layout, self.calls = pipe, pipe.layout, []

    def __call__(self, feeds):
        self.calls.append({k: v.shape for k, v in feeds.items()})
        return self.pipe(feeds)


def bgr(png) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(Image.open(png).convert("RGB"))[..., ::-1])


@pytest.fixture(scope="module")
def images_pipe(real_bundles):
    with CpuPipeline.load(real_bundles["gpu_letterbox"]) as pipe:
        yield pipe


def same_detections(a: dict, b: dict, box_atol: float = 1e-3) -> None:
    n = int(a["num_dets"].reshape(-1)[0])
    assert n == int(b["num_dets"].reshape(-1)[0]) > 0
    np.testing.assert_array_equal(a["classes"][0, :n], b["classes"][0, :n])
    np.testing.assert_allclose(a["scores"][0, :n], b["scores"][0, :n], atol=1e-5)
    np.testing.assert_allclose(a["boxes"][0, :n], b["boxes"][0, :n], atol=box_atol)


def test_boxes_come_back_in_the_pixels_of_each_image_as_deepjit_run_maps_them(real_bundles, photos, images_pipe):
    runner = RequestRunner(images_pipe)
    assert runner.mapping is not None and runner.mapping.images == "raw_images"
    pngs = list(photos.values())
    results = runner.run([{"raw_images": bgr(p)[None]} for p in pngs])
    records = run_bundle(real_bundles["gpu_letterbox"], pngs, device="cpu")["results"]
    for result, record in zip(results, records):
        n = int(result["num_dets"][0])
        assert record["boxes_in"] == "image" and n == record["num_dets"] > 0
        assert [int(c) for c in result["classes"][0, :n]] == [d["class"] for d in record["detections"]]
        np.testing.assert_allclose(result["boxes"][0, :n], [d["box"] for d in record["detections"]], atol=1e-3)
        np.testing.assert_allclose(result["scores"][0, :n], [d["score"] for d in record["detections"]], atol=1e-6)


def test_requests_of_one_shape_run_as_one_call_and_are_split_back(photos, images_pipe):
    spy = Spy(images_pipe)
    image = bgr(photos["astronaut"])
    mirrored = np.ascontiguousarray(image[:, ::-1])
    together = RequestRunner(spy).run([{"raw_images": image[None]}, {"raw_images": mirrored[None]}])
    assert spy.calls == [{"raw_images": (2, 512, 512, 3)}]
    alone = [RequestRunner(images_pipe).run([{"raw_images": x[None]}])[0] for x in (image, mirrored)]
    for a, b in zip(together, alone):
        assert {k: v.shape[0] for k, v in a.items()} == dict.fromkeys(a, 1)
        same_detections(a, b)
    assert int(together[0]["num_dets"][0]) != 0 and not np.array_equal(together[0]["boxes"], together[1]["boxes"])


def test_calls_keep_to_the_max_batch_and_to_one_shape(photos, images_pipe):
    spy = Spy(images_pipe)
    astronaut, coffee = bgr(photos["astronaut"])[None], bgr(photos["coffee"])[None]
    requests = [{"raw_images": x} for x in (astronaut, astronaut, astronaut, coffee, np.concatenate([coffee, coffee]))]
    results = RequestRunner(spy).run(requests)
    assert [c["raw_images"][0] for c in spy.calls] == [2, 1, 1, 2]   # max batch 2; coffee's shape apart
    assert [len(r["num_dets"]) for r in results] == [1, 1, 1, 1, 2]


def test_a_refused_request_gets_its_own_error_and_the_others_are_answered(photos, images_pipe):
    spy = Spy(images_pipe)
    image = bgr(photos["chelsea"])[None]
    tiny = np.random.default_rng(0).integers(0, 256, (1, 16, 16, 3), dtype=np.uint8)
    results = RequestRunner(spy).run([{"raw_images": image}, {"raw_images": tiny}, {"raw_images": image}])
    assert isinstance(results[1], RuntimeInputError)
    assert "input 'raw_images' dim 1 is 16, allowed 32..1024" in str(results[1])
    assert spy.calls == [{"raw_images": (2, *image.shape[1:])}]      # the good two, as one call
    assert int(results[0]["num_dets"][0]) == int(results[2]["num_dets"][0]) > 0


class FailsAt(Spy):
    """A spy whose pipeline refuses calls of images `height` rows high."""

    def __init__(self, pipe, height: int):
        super().__init__(pipe)
        self.height = height

    def __call__(self, feeds):
        if feeds["raw_images"].shape[1] == self.height:
            raise RuntimeInputError(f"refused at height {self.height}")
        return super().__call__(feeds)


def test_a_call_that_fails_answers_its_own_requests_with_the_error(photos, images_pipe):
    astronaut, coffee = bgr(photos["astronaut"])[None], bgr(photos["coffee"])[None]
    spy = FailsAt(images_pipe, coffee.shape[1])
    results = RequestRunner(spy).run([{"raw_images": astronaut}, {"raw_images": coffee}, {"raw_images": coffee}])
    assert [str(r) for r in results[1:]] == [f"refused at height {coffee.shape[1]}"] * 2
    assert spy.calls == [{"raw_images": astronaut.shape}] and int(results[0]["num_dets"][0]) > 0


def test_a_bundle_without_an_image_stage_keeps_its_boxes(real_bundles, photos):
    with CpuPipeline.load(real_bundles["host_letterbox"]) as pipe:
        assert box_mapping(pipe.layout) is None
        # a photo letterboxed on the host (noise gives the trained model nothing to keep)
        x = letterbox_numpy(bgr(photos["coffee"])[None], size=320, swap_rb=True)["images"]
        result = RequestRunner(pipe).run([{"images": x}])[0]
        direct = pipe({"images": x})
    assert int(direct["num_dets"][0]) > 0
    for name, value in direct.items():
        np.testing.assert_array_equal(result[name], value)
