"""The three JIT kernels on a GPU against ONNX Runtime on their references, through Polygraphy's
Comparator: yolov8_decode against the subgraph surgery cuts out of a synthetic YOLOv8, nms and
letterbox against references.py's graphs. Each runs as the T4 build (sm_75, loaded through its
PTX, since an sm_75 cubin cannot load on a newer GPU) and as a build for this GPU (its cubin).

Inputs are fresh seeded head maps with a realistic score sparsity (a few percent of anchors above
0.25, clustered around objects so NMS has work). Outputs are poisoned (0xFF, NaN for floats) before
every launch, so an element the kernel forgot to write fails the comparison.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from fractions import Fraction
from functools import lru_cache

import numpy as np
import onnx
import onnx.compose
import pytest

from deepjit_compiler.errors import KernelError
from deepjit_compiler.jit.contracts import load_contract
from deepjit_compiler.jit.nvrtc import compile_site_kernel
from deepjit_compiler.runtime import gpu as gpu_mod
from deepjit_compiler.runtime.launch import ContractKernel, KernelChain
from deepjit_compiler.runtime.layout import site_aliases
from deepjit_compiler.surgery.references import letterbox_reference, nms_reference

pytestmark = pytest.mark.gpu

polygraphy = pytest.importorskip("polygraphy", reason="the GPU tests compare through Polygraphy")
from polygraphy.backend.base import BaseRunner  # noqa: E402
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx  # noqa: E402
from polygraphy.common import TensorMetadata  # noqa: E402
from polygraphy.comparator import Comparator  # noqa: E402
from polygraphy.comparator.compare import SimpleCompareFunc  # noqa: E402

NC, REG, STRIDES = 80, 16, (8, 16, 32)


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu():
    if not gpu_mod.available():
        pytest.skip("needs an NVIDIA GPU")
    return gpu_mod.Gpu()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(params=["t4-ptx", "native-cubin"])
def target(request, gpu):
    """(sm to build for, how to load it): the T4 build through its PTX, this GPU's through its cubin."""
    return (75, "ptx") if request.param == "t4-ptx" else (gpu.sm, "cubin")


@lru_cache(maxsize=None)
def decode_site(head_layout: str = "separate", dynamic: bool = False, precision: str = "fp32"):
    """(reference subgraph, facts, input signatures) of the decode cut from a synthetic YOLOv8n; with
    precision fp16, as an fp16 build has it: the head maps handed over in fp16, the reference taking
    them so and the facts saying so (precision/boundaries.py)."""
    from deepjit_compiler.model.synth import synthesize_yolov8
    from deepjit_compiler.precision.boundaries import plan_at_precision
    from deepjit_compiler.surgery.cut import plan_from_model
    from deepjit_compiler.surgery.plan import CutRequest, KernelRequest

    model = synthesize_yolov8("yolov8n", seed=0, dynamic=dynamic, head_layout=head_layout)
    plan = plan_from_model(model, [CutRequest("decode", preset="yolov8_decode", kernels=[KernelRequest("yolov8_decode")])])
    site = plan_at_precision(plan, precision).sites[0]
    return site.reference, dict(site.facts), site.inputs


def build(contract: str, params: dict, facts: dict, target, cache):
    sm, _ = target
    return compile_site_kernel(contract, params, facts, sm=sm, cache_dir=cache)


# --- data ---------------------------------------------------------------------------------------


def head_maps(rng: np.random.Generator, batch: int, size=(640, 640), dtype=np.float32) -> list[dict[str, np.ndarray]]:
    """Per level {box, cls} maps like a trained head's on a real image: class logits low (~0 score)
    except in 3x3 patches around objects, DFL logits biased toward low bins (boxes a few strides)."""
    levels = []
    for s in STRIDES:
        h, w = size[0] // s, size[1] // s
        cls = rng.normal(-6.0, 1.2, (batch, NC, h, w))
        ramp = -0.6 * np.arange(REG)
        box = np.tile(ramp, 4)[None, :, None, None] + rng.normal(0.0, 1.0, (batch, 4 * REG, h, w))
        levels.append({"box": box, "cls": cls})
    anchors = sum(lv["cls"].shape[2] * lv["cls"].shape[3] for lv in levels)
    for b in range(batch):
        for _ in range(anchors // 250):
            lv = levels[rng.choice(3, p=[0.7, 0.2, 0.1])]
            h, w = lv["cls"].shape[2:]
            y, x, c = rng.integers(0, h), rng.integers(0, w), rng.integers(0, NC)
            ys, xs = slice(max(0, y - 1), y + 2), slice(max(0, x - 1), x + 2)
            patch = lv["cls"][b, c, ys, xs]
            lv["cls"][b, c, ys, xs] = rng.normal(0.8, 1.2, patch.shape)
    return [{k: v.astype(dtype) for k, v in lv.items()} for lv in levels]


def site_feed(maps, facts, dtype=np.float32) -> dict[str, np.ndarray]:
    """Reference feed: site tensor names -> maps in `dtype` (what the reference graph takes: fp32, or
    fp16 for an fp16 build's), by the preset's own record of which head map is which (facts["head_inputs"])."""
    return {h["name"]: maps[h["level"]][h["role"]].astype(dtype) for h in facts["head_inputs"]}


def per_level_names(facts) -> dict[str, str]:
    """box_i / cls_i -> the site tensor of that level and role (facts["head_inputs"])."""
    return {f"{h['role']}_{h['level']}": h["name"] for h in facts["head_inputs"]}


def decode_names(compiled, inputs) -> dict[str, str]:
    """The decode's own inputs -> the cut's tensors, as its contract binds them (site_input)."""
    return site_aliases(load_contract(compiled.contract_path), compiled.params, inputs, "decode")


def candidates(maps) -> np.ndarray:
    """Anchors per image whose best class score is > 0.25 (what the decode appends)."""
    best = np.concatenate([lv["cls"].astype(np.float32).max(axis=1).reshape(lv["cls"].shape[0], -1) for lv in maps], 1)
    return (1 / (1 + np.exp(-best)) > 0.25).sum(axis=1)


def score_fraction(maps) -> float:
    """The fraction of all anchors of all images above 0.25."""
    counts, anchors = candidates(maps), sum(lv["cls"].shape[2] * lv["cls"].shape[3] for lv in maps)
    return float(counts.sum() / (len(counts) * anchors))


# --- runners ------------------------------------------------------------------------------------


class Runner(BaseRunner):
    """A Polygraphy runner around `feed -> outputs` (a kernel on the GPU, or chained references)."""

    def __init__(self, fn, name: str):
        super().__init__(name=name)
        self._fn, self.meta = fn, TensorMetadata()

    def get_input_metadata_impl(self):
        return self.meta  # the Comparator feeds a runner only the inputs its metadata lists

    def infer_impl(self, feed_dict):
        start = time.perf_counter()
        out = OrderedDict((k, np.asarray(v)) for k, v in self._fn(feed_dict).items())
        self.inference_time = time.perf_counter() - start
        return out


def ort_runner(model: onnx.ModelProto, name: str) -> OnnxrtRunner:
    return OnnxrtRunner(SessionFromOnnx(model.SerializeToString(), providers=["CPUExecutionProvider"]), name=name)


def run_both(reference, candidate, feeds):
    """Comparator.run over the feeds; returns (results, per-iteration outputs of each runner)."""
    for name, value in feeds[0].items():
        candidate.meta.add(name, value.dtype, [-1] * value.ndim)
    results = Comparator.run([reference, candidate], data_loader=feeds)
    (_, ref_iters), (_, test_iters) = results
    return results, ref_iters, test_iters


def decode_runner(gpu, compiled, facts, inputs, load, *, form="per_level", dtype=np.float32, extra_dims=None):
    kernel = ContractKernel(gpu, compiled, load)
    names = decode_names(compiled, inputs) if form == "per_level" else per_level_names(facts)

    def run(feed):
        host = {k: feed[v].astype(dtype) for k, v in names.items()}
        if form == "concatenated":
            flat = [np.concatenate([host[f"box_{i}"], host[f"cls_{i}"]], 1).reshape(host["box_0"].shape[0], 4 * REG + NC, -1)
                    for i in range(3)]
            host = {"x": np.concatenate(flat, axis=2)}
        inputs = {k: gpu.upload(v) for k, v in host.items()}
        dims = kernel.bind(inputs, extra_dims)
        outs = kernel.allocate_outputs(dims)
        gpu.fill(outs["output0"], 0xFF)
        kernel.launch({**inputs, **outs}, dims)
        return {"output0": gpu.download(outs["output0"])}

    return Runner(run, f"deepjit-decode-{compiled.arch}-{load}")


def assert_close(results, atol, rtol):
    verdict = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=atol, rtol=rtol))
    assert bool(verdict), "kernel output differs from ONNX Runtime on the reference (see Polygraphy's log above)"


