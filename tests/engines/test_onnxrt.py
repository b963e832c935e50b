"""engines/onnxrt.py: the portable engine, its runner, and the artifact plumbing around it."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from polygraphy.backend.base import BaseRunner
from polygraphy.comparator import Comparator

from deepjit_compiler.engines import (
    Decision,
    EngineArtifact,
    EngineSettings,
    InputProfile,
    Runner,
    engine_from_segment,
    onnxrt,
    runner_for,
)
from deepjit_compiler.engines.onnxrt import OnnxrtEngineRunner, build_engine, cuda_available
from deepjit_compiler.errors import BundleError, EngineError, MissingDependency, RuntimeInputError
from deepjit_compiler.spec.models import Engine


def segment(seed: int = 0) -> onnx.ModelProto:
    """images [B,3,32,32] -> Conv -> Sigmoid*x (SiLU) -> Conv -> out [B,8,32,32], weights seeded."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.4).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((8, 8, 1, 1)) * 0.4).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["images", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Sigmoid", ["c1"], ["s1"], name="sig"),
             helper.make_node("Mul", ["c1", "s1"], ["a1"], name="silu"),
             helper.make_node("Conv", ["a1", "w2"], ["out"], name="conv2")]
    graph = helper.make_graph(nodes, "seg",
                              [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["B", 3, 32, 32])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", 8, 32, 32])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


SETTINGS = EngineSettings(backend="onnxruntime", target_sm=90,
                          profiles=(InputProfile("images", (1, 3, 32, 32), (2, 3, 32, 32), (4, 3, 32, 32)),))


def plain_ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"images": x})[0]


def images(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, size=(batch, 3, 32, 32)).astype(np.float32)


def test_build_is_the_segment_itself():
    model = segment()
    art = build_engine(model, "engine", SETTINGS)
    assert art.backend == "onnxruntime" and not art.deferred and art.segment_name == "engine"
    assert art.files == {"engine.onnx": model.SerializeToString()}
    assert EngineSettings.from_dict(json.loads(art.settings_json)) == SETTINGS
    assert art.digest() == build_engine(model, "engine", SETTINGS).digest()
    assert art.digest() != build_engine(segment(seed=1), "engine", SETTINGS).digest()


def test_build_rejects_a_model_onnxruntime_cannot_load():
    broken = segment()
    broken.graph.node[1].input[0] = "nowhere"
    with pytest.raises(EngineError, match="segment 'head': ONNX Runtime cannot load it"):
        build_engine(broken, "head", SETTINGS)


def test_runner_matches_plain_onnxruntime():
    model = segment()
    x = images(3, seed=1)
    expected = plain_ort(model, x)
    art = engine_from_segment("engine", model, SETTINGS, Decision("onnxruntime", False, "test"), workdir="unused")
    with runner_for(art) as runner:
        assert isinstance(runner, Runner) and isinstance(runner, BaseRunner)
        out = runner.infer({"images": x})
        meta = runner.get_input_metadata(use_numpy_dtypes=False)
    np.testing.assert_array_equal(out["out"], expected)
    assert list(meta.keys()) == ["images"]
    assert not runner.is_active


def test_runner_works_inside_polygraphys_comparator():
    # The accuracy gate hands our runners to Polygraphy's Comparator as they are.
    model, x = segment(), images(2, seed=2)
    art = build_engine(model, "engine", SETTINGS)
    results = Comparator.run([runner_for(art, name="ours")], data_loader=[{"images": x}])
    (name, iterations), = results.items()
    assert name == "ours" and len(iterations) == 1
    np.testing.assert_array_equal(iterations[0]["out"], plain_ort(model, x))


def test_deferred_artifact_runs_its_segment_in_onnxruntime():
    model = segment()
    art = engine_from_segment("engine", model, SETTINGS, Decision("tensorrt", True, "no TensorRT here"),
                              workdir="unused")
    assert art.deferred and art.backend == "tensorrt" and art.files == {"engine.onnx": model.SerializeToString()}
    x = images(1, seed=3)
    with runner_for(art) as runner:
        out = runner.infer({"images": x})["out"]
    expected = plain_ort(model, x)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.skipif(cuda_available(), reason="this ONNX Runtime has the CUDA provider")
