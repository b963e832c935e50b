"""A real trained YOLOv8 on real photos through `deepjit run`: nudenet 3.4.2's 320n.onnx (YOLOv8n,
18 classes, dynamic axes, 320 input) on scikit-image's photos. Its detections must equal ONNX Runtime
on the CPU running the model itself, with the same preprocessing and ultralytics' NMS written out
here: the same classes, boxes within 1 px of the original image. On the CPU (`--device cpu`) on
every machine; on a GPU (the gpu tests) with the letterbox on the host and on the GPU."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml
from real_bundles import CONF, IOU, SIZE, spec  # the model, photos and bundles: fixtures in conftest.py

from deepjit_compiler import build as build_module
from deepjit_compiler.build import build_pipeline
from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.runtime import gpu as gpu_mod
from deepjit_compiler.runtime.run import run_bundle
from deepjit_compiler.surgery.references import letterbox_reference
from deepjit_compiler.validation.gate import not_run


@pytest.fixture(scope="module")
def fp16_bundle(real_model, photos, tmp_path_factory) -> Path:
    """An fp16 bundle of the model (host letterbox), its levels on the photos: the engine hands the
    decode its head maps in fp16."""
    folder = tmp_path_factory.mktemp("real-fp16")
    sm = gpu_mod.Gpu().sm if gpu_mod.available() else 75
    body = spec(real_model, False, folder / "out" / "fp16", sm, precision="fp16")
    body["validation"].update({"samples": len(photos), "data": {"folder": str(next(iter(photos.values())).parent)}})
    (folder / "fp16.yaml").write_text(yaml.safe_dump(body))
    with pytest.MonkeyPatch.context() as mp:  # the GPU levels are the validation tests'
        mp.setattr(build_module, "gpu_levels", lambda path, spec, *_: [not_run("kernels", "test"),
                                                                       not_run("end_to_end", "test")])
        return build_pipeline(folder / "fp16.yaml", publish=False).bundle.path


# ----------------------------------------------------------------------------- the oracle
def ultralytics_nms(pred: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """non_max_suppression for one image's [4 + nc, A] (multi_label=False): boxes, scores, classes."""
    x = pred.T.astype(np.float64)
    scores, classes = x[:, 4:].max(1), x[:, 4:].argmax(1)
    keep = scores > CONF
    cxcywh, scores, classes = x[keep, :4], scores[keep], classes[keep]
    boxes = np.concatenate([cxcywh[:, :2] - cxcywh[:, 2:] / 2, cxcywh[:, :2] + cxcywh[:, 2:] / 2], 1)
    kept: list[int] = []
    for i in np.argsort(-scores, kind="stable"):
        others = [j for j in kept if classes[j] == classes[i]]
        if all(iou(boxes[i], boxes[j]) <= IOU for j in others):
            kept.append(int(i))
    return boxes[kept], scores[kept], classes[kept]


def iou(a: np.ndarray, b: np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def expected(model: Path, png: Path) -> tuple[np.ndarray, np.ndarray]:
    """Boxes in the photo's pixels and classes: the ONNX letterbox and the model on ONNX Runtime's CPU
    (not letterbox_numpy, which is what the host-letterbox bundle itself runs)."""
    from PIL import Image

    rgb = np.asarray(Image.open(png).convert("RGB"))
    letterbox = ort.InferenceSession(letterbox_reference(size=SIZE).SerializeToString(),
                                     providers=["CPUExecutionProvider"])
    images, ratio_pad = letterbox.run(["images", "ratio_pad"], {"raw_images": rgb[None, ..., ::-1].copy()})  # BGR in
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    boxes, _, classes = ultralytics_nms(sess.run(None, {"images": images})[0][0])
    r, left, top = (float(v) for v in ratio_pad[0])
    h, w = rgb.shape[:2]
    boxes = (boxes - [left, top, left, top]) / r
    return np.clip(boxes, 0, [w, h, w, h]), classes


def assert_same(record: dict, boxes: np.ndarray, classes: np.ndarray) -> None:
    got = record["detections"]
    assert record["boxes_in"] == "image" and len(got) == len(boxes) > 0, (record["source"], len(got), len(boxes))
    free = list(range(len(got)))
    for box, cls in zip(boxes, classes):
        j = max((j for j in free if got[j]["class"] == cls), key=lambda j: iou(box, np.array(got[j]["box"])),
                default=None)
        assert j is not None, f"{record['source']}: no class-{cls} detection for {box}"
        free.remove(j)
        assert np.abs(np.array(got[j]["box"]) - box).max() <= 1.0, (record["source"], got[j]["box"], box)


# ----------------------------------------------------------------------------- the tests
def test_cpu_run_of_a_trained_model_equals_onnxruntime(real_bundles, real_model, photos):
    result = run_bundle(real_bundles["host_letterbox"], list(photos.values()), device="cpu")
    assert result["engine"].startswith("cpu (ONNX Runtime")
    for record, png in zip(result["results"], photos.values()):
        assert record["source"] == png.name
        assert_same(record, *expected(real_model, png))


def test_fp16_bundle_of_a_trained_model_hands_the_decode_fp16_and_equals_onnxruntime(fp16_bundle, real_model, photos):
    """The head maps stay fp16 from the engine to the decode; the graph level (the cut, with that
    boundary stored in fp16 on the model's side too) and the precision level (against the fp32 model,
    on the photos) pass, and the CPU run gives the fp32 model's detections."""
    view = read_bundle(fp16_bundle)
    segment, decode = view.step("segment"), view.step("decode")
    assert {t.dtype for t in segment.outputs} == {t.dtype for t in decode.inputs} == {"float16"}
    assert [k.params["dtype"] for k in decode.kernels] == ["float16"]
    levels = view.levels
    assert levels["graph"]["status"] == "passed" and levels["precision"]["status"] == "passed"
    assert all(o["detail"] == "bit-identical" for o in levels["graph"]["outputs"].values())
    detections = levels["precision"]["outputs"]["detections"]
    found = re.search(r"in total over \d+ images: (\d+)/(\d+) matched", detections["detail"])
    assert detections["detail"].startswith("passed"), detections
    assert found and found[1] == found[2] and int(found[1]) > 0, detections
    result = run_bundle(fp16_bundle, list(photos.values()), device="cpu")
    for record, png in zip(result["results"], photos.values()):
        assert_same(record, *expected(real_model, png))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["host_letterbox", "gpu_letterbox", "fp16"])
def test_gpu_run_of_a_trained_model_equals_onnxruntime(real_bundles, fp16_bundle, real_model, photos, variant):
    if not gpu_mod.available():
        pytest.skip("needs an NVIDIA GPU")
    result = run_bundle(fp16_bundle if variant == "fp16" else real_bundles[variant], list(photos.values()))
    if ort.get_device() == "GPU":
        assert result["engine"].startswith("cuda (ONNX Runtime") and "tf32 off" in result["engine"]
    for record, png in zip(result["results"], photos.values()):
        assert_same(record, *expected(real_model, png))