# --- decode -------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("head_layout", ["separate", "split"])
def test_decode_output0_matches_cut_subgraph(gpu, target, cache, batch, head_layout):
    ref, facts, inputs = decode_site(head_layout)
    rng = np.random.default_rng([batch, len(head_layout)])
    feeds = [site_feed(head_maps(rng, batch), facts) for _ in range(2)]
    compiled = build("yolov8_decode", {"mode": "output0"}, facts, target, cache)
    results, ref_out, test_out = run_both(ort_runner(ref, "onnxrt-cut-subgraph"),
                                          decode_runner(gpu, compiled, facts, inputs, target[1]), feeds)
    assert not np.isnan(test_out[0]["output0"]).any()
    assert_close(results, atol=2e-3, rtol=1e-5)


def test_decode_concatenated_form(gpu, target, cache):
    ref, facts, inputs = decode_site()
    rng = np.random.default_rng(7)
    feeds = [site_feed(head_maps(rng, 3), facts)]
    compiled = build("yolov8_decode", {"mode": "output0", "input_form": "concatenated", "anchors_per_thread": 2},
                     facts, target, cache)
    results, _, _ = run_both(ort_runner(ref, "onnxrt-cut-subgraph"),
                             decode_runner(gpu, compiled, facts, inputs, target[1], form="concatenated"), feeds)
    assert_close(results, atol=2e-3, rtol=1e-5)