def test_enqueue_without_the_cuda_provider_names_onnxruntime_gpu():
    with OnnxrtEngineRunner(segment(), device="auto") as runner:
        assert runner.device == "cpu"
        with pytest.raises(MissingDependency, match="onnxruntime-gpu"):
            runner.enqueue(1234, {"images": 1, "out": 2}, {"images": (1, 3, 32, 32), "out": (1, 8, 32, 32)})
    with pytest.raises(MissingDependency, match="onnxruntime-gpu"):
        OnnxrtEngineRunner(segment(), device="cuda")


def test_unknown_device_is_an_engine_error():
    with pytest.raises(EngineError, match="cpu, cuda"):
        OnnxrtEngineRunner(segment(), device="gpu")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs onnxruntime-gpu (CUDAExecutionProvider)")
def test_enqueue_on_our_stream_over_our_buffers_matches_cpu():
    from polygraphy import cuda

    model, x = segment(), images(2, seed=4)
    expected = plain_ort(model, x)
    stream = cuda.Stream()
    d_in = cuda.DeviceArray(x.shape).copy_from(x, stream)
    d_out = cuda.DeviceArray(expected.shape)
    try:
        with OnnxrtEngineRunner(model, device="cuda") as runner:
            runner.enqueue(stream.ptr, {"images": d_in.ptr, "out": d_out.ptr},
                           {"images": x.shape, "out": expected.shape})
            got = d_out.copy_to(np.empty_like(expected), stream)
            stream.synchronize()
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)
    finally:
        d_in.free(), d_out.free(), stream.free()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs onnxruntime-gpu (CUDAExecutionProvider)")
def test_onnxruntimes_own_cuda_graph_replays_new_data_in_the_same_buffers():
    """own_graph: ONNX Runtime captures its CUDA graph on the first runs and replays it after; each run
    must still read what is in the bound input buffer now."""
    from polygraphy import cuda

    model = segment(3)
    stream = cuda.Stream()
    d_in, d_out = cuda.DeviceArray((2, 3, 32, 32)), cuda.DeviceArray((2, 8, 32, 32))
    try:
        with OnnxrtEngineRunner(model, device="cuda") as runner:
            assert runner.own_graphs and runner.describe().endswith("tf32 off)")
            for seed in range(4):
                x = images(2, seed=10 + seed)
                d_in.copy_from(x, stream)
                runner.enqueue(stream.ptr, {"images": d_in.ptr, "out": d_out.ptr},
                               {"images": x.shape, "out": (2, 8, 32, 32)}, own_graph=True)
                got = d_out.copy_to(np.empty((2, 8, 32, 32), np.float32), stream)
                stream.synchronize()
                np.testing.assert_allclose(got, plain_ort(model, x), rtol=1e-3, atol=1e-4, err_msg=f"run {seed}")
    finally:
        d_in.free(), d_out.free(), stream.free()


def test_tf32_is_off_unless_the_spec_allows_it(monkeypatch):
    """fp32 means fp32: the CUDA provider gets use_tf32=0 by default, 1 only with engine.tf32."""
    assert Engine().tf32 is False and Engine(tf32=True).tf32 is True
    settings = EngineSettings(backend="onnxruntime", tf32=True)
    assert EngineSettings.from_dict(json.loads(settings.to_json())).tf32 is True
    seen = []
    session = type("Session", (), {"get_providers": lambda self: ["CUDAExecutionProvider"]})

    def make(model, so, providers):
        seen.append(providers)
        return session()
    monkeypatch.setattr(onnxrt.ort, "InferenceSession", make)
    monkeypatch.setattr(onnxrt, "_preloaded", True)
    for tf32 in (False, True):
        runner = OnnxrtEngineRunner(segment(), device="cpu", tf32=tf32)
        runner.device = "cuda"  # what onnxruntime-gpu would choose: the session options are what is checked
        runner._session(1234)
        assert runner.describe().endswith(f"tf32 {'on' if tf32 else 'off'})")
    assert [p[0][1]["use_tf32"] for p in seen] == ["0", "1"]
    assert seen[0][0][1]["user_compute_stream"] == "1234"


