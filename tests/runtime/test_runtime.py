"""The runtime without a GPU: manifest layout, phases and copies, buckets, input checks, cubin/PTX
choice, and the whole call path of `Pipeline` on a host-memory fake device (real ONNX Runtime
engine, real staging and copies; the kernels are recorded, and emulated where a test says how),
plus `deepjit run`/`bench`'s input loading, box mapping and JSON.

Bundles are real: a yolov8n variant of pipelines/yolov8_t4.yaml, and one with a letterbox stage.
"""
from __future__ import annotations

import copy
import ctypes
import json
import logging
import math
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import FUSED, REPO, YOLOV8N_T4, letterbox_variant

from deepjit_compiler.bundle.folder import read_bundle, update_bundle
from deepjit_compiler.bundle.view import InputView, StepView
from deepjit_compiler.errors import BundleError, KernelError, MissingDependency, RuntimeInputError
from deepjit_compiler.graph.tensors import TensorSig
from deepjit_compiler.runtime import hostmem
from deepjit_compiler.runtime import pipeline as runtime
from deepjit_compiler.runtime import run as runbundle
from deepjit_compiler.runtime.code import choose_code
from deepjit_compiler.runtime.cpu import CpuPipeline
from deepjit_compiler.runtime.inputs import bucket_for
from deepjit_compiler.runtime.layout import KernelInfo, Layout, StepInfo, site_aliases
from deepjit_compiler.runtime.pipeline import CountingGpu, Pipeline

YOLOV8N = {old: new for old, new in YOLOV8N_T4.items() if not new.startswith("path: out/")}  # out/<name> here
LETTERBOX = letterbox_variant(opt_hw=(48, 64))
HEADS = 80 * 80 + 40 * 40 + 20 * 20     # anchors of a 640x640 YOLOv8 (strides 8, 16, 32)


def build_variant(folder: Path, name: str, extra: dict[str, str] | None = None) -> Path:
    from deepjit_compiler.build import build_pipeline

    text = (REPO / "pipelines" / "yolov8_t4.yaml").read_text()
    for old, new in {**YOLOV8N, "path: ../build/yolov8s_t4": f"path: out/{name}", **(extra or {})}.items():
        assert old in text, f"test bug: {old!r} is not in the spec"
        text = text.replace(old, new)
    spec = folder / f"{name}.yaml"
    spec.write_text(text)
    return build_pipeline(spec, publish=False).bundle.path


@pytest.fixture(scope="session")
def t4_bundle(t4_build) -> Path:
    return t4_build.bundle.path  # conftest.py's build of the same spec build_variant would write


@pytest.fixture(scope="session")
def lb_bundle(tmp_path_factory) -> Path:
    return build_variant(tmp_path_factory.mktemp("rt-lb"), "yolov8n_lb", LETTERBOX)


@pytest.fixture(scope="session")
def fused_bundle(tmp_path_factory) -> Path:
    """The T4 example with decode and NMS in one launch (yolov8_decode mode nms, nms fused: true)."""
    return build_variant(tmp_path_factory.mktemp("rt-fused"), "yolov8n_fused", FUSED)


@pytest.fixture(scope="session")
def lanes_bundle(tmp_path_factory) -> Path:
    """The T4 example with the H200 spec's decode: 4 lanes an anchor, 2 from batch 4 (large_batch_lanes)."""
    return build_variant(tmp_path_factory.mktemp("rt-lanes"), "yolov8n_lanes", {
        "          anchors_per_thread: 4\n": "          anchors_per_thread: 1\n          lanes_per_anchor: 4\n"
                                            "          large_batch_lanes: 2\n"})


@pytest.fixture(scope="session")
def t4_layout(t4_bundle) -> Layout:
    return Layout.from_bundle(read_bundle(t4_bundle))


def head_names(manifest) -> list[str]:
    site = next(s for s in manifest["plan"]["steps"] if s["kind"] == "kernel")
    return [t["name"] for t in site["inputs"]]


# ----------------------------------------------------------------------------- a host-memory GPU
class FakeBuffer:
    def __init__(self, nbytes: int):
        self.size = nbytes
        self._mem = (ctypes.c_uint8 * nbytes)()
        self.handle = ctypes.addressof(self._mem)

    def close(self, *args):
        pass


class FakeFunction:
    def __init__(self, contract: str, entry: str):
        self.contract, self.entry = contract, entry


class FakeModule:
    """A kernel by its entry point's name or C++ name expression, as gpu.Module finds it; named by its entry."""

    def __init__(self, kernel):
        self.contract = kernel.contract
        self.entries = {expr: entry for entry, expr in kernel.entries}

    def kernel(self, name: str) -> FakeFunction:
        return FakeFunction(self.contract, self.entries.get(name, name))


class FakeGraph:
    def __init__(self, gpu, launches):
        self.gpu, self.launches = gpu, launches

    def replay(self):
        self.gpu.log.append(("replay", tuple(fn.entry for fn, *_ in self.launches)))
        for launch in self.launches:
            self.gpu.execute(*launch)

    def close(self):
        pass


class FakeStream:
    handle = 0x5EED

    def __init__(self, gpu):
        self.gpu = gpu

    def sync(self):
        self.gpu.log.append(("sync",))


class FakeGpu(CountingGpu):
    """Device memory is host memory, copies are memmove, kernels run `hooks[entry]` if given."""

    def __init__(self, sm: int = 90):
        self.sm, self.name = sm, "Fake GPU"
        self.device = type("Device", (), {"allocate": lambda _, n, stream=None: FakeBuffer(n)})()
        self.stream = FakeStream(self)
        self.allocations = self.allocated_bytes = 0
        self.log: list[tuple] = []
        self.loaded: dict[str, str] = {}
        self.hooks: dict = {}
        self._capturing = None

    @property
    def cu_stream(self):
        return self.stream.handle

    def fill(self, arr, byte):
        ctypes.memset(arr.ptr, byte, arr.nbytes)

    def load(self, kernel, prefer="auto"):
        self.loaded[kernel.contract] = prefer
        return FakeModule(kernel)

    def launch_config(self, grid, block, shared_mem=0, overlap=False):
        self.log.append(("config", tuple(grid), shared_mem, overlap))
        return tuple(grid), tuple(block), shared_mem

    def allow_shared(self, fn, dynamic, who):
        self.log.append(("allow_shared", fn.entry, dynamic))

    def launch_with(self, config, fn, *args):
        self.launch(fn, *config, *args)

    def launch(self, fn, grid, block, shared_mem, *args):
        if self._capturing is not None:
            self._capturing.append((fn, grid, block, args))
            return
        self.log.append(("launch", fn.entry, tuple(grid)))
        self.execute(fn, grid, block, args)

    def execute(self, fn, grid, block, args):
        if fn.entry in self.hooks:
            self.hooks[fn.entry](tuple(grid), args)

    def abandon_capture(self):
        self.log.append(("abandon_capture",))

    def capture(self, body):
        self._capturing = []
        try:
            body()
        finally:
            launches, self._capturing = self._capturing, None
        self.log.append(("capture",))
        return FakeGraph(self, launches)

    @staticmethod
    def event():
        return object()

    @staticmethod
    def destroy_event(event):
        pass

    def record(self, event=None):
        return event

    @staticmethod
    def elapsed_ms(start, end):
        return 0.25


class FakeDriver:
    """cuda.bindings.driver's pinned-memory and copy calls over host memory."""

    def __init__(self, log):
        self.log, self.pinned = log, {}

    def cuMemHostAlloc(self, nbytes, flags):
        buf = (ctypes.c_uint8 * nbytes)()
        self.pinned[ctypes.addressof(buf)] = buf
        return 0, ctypes.addressof(buf)

    def cuMemFreeHost(self, ptr):
        del self.pinned[ptr]
        return (0,)

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        self.log.append(("h2d", nbytes))
        return (0,)

    def cuMemcpyDtoHAsync(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)
        self.log.append(("d2h", nbytes))
        return (0,)