def test_decode_fp16_inputs(gpu, target, cache):
    ref, facts, inputs = decode_site()
    rng = np.random.default_rng(16)
    maps = head_maps(rng, 2, dtype=np.float16)  # fp16 values, fed to the fp32 reference exactly
    compiled = build("yolov8_decode", {"mode": "output0", "dtype": "float16", "anchors_per_thread": 8}, facts, target, cache)
    results, _, _ = run_both(ort_runner(ref, "onnxrt-cut-subgraph"),
                             decode_runner(gpu, compiled, facts, inputs, target[1], dtype=np.float16),
                             [site_feed(maps, facts)])
    assert_close(results, atol=2e-3, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_output0_on_fp16_head_maps_matches_the_fp16_builds_reference(gpu, target, cache, batch):
    """An fp16 build hands the decode fp16 head maps: its twin (mode output0), with the dtype inferred
    from the site's facts, against the reference as that build has it (fp16 inputs)."""
    ref, facts, inputs = decode_site(precision="fp16")
    assert facts["input_dtype"] == "float16" and {t.dtype for t in inputs} == {"float16"}
    rng = np.random.default_rng([batch, 16])
    feeds = [site_feed(head_maps(rng, batch, dtype=np.float16), facts, np.float16) for _ in range(2)]
    compiled = build("yolov8_decode", {"mode": "output0"}, facts, target, cache)
    assert compiled.params["dtype"] == "float16"
    results, _, test_out = run_both(ort_runner(ref, "onnxrt-cut-subgraph-fp16-inputs"),
                                    decode_runner(gpu, compiled, facts, inputs, target[1], dtype=np.float16), feeds)
    assert not np.isnan(test_out[0]["output0"]).any()
    assert_close(results, atol=2e-3, rtol=1e-5)


def test_decode_dynamic_sizes_compute_anchors_in_kernel(gpu, cache):
    ref, facts, inputs = decode_site(dynamic=True)
    assert facts["anchors_source"] == "computed"
    compiled = build("yolov8_decode", {"mode": "output0"}, facts, (gpu.sm, "cubin"), cache)
    rng = np.random.default_rng(384)
    feeds = [site_feed(head_maps(rng, 2, size=(384, 640)), facts), site_feed(head_maps(rng, 1, size=(224, 96)), facts)]
    results, _, test_out = run_both(ort_runner(ref, "onnxrt-cut-subgraph"), decode_runner(gpu, compiled, facts, inputs, "cubin"),
                                    feeds)
    assert test_out[0]["output0"].shape == (2, 84, 48 * 80 + 24 * 40 + 12 * 20)
    assert test_out[1]["output0"].shape == (1, 84, 28 * 12 + 14 * 6 + 7 * 3)  # groups straddle levels here
    assert_close(results, atol=2e-3, rtol=1e-5)


# --- decode -> nms ------------------------------------------------------------------------------


def match_detections(ref, test, *, min_iou=0.99, score_atol=1e-4) -> tuple[int, int]:
    """Per image: same count, every reference detection matched to a distinct test detection of the
    same class with IoU >= min_iou and a close score. Returns (detections, images)."""
    total = 0
    for b in range(len(ref["num_dets"])):
        n, m = int(ref["num_dets"][b]), int(test["num_dets"][b])
        assert n == m, f"image {b}: {m} detections, reference has {n}"
        free = np.ones(n, bool)
        tb, ts, tc = test["boxes"][b, :n], test["scores"][b, :n], test["classes"][b, :n]
        for i in range(n):
            rb = ref["boxes"][b, i]
            iw = np.clip(np.minimum(rb[2], tb[:, 2]) - np.maximum(rb[0], tb[:, 0]), 0, None)
            ih = np.clip(np.minimum(rb[3], tb[:, 3]) - np.maximum(rb[1], tb[:, 1]), 0, None)
            inter = iw * ih
            iou = inter / ((rb[2] - rb[0]) * (rb[3] - rb[1]) + (tb[:, 2] - tb[:, 0]) * (tb[:, 3] - tb[:, 1]) - inter)
            ok = free & (tc == ref["classes"][b, i]) & (np.abs(ts - ref["scores"][b, i]) <= score_atol)
            iou = np.where(ok, iou, -1)
            j = int(np.argmax(iou))
            assert iou[j] >= min_iou, f"image {b}: reference detection {i} {rb} (class {ref['classes'][b, i]}) unmatched"
            free[j] = False
        rows = test["scores"].shape[1]
        if m < rows:  # rows past num_dets are zero
            assert not test["boxes"][b, m:].any() and not test["scores"][b, m:].any() and not test["classes"][b, m:].any()
        total += n
    return total, len(ref["num_dets"])


def merged_reference(decode_ref: onnx.ModelProto, nms_ref: onnx.ModelProto) -> onnx.ModelProto:
    a, b = onnx.ModelProto(), onnx.ModelProto()
    a.CopyFrom(decode_ref)
    b.CopyFrom(nms_ref)
    a.ir_version = b.ir_version = max(a.ir_version, b.ir_version)
    return onnx.compose.merge_models(a, b, io_map=[("output0", "output0")])


DETECTIONS = ("num_dets", "boxes", "scores", "classes")


def postprocess_runner(gpu, decode, nms, inputs, load):
    """decode (candidates) -> nms as one KernelChain on the cut's tensors, rebuilt when shapes change;
    with nms None, the decode alone (mode nms: both in one launch)."""
    names = decode_names(decode, inputs)
    kernels = [(decode, names)] + ([nms] if nms is not None else [])
    state = {}

    def run(feed):
        key = tuple(feed[v].shape for v in names.values())
        if state.get("key") != key:
            given = {v: gpu.upload(np.ascontiguousarray(feed[v])) for v in names.values()}
            state["post"], state["key"] = KernelChain(gpu, kernels, given, load), key
        post = state["post"]
        for name, arr in post.inputs.items():
            gpu.upload(np.ascontiguousarray(feed[name]), out=arr)
        for name in DETECTIONS:
            gpu.fill(post.tensors[name], 0xFF)
        assert post.launch() == len(kernels)  # no memset launch: the kernels reset their counters
        return post.results(DETECTIONS)

    return Runner(run, f"deepjit-decode-{'nms' if nms is not None else 'fused'}-{decode.arch}-{load}")


NMS_CASES = {"default": {}, "agnostic-maxdet20": {"agnostic": True, "max_det": 20},
             "block1024-chunk512": {"block": 1024, "chunk": 512},
             "maxdet20-chunk512": {"max_det": 20, "block": 1024, "chunk": 512},
             "agnostic-maxdet20-chunk512": {"agnostic": True, "max_det": 20, "block": 1024, "chunk": 512},
             # two blocks an image on the slot path (a thread block cluster); four with max_det binding; four,
             # then two from batch 8 (the entry's from_batch)
             "cluster2-chunk512": {"block": 1024, "chunk": 512, "cluster": 2},
             "cluster4-maxdet20-chunk512": {"max_det": 20, "block": 1024, "chunk": 512, "cluster": 4},
             "cluster4-then-2-from-batch-8": {"block": 1024, "chunk": 512, "cluster": 4, "large_batch_cluster": 2,
                                              "large_batch": 8},
             # eight blocks of 512 an image (the H200 spec's): an image past 480 candidates takes the general path
             "cluster8-block512-chunk512": {"block": 512, "chunk": 512, "cluster": 8}}
DECODE_WAYS = {"4-anchors-per-thread": {"anchors_per_thread": 4},
               "4-lanes-per-anchor": {"anchors_per_thread": 1, "lanes_per_anchor": 4},
               "2-lanes-per-2-anchors": {"anchors_per_thread": 2, "lanes_per_anchor": 2},
               # batches 1-3 launch the 4-lane kernel, 4 and up the 2-lane one (the entry's from_batch)
               "4-lanes-then-2-from-batch-4": {"anchors_per_thread": 1, "lanes_per_anchor": 4,
                                               "large_batch_lanes": 2, "large_batch": 4}}


def skip_if_chunk_too_big(params, target):
    if params.get("chunk", 256) > 256 and target[0] < 80:
        pytest.skip(f"nms chunk {params['chunk']} needs more shared memory than sm_{target[0]} allows a block")
    if params.get("cluster", 1) > 1 and target[0] < 90:
        pytest.skip(f"nms cluster {params['cluster']} needs thread block clusters (sm_90+), not sm_{target[0]}")


@pytest.mark.parametrize("decode_way", list(DECODE_WAYS))
@pytest.mark.parametrize("case", list(NMS_CASES))
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_then_nms_match_reference_detections(gpu, target, cache, batch, case, decode_way):
    ref, facts, inputs = decode_site()
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False, **NMS_CASES[case]}
    skip_if_chunk_too_big(params, target)
    decode = build("yolov8_decode", {"mode": "candidates", "conf_threshold": params["conf_threshold"],
                                     **DECODE_WAYS[decode_way]}, facts, target, cache)
    nms = build("nms", params, facts, target, cache)
    rng = np.random.default_rng([batch, len(case)])
    maps = [head_maps(rng, batch) for _ in range(3)]
    assert all(0.01 < score_fraction(m) < 0.08 for m in maps), [score_fraction(m) for m in maps]
    # how the kernel runs, not what it computes
    semantics = {k: v for k, v in params.items() if k not in ("block", "chunk", "cluster", "large_batch_cluster",
                                                              "large_batch")}
    reference = ort_runner(merged_reference(ref, nms_reference(NC, **semantics)), "onnxrt-cut-subgraph+nms-reference")
    _, ref_iters, test_iters = run_both(reference, postprocess_runner(gpu, decode, nms, inputs, target[1]),
                                        [site_feed(m, facts) for m in maps])
    for r, t in zip(ref_iters, test_iters):
        total, images = match_detections(r, t)
        assert total >= images * min(params["max_det"], 5)  # the NMS had real work in every image