def _cuda_sessions(monkeypatch, providers: list[str]) -> list:
    """ONNX Runtime sessions faked to report `providers`: the provider options each was asked for."""
    seen = []
    session = type("Session", (), {"get_providers": lambda self: providers})

    def make(model, so, providers):
        seen.append(dict(providers[0][1]))
        return session()
    monkeypatch.setattr(onnxrt.ort, "InferenceSession", make)
    monkeypatch.setattr(onnxrt, "_preloaded", True)
    return seen


def test_the_cuda_provider_runs_on_the_device_asked_for(monkeypatch):
    art = build_engine(segment(), "engine", SETTINGS)
    seen = _cuda_sessions(monkeypatch, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    runner = runner_for(art, device="cpu", tf32=True, device_id=1)
    assert (runner.tf32, runner.device_id) == (True, 1)
    runner.device = "cuda"  # what onnxruntime-gpu would choose: the session options are what is checked
    runner._session(1234)
    assert (seen[0]["device_id"], seen[0]["use_tf32"]) == ("1", "1")


def test_a_cuda_session_that_fell_back_to_the_cpu_is_an_engine_error(monkeypatch):
    """ONNX Runtime falls back to the CPU with only a log line when CUDA or cuDNN is missing."""
    _cuda_sessions(monkeypatch, ["CPUExecutionProvider"])
    runner = OnnxrtEngineRunner(segment(), device="cpu", name="ort:head")
    runner.device = "cuda"
    with pytest.raises(EngineError, match="ort:head: ONNX Runtime could not start its CUDA provider .* it has "
                                          "CPUExecutionProvider$"):
        runner._session(1234)


def test_enqueue_refuses_before_activate_and_on_stream_0():
    runner = OnnxrtEngineRunner(segment(), device="cpu", name="ort:head")
    shapes = {"images": (1, 3, 32, 32), "out": (1, 8, 32, 32)}
    with pytest.raises(EngineError, match="ort:head: enqueue before activate"):
        runner.enqueue(1234, {"images": 1, "out": 2}, shapes)
    with runner:
        runner.device = "cuda"  # past the provider check: stream 0 is refused before any session is made
        with pytest.raises(RuntimeInputError, match="stream 0 as 'no user stream'"):
            runner.enqueue(0, {"images": 1, "out": 2}, shapes)


def test_binding_names_the_tensor_without_a_device_pointer():
    runner = OnnxrtEngineRunner(segment(), device="cpu", name="ort:head")
    sess = ort.InferenceSession(segment().SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(RuntimeInputError, match=r"ort:head: no device pointer and shape for input 'images'; the "
                                                r"segment's tensors are \['images', 'out'\]"):
        runner._bind(sess, {"out": 2}, {"images": (1, 3, 32, 32), "out": (1, 8, 32, 32)})


def test_runner_for_takes_the_plan_of_its_flavour_and_refuses_ambiguity():
    files = {"seg.onnx": b"onnx", "seg.plan": b"a TensorRT plan", "seg.rtx.plan": b"a TensorRT-RTX plan"}
    assert runner_for(EngineArtifact("tensorrt", "seg", files))._plan == b"a TensorRT plan"
    assert runner_for(EngineArtifact("tensorrt-rtx", "seg", files))._plan == b"a TensorRT-RTX plan"
    two = {"a.onnx": segment().SerializeToString(), "b.onnx": segment(1).SerializeToString()}
    with pytest.raises(BundleError, match=r"engine 'seg': expected one .onnx file, found \['a.onnx', 'b.onnx'\]"):
        runner_for(EngineArtifact("onnxruntime", "seg", two))