@pytest.fixture
def fake(monkeypatch):
    """Pipelines load on a FakeGpu (sm_90 by default: a T4 bundle goes through its PTX)."""
    made: list[FakeGpu] = []
    state = {"sm": 90}

    def new_gpu(ordinal=0):
        state["ordinal"] = ordinal
        gpu = FakeGpu(state["sm"])
        monkeypatch.setattr(hostmem, "driver", FakeDriver(gpu.log))
        made.append(gpu)
        return gpu

    monkeypatch.setattr(runtime, "_new_gpu", new_gpu)
    monkeypatch.setattr(runtime, "driver_version", lambda: 13050)
    return type("Fake", (), {"made": made, "state": state})


def device_array(arr, shape=None) -> np.ndarray:
    """Read a fake device array (host memory) as numpy."""
    shape = shape or arr.shape
    n = math.prod(shape) * arr.dtype.itemsize
    raw = (ctypes.c_uint8 * n).from_address(arr.ptr)
    return np.frombuffer(raw, np.uint8).view(arr.dtype).reshape(shape).copy()


def write_at(ptr: int, values: np.ndarray) -> None:
    values = np.ascontiguousarray(values)
    ctypes.memmove(int(ptr), values.ctypes.data, values.nbytes)


def images(rng, n) -> np.ndarray:
    return rng.random((n, 3, 640, 640), dtype=np.float32)