@pytest.mark.parametrize("decode_way", list(DECODE_WAYS))
@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_decode_then_nms_on_fp16_head_maps_match_the_fp16_builds_reference(gpu, target, cache, batch, decode_way):
    """The T4 and H200 specs are fp16: the decode reads the engine's fp16 head maps (its dtype inferred
    from the site's facts) and the pair equals the fp16 build's references, every batch bucket."""
    ref, facts, inputs = decode_site(precision="fp16")
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False}
    decode = build("yolov8_decode", {"mode": "candidates", "conf_threshold": 0.25, **DECODE_WAYS[decode_way]},
                   facts, target, cache)
    assert decode.params["dtype"] == "float16"
    nms = build("nms", params, facts, target, cache)
    rng = np.random.default_rng([batch, 1616])
    maps = [head_maps(rng, batch, dtype=np.float16) for _ in range(2)]
    assert all(0.01 < score_fraction(m) < 0.08 for m in maps), [score_fraction(m) for m in maps]
    reference = ort_runner(merged_reference(ref, nms_reference(NC, **params)), "onnxrt-fp16-cut-subgraph+nms-reference")
    _, ref_iters, test_iters = run_both(reference, postprocess_runner(gpu, decode, nms, inputs, target[1]),
                                        [site_feed(m, facts, np.float16) for m in maps])
    for r, t in zip(ref_iters, test_iters):
        total, images = match_detections(r, t)
        assert total >= images * 5  # the NMS had real work in every image


@pytest.mark.parametrize("decode_way", list(DECODE_WAYS))
def test_decode_then_nms_on_dynamic_sizes_with_odd_levels(gpu, cache, decode_way):
    """Dynamic sizes: 384x640, then 224x96, whose levels (28x12, 14x6, 7x3) are odd, so a thread's or a
    lane's anchors straddle levels or are misaligned and take the per-anchor loads."""
    ref, facts, inputs = decode_site(dynamic=True)
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False}
    target = (gpu.sm, "cubin")
    decode = build("yolov8_decode", {"mode": "candidates", "conf_threshold": 0.25, **DECODE_WAYS[decode_way]},
                   facts, target, cache)
    nms = build("nms", params, facts, target, cache)
    rng = np.random.default_rng(2496)
    feeds = [site_feed(head_maps(rng, 2, size=(384, 640)), facts), site_feed(head_maps(rng, 1, size=(224, 96)), facts)]
    reference = ort_runner(merged_reference(ref, nms_reference(NC, **params)), "onnxrt-cut-subgraph+nms-reference")
    _, ref_iters, test_iters = run_both(reference, postprocess_runner(gpu, decode, nms, inputs, "cubin"), feeds)
    for r, t in zip(ref_iters, test_iters):
        total, images = match_detections(r, t)
        assert total >= images  # detections in every image


# --- decode and NMS in one launch (yolov8_decode mode nms) ----------------------------------------

FUSED_CASES = {"block128-bitonic": {"block": 128}, "block1024": {"block": 1024},
               "agnostic-maxdet20-block512": {"agnostic": True, "max_det": 20, "block": 512},
               "block1024-chunk512": {"block": 1024, "chunk": 512}}


def fused_decode(params, facts, target, cache, **decode_way):
    """yolov8_decode in mode nms with the NMS semantics `params` and its block/chunk."""
    return build("yolov8_decode", {"mode": "nms", **params, **decode_way}, facts, target, cache)


def nms_semantics(params) -> dict:
    return {k: params[k] for k in ("conf_threshold", "iou_threshold", "max_det", "agnostic") if k in params}


@pytest.mark.parametrize("decode_way", list(DECODE_WAYS))
@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("batch", [1, 8])
def test_fused_decode_nms_match_reference_detections(gpu, target, cache, batch, case, decode_way):
    """One launch: each image's last decode block runs its NMS; the detections are the cut subgraph +
    NMS reference's, whichever NMS path the block takes (block 128: more candidates than threads, the
    bitonic sort; agnostic: one group of hundreds, one warp settling it 32 at a time; 1024: a thread per
    candidate)."""
    ref, facts, inputs = decode_site()
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False, **FUSED_CASES[case]}
    skip_if_chunk_too_big(params, target)
    fused = fused_decode(params, facts, target, cache, **DECODE_WAYS[decode_way])
    rng = np.random.default_rng([batch, len(case), 17])
    maps = [head_maps(rng, batch) for _ in range(3)]
    reference = ort_runner(merged_reference(ref, nms_reference(NC, **nms_semantics(params))), "onnxrt-cut+nms-reference")
    _, ref_iters, test_iters = run_both(reference, postprocess_runner(gpu, fused, None, inputs, target[1]),
                                        [site_feed(m, facts) for m in maps])
    for r, t in zip(ref_iters, test_iters):
        total, images = match_detections(r, t)
        assert total >= images * min(params["max_det"], 5)


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_fused_decode_nms_on_fp16_head_maps_every_bucket(gpu, target, cache, batch):
    """The H200 spec's fused setting (fp16 head maps, four lanes per anchor, block 1024, chunk 256) on
    every batch bucket of the example specs, against the fp16 build's references."""
    ref, facts, inputs = decode_site(precision="fp16")
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "block": 1024, "chunk": 256}
    fused = fused_decode(params, facts, target, cache, **DECODE_WAYS["4-lanes-per-anchor"])
    assert fused.params["dtype"] == "float16"
    rng = np.random.default_rng([batch, 2323])
    maps = [head_maps(rng, batch, dtype=np.float16) for _ in range(2)]
    reference = ort_runner(merged_reference(ref, nms_reference(NC, **nms_semantics(params))), "onnxrt-fp16-cut+nms")
    _, ref_iters, test_iters = run_both(reference, postprocess_runner(gpu, fused, None, inputs, target[1]),
                                        [site_feed(m, facts, np.float16) for m in maps])
    for r, t in zip(ref_iters, test_iters):
        total, images = match_detections(r, t)
        assert total >= images * 5


