"""The runtime on a GPU: YOLOv8n bundles (ONNX Runtime CPU engine + JIT kernels) end to end.

- the pipeline equals ONNX Runtime running the bundle's own pieces (engine segment, decode and NMS
  references; letterbox reference too), compared as detection sets;
- graph replay gives exactly the plain launches' outputs, for every bucket;
- a T4 (sm_75) bundle runs here through its PTX, with the same detections;
- the steady state allocates nothing (the runtime's allocator counts; the driver's free memory agrees);
- `deepjit run` / `bench`'s implementations work on the GPU (and say the engine runs on CUDA).

Bundles come from $DEEPJIT_RUNTIME_BUNDLES (a folder with out/<variant> bundles of `write_specs`'s
specs, built with `deepjit build`) or are built here (GPU levels left to the validation tests). With
onnxruntime-gpu the engine runs on its CUDA provider: its segment outputs are checked against the CPU
provider's, and the fp16 engine's detections by the lossy metrics.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import letterbox_variant

from deepjit_compiler.errors import BundleError, RuntimeInputError
from deepjit_compiler.runtime import gpu as gpu_mod
from deepjit_compiler.validation.detections import evaluate_detections, images_from_batch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
DETS = ("num_dets", "boxes", "scores", "classes")


@pytest.fixture(scope="module")
def gpu():
    if not gpu_mod.available():
        pytest.skip("needs an NVIDIA GPU")
    return gpu_mod.Gpu()


def variant_specs(sm: int) -> dict[str, dict[str, str]]:
    """yolov8n variants of pipelines/yolov8_t4.yaml: built for this GPU (and the H200 spec's decode), for a
    T4, and with a letterbox."""
    base = {"path: ../models/yolov8s.onnx": "path: models/yolov8n.onnx", "synthesize: yolov8s": "synthesize: yolov8n",
            "file://../build/store": "file://store", "  gate: true": "  gate: false"}
    letterbox = {**letterbox_variant(), "gpu: T4 ": f"sm: {sm} "}
    # built for this GPU with the H200 spec's decode: 4 lanes an anchor, and a 2-lane kernel from batch 4; on
    # sm_90+ its nms takes clusters of 4 blocks an image, and of 2 from batch 4
    native = {"gpu: T4 ": f"sm: {sm} ", "          anchors_per_thread: 4\n": "          anchors_per_thread: 1\n"
              "          lanes_per_anchor: 4\n          large_batch_lanes: 2\n"}
    if sm >= 90:
        native["          agnostic: false\n"] = ("          agnostic: false\n          block: 1024\n          chunk: 512\n"
                                                 "          cluster: 4\n          large_batch_cluster: 2\n"
                                                 "          large_batch: 4\n")
    return {"yolov8n_native": {**base, **native}, "yolov8n_t4": dict(base),
            "yolov8n_lb": {**base, **letterbox}}


def write_specs(folder: Path, sm: int) -> dict[str, Path]:
    specs = {}
    for name, changes in variant_specs(sm).items():
        text = (REPO / "pipelines" / "yolov8_t4.yaml").read_text()
        for old, new in {**changes, "path: ../build/yolov8s_t4": f"path: out/{name}",
                         "name: yolov8s_t4": f"name: {name}"}.items():
            assert old in text, f"test bug: {old!r} is not in the spec"
            text = text.replace(old, new)
        specs[name] = folder / f"{name}.yaml"
        specs[name].write_text(text)
    return specs


@pytest.fixture(scope="session")
def bundles(tmp_path_factory) -> dict[str, Path]:
    if not gpu_mod.available():
        pytest.skip("needs an NVIDIA GPU")
    prebuilt = os.environ.get("DEEPJIT_RUNTIME_BUNDLES")
    if prebuilt:
        return {name: Path(prebuilt) / "out" / name for name in variant_specs(0)}
    from deepjit_compiler import build
    from deepjit_compiler.build import build_pipeline
    from deepjit_compiler.validation.gate import not_run

    folder = tmp_path_factory.mktemp("runtime-gpu")
    out = {}
    with pytest.MonkeyPatch.context() as mp:  # the kernels/end_to_end levels are the validation tests'
        mp.setattr(build, "gpu_levels", lambda path, spec, *_: [not_run("kernels", "runtime test"),
                                                              not_run("end_to_end", "runtime test")])
        for name, spec in write_specs(folder, gpu_mod.Gpu().sm).items():
            out[name] = build_pipeline(spec, publish=False).bundle.path
    return out


def images(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 3, 640, 640), dtype=np.float32)


def reference(bundle: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ONNX Runtime (CPU) through the bundle's steps: the engine segment and each step's reference."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    env = dict(feed)
    for step in manifest["plan"]["steps"]:
        path = bundle / (step.get("file") or step["reference"])
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        env.update(zip(names, sess.run(names, {i.name: env[i.name] for i in sess.get_inputs()})))
    return {t["name"]: env[t["name"]] for t in manifest["plan"]["outputs"]}


def assert_same_detections(ref, got, *, min_iou=0.99, score_atol=1e-4):
    """Every reference detection found and nothing else, boxes within min_iou, scores within score_atol."""
    m = evaluate_detections(images_from_batch(ref), images_from_batch(got), threshold=None)
    assert (m.total.missed, m.total.extra) == (0, 0) and m.min_iou >= min_iou and m.max_score_diff <= score_atol, \
        m.describe()
    return m


def assert_close_detections_on_cuda(ref, got):
    """The fp16 segment on the CPU provider is the reference's own engine: the same detections. On the
    CUDA provider it multiplies in fp16 (the CPU provider in fp32): on the H200 only 2 of 800
    detections met IoU 0.99 and scores within 1e-4, the end_to_end level saw 18 of 537 move against
    the fp32 model (min IoU 0.91, scores 2.7e-2), and 3 of 191 on 2x2-block noise (IoU 0.93, scores
    2.4e-2): there, the precision gate's lossy defaults."""
    m = evaluate_detections(images_from_batch(ref), images_from_batch(got), threshold=None)
    assert m.map50_95 >= 0.9 and m.recall >= 0.9 and m.precision >= 0.9, m.describe()
    assert m.total.reference > 0, "no detections: the comparison would prove nothing"


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("batch", [3, 8])
def test_pipeline_equals_onnxruntime_on_the_bundles_pieces(bundles, batch):
    from deepjit_compiler.runtime.pipeline import Pipeline

    x = images(batch, batch)
    with Pipeline.load(bundles["yolov8n_native"]) as pipe:
        assert set(pipe.code.values()) == {"cubin"}
        got = pipe({"images": x})
        engine = pipe.describe()["engine"]
    want = reference(bundles["yolov8n_native"], {"images": x})
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    if engine.startswith("cuda"):
        assert_close_detections_on_cuda(want, got)
        return
    match = assert_same_detections(want, got)
    assert match.total.reference > 0, "no detections: the comparison would prove nothing"


def test_graph_replay_equals_plain_launches_for_every_bucket(bundles):
    from deepjit_compiler.runtime.pipeline import Pipeline

    with Pipeline.load(bundles["yolov8n_native"]) as graphs, \
            Pipeline.load(bundles["yolov8n_native"], graphs=False) as plain:
        for batch in (*graphs.buckets, 3):
            x = {"images": images(100 + batch, batch)}
            a, b = graphs(x), plain(x)
            for name in DETS:
                np.testing.assert_array_equal(a[name], b[name], err_msg=f"batch {batch}: {name}")
            assert int(a["num_dets"].sum()) > 0
        assert graphs.graph_launches_per_inference() == 1 and plain.graph_launches_per_inference() == 0
        assert graphs.launches_per_inference(3) == plain.launches_per_inference(3) == 2


def test_padding_rows_do_not_change_the_real_rows(bundles):
    from deepjit_compiler.runtime.pipeline import Pipeline

    x = images(7, 4)
    with Pipeline.load(bundles["yolov8n_native"]) as pipe:
        full = pipe({"images": x})
        pipe({"images": images(8, 8)})               # leaves other data in every padding row
        three = pipe({"images": x[:3]})              # bucket 4: row 3 is padding
    assert int(full["num_dets"][:3].sum()) > 0       # detections to compare, not two empty sets
    for name in DETS:
        np.testing.assert_array_equal(three[name], full[name][:3])


def test_t4_bundle_runs_through_its_ptx(bundles, caplog):
    from deepjit_compiler.runtime.pipeline import Pipeline

    caplog.set_level(logging.WARNING, "deepjit.runtime")
    x = {"images": images(21, 2)}
    with Pipeline.load(bundles["yolov8n_native"]) as native:
        want = native(x)
    with Pipeline.load(bundles["yolov8n_t4"]) as t4:
        assert set(t4.code.values()) == {"ptx"}
        assert "built for sm_75" in caplog.text and "PTX" in caplog.text
        got = t4(x)
    assert int(want["num_dets"].sum()) > 0           # detections to compare, not two empty sets
    assert_same_detections(want, got)
    with pytest.raises(BundleError, match="cubin for sm_75.*load its PTX"):
        Pipeline.load(bundles["yolov8n_t4"], prefer="cubin")


def test_steady_state_allocates_nothing(bundles, gpu):
    from deepjit_compiler.runtime.pipeline import Pipeline

    with Pipeline.load(bundles["yolov8n_native"]) as pipe:
        pipe({"images": images(1, 8)})
        pipe.gpu.sync()
        allocations = pipe.allocations
        free, _ = gpu_mod._ck(gpu_mod.driver.cuMemGetInfo(), "cuMemGetInfo")
        for i, batch in enumerate((1, 3, 8, 2, 5, 8, 1)):
            pipe({"images": images(30 + i, batch)})
        assert pipe.allocations == allocations
        after, _ = gpu_mod._ck(gpu_mod.driver.cuMemGetInfo(), "cuMemGetInfo")
        assert after == free


def test_bad_inputs_on_the_gpu(bundles):
    from deepjit_compiler.runtime.pipeline import Pipeline

    with Pipeline.load(bundles["yolov8n_native"]) as pipe:
        with pytest.raises(RuntimeInputError, match="batch 9 is above this pipeline's max batch 8"):
            pipe({"images": images(2, 9)})
        with pytest.raises(RuntimeInputError, match="is float64, expected float32"):
            pipe({"images": images(2, 1).astype(np.float64)})
        assert int(pipe({"images": images(2, 1)})["num_dets"].shape[0]) == 1  # still usable


def test_letterbox_pipeline_matches_its_references(bundles):
    from deepjit_compiler.runtime.pipeline import Pipeline

    rng = np.random.default_rng(44)
    with Pipeline.load(bundles["yolov8n_lb"]) as pipe:
        allocations = pipe.allocations
        # r = 1, then r = 0.5 (a new size captures a new graph). The second is noise in 2x2 blocks: the
        # letterbox halves it back to plain noise, on which the synthetic detector fires; upscaled
        # noise (a 360x500 image) gives no detections at all, and an empty comparison.
        for (n, h, w), block in (((2, 480, 640), 1), ((3, 720, 1280), 2)):
            raw = rng.integers(0, 256, (n, h // block, w // block, 3), dtype=np.uint8)
            raw = raw.repeat(block, axis=1).repeat(block, axis=2)
            got = pipe({"raw_images": raw})
            want = reference(bundles["yolov8n_lb"], {"raw_images": raw})
            assert want["num_dets"].min() > 0, "no detections: the comparison would prove nothing"
            np.testing.assert_allclose(got["ratio_pad"], want["ratio_pad"], rtol=1e-6)
            assert_same_detections(want, got, min_iou=0.98, score_atol=1e-3)
        assert pipe.allocations == allocations


# ----------------------------------------------------------------------------- the engine on CUDA
def needs_cuda_engine():
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed: the engine runs on the CPU (the other tests cover that)")


# fp32 with TF32 off: what the CPU provider computes, to float32 noise; fp16: a GPU multiplies in fp16,
# the CPU provider runs fp16 Convs in fp32 (boxes in pixels, class logits).
@pytest.mark.parametrize("name, atol, rtol", [("yolov8n_lb", 2e-3, 1e-3), ("yolov8n_native", 0.25, 2e-2)])
def test_cuda_engine_segment_outputs_equal_the_cpu_provider(bundles, name, atol, rtol):
    """The CUDA path's own buffers and stream: what the engine wrote into the runtime's device buffers
    equals ONNX Runtime's CPU provider on the same segment and the same device-made inputs."""
    from deepjit_compiler.runtime.pipeline import Pipeline

    needs_cuda_engine()
    n = 3
    rng = np.random.default_rng(60)
    with Pipeline.load(bundles[name]) as pipe:
        about = pipe.describe()
        assert about["engine"].startswith("cuda (ONNX Runtime") and "tf32 off" in about["engine"], about
        feed = {i.name: (rng.integers(0, 256, (n, 480, 640, 3), dtype=np.uint8) if i.dtype == "uint8"
                         else images(61, n)) for i in pipe.inputs}
        out = pipe(feed)
        step = next(s for s in pipe.layout.steps if s.kind == "segment")
        seg_in = {t.name: pipe.read(t.name)[:n] for t in step.inputs}
        seg_out = {t.name: pipe.read(t.name)[:n] for t in step.outputs}
        copies = pipe.last_copies()
    # one copy of each input in and of each output out: nothing crosses between engine and kernels
    assert copies == {"h2d": sum(v.nbytes for v in feed.values()), "d2h": sum(v.nbytes for v in out.values())}
    sess = ort.InferenceSession(str(bundles[name] / step.file), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, seg_in)))
    for k, v in want.items():
        diff = float(np.abs(seg_out[k].astype(np.float64) - v).max())
        np.testing.assert_allclose(seg_out[k], v, atol=atol, rtol=rtol,
                                   err_msg=f"{name}: segment output {k}: max abs diff {diff}")


def test_bench_says_the_engine_runs_on_cuda(bundles):
    from deepjit_compiler.runtime.run import bench_bundle, format_bench

    needs_cuda_engine()
    result = bench_bundle(bundles["yolov8n_lb"], [1], warmup=2, iters=5)
    assert "engine cuda (ONNX Runtime" in format_bench(result)
    assert result["capture"] in ("whole", "split"), result["capture"]
    (row,) = result["results"]
    assert row["copied_bytes"]["h2d"] == 480 * 640 * 3  # the one raw image at the profile's opt size


def test_pinned_staging_round_trip(gpu):
    from deepjit_compiler.runtime.hostmem import PinnedBuffer, d2h_async, h2d_async

    data = np.random.default_rng(3).random((5, 7), dtype=np.float32)
    a, b = PinnedBuffer(data.nbytes), PinnedBuffer(data.nbytes)
    src, dst = a.array(data.shape, data.dtype), b.array(data.shape, data.dtype)
    np.copyto(src, data)
    dev = gpu.empty(data.shape, data.dtype)
    h2d_async(gpu, dev, src)
    d2h_async(gpu, dst, dev)
    gpu.sync()
    np.testing.assert_array_equal(dst, data)
    a.close()
    b.close()


# ----------------------------------------------------------------------------- deepjit run / bench
def test_run_bundle_maps_boxes_into_the_image(bundles, tmp_path):
    from deepjit_compiler.runtime.run import run_bundle

    image = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    # Noise in 2x2 blocks: the 0.5x letterbox gives back plain noise, on which the synthetic YOLOv8n
    # detects (~190 boxes on the CPU reference). Upscaled noise (a 300x500 image) gives none, which
    # would leave nothing to map.
    small = np.random.default_rng(5).integers(0, 256, (360, 640, 3), dtype=np.uint8)
    rgb = small.repeat(2, axis=0).repeat(2, axis=1)             # 720 x 1280: r = 0.5, top = 140
    canvas = np.full((640, 640, 3), 114, np.uint8)
    canvas[140:500] = small                                      # what the letterbox makes of it
    image.fromarray(rgb).save(tmp_path / "a.png")
    np.save(tmp_path / "b.npy", rgb[..., ::-1].copy())          # the same image as BGR uint8
    for name in ("yolov8n_native", "yolov8n_lb"):              # host letterbox, GPU letterbox
        result = run_bundle(bundles[name], [tmp_path / "a.png", tmp_path / "b.npy"], tmp_path / f"{name}.json")
        a, b = result["results"]
        assert a["boxes_in"] == b["boxes_in"] == "image" and a["size"] == [720, 1280]
        assert a["detections"], f"{name}: no detections, nothing was mapped"
        assert a["detections"] == b["detections"]
        # ONNX Runtime through the bundle's pieces (its letterbox: the ONNX reference, or for the host
        # letterbox `small` placed by hand at rows 140..499 of 114s), boxes mapped back by hand:
        # (box - pad) / 0.5, clipped to the 1280 x 720 image
        want = reference(bundles[name], {"raw_images": rgb[None, ..., ::-1].copy()} if name == "yolov8n_lb" else
                         {"images": canvas.transpose(2, 0, 1)[None] / np.float32(255)})
        n = int(want["num_dets"][0])
        want = {k: want[k][:, :n] if k != "num_dets" else want[k] for k in DETS}
        want["boxes"][0] = np.clip((want["boxes"][0] - [0, 140, 0, 140]) / 0.5, 0, [1280, 720, 1280, 720])
        got = {"num_dets": np.array([len(a["detections"])]),
               **{k: np.array([[d[field] for d in a["detections"]]])
                  for k, field in (("boxes", "box"), ("scores", "score"), ("classes", "class"))}}
        if result["engine"].startswith("cuda"):
            assert_close_detections_on_cuda(want, got)
        else:
            assert_same_detections(want, got, min_iou=0.98, score_atol=1e-2)
        assert json.loads((tmp_path / f"{name}.json").read_text())["results"] == result["results"]


@pytest.mark.parametrize("graphs", [True, False])
def test_bench_bundle(bundles, graphs):
    from deepjit_compiler.runtime.run import bench_bundle, format_bench

    result = bench_bundle(bundles["yolov8n_native"], [1, 4], graphs=graphs, warmup=2, iters=5)
    for row in result["results"]:
        assert row["kernel_launches"] == 2 and row["graph_launches"] == (1 if graphs else 0)
        assert 0 < row["kernels_us"]["p50"] <= row["gpu_us"]["p50"] < row["call_us"]["p50"]
    assert "img/s" in format_bench(result)