def segment_heads(bundle: Path, feed: np.ndarray) -> dict[str, np.ndarray]:
    """The bundle's engine segment on ONNX Runtime, independently of the runtime."""
    sess = ort.InferenceSession(str(bundle / "engines/segment.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {sess.get_inputs()[0].name: feed})))


# ----------------------------------------------------------------------------- layout
def test_layout_of_the_flagship_bundle(t4_bundle, t4_layout):
    m = read_bundle(t4_bundle).manifest
    assert [i.name for i in t4_layout.inputs] == ["images"]
    assert t4_layout.buckets == (1, 2, 4, 8) and t4_layout.max_batch == 8
    assert [s.kind for s in t4_layout.steps] == ["segment", "kernel", "added"]
    decode, nms = t4_layout.steps[1], t4_layout.steps[2]
    assert sorted(decode.reads) == sorted(head_names(m))  # box_i/cls_i bound to the site's head maps
    assert set(decode.writes) == {"cand_count", "cand_boxes", "cand_scores", "cand_classes", "cand_index"}
    assert set(nms.reads) == set(decode.writes) and "output0" not in nms.reads  # its reference reads output0
    assert nms.writes == ("num_dets", "boxes", "scores", "classes")


def test_schedule_with_the_engine_on_the_cpu_or_the_gpu(t4_bundle, t4_layout):
    heads = head_names(read_bundle(t4_bundle).manifest)
    sched = t4_layout.schedule(engines_on_device=False)
    assert [(p.where, p.steps) for p in sched.phases] == [("host", ("segment",)), ("device", ("decode", "nms"))]
    assert sorted(sched.phases[1].upload) == sorted(heads)
    assert sched.final_download == ("num_dets", "boxes", "scores", "classes")
    on_gpu = t4_layout.schedule(engines_on_device=True)
    assert [(p.where, p.steps, p.upload) for p in on_gpu.phases] == \
        [("device", ("segment", "decode", "nms"), ("images",))]


def test_schedule_with_a_letterbox_before_a_cpu_engine(lb_bundle):
    layout = Layout.from_bundle(read_bundle(lb_bundle))
    assert [i.name for i in layout.inputs] == ["raw_images"] and layout.buckets == (1, 2, 4)
    phases = layout.schedule(False).phases
    assert [(p.where, p.steps) for p in phases] == [("device", ("letterbox",)), ("host", ("segment",)),
                                                     ("device", ("decode", "nms"))]
    assert phases[0].upload == ("raw_images",) and phases[1].download == ("images",)
    assert "ratio_pad" in layout.schedule(False).final_download


def test_shapes_at_the_max_batch(t4_layout):
    shapes = t4_layout.shapes(t4_layout.steps, {"images": (8, 3, 640, 640)}, 8)
    assert shapes["cand_boxes"] == (8, HEADS, 4) and shapes["cand_count"] == (8,)
    assert shapes["boxes"] == (8, 300, 4) and shapes["num_dets"] == (8,) and shapes["classes"] == (8, 300)
    assert shapes["/model.22/cv3.0/cv3.0.2/Conv_output_0"] == (8, 80, 80, 80)


def test_broken_plans_are_bundle_errors(t4_bundle):
    m = read_bundle(t4_bundle).manifest
    swapped = copy.deepcopy(m)
    steps = swapped["plan"]["steps"]
    steps[1], steps[2] = steps[2], steps[1]
    with pytest.raises(BundleError, match="step 'nms' reads 'cand_count', which no input or earlier step makes"):
        Layout.from_manifest(swapped).schedule(False)
    extra = copy.deepcopy(m)
    extra["plan"]["outputs"].append({"name": "output0", "dtype": "float32", "shape": ["batch", 84, HEADS]})
    with pytest.raises(BundleError, match="pipeline output 'output0' is made by no step"):
        Layout.from_manifest(extra).schedule(False)
    for key in ("steps", "outputs"):
        empty = copy.deepcopy(m)
        empty["plan"][key] = []
        with pytest.raises(BundleError, match=f"plan.{key} is empty: nothing to run"):
            Layout.from_manifest(empty).schedule(False)
    user = copy.deepcopy(m)
    user["plan"]["steps"][2]["kernels"][0]["contract"] = "my_nms"
    with pytest.raises(BundleError, match="contract 'my_nms' cannot be loaded.*carries no copy of it"):
        Layout.from_manifest(user)


def test_every_tensor_has_the_dtype_its_maker_declares(t4_bundle, t4_layout):
    """The buffers' dtypes: the input's, the fp16 segment's head maps (handed to the decode in the
    engine's dtype), the decode's candidates and the nms's detections, as their contracts declare."""
    heads = head_names(read_bundle(t4_bundle).manifest)
    dtypes = t4_layout.dtypes()
    assert dtypes["images"] == "float32" and {dtypes[h] for h in heads} == {"float16"}
    assert [dtypes[n] for n in ("cand_count", "cand_boxes", "cand_scores", "cand_classes", "cand_index")] == \
        ["int32", "float32", "float32", "int32", "int32"]
    assert [dtypes[n] for n in ("num_dets", "boxes", "scores", "classes")] == ["int32", "float32", "float32", "int32"]


def test_a_kernel_reading_a_tensor_in_another_dtype_is_a_bundle_error(t4_bundle):
    """A segment that makes a head map in float32 while the decode reads it as float16 (the bundle's
    records disagree): its buffer would be read as the wrong type, so loading refuses, naming both."""
    m = copy.deepcopy(read_bundle(t4_bundle).manifest)
    head = next(t for t in m["plan"]["steps"][0]["outputs"] if t["name"] == head_names(m)[0])
    head["dtype"] = "float32"
    with pytest.raises(BundleError, match=rf"kernel decode/yolov8_decode reads '\w+' \({re.escape(head['name'])}\) as "
                                          r"float16, but the pipeline makes it float32"):
        Layout.from_manifest(m).dtypes()


def test_a_fused_decode_makes_the_detections_and_its_nms_stage_nothing(t4_bundle):
    """decode in mode nms + nms with fused: true: the decode step writes the detections, the nms step
    reads and writes nothing; both writing them, or neither, is a located error."""
    m = copy.deepcopy(read_bundle(t4_bundle).manifest)
    steps = m["plan"]["steps"]
    steps[1]["kernels"][0]["params"]["mode"] = "nms"
    steps[2]["kernels"][0]["params"]["fused"] = True
    layout = Layout.from_manifest(m)
    decode, nms = layout.steps[1], layout.steps[2]
    assert {"num_dets", "boxes", "scores", "classes", "blocks_done"} <= set(decode.writes)
    assert nms.reads == () and nms.writes == ()
    schedule = layout.schedule(True)
    assert {"num_dets", "boxes"} <= set(schedule.device_tensors)
    assert layout.shapes(layout.steps, {"images": (8, 3, 640, 640)}, 8)["boxes"] == (8, 300, 4)
    both = copy.deepcopy(m)
    both["plan"]["steps"][2]["kernels"][0]["params"]["fused"] = False
    with pytest.raises(BundleError, match="step 'nms' makes 'num_dets', which an input or earlier step made already"):
        Layout.from_manifest(both).schedule(True)
    neither = copy.deepcopy(m)
    neither["plan"]["steps"][1]["kernels"][0]["params"]["mode"] = "candidates"
    with pytest.raises(BundleError, match="pipeline output 'num_dets' is made by no step"):
        Layout.from_manifest(neither).schedule(True)


@pytest.mark.parametrize("batch,bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8)])
def test_bucket_is_the_smallest_that_holds_the_batch(batch, bucket):
    assert bucket_for(batch, (1, 2, 4, 8)) == bucket == bucket_for(batch, (8, 2, 1, 4))


def test_buckets_always_reach_the_max_batch(t4_bundle):
    m = copy.deepcopy(read_bundle(t4_bundle).manifest)
    m["inputs"]["images"]["buckets"] = [1, 2]
    layout = Layout.from_manifest(m)
    assert layout.buckets == (1, 2, 8) and layout.bucket_for(3) == 8
    with pytest.raises(RuntimeInputError, match="above the largest bucket 8"):
        bucket_for(9, layout.buckets)


@pytest.mark.parametrize("feeds,message", [
    (lambda r: {"images": r.random((2, 3, 640, 640))}, "input 'images' is float64, expected float32"),
    (lambda r: {"images": images(r, 9)}, "batch 9 is above this pipeline's max batch 8"),
    (lambda r: {"images": images(r, 1)[0]}, r"expected rank 4 \[batch, 3, 640, 640\]"),
    (lambda r: {"images": r.random((1, 3, 320, 640), dtype=np.float32)},
     r"dim 2 is 320, allowed 640 \(shape \[batch, 3, 640, 640\], got \(1, 3, 320, 640\)\)"),
    (lambda r: {"images": r.random((1, 4, 640, 640), dtype=np.float32)}, r"dim 1 is 4, allowed 3 \("),
    (lambda r: {"images": r.random((1, 3, 640, 640, 1), dtype=np.float32)},
     r"has shape \(1, 3, 640, 640, 1\), expected rank 4"),
    (lambda r: {}, "input 'images' is missing"),
    (lambda r: {"image": images(r, 1), "images": images(r, 1)}, "unknown input 'image' \\(did you mean 'images'"),
    (lambda r: {"images": [[0.0]]}, "expected a numpy array, got list"),
])
def test_bad_feeds_name_the_input_and_what_is_allowed(t4_layout, feeds, message):
    with pytest.raises(RuntimeInputError, match=message):
        t4_layout.check_feeds(feeds(np.random.default_rng(5)))


def test_good_feeds_give_their_batch(t4_layout):
    assert t4_layout.check_feeds({"images": images(np.random.default_rng(1), 3)}) == 3


def _kernel_step(name: str, reads: tuple[str, ...], writes: tuple[str, ...]) -> StepInfo:
    """A kernel step of one kernel that reads and writes these float32 [batch] tensors (no contract needed
    to schedule it)."""
    sigs = tuple(TensorSig(n, "float32", ("batch",), role) for role, names in (("input", reads), ("output", writes))
                 for n in names)
    return StepInfo(StepView(name, "kernel", (), (), ""), (KernelInfo(name, 0, None, None, {}, sigs),))


def _segment_step(name: str, reads: tuple[str, ...], writes: tuple[str, ...]) -> StepInfo:
    return StepInfo(StepView(name, "segment", _batch_sigs(reads), _batch_sigs(writes), f"{name}.onnx"))


def _batch_sigs(names: tuple[str, ...]) -> tuple[TensorSig, ...]:
    return tuple(TensorSig(n, "float32", ("batch",)) for n in names)


def test_copies_cross_only_where_a_tensor_is_not_yet_on_that_side(t4_layout):
    """k1 on the device makes `a`; the CPU engine reads it (one download) and makes `b`; k2 reads both:
    only `b` is uploaded (`a` is still on the device), and only the device's outputs are copied out."""
    steps = (_kernel_step("k1", ("x",), ("a",)), _segment_step("s", ("a",), ("b",)), _kernel_step("k2", ("a", "b"), ("c",)))
    outputs = _batch_sigs(("c", "b"))
    x = InputView("x", "float32", ("batch",), (1,), (2,), (4,), (1, 2, 4))
    layout = replace(t4_layout, inputs=(x,), outputs=outputs, steps=steps)
    host = layout.schedule(engines_on_device=False)
    assert [(p.where, p.steps, p.reads, p.upload, p.download) for p in host.phases] == [
        ("device", ("k1",), ("x",), ("x",), ()), ("host", ("s",), ("a",), (), ("a",)),
        ("device", ("k2",), ("a", "b"), ("b",), ())]
    assert host.final_download == ("c",) and host.device_tensors == ("x", "a", "b", "c")
    device = layout.schedule(engines_on_device=True)
    assert [(p.where, p.steps, p.upload) for p in device.phases] == [("device", ("k1", "s", "k2"), ("x",))]
    assert device.final_download == ("c", "b") and device.device_tensors == ("x", "a", "b", "c")


def test_inputs_share_one_batch_within_the_tightest_of_their_profiles(t4_layout):
    """Every input is batch-major with one batch: the max is the smallest max, the min the largest min,
    and a call's inputs must agree on it."""
    images_in = t4_layout.inputs[0]  # batch 1..8
    scale = InputView("scale", "float32", ("batch", 2), (2, 2), (4, 2), (6, 2), images_in.buckets)
    layout = replace(t4_layout, inputs=(images_in, scale))
    assert (layout.min_batch, layout.max_batch) == (2, 6)
    rng = np.random.default_rng(7)

    def feeds(n: int, m: int | None = None) -> dict[str, np.ndarray]:
        return {"images": images(rng, n), "scale": rng.random((n if m is None else m, 2), dtype=np.float32)}

    assert layout.check_feeds(feeds(3)) == 3
    with pytest.raises(RuntimeInputError, match="input 'scale' has batch 2, but the other inputs have 3"):
        layout.check_feeds(feeds(3, 2))
    with pytest.raises(RuntimeInputError, match="batch 1 is below this pipeline's min batch 2$"):
        layout.check_feeds(feeds(1))
    with pytest.raises(RuntimeInputError, match="batch 7 is above this pipeline's max batch 6"):
        layout.check_feeds(feeds(7))


def test_inputs_with_different_buckets_are_refused_and_launches_cover_the_min_batch(t4_layout):
    images_in = replace(t4_layout.inputs[0], min=(3, 3, 320, 320), buckets=(4, 8))
    layout = replace(t4_layout, inputs=(images_in,))
    assert layout.launch_batches == (3, 4, 8) and layout.buckets == (4, 8)
    with pytest.raises(RuntimeInputError, match=r"input 'images' dim 2 is 100, allowed 320..640 \(shape"):
        layout.check_feeds({"images": np.random.default_rng(2).random((3, 3, 100, 640), dtype=np.float32)})
    other = replace(images_in, name="other", buckets=(8,))
    with pytest.raises(BundleError, match=r"inputs have different batch buckets \[\(4, 8\), \(8,\)\]"):
        replace(layout, inputs=(images_in, other)).buckets


def test_a_step_reads_only_what_its_own_kernels_do_not_make_first():
    k1 = _kernel_step("k", ("x",), ("a",)).kernels[0]
    k2 = _kernel_step("k", ("a", "y"), ("b",)).kernels[0]
    step = StepInfo(StepView("k", "kernel", (), (), ""), (k1, k2))
    assert (step.reads, step.writes) == (("x", "y"), ("a", "b"))


def test_a_site_input_past_the_steps_inputs_is_a_bundle_error(t4_layout):
    decode = t4_layout.step("decode")
    k = decode.kernels[0]
    with pytest.raises(BundleError, match=r"kernel d: input '\w+' reads site input 5, but the step has 5 inputs"):
        site_aliases(k.contract, k.params, decode.inputs[:5], "kernel d")


def test_an_engine_outputs_symbolic_dims_come_from_the_input_that_names_them(t4_layout):
    frames = InputView("frames", "float32", ("batch", 3, "height", "width"), (1, 3, 32, 32), (2, 3, 64, 64),
                       (4, 3, 640, 640), (1, 2, 4))
    layout = replace(t4_layout, inputs=(frames,))
    known = {"frames": (2, 3, 480, 320)}
    assert layout.engine_output_shape(TensorSig("y", "float32", ("batch", 84, "width", "height")), 2, known) == \
        (2, 84, 320, 480)
    assert layout.engine_output_shape(TensorSig("z", "float32", ("batch", "anchors")), 2, known) is None


# ----------------------------------------------------------------------------- cubin or PTX
@pytest.mark.parametrize("device_sm,prefer,code", [(75, "auto", "cubin"), (90, "auto", "ptx"), (90, "ptx", "ptx"),
                                                   (75, "ptx", "ptx"), (75, "cubin", "cubin")])
def test_cubin_on_its_own_sm_else_ptx(t4_layout, device_sm, prefer, code):
    kernel = t4_layout.kernels[0]          # built for sm_75
    assert choose_code(kernel, device_sm, int(kernel.entry["ptx_min_driver"]), prefer) == code


def test_incompatible_gpu_or_driver_says_which(t4_layout):
    kernel = t4_layout.kernels[0]          # built for sm_75
    with pytest.raises(BundleError, match=r"cubin for sm_75, which cannot load on H200 \(sm_90.*load its PTX"):
        choose_code(kernel, 90, 99999, "cubin", device_name="H200")
    with pytest.raises(BundleError, match=r"built for sm_75; V100 \(sm_70.*is older.*rebuild with target.gpu"):
        choose_code(kernel, 70, 99999, "auto", device_name="V100")
    with pytest.raises(BundleError, match=r"built for sm_75; this GPU \(sm_74.*is older"):
        choose_code(kernel, 74, 99999, "auto")
    need = int(kernel.entry["ptx_min_driver"])
    old = need - 10
    want = f"CUDA {need // 1000}.{need % 1000 // 10}"
    with pytest.raises(BundleError, match=rf"its PTX \(ISA .*needs a driver for {want} or newer.*update the driver"):
        choose_code(kernel, 90, old, "auto")
    with pytest.raises(BundleError, match=r"its cubin, made by NVRTC .* needs a driver"):
        choose_code(kernel, 75, int(kernel.entry["min_driver"]) - 10, "auto")
    with pytest.raises(KernelError, match="prefer must be auto, cubin or ptx"):
        choose_code(kernel, 75, 99999, "sass")


def test_compiled_kernel_from_the_manifest_is_the_built_one(t4_bundle):
    from deepjit_compiler.jit.nvrtc import compile_site_kernel

    bundle = read_bundle(t4_bundle)
    got = bundle.compiled(bundle.step("nms").kernels[0])
    spec_params = {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300, "agnostic": False}
    manifest_steps = {s["name"]: s for s in bundle.manifest["plan"]["steps"]}
    facts = {**manifest_steps["decode"]["facts"], **manifest_steps["nms"]["params"]}  # as the build compiles an added stage
    want = compile_site_kernel("nms", spec_params, facts, sm=75)  # the kernel cache answers
    assert (got.cubin, got.ptx, got.sm, got.min_driver, got.ptx_min_driver) == \
        (want.cubin, want.ptx, want.sm, want.min_driver, want.ptx_min_driver)
    assert dict(got.lowered) == dict(want.lowered) and dict(got.entries) == dict(want.entries)
    assert json.loads(json.dumps(dict(got.params))) == json.loads(json.dumps(dict(want.params)))
    assert got.symbol("nms") == want.symbol("nms")


# ----------------------------------------------------------------------------- the call path
def test_loading_without_a_gpu_is_a_missing_dependency(t4_bundle, monkeypatch):
    monkeypatch.setattr(runtime.Gpu, "__init__", lambda self, ordinal=0: (_ for _ in ()).throw(
        MissingDependency("no NVIDIA GPU or driver is available here")))
    with pytest.raises(MissingDependency, match="no NVIDIA GPU"):
        Pipeline.load(t4_bundle)


def _since(log, mark):
    return log[mark:]


def test_a_call_is_copies_in_one_replay_copies_out_one_sync(t4_bundle, fake, caplog):
    caplog.set_level(logging.WARNING, "deepjit.runtime")
    with Pipeline.load(t4_bundle) as pipe:
        gpu = fake.made[0]
        assert set(pipe.code.values()) == {"ptx"} and set(gpu.loaded.values()) == {"ptx"}
        assert "built for sm_75 (T4); this GPU is sm_90" in caplog.text and "PTX" in caplog.text
        after_load = pipe.allocations
        # every buffer was made at load: 6 head maps + 5 candidate buffers + 4 outputs (+ nms workspace if any)
        assert after_load >= 15
        captures = sum(1 for e in gpu.log if e[0] == "capture")
        assert captures == len(pipe.buckets)

        def nms(grid, args):  # the nms kernel writes num_dets = 7 * (image + 1) for every image it runs
            write_at(args[8], 7 * np.arange(1, grid[0] + 1, dtype=np.int32))
        gpu.hooks["nms"] = nms

        rng = np.random.default_rng(11)
        x = images(rng, 3)
        mark = len(gpu.log)
        out = pipe({"images": x})
        events = _since(gpu.log, mark)
        heads = segment_heads(t4_bundle, x)
        row = {k: v[0].nbytes for k, v in heads.items()}
        assert [e for e in events if e[0] == "h2d"] == [("h2d", 3 * row[n]) for n in pipe.phases[1].upload]
        assert [e for e in events if e[0] == "replay"] == [("replay", ("decode", "nms"))]
        assert not [e for e in events if e[0] in ("launch", "capture")]
        assert [e[0] for e in events].count("sync") == 1 and events[-1] == ("sync",)
        assert [e for e in events if e[0] == "d2h"] == [("d2h", 3 * 4), ("d2h", 3 * 300 * 4 * 4), ("d2h", 3 * 300 * 4),
                                                        ("d2h", 3 * 300 * 4)]
        for name, want in heads.items():  # the first 3 rows of the max-size buffers hold the engine's maps
            np.testing.assert_array_equal(device_array(pipe._buffers[name], want.shape), want)
        np.testing.assert_array_equal(out["num_dets"], [7, 14, 21])  # bucket 4 ran, 3 rows came back
        assert out["boxes"].shape == (3, 300, 4) and out["classes"].dtype == np.int32
        assert pipe.allocations == after_load
        assert pipe.launches_per_inference(3) == 2 and pipe.graph_launches_per_inference() == 1


class DeviceEngine:
    """An engine on the fake device, like ONNX Runtime's CUDA provider seen from outside: enqueue runs
    the segment over the runtime's (host-memory) device buffers, and fails under stream capture."""

    own_graphs = False

    def __init__(self, gpu, path: Path):
        self.gpu, self.sess = gpu, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def activate(self):
        pass

    def deactivate(self):
        pass

    def describe(self) -> str:
        return "fake device engine"

    def output_shapes(self, shapes):
        return {}

    def infer(self, feed):
        return dict(zip([o.name for o in self.sess.get_outputs()], self.sess.run(None, feed)))

    def enqueue(self, stream, bindings, shapes, own_graph=False):
        if self.gpu._capturing is not None or own_graph:  # like cuDNN's fp32 convolutions under capture
            raise RuntimeError("operation not permitted when stream is capturing")
        feed = {i.name: np.frombuffer((ctypes.c_uint8 * (4 * math.prod(shapes[i.name]))).from_address(
            bindings[i.name]), np.float32).reshape(shapes[i.name]) for i in self.sess.get_inputs()}
        for name, value in self.infer(feed).items():
            write_at(bindings[name], value)
        self.gpu.log.append(("engine", tuple(shapes[self.sess.get_inputs()[0].name])))


def test_an_engine_that_cannot_be_captured_runs_between_the_kernels_graphs(t4_bundle, fake, monkeypatch, caplog):
    """Whole-phase capture fails on the engine: the kernels after it are captured on their own and the
    engine runs plainly before their replay, on the same stream; only the inputs and outputs cross."""
    caplog.set_level(logging.INFO, "deepjit.runtime")
    monkeypatch.setattr(runtime, "engine_runner", lambda bundle, layout, step, **_: (
        DeviceEngine(fake.made[-1], bundle.file(step.file)), True))
    with Pipeline.load(t4_bundle) as pipe:
        gpu = fake.made[0]
        assert [p.where for p in pipe.phases] == ["device"] and pipe.capture_modes() == "split"
        assert "cannot be captured in the kernels' graph (operation not permitted" in caplog.text
        assert pipe.describe()["engine"] == "fake device engine"
        x = images(np.random.default_rng(12), 3)
        mark = len(gpu.log)
        out = pipe({"images": x})
        events = [e for e in _since(gpu.log, mark) if e[0] in ("engine", "replay", "h2d", "d2h", "sync")]
        assert [e[0] for e in events] == ["h2d", "engine", "replay", "d2h", "d2h", "d2h", "d2h", "sync"]
        assert events[1] == ("engine", (4, 3, 640, 640))  # bucket 4
        assert pipe.last_copies() == {"h2d": x.nbytes, "d2h": sum(v.nbytes for v in out.values())}
        for name, want in segment_heads(t4_bundle, x).items():  # the engine wrote the runtime's own buffers
            np.testing.assert_array_equal(pipe.read(name)[:3], want)
        assert pipe.graph_launches_per_inference(3) == 1 and pipe.launches_per_inference(3) == 2
        with pytest.raises(KernelError, match="'nope' is not a device tensor of the last call"):
            pipe.read("nope")


def test_an_engine_whose_own_graph_fails_too_runs_plainly_between_the_graphs(t4_bundle, fake, monkeypatch,
                                                                              caplog):
    caplog.set_level(logging.INFO, "deepjit.runtime")

    def runner(bundle, layout, step, **_):
        engine = DeviceEngine(fake.made[-1], bundle.file(step.file))
        engine.own_graphs = True  # offers its own graph, which then fails
        return engine, True
    monkeypatch.setattr(runtime, "engine_runner", runner)
    with Pipeline.load(t4_bundle) as pipe:
        assert pipe.capture_modes() == "split_plain"
        assert "cannot run as its own CUDA graph either" in caplog.text
        assert ("abandon_capture",) in fake.made[0].log
        x = images(np.random.default_rng(15), 2)
        pipe({"images": x})
        for name, want in segment_heads(t4_bundle, x).items():
            np.testing.assert_array_equal(pipe.read(name)[:2], want)


def test_graph_holds_the_buckets_launch_geometry(t4_bundle, fake):
    with Pipeline.load(t4_bundle) as pipe:
        gpu = fake.made[0]
        seen = {}
        gpu.hooks["decode"] = lambda grid, args: seen.setdefault("decode", []).append(grid)
        gpu.hooks["nms"] = lambda grid, args: seen.setdefault("nms", []).append(grid)
        pipe({"images": images(np.random.default_rng(2), 5)})            # bucket 8
        blocks = math.ceil(HEADS / (4 * 128))                              # anchors_per_thread 4, block 128
        assert seen == {"decode": [(blocks, 8, 1)], "nms": [(8, 1, 1)]}


def test_each_buckets_graph_holds_its_own_decode_kernel(lanes_bundle, fake):
    """large_batch_lanes 2 from batch 4: buckets 1 and 2 capture the 4-lane decode kernel and its grid,
    4 and 8 the 2-lane one (the entry's from_batch), each launched by its entry's name."""
    with Pipeline.load(lanes_bundle) as pipe:
        gpu = fake.made[0]
        seen = []
        for entry in ("decode", "decode (batch 4+)"):
            gpu.hooks[entry] = lambda grid, args, entry=entry: seen.append((entry, grid))
        for batch in (1, 2, 3, 8):
            pipe({"images": images(np.random.default_rng(batch), batch)})
    blocks = {lanes: math.ceil(HEADS * lanes / 128) for lanes in (4, 2)}  # anchors_per_thread 1, block 128
    assert seen == [("decode", (blocks[4], 1, 1)), ("decode", (blocks[4], 2, 1)),
                    ("decode (batch 4+)", (blocks[2], 4, 1)), ("decode (batch 4+)", (blocks[2], 8, 1))]


def test_nms_gets_its_shared_memory_and_overlaps_the_decode_only_in_sm90_code(t4_bundle, fake, tmp_path):
    """The T4 bundle's compute_75 PTX has no griddepcontrol.wait, so its nms launches after the decode
    as usual; the same contract compiled for sm_90 waits for the decode itself and is launched to
    overlap it. Either way it is given its contract's dynamic shared memory."""
    from deepjit_compiler.jit.nvrtc import compile_site_kernel
    from deepjit_compiler.runtime.launch import ContractKernel

    def shared(chunk):
        return chunk * (chunk // 8 + 28)

    with Pipeline.load(t4_bundle):
        log = fake.made[0].log
        assert [e for e in log if e[0] == "allow_shared"] == [("allow_shared", "nms", shared(256))]  # once, for all buckets
        assert [e for e in log if e[0] == "config" and e[3]] == []
    gpu = FakeGpu(90)
    nms = ContractKernel(gpu, compile_site_kernel("nms", {"max_candidates": 640, "chunk": 512}, sm=90,
                                                  cache_dir=tmp_path))
    cands = {s.name: gpu.empty([{"B": 2, "K": 640}.get(d, d) for d in s.shape], s.dtype) for s in nms.inputs}
    dims = nms.bind(cands)
    tensors = {**cands, **nms.allocate_outputs(dims), "workspace": None}
    nms.prepare(tensors, dims)
    nms.prepare(tensors, dims)
    assert [e for e in gpu.log if e[0] == "allow_shared"] == [("allow_shared", "nms", shared(512))]
    assert [e for e in gpu.log if e[0] == "config"] == [("config", (2, 1, 1), shared(512), True)] * 2


def test_a_launch_past_this_gpus_limits_fails_before_the_driver_sees_it(tmp_path):
    """A bundle built for an H200 (nms chunk 1024: 156 KiB of dynamic shared memory a block) loaded on an
    sm_86 GPU (99 KiB): the kernel names its contract, entry, batch and what this GPU allows before it
    opts in to shared memory or makes a launch config; within the limits, the same kernel prepares."""
    from deepjit_compiler.jit.nvrtc import compile_site_kernel
    from deepjit_compiler.runtime.launch import ContractKernel

    compiled = compile_site_kernel("nms", {"max_candidates": 640, "chunk": 1024}, sm=90, cache_dir=tmp_path)
    for sm in (86, 90):
        gpu = FakeGpu(sm)
        nms = ContractKernel(gpu, compiled)
        cands = {s.name: gpu.empty([{"B": 4, "K": 640}.get(d, d) for d in s.shape], s.dtype) for s in nms.inputs}
        dims = nms.bind(cands)
        tensors = {**cands, **nms.allocate_outputs(dims), "workspace": None}
        if sm == 90:
            nms.prepare(tensors, dims)
            assert [e[0] for e in gpu.log if e[0] in ("allow_shared", "config")] == ["allow_shared", "config"]
            continue
        with pytest.raises(KernelError, match=re.escape(f"kernel nms ({compiled.contract_path}): entry point 'nms' at "
                                                        "batch 4: shared_mem is 159744 bytes; Fake GPU (sm_86) allows "
                                                        "0 to 101376 bytes")):
            nms.prepare(tensors, dims)
        assert not [e for e in gpu.log if e[0] in ("allow_shared", "config")]


def test_a_fused_bundle_runs_decode_and_nms_as_one_launch(fused_bundle, fake):
    """The bundle keeps the nms step (its reference, its detections) with nothing to launch: a call is
    one kernel in the graph, and the detections come from the decode's buffers."""
    with Pipeline.load(fused_bundle) as pipe:
        gpu = fake.made[0]
        names = [s.name for s in pipe.layout.steps]
        assert names[-2:] == ["decode", "nms"] and pipe.layout.step("nms").kernels[0].sigs == ()

        def decode(grid, args):  # the fused decode writes num_dets = 5 * (image + 1) for every image
            write_at(args[-4], 5 * np.arange(1, grid[1] + 1, dtype=np.int32))
        gpu.hooks["decode"] = decode
        mark = len(gpu.log)
        out = pipe({"images": images(np.random.default_rng(5), 2)})
        events = _since(gpu.log, mark)
        assert [e for e in events if e[0] == "replay"] == [("replay", ("decode",))]
        np.testing.assert_array_equal(out["num_dets"], [5, 10])
        assert pipe.launches_per_inference(2) == 1 and pipe.graph_launches_per_inference() == 1
        assert [e for e in gpu.log if e[0] == "allow_shared"] == [("allow_shared", "decode", 256 * (256 // 8 + 28))]


def test_without_graphs_the_kernels_launch_plainly(t4_bundle, fake):
    with Pipeline.load(t4_bundle, graphs=False) as pipe:
        gpu = fake.made[0]
        assert not [e for e in gpu.log if e[0] == "capture"]
        mark = len(gpu.log)
        pipe({"images": images(np.random.default_rng(3), 2)})
        events = _since(gpu.log, mark)
        assert [e[:2] for e in events if e[0] == "launch"] == [("launch", "decode"), ("launch", "nms")]
        assert not [e for e in events if e[0] == "replay"]
        assert pipe.graph_launches_per_inference() == 0 and pipe.launches_per_inference(2) == 2


def test_prefer_cubin_for_another_sm_fails_before_anything_runs(t4_bundle, fake):
    with pytest.raises(BundleError, match="cubin for sm_75.*load its PTX"):
        Pipeline.load(t4_bundle, prefer="cubin")
    fake.state["sm"] = 75
    with Pipeline.load(t4_bundle) as pipe:
        assert set(pipe.code.values()) == {"cubin"}


def test_a_calls_outputs_are_its_own_after_the_next_call(t4_bundle, fake):
    """Outputs come back through reused pinned staging: a later call must not rewrite an earlier result."""
    counts = iter([np.array([5, 9], np.int32), np.array([2, 4], np.int32)])
    with Pipeline.load(t4_bundle) as pipe:
        pipe.gpu.hooks["nms"] = lambda grid, args: write_at(args[8], next(counts))
        rng = np.random.default_rng(16)
        first = pipe({"images": images(rng, 2)})
        second = pipe({"images": images(rng, 2)})
    np.testing.assert_array_equal(first["num_dets"], [5, 9])
    np.testing.assert_array_equal(second["num_dets"], [2, 4])


def test_bad_calls_and_closed_pipelines(t4_bundle, fake):
    pipe = Pipeline.load(t4_bundle)
    rng = np.random.default_rng(4)
    with pytest.raises(RuntimeInputError, match="batch 9 is above this pipeline's max batch 8"):
        pipe({"images": images(rng, 9)})
    with pytest.raises(RuntimeInputError, match="is float16, expected float32"):
        pipe({"images": images(rng, 1).astype(np.float16)})
    pipe.close()
    with pytest.raises(KernelError, match="closed"):
        pipe({"images": images(rng, 1)})


def test_letterbox_on_the_gpu_then_the_cpu_engine(lb_bundle, fake):
    with Pipeline.load(lb_bundle) as pipe:
        gpu = fake.made[0]
        after_load = pipe.allocations
        geometry = []

        letterboxed = np.random.default_rng(7).random((2, 3, 640, 640), dtype=np.float32)

        def letterbox(grid, args):  # args: raw, H, W, images, ratio_pad, new_w, new_h, left, top, sx, sy, r
            geometry.append(tuple(float(a) for a in (args[1], args[2], *args[5:9], args[11])))
            write_at(args[3], letterboxed[:grid[2]])
        gpu.hooks["letterbox"] = letterbox
        raw = np.random.default_rng(6).integers(0, 256, (2, 48, 64, 3), dtype=np.uint8)
        mark = len(gpu.log)
        pipe({"raw_images": raw})
        events = _since(gpu.log, mark)
        # 48 x 64 into 640: r = min(640/48, 640/64) = 10, new 640 x 480, left 0, top round(80 - 0.1) = 80
        assert geometry[-1] == (48, 64, 640, 480, 0, 80, 10.0)
        kinds = [e[0] for e in events]
        assert kinds.count("sync") == 2          # before the CPU engine, and at the end
        assert events[kinds.index("h2d")] == ("h2d", raw.nbytes)
        assert ("d2h", 2 * 3 * 640 * 640 * 4) in events          # the letterboxed images, to the engine
        heads = segment_heads(lb_bundle, letterboxed)
        for name, want in heads.items():
            np.testing.assert_allclose(device_array(pipe._buffers[name], want.shape), want, rtol=1e-6, atol=1e-6)
        assert pipe.allocations == after_load   # a new image size captures a graph, allocates nothing


def test_graphs_for_new_image_sizes_are_kept_for_the_newest_sixteen(lb_bundle, fake):
    """Each new image size prepares (and captures) the letterbox phase once more; past 16 such sizes the
    oldest is dropped, and the buckets' graphs made at load are never dropped."""
    rng = np.random.default_rng(18)
    with Pipeline.load(lb_bundle) as pipe:
        cache = pipe._prepared[0]
        at_load = list(cache)
        for h in range(40, 57):  # 17 sizes
            pipe({"raw_images": rng.integers(0, 256, (1, h, 64, 3), dtype=np.uint8)})
        assert list(cache)[:len(at_load)] == at_load
        kept = [dict(reads)["raw_images"] for _, reads in list(cache)[len(at_load):]]
    assert kept == [(1, h, 64, 3) for h in range(41, 57)]


def test_a_users_copy_of_letterbox_gets_its_host_args_and_image_input(tmp_path, fake):
    """The letterbox's host-computed geometry and its taking raw images come from its contract's roles
    (host_args, image_input), so a copy under another name runs exactly as the built-in one."""
    text = (REPO / "kernels" / "letterbox.yaml").read_text().replace("\nname: letterbox\n", "\nname: my_letterbox\n")
    (tmp_path / "my_kernels").mkdir()
    (tmp_path / "my_kernels" / "my_letterbox.yaml").write_text(text)
    extra = {**LETTERBOX, "cuts:\n": LETTERBOX["cuts:\n"].replace("contract: letterbox", "contract: my_kernels/my_letterbox.yaml")}
    layout = Layout.from_bundle(read_bundle(bundle := build_variant(tmp_path, "yolov8n_my_lb", extra)))
    assert layout.steps[0].kernels[0].contract.name == "my_letterbox"
    assert runbundle.image_stage(layout) == runbundle.ImageStage("raw_images", "bgr", "ratio_pad")
    with Pipeline.load(bundle) as pipe:
        geometry = []
        pipe.gpu.hooks["letterbox"] = lambda grid, args: geometry.append(tuple(float(a) for a in (*args[5:9], args[11])))
        pipe({"raw_images": np.random.default_rng(6).integers(0, 256, (1, 48, 64, 3), dtype=np.uint8)})
        assert geometry[-1] == (640, 480, 0, 80, 10.0)   # new_w, new_h, left, top, r: computed on the host


# ----------------------------------------------------------------------------- deepjit run
def test_map_boxes_back_to_the_image():
    boxes = np.array([[110.0, 220.0, 210.0, 320.0], [0.0, 0.0, 900.0, 900.0]])
    got = runbundle.map_boxes(boxes, (0.5, 10.0, 20.0), (500, 350))
    np.testing.assert_allclose(got, [[200.0, 400.0, 350.0, 500.0], [0.0, 0.0, 350.0, 500.0]])
    np.testing.assert_allclose(runbundle.map_boxes(boxes[:1], (2.0, 0.0, 80.0), None), [[55.0, 70.0, 105.0, 120.0]])


def test_npy_rows_and_single_samples(tmp_path, t4_layout):
    rng = np.random.default_rng(8)
    a, b = images(rng, 2), images(rng, 1)[0]
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    samples = runbundle.load_samples([tmp_path / "a.npy", tmp_path / "b.npy"], t4_layout)
    assert [s.source for s in samples] == ["a.npy[0]", "a.npy[1]", "b.npy"]
    assert all(s.feed["images"].shape == (1, 3, 640, 640) and s.ratio_pad is None for s in samples)
    for sample, want in zip(samples, (a[0:1], a[1:2], b[None])):  # each row its own data
        np.testing.assert_array_equal(sample.feed["images"], want)
    assert [len(g) for g in runbundle.batches(samples * 3, 4)] == [4, 4, 1]
    folder = runbundle.expand_inputs([tmp_path])
    assert [p.name for p in folder] == ["a.npy", "b.npy"]


def test_uint8_image_is_letterboxed_on_the_host(tmp_path, t4_layout):
    from deepjit_compiler.graph.ort import ort_session
    from deepjit_compiler.surgery.references import letterbox_reference

    bgr = np.random.default_rng(12).integers(0, 256, (32, 64, 3), dtype=np.uint8)
    np.save(tmp_path / "img.npy", bgr)
    (s,) = runbundle.load_samples([tmp_path / "img.npy"], t4_layout)
    # 32 x 64 into 640: r = 10, content 640 x 320 at top = round(160 - 0.1) = 160, rows 160..479
    assert s.size == (32, 64) and s.ratio_pad == (10.0, 0.0, 160.0)
    x = s.feed["images"]
    assert x.shape == (1, 3, 640, 640) and x.dtype == np.float32
    pad = np.float32(114) / np.float32(255)
    assert (x[0, :, :160] == pad).all() and (x[0, :, 480:] == pad).all()
    assert not (x[0, :, 160] == pad).all() and not (x[0, :, 479] == pad).all()
    # BGR in, RGB out, as the ONNX letterbox reference computes it (runbundle letterboxes in numpy)
    want = ort_session(letterbox_reference(size=640, swap_rb=True)).run(["images"], {"raw_images": bgr[None]})[0]
    np.testing.assert_allclose(x, want, atol=2e-5, rtol=0)


def test_inputs_that_cannot_be_read(tmp_path, t4_layout, lb_bundle, monkeypatch):
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(RuntimeInputError, match="unsupported input"):
        runbundle.expand_inputs([tmp_path / "x.txt"])
    with pytest.raises(RuntimeInputError, match="no such file"):
        runbundle.expand_inputs([tmp_path / "missing.npy"])
    np.savez(tmp_path / "z.npz", other=np.zeros(3))
    with pytest.raises(RuntimeInputError, match="no array for input.*images.*it has other"):
        runbundle.load_samples([tmp_path / "z.npz"], t4_layout)
    (tmp_path / "p.png").write_bytes(b"\x89PNG")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(MissingDependency, match="reading images needs Pillow"):
        runbundle.load_samples([tmp_path / "p.png"], t4_layout)


def test_png_through_pillow(tmp_path, lb_bundle):
    image_mod = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    rgb = np.random.default_rng(9).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    image_mod.fromarray(rgb).save(tmp_path / "p.png")
    (s,) = runbundle.load_samples([tmp_path / "p.png"], Layout.from_bundle(read_bundle(lb_bundle)))
    np.testing.assert_array_equal(s.feed["raw_images"][0], rgb[..., ::-1])  # BGR in: the kernel swaps to RGB
    assert s.size == (40, 50) and s.ratio_pad is None                         # mapped by the pipeline's ratio_pad


def test_an_image_array_of_the_gpu_letterboxs_own_input_shape_keeps_its_size(tmp_path, lb_bundle):
    """With the letterbox on the GPU every uint8 [H, W, 3] array is an image, even one of the raw input's
    opt shape: its size is kept, so its boxes map back to it."""
    layout = Layout.from_bundle(read_bundle(lb_bundle))
    h, w = layout.inputs[0].opt[1:3]
    bgr = np.random.default_rng(19).integers(0, 256, (h, w, 3), dtype=np.uint8)
    np.save(tmp_path / "frame.npy", bgr)
    (s,) = runbundle.load_samples([tmp_path / "frame.npy"], layout)
    assert s.size == (h, w) and s.ratio_pad is None
    np.testing.assert_array_equal(s.feed["raw_images"][0], bgr)


def bundle_steps_on_onnxruntime(bundle: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The bundle's steps from its manifest (segment ONNX, kernel references), each on ONNX Runtime,
    graph optimizations off (its fusions reorder the fp16 segment's math: a borderline box flips)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    env = dict(feed)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for step in manifest["plan"]["steps"]:
        sess = ort.InferenceSession(str(bundle / (step.get("file") or step["reference"])), opts,
                                    providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        env.update(zip(names, sess.run(names, {i.name: env[i.name] for i in sess.get_inputs()})))
    return {t["name"]: env[t["name"]] for t in manifest["plan"]["outputs"]}


def test_run_and_bench_on_the_cpu(tmp_path, t4_bundle):
    """`--device cpu`: the bundle's segments and kernel references on ONNX Runtime, no GPU needed."""
    from conftest import run_cli

    x = images(np.random.default_rng(13), 2)
    np.save(tmp_path / "x.npy", x)
    done = run_cli("run", str(t4_bundle), "-i", str(tmp_path / "x.npy"), "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["engine"].startswith("cpu (ONNX Runtime") and result["graphs"] is False
    assert set(result["kernels"].values()) == {"onnx reference"}
    want = bundle_steps_on_onnxruntime(t4_bundle, {"images": x})
    assert [r["num_dets"] for r in result["results"]] == want["num_dets"].tolist() and want["num_dets"].min() > 0
    for r, boxes, scores, classes in zip(result["results"], want["boxes"], want["scores"], want["classes"]):
        n = r["num_dets"]
        np.testing.assert_allclose([d["box"] for d in r["detections"]], boxes[:n], atol=1e-3)
        np.testing.assert_allclose([d["score"] for d in r["detections"]], scores[:n], atol=1e-6)  # 6 places
        assert [d["class"] for d in r["detections"]] == classes[:n].tolist()
    bench = runbundle.bench_bundle(t4_bundle, [1], warmup=0, iters=2, device="cpu")
    (row,) = bench["results"]
    assert row["gpu_us"] is None and row["copied_bytes"] == {"h2d": 0, "d2h": 0} and row["kernel_launches"] == 0
    assert "engine cpu (ONNX Runtime" in runbundle.format_bench(bench)
    with pytest.raises(RuntimeInputError, match="--device must be one of gpu, cpu, got 'tpu'"):
        runbundle.run_bundle(t4_bundle, [tmp_path / "x.npy"], device="tpu")


def test_the_cpu_pipeline_refuses_bad_feeds_naming_the_input(t4_bundle):
    """Called directly (not through `deepjit run`'s per-file check), it checks feeds as the GPU pipeline does."""
    rng = np.random.default_rng(17)
    with CpuPipeline.load(t4_bundle) as pipe:
        with pytest.raises(RuntimeInputError, match="input 'images' is float16, expected float32"):
            pipe({"images": images(rng, 1).astype(np.float16)})
        with pytest.raises(RuntimeInputError, match="batch 9 is above this pipeline's max batch 8"):
            pipe({"images": images(rng, 9)})


def test_without_a_gpu_run_says_how_to_run_on_the_cpu(t4_bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(runtime.Gpu, "__init__", lambda self, ordinal=0: (_ for _ in ()).throw(
        MissingDependency("no NVIDIA GPU or driver is available here")))
    np.save(tmp_path / "x.npy", images(np.random.default_rng(14), 1))
    with pytest.raises(MissingDependency, match="no NVIDIA GPU.*instead with --device cpu"):
        runbundle.run_bundle(t4_bundle, [tmp_path / "x.npy"])


def test_run_bundle_writes_detections_in_image_pixels(tmp_path, t4_bundle, fake):
    bgr = np.random.default_rng(10).integers(0, 256, (320, 640, 3), dtype=np.uint8)
    np.save(tmp_path / "street.npy", bgr)

    def nms(grid, args):  # one detection per image at x1, y1, x2, y2 = 100, 200, 300, 400 (network pixels)
        write_at(args[8], np.ones(grid[0], np.int32))
        write_at(args[9], np.tile(np.array([100, 200, 300, 400], np.float32), (grid[0], 1)))
        write_at(args[10], np.full(grid[0], 0.75, np.float32))
        write_at(args[11], np.full(grid[0], 3, np.int32))

    runtime_load = Pipeline.load

    def load(*a, **k):
        pipe = runtime_load(*a, **k)
        pipe.gpu.hooks["nms"] = nms
        return pipe

    out = tmp_path / "res" / "dets.json"
    import unittest.mock as mock
    with mock.patch.object(Pipeline, "load", side_effect=load):
        result = runbundle.run_bundle(t4_bundle, [tmp_path / "street.npy"], out)
    # 320 x 640 into 640: r = 1, top = round(160 - 0.1) = 160: y maps to y - 160
    (rec,) = result["results"]
    assert rec["boxes_in"] == "image" and rec["num_dets"] == 1 and rec["size"] == [320, 640]
    assert rec["detections"] == [{"class": 3, "score": 0.75, "box": [100.0, 40.0, 300.0, 240.0]}]
    assert json.loads(out.read_text()) == result and result["kernels"] == {"decode/yolov8_decode": "ptx",
                                                                          "nms/nms": "ptx"}
    assert "street.npy: 1 detections (boxes in image pixels)" in runbundle.format_run(result)


def test_run_maps_boxes_back_through_the_gpu_letterboxs_ratio_pad(tmp_path, lb_bundle, fake, monkeypatch):
    """With the letterbox on the GPU, the boxes of an image map back through the ratio_pad it wrote."""
    np.save(tmp_path / "frame.npy", np.random.default_rng(20).integers(0, 256, (48, 64, 3), dtype=np.uint8))

    def letterbox(grid, args):  # ratio_pad (r, left, top) = (10, 0, 80): 48 x 64 into 640
        write_at(args[4], np.tile(np.array([10.0, 0.0, 80.0], np.float32), (grid[2], 1)))

    def nms(grid, args):  # one box at x1, y1, x2, y2 = 100, 200, 300, 400 in network pixels
        write_at(args[8], np.ones(grid[0], np.int32))
        write_at(args[9], np.tile(np.array([100, 200, 300, 400], np.float32), (grid[0], 1)))

    load = Pipeline.load

    def hooked(*a, **k):
        pipe = load(*a, **k)
        pipe.gpu.hooks.update(letterbox=letterbox, nms=nms)
        return pipe

    monkeypatch.setattr(Pipeline, "load", hooked)
    (rec,) = runbundle.run_bundle(lb_bundle, [tmp_path / "frame.npy"])["results"]
    # x / 10, (y - 80) / 10, clipped to the 64 x 48 image
    assert rec["boxes_in"] == "image" and rec["detections"][0]["box"] == [10.0, 12.0, 30.0, 32.0]


def test_bench_bundle_reports_percentiles_and_launches(t4_bundle, fake, monkeypatch):
    with pytest.raises(RuntimeInputError, match="--batch 9: this bundle takes batches 1..8"):
        runbundle.bench_bundle(t4_bundle, [1, 9])
    # The timed calls take known, seeded times: the clock reads t, t + d for each call.
    durations_s = np.random.default_rng(21).uniform(100e-6, 900e-6, (2, 7))
    clock = iter(np.cumsum(np.stack([np.full_like(durations_s, 1.0), durations_s], -1).ravel()))
    monkeypatch.setattr(runbundle, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(clock))}))
    result = runbundle.bench_bundle(t4_bundle, [1, 3], graphs=True, warmup=1, iters=7)
    rows = result["results"]
    assert [(r["batch"], r["bucket"], r["kernel_launches"], r["graph_launches"]) for r in rows] == \
        [(1, 1, 2, 1), (3, 4, 2, 1)]
    for r, d in zip(rows, durations_s * 1e6):
        assert r["call_us"] == pytest.approx({"p50": np.median(d), "p95": np.percentile(d, 95),
                                              "p99": np.percentile(d, 99), "mean": d.mean()}, rel=1e-6)
        assert r["throughput_img_s"] == pytest.approx(r["batch"] * 1e6 / d.mean(), rel=1e-6)
        assert r["gpu_us"]["p50"] == pytest.approx(250.0)   # the fake's events: 0.25 ms per device phase
    table = runbundle.format_bench(result)
    assert "call p50" in table and len(table.splitlines()) == 1 + 1 + 2 + 1


def test_a_kernel_chain_holds_its_workspaces(tmp_path):
    """The plan keeps only pointers, so the chain must keep its kernels' workspaces alive (the fused
    decode's sort of thousands of candidates wrote into freed memory under compute-sanitizer before)."""
    import gc

    from deepjit_compiler.jit.nvrtc import compile_site_kernel
    from deepjit_compiler.runtime.launch import KernelChain

    facts = {"reg_max": 16, "num_classes": 80, "strides": [8, 16, 32], "anchors": 8400,
             "levels": [{"level": i, "stride": s, "height": 640 // s, "width": 640 // s} for i, s in enumerate((8, 16, 32))]}
    fused = compile_site_kernel("yolov8_decode", {"mode": "nms", "block": 512}, facts, sm=90, cache_dir=tmp_path)
    gpu = FakeGpu()
    inputs = {f"{r}_{i}": gpu.empty((2, 64 if r == "box" else 80, 640 // s, 640 // s), np.float32)
              for i, s in enumerate((8, 16, 32)) for r in ("box", "cls")}
    chain = KernelChain(gpu, [fused], inputs)
    gc.collect()
    (prepared,) = chain.plan
    (workspace,) = chain.workspaces
    assert workspace.nbytes == 2 * 16384 * 12 and int(workspace.ptr) in [int(v) for v in prepared.args]
    stage = compile_site_kernel("nms", {"fused": True}, facts, sm=90, cache_dir=tmp_path)
    both = KernelChain(gpu, [fused, stage], inputs)  # the nms stage done by the decode: nothing of its own
    assert len(both.plan) == 1 and {"num_dets", "boxes", "scores", "classes"} <= set(both.outputs)


def test_an_absurd_manifest_shape_names_the_tensor_before_any_allocation(tmp_path, t4_bundle, fake):
    """A tampered input max passes the manifest's checks (dims up to INT32_MAX) but not the allocator:
    the load stops naming the tensor, before a byte is allocated."""
    bundle = shutil.copytree(t4_bundle, tmp_path / "absurd")
    inputs = json.loads((bundle / "manifest.json").read_text())["inputs"]
    assert inputs["images"]["max"] == [8, 3, 640, 640], "test bug: the T4 bundle's input changed"
    inputs["images"]["max"][0] = 2**31 - 1
    update_bundle(bundle, {}, {"inputs": inputs})  # sealed again, as a hostile publisher can
    with pytest.raises(BundleError, match=r"tensor '[^']+': shape \[2147483647, .*\] of float\d+ \(\d+ bytes\) is not "
                                          r"allocatable"):
        Pipeline.load(bundle)
    assert [gpu.allocations for gpu in fake.made] == [0]


def test_run_out_replaces_only_an_earlier_run_output(tmp_path, t4_bundle):
    """--out never overwrites a user's file, nor writes into the bundle; an earlier run output it replaces."""
    x = tmp_path / "x.npy"
    np.save(x, images(np.random.default_rng(15), 1))
    (tmp_path / "README.md").write_text("# mine\n")
    manifest = (t4_bundle / "manifest.json").read_bytes()
    for out, why in ((tmp_path / "README.md", "exists and is not a `deepjit run` output"),
                     (t4_bundle / "manifest.json", "inside the bundle"), (t4_bundle / "dets.json", "inside the bundle")):
        with pytest.raises(RuntimeInputError, match=f"--out {out}: {why}"):
            runbundle.run_bundle(t4_bundle, [x], out, device="cpu")
    assert (tmp_path / "README.md").read_text() == "# mine\n" and (t4_bundle / "manifest.json").read_bytes() == manifest
    assert not (t4_bundle / "dets.json").exists()
    first = runbundle.run_bundle(t4_bundle, [x], tmp_path / "dets.json", device="cpu")
    again = runbundle.run_bundle(t4_bundle, [x], tmp_path / "dets.json", device="cpu")  # its own output: replaced
    assert json.loads((tmp_path / "dets.json").read_text())["results"] == again["results"] == first["results"]


def test_an_array_with_no_rows_is_refused(tmp_path, t4_layout):
    np.save(tmp_path / "empty.npy", np.zeros((0, 3, 640, 640), np.float32))
    with pytest.raises(RuntimeInputError, match=r"empty.npy: array for input 'images' has no rows \(shape \(0, 3, 640"):
        runbundle.load_samples([tmp_path / "empty.npy"], t4_layout)


def test_the_cpu_pipeline_checks_the_plans_wiring_at_load(t4_bundle, tmp_path):
    """A resealed manifest with its steps swapped ran into a KeyError mid-run on the CPU (exit 3)."""
    bundle = shutil.copytree(t4_bundle, tmp_path / "swapped")
    plan = json.loads((bundle / "manifest.json").read_text())["plan"]
    plan["steps"][1], plan["steps"][2] = plan["steps"][2], plan["steps"][1]
    update_bundle(bundle, {}, {"plan": plan})
    with pytest.raises(BundleError, match="step 'nms' reads 'cand_count', which no input or earlier step makes"):
        runbundle.load_pipeline(bundle, "cpu")