@pytest.mark.parametrize("lift, low, high, what", [
    (1.0, 512, 2048, "more candidates than the block: the shared-memory bitonic sort"),
    (2.0, 2048, 8400, "past sort_capacity: the workspace sort")])
def test_fused_decode_nms_many_candidates(gpu, target, cache, lift, low, high, what):
    ref, facts, inputs = decode_site()
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "block": 512, "chunk": 256}
    fused = fused_decode(params, facts, target, cache, anchors_per_thread=4)
    rng = np.random.default_rng([int(lift * 10), 5])
    maps = [head_maps(rng, 2) for _ in range(2)]
    for m in maps:
        for lv in m:
            lv["cls"] += np.float32(lift)  # more anchors above the threshold
    counts = [candidates(m) for m in maps]
    assert all(low < c.min() and c.max() <= high for c in counts), (what, counts)
    reference = ort_runner(merged_reference(ref, nms_reference(NC, **nms_semantics(params))), "onnxrt-cut+nms")
    _, ref_iters, test_iters = run_both(reference, postprocess_runner(gpu, fused, None, inputs, target[1]),
                                        [site_feed(m, facts) for m in maps])
    for r, t in zip(ref_iters, test_iters):
        total, images = match_detections(r, t)
        assert total >= images * 50


def test_fused_decode_then_the_nms_stage_done_before_it_chain_as_one_launch(gpu, cache):
    """As a pipeline chains them: the decode in mode nms, then the nms stage with fused: true, whose
    module holds no kernel and which launches nothing; the detections are the decode's."""
    _, facts, inputs = decode_site()
    target = (gpu.sm, "cubin")
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False}
    fused = fused_decode({**params, "block": 1024}, facts, target, cache, anchors_per_thread=1, lanes_per_anchor=4)
    stage = build("nms", {**params, "fused": True}, facts, target, cache)
    assert stage.entries == ()
    host = site_feed(head_maps(np.random.default_rng(31), 2), facts)
    both = KernelChain(gpu, [(fused, decode_names(fused, inputs)), stage], {k: gpu.upload(v) for k, v in host.items()})
    alone = KernelChain(gpu, [(fused, decode_names(fused, inputs))], {k: gpu.upload(v) for k, v in host.items()})
    assert both.launch() == 1 and alone.launch() == 1
    got, want = both.results(DETECTIONS), alone.results(DETECTIONS)
    assert int(want["num_dets"].min()) >= 5
    for name in DETECTIONS:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_fused_decode_nms_graph_replays_reset_their_counters(gpu, cache):
    """Replayed from a CUDA graph with no memset node, every replay gives the plain launch's detections:
    the last block of each image resets blocks_done and the NMS resets cand_count."""
    _, facts, inputs = decode_site()
    target = (gpu.sm, "cubin")
    fused = fused_decode({"block": 1024}, facts, target, cache, anchors_per_thread=1, lanes_per_anchor=4)
    rng = np.random.default_rng(7)
    host = [site_feed(head_maps(rng, 4), facts) for _ in range(2)]
    chain = KernelChain(gpu, [(fused, decode_names(fused, inputs))], {k: gpu.upload(v) for k, v in host[0].items()})
    chain.launch()
    want = chain.results(DETECTIONS)
    graph = gpu.capture(chain.launch)
    for k in range(3):
        for name in DETECTIONS:
            gpu.fill(chain.tensors[name], 0xFF)
        graph.replay()
        got = chain.results(DETECTIONS)
        for name in DETECTIONS:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"replay {k}: {name}")
    assert not gpu.download(chain.tensors["blocks_done"]).any() and not gpu.download(chain.tensors["cand_count"]).any()
    for name, arr in host[1].items():  # other maps: other detections, so the replays were not stale
        gpu.upload(arr, out=chain.inputs[name])
    graph.replay()
    assert not np.array_equal(chain.results(["num_dets", "scores"])["scores"], want["scores"])


def candidates_from_output0(output0: np.ndarray, conf: float, capacity: int):
    """Host-side candidates from output0 with the reference's float32 ops, in a shuffled order
    (the decode appends in whatever order its warps arrive)."""
    rng = np.random.default_rng(0)
    batch, _, anchors = output0.shape
    out = {"cand_count": np.zeros(batch, np.int32), "cand_boxes": np.zeros((batch, capacity, 4), np.float32),
           "cand_scores": np.zeros((batch, capacity), np.float32), "cand_classes": np.zeros((batch, capacity), np.int32),
           "cand_index": np.zeros((batch, capacity), np.int32)}
    for b in range(batch):
        pred = output0[b].T                                   # [A, 4 + nc]
        best, cls = pred[:, 4:].max(axis=1), pred[:, 4:].argmax(axis=1)
        idx = rng.permutation(np.flatnonzero(best > np.float32(conf)))
        half = pred[idx, 2:4] / np.float32(2)
        n = len(idx)
        out["cand_count"][b] = n
        out["cand_boxes"][b, :n] = np.concatenate([pred[idx, :2] - half, pred[idx, :2] + half], axis=1)
        out["cand_scores"][b, :n], out["cand_classes"][b, :n], out["cand_index"][b, :n] = best[idx], cls[idx], idx
    return out


def detections(rng, batch: int, anchors: int, logit_mean: float, classes: int = NC) -> np.ndarray:
    """output0 [batch, 4 + NC, anchors]: boxes around 40 centres per image; only the first `classes`
    classes can score above the threshold."""
    centres = rng.uniform(20, 600, size=(batch, 2, 40))
    pick = rng.integers(0, 40, size=(batch, anchors))
    cxcy = np.take_along_axis(centres, pick[:, None, :].repeat(2, 1), axis=2) + rng.normal(0, 6, (batch, 2, anchors))
    wh = rng.uniform(10, 80, size=(batch, 2, anchors))
    logits = rng.normal(logit_mean, 1.5, size=(batch, NC, anchors))
    logits[:, classes:] -= 20.0
    return np.concatenate([cxcy, wh, 1 / (1 + np.exp(-logits))], axis=1).astype(np.float32)


def check_nms_alone(gpu, kernel, x, cands, params, classes: int = NC) -> int:
    """Run the nms kernel on candidates made from output0 `x` (of `classes` classes); its detections must
    be the ONNX reference's exactly (same boxes, scores and classes), and its counters reset. Returns how
    many."""
    inputs = {k: gpu.upload(v) for k, v in cands.items()}
    dims = kernel.bind(inputs)
    outs = kernel.allocate_outputs(dims)
    for arr in outs.values():
        gpu.fill(arr, 0xFF)
    kernel.launch({**inputs, **outs, "workspace": kernel.workspace(dims)}, dims)
    got = {k: gpu.download(v) for k, v in outs.items()}
    sess = SessionFromOnnx(nms_reference(classes, **params).SerializeToString(), providers=["CPUExecutionProvider"])()
    want = dict(zip(["num_dets", "boxes", "scores", "classes"], sess.run(None, {"output0": x})))
    total, _ = match_detections(want, got, min_iou=0.999999, score_atol=0.0)  # same boxes: exact
    assert not gpu.download(inputs["cand_count"]).any()  # counters reset for the next decode
    return total


@pytest.mark.parametrize("block, chunk, cluster", [(512, 256, 1), (1024, 512, 1), (1024, 512, 2),
                                                 (512, 512, 8)])
@pytest.mark.parametrize("agnostic, logit_mean, classes, what", [
    (False, -4.8, 3, "about 170 boxes in 3 classes: big class groups"),
    (False, -5.0, 2, "about 75 boxes in 2 classes: groups past 32 boxes, each box tested by pairs"),
    (False, -4.1, 1, "about 190 boxes of one class: a crowd, one group settled 32 members at a time"),
    (True, -7.3, NC, "about 14 boxes, agnostic"),
    (True, -6.4, NC, "about 140 boxes, agnostic: one group")])
def test_nms_alone_crowded_classes_and_agnostic(gpu, target, cache, block, chunk, cluster, agnostic, logit_mean, classes,
                                                what):
    anchors = 8400
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": agnostic}
    skip_if_chunk_too_big({"chunk": chunk, "cluster": cluster}, target)
    way = {"block": block, "chunk": chunk, "cluster": cluster}
    nms = build("nms", {**params, "max_candidates": anchors, **way}, {}, target, cache)
    rng = np.random.default_rng([block, classes, int(-logit_mean * 10)])
    x = detections(rng, 4, anchors, logit_mean, classes)
    cands = candidates_from_output0(x, params["conf_threshold"], anchors)
    counts = cands["cand_count"]
    if "14 boxes" in what:
        assert 3 <= counts.min() and counts.max() <= 32, counts
    elif "by pairs" in what:  # mask_pairs: one chunk, same-class pairs <= 4 per thread, masks of two words
        assert counts.max() <= min(block, chunk), counts
        for n, c in zip(counts, cands["cand_classes"]):
            sizes = np.bincount(c[:n])
            assert sizes.max() > 32 and (sizes * (sizes - 1) // 2).sum() <= 4 * block, sizes
    else:
        assert 100 < counts.min() and counts.max() <= min(block, chunk), counts  # one chunk, bucket sort
        if "crowd" in what:  # one group of every box: settle_groups walks it in several 32s
            assert all(np.bincount(c[:n]).max() == n for n, c in zip(counts, cands["cand_classes"]))
    assert check_nms_alone(gpu, ContractKernel(gpu, nms, target[1]), x, cands, params) >= 4


THRESHOLD_KINDS = ("quotient below t", "quotient t, ratio above t", "quotient t, ratio at most t", "quotient above t")


def threshold_pairs(rng, cells: int, t: np.float32) -> tuple[np.ndarray, list[str]]:
    """output0 [1, 4 + NC, 2 * cells]: a pair of boxes in each of `cells` cells 80 px apart (disjoint from
    the other pairs), whose IoU (float32, op by op as docs/semantics.md) is within an ulp of t; the cells
    cycle through THRESHOLD_KINDS, where the exact ratio inter / union (Fractions) tells "quotient t" apart.
    The first box of a pair scores higher; pair k has class k % NC. Returns output0 and the kinds."""
    f32 = np.float32
    ft = Fraction(float(t))
    x = np.zeros((1, 4 + NC, 2 * cells), f32)
    kinds = []
    for k in range(cells):
        want = THRESHOLD_KINDS[k % len(THRESHOLD_KINDS)]
        n = 4000
        w, h = rng.uniform(12, 40, n).astype(f32), rng.uniform(12, 40, n).astype(f32)
        dx = (w * (1 - t) / (1 + t) * (1 + rng.normal(0, 2e-6, n))).astype(f32)  # IoU (w - dx) / (w + dx) ~ t
        cx = (40 + 80 * (k % 8) + rng.uniform(0, 1, n)).astype(f32)
        cy = np.full(n, 40 + 80 * (k // 8), f32)
        a = [cx - w / f32(2), cy - h / f32(2), cx + w / f32(2), cy + h / f32(2)]
        b = [cx + dx - w / f32(2), cy - h / f32(2), cx + dx + w / f32(2), cy + h / f32(2)]
        iw = np.maximum(f32(0), np.minimum(a[2], b[2]) - np.maximum(a[0], b[0]))
        ih = np.maximum(f32(0), np.minimum(a[3], b[3]) - np.maximum(a[1], b[1]))
        inter = iw * ih
        uni = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
        q = inter / uni
        for i in np.flatnonzero(np.abs(q.view(np.int32) - t.view(np.int32)) <= 1):
            ratio = Fraction(float(inter[i])) / Fraction(float(uni[i]))
            kind = (THRESHOLD_KINDS[0] if q[i] < t else THRESHOLD_KINDS[3] if q[i] > t
                    else THRESHOLD_KINDS[1] if ratio > ft else THRESHOLD_KINDS[2])
            if kind == want:
                break
        else:
            raise AssertionError(f"cell {k}: no pair of kind {want!r} among {n} samples")
        kinds.append(kind)
        for j, (bx, score) in enumerate([(cx[i], 0.9 - 0.002 * k), (cx[i] + dx[i], 0.5 - 0.002 * k)]):
            x[0, :4, 2 * k + j] = [bx, cy[i], w[i], h[i]]
            x[0, 4 + k % NC, 2 * k + j] = score
    return x, kinds


@pytest.mark.parametrize("block, chunk, cluster", [(512, 256, 1), (1024, 512, 1), (1024, 512, 2),
                                                 (512, 512, 8)])
@pytest.mark.parametrize("classes", ["one", "a class a pair"])
def test_nms_alone_iou_at_the_threshold(gpu, target, cache, block, chunk, cluster, classes):
    """Pairs whose IoU rounds to the threshold's neighbours, to it from above or below, and past it
    (the NMS's test decides most pairs without the division: deepjit::iou_above, docs/design.md). One class: a row per
    box (mask_groups); a class a pair: a thread per pair (mask_pairs)."""
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False}
    skip_if_chunk_too_big({"chunk": chunk, "cluster": cluster}, target)
    cells = 48
    x, kinds = threshold_pairs(np.random.default_rng([block, len(classes)]), cells, np.float32(0.45))
    if classes == "one":
        x[:, 4] = x[:, 4:].max(axis=1)
        x[:, 5:] = 0
    way = {"block": block, "chunk": chunk, "cluster": cluster}
    nms = build("nms", {**params, "max_candidates": 2 * cells, **way}, {}, target, cache)
    cands = candidates_from_output0(x, params["conf_threshold"], 2 * cells)
    assert cands["cand_count"][0] == 2 * cells
    suppressed = sum(kind == THRESHOLD_KINDS[3] for kind in kinds)  # only a quotient above t suppresses
    assert check_nms_alone(gpu, ContractKernel(gpu, nms, target[1]), x, cands, params) == 2 * cells - suppressed


def score_buckets(scores: np.ndarray, conf: float) -> np.ndarray:
    """templates/deepjit_nms.cuh's score_bucket: the float bits above conf's, shifted so that (conf, 1]
    spans 256 buckets."""
    lo = int(np.float32(conf).view(np.uint32))
    shift = max(0, (0x3F800000 - lo - 1).bit_length() - 8)
    return np.minimum(255, (scores.astype(np.float32).view(np.uint32).astype(np.int64) - lo) >> shift)


def slot_frame(rng, group: int, bucket: int, chain: int) -> np.ndarray:
    """output0 [1, 4 + NC, 512]: `group` boxes of class 7 in clusters of four overlapping boxes; `bucket`
    disjoint boxes of score 0.9, no other score near it (classes 20 .. 59); `chain` boxes of class 3 in
    a row, each overlapping only its neighbours (IoU 0.6, 0.33 two apart), in falling score order, so
    greedy NMS keeps every other one and which depends on the one before; and 150 scattered boxes of
    the other classes."""
    x = np.zeros((1, 4 + NC, 512), np.float32)
    at = 0

    def put(cx, cy, w, h, cls, score):
        nonlocal at
        x[0, :4, at], x[0, 4 + cls, at] = [cx, cy, w, h], score
        at += 1

    scores = rng.permutation(np.linspace(0.3, 0.85, group))
    for k in range(group):
        cx, cy = 60 + 70 * (k // 4 % 8), 60 + 200 * (k // 32)
        put(cx + rng.normal(0, 4), cy + rng.normal(0, 4), 40 + rng.normal(0, 3), 40 + rng.normal(0, 3), 7, scores[k])
    for k in range(bucket):
        put(30 + 36 * (k % 16), 480 + 36 * (k // 16), 20, 20, 20 + k % 40, 0.9)
    for k in range(chain):
        put(100 + 10 * k, 400, 40, 30, 3, 0.98 - 0.002 * k)
    others = [c for c in range(NC) if c not in (3, 7) and not 20 <= c < 60]
    for _ in range(150):
        put(*rng.uniform(20, 620, 2), *rng.uniform(10, 60, 2), rng.choice(others), rng.uniform(0.3, 0.85))
    return x


@pytest.mark.parametrize("block, chunk, cluster", [(512, 256, 1), (1024, 512, 1), (1024, 512, 2),
                                                 (512, 512, 8)])
@pytest.mark.parametrize("group, bucket, what", [
    (32, 16, "a class group of one warp's members, a score bucket at its slot capacity: the slot path "
             "(210 candidates: the rows leave the last two warps free, so the settle takes a listed group a warp)"),
    (64, 16, "a class group at its slot capacity (two members a lane in the settle): the slot path "
             "(242 candidates at 4 lanes reach the last warp but one: the settle takes the groups g % 32 a warp)"),
    (65, 16, "a class group past 64: the general path"),
    (64, 17, "a score bucket past 16: the general path")])
def test_nms_alone_slot_path_capacities_and_chains(gpu, target, cache, block, chunk, cluster, group, bucket, what):
    """The slot path (nms_image: with chunk >= 512, up to min(chunk, block - 32) candidates, at most 64 a
    class and 16 a score bucket) at its capacities and just past them, with a chain of boxes its settle
    walks in score order; chunk 256 (no slot path) on the same frames. Either way the detections are
    ONNX Runtime's exactly."""
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False}
    skip_if_chunk_too_big({"chunk": chunk, "cluster": cluster}, target)
    x = slot_frame(np.random.default_rng([block, group, bucket]), group, bucket, chain=12)
    cands = candidates_from_output0(x, params["conf_threshold"], 512)
    n = cands["cand_count"][0]
    assert n == group + bucket + 12 + 150 and n <= min(chunk, block - 32)
    assert np.bincount(cands["cand_classes"][0, :n]).max() == group
    assert np.bincount(score_buckets(cands["cand_scores"][0, :n], params["conf_threshold"])).max() == bucket
    way = {"block": block, "chunk": chunk, "cluster": cluster}
    nms = build("nms", {**params, "max_candidates": 512, **way}, {}, target, cache)
    kept = check_nms_alone(gpu, ContractKernel(gpu, nms, target[1]), x, cands, params)
    assert bucket + 6 < kept < n - group // 2  # the bucket's boxes and half the chain kept, clusters thinned


@pytest.mark.parametrize("block, chunk, cluster", [(512, 256, 1), (1024, 512, 1), (1024, 512, 2),
                                                 (512, 512, 8)])
def test_nms_alone_classes_256_apart_stay_apart(gpu, target, cache, block, chunk, cluster):
    """The nms groups classes by class & 255, and the slot path's tests skip the class (a group is one
    class there): an image with a class past 255 leaves it for the general path, whose tests compare
    classes. 24 pairs of overlapping boxes (IoU ~0.8) of classes k and k + 256 all stay; 24 pairs of
    one class each lose their lower box."""
    classes = 300
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False}
    skip_if_chunk_too_big({"chunk": chunk, "cluster": cluster}, target)
    rng = np.random.default_rng([block, 256])
    x = np.zeros((1, 4 + classes, 96), np.float32)
    for k in range(48):
        cx, cy, w = 40 + 80 * (k % 8), 40 + 80 * (k // 8), rng.uniform(30, 50)
        for j, cls in enumerate([k % 24, k % 24 + 256 if k < 24 else k % 24]):
            x[0, :4, 2 * k + j] = [cx + 3 * j, cy, w, w]
            x[0, 4 + cls, 2 * k + j] = rng.uniform(0.3, 0.95)
    way = {"block": block, "chunk": chunk, "cluster": cluster}
    nms = build("nms", {**params, "max_candidates": 96, **way}, {}, target, cache)
    cands = candidates_from_output0(x, params["conf_threshold"], 96)
    assert cands["cand_count"][0] == 96 and cands["cand_classes"][0].max() >= 256
    assert check_nms_alone(gpu, ContractKernel(gpu, nms, target[1]), x, cands, params, classes) == 96 - 24


@pytest.mark.parametrize("block, chunk, cluster", [(128, 256, 1), (512, 256, 1), (1024, 256, 1), (512, 512, 1),
                                                  (1024, 512, 1), (1024, 1024, 1), (1024, 512, 2)])
@pytest.mark.parametrize("logit_mean, what", [(-6.0, "hundreds of candidates: bucket sort, one or two chunks"),
                                              (-5.5, "about a thousand: shared-memory bitonic sort"),
                                              (-3.5, "thousands of candidates: workspace sort")])
def test_nms_alone_on_reference_output0(gpu, target, cache, logit_mean, what, block, chunk, cluster):
    anchors = 8400
    params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300}
    skip_if_chunk_too_big({"chunk": chunk, "cluster": cluster}, target)
    way = {"block": block, "chunk": chunk, "cluster": cluster}
    nms = build("nms", {**params, "max_candidates": anchors, **way}, {}, target, cache)
    kernel = ContractKernel(gpu, nms, target[1])
    rng = np.random.default_rng(int(-logit_mean * 10))
    x = detections(rng, 4, anchors, logit_mean)
    cands = candidates_from_output0(x, params["conf_threshold"], anchors)
    counts = cands["cand_count"]
    if "hundreds" in what:
        assert 256 < counts.min() and counts.max() <= 512  # the bucket sort where block >= count; two chunks of 256
    elif "thousand:" in what:
        assert 1024 < counts.min() and counts.max() <= 2048  # past every block, within sort_capacity
    else:
        assert counts.min() > 2048  # past sort_capacity
    assert check_nms_alone(gpu, kernel, x, cands, params) > 4 * 20


def test_graph_replay_matches_plain_launches(gpu, cache):
    _, facts, inputs = decode_site()
    target = (gpu.sm, "cubin")
    decode = build("yolov8_decode", {"mode": "candidates"}, facts, target, cache)
    nms = build("nms", {}, facts, target, cache)
    rng = np.random.default_rng(99)
    batches = [head_maps(rng, 4) for _ in range(3)]
    host = lambda maps: site_feed(maps, facts)  # noqa: E731
    post = KernelChain(gpu, [(decode, decode_names(decode, inputs)), nms],
                       {k: gpu.upload(v) for k, v in host(batches[0]).items()})
    plain = []
    for maps in batches:
        for k, v in host(maps).items():
            gpu.upload(v, out=post.inputs[k])
        post.launch()
        plain.append(post.results())
    graph = gpu.capture(post.launch)
    for maps, want in zip(batches * 2, plain * 2):  # twice round: the counters reset every replay
        for k, v in host(maps).items():
            gpu.upload(v, out=post.inputs[k])
        for arr in post.outputs.values():
            gpu.fill(arr, 0xFF)
        graph.replay()
        got = post.results()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert all(p["num_dets"].min() > 0 for p in plain)  # every image had detections to compare


def test_sm75_cubin_does_not_load_on_a_newer_gpu(gpu, cache):
    if gpu.sm == 75:
        pytest.skip("this GPU is sm_75: its cubin loads")
    k = compile_site_kernel("letterbox", {}, {}, sm=75, cache_dir=cache)
    with pytest.raises(KernelError, match=r"cubin is for sm_75.*load its PTX"):
        gpu.load(k, prefer="cubin")
    assert gpu.load(k).code_type == "ptx"


# --- letterbox ----------------------------------------------------------------------------------


def letterbox_runner(gpu, compiled, load):
    def run(feed):
        lb = KernelChain(gpu, [compiled], {"raw_images": gpu.upload(feed["raw_images"])}, load)
        for arr in lb.outputs.values():
            gpu.fill(arr, 0xFF)
        lb.launch()  # its geometry comes from the contract's roles.host_args
        return lb.results()

    return Runner(run, f"deepjit-letterbox-{compiled.arch}-{load}")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("batch, hw", [(1, (480, 640)), (8, (375, 500)), (1, (1080, 1920)), (8, (640, 427))])
def test_letterbox_matches_reference(gpu, target, cache, batch, hw, dtype):
    params = {"size": 640, "dtype": dtype, "swap_rb": True, "pad_value": 114}
    compiled = build("letterbox", params, {}, target, cache)
    rng = np.random.default_rng([batch, *hw])
    feeds = [{"raw_images": rng.integers(0, 256, (batch, *hw, 3), dtype=np.uint8)}]
    results, ref_out, test_out = run_both(ort_runner(letterbox_reference(**params), "onnxrt-letterbox-reference"),
                                          letterbox_runner(gpu, compiled, target[1]), feeds)
    np.testing.assert_array_equal(test_out[0]["ratio_pad"], ref_out[0]["ratio_pad"])
    assert_close(results, atol=1e-5 if dtype == "float32" else 1e-3, rtol=0.0)
