"""The TensorRT (datacenter) flavour end to end: build plans from segments (fp32, fp16 in the graph, int8
Q/DQ) through the same loaders, worker and plan cache as TensorRT-RTX (test_tensorrt_rtx_build.py runs
those here), run them on our stream, save the timing cache, materialize deferred segments. Needs
TensorRT and a GPU."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from tiny_segments import conv_relu_conv

trt = pytest.importorskip("tensorrt", reason="needs TensorRT (pip install deepjit[tensorrt]); the config "
                                             "mapping is covered by test_tensorrt_config.py")

from deepjit_compiler.engines import (
    EngineSettings,
    InputProfile,
    deferred_settings,
    local_device_sm,
    materialize,
    runner_for,
)
from deepjit_compiler.engines.plans import build_engine  # noqa: E402
from deepjit_compiler.engines.tensorrt import TrtEngineRunner  # noqa: E402
from deepjit_compiler.errors import RuntimeInputError  # noqa: E402
from deepjit_compiler.precision.calibration import CalibrationSettings  # noqa: E402
from deepjit_compiler.precision.rewrite import apply_precision  # noqa: E402

pytestmark = [pytest.mark.trt, pytest.mark.gpu]


segment = conv_relu_conv


def settings(precision: str, tmp_path) -> EngineSettings:
    return EngineSettings(backend="tensorrt", precision=precision, workspace_bytes=2**28,
                          timing_cache=tmp_path / "cache" / "t.timing", optimization_level=1,
                          profiles=(InputProfile("images", (1, 3, 32, 32), (2, 3, 32, 32), (4, 3, 32, 32)),),
                          target_sm=local_device_sm())


def reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"images": x})[0]


@pytest.mark.parametrize("precision,atol", [("fp32", 1e-3), ("fp16", 3e-2), ("int8", 0.3)])
def test_build_run_and_timing_cache(precision, atol, tmp_path):
    fp32 = segment()
    cal = CalibrationSettings(data="random", cache=tmp_path / "calib", samples=4, shapes={"images": (2, 3, 32, 32)})
    seg = apply_precision(fp32, precision, calibration=cal if precision == "int8" else None)
    path = tmp_path / "engine.onnx"
    onnx.save(seg, path)
    s = settings(precision, tmp_path)
    art = build_engine(path, s, cache_dir=tmp_path / "plans", build_sm=local_device_sm())
    assert art.backend == "tensorrt" and not art.deferred and sorted(art.files) == ["engine.onnx", "engine.plan"]
    assert json.loads(art.settings_json)["built_with"]["tensorrt"] == trt.__version__
    sm = local_device_sm()
    assert art.plan.compute_capabilities == (f"{sm // 10}.{sm % 10}",) and art.plan.network_layers >= 3
    assert s.timing_cache.is_file() and s.timing_cache.stat().st_size > 0
    assert sorted(p.name for p in s.timing_cache.parent.iterdir()) == [s.timing_cache.name]  # saved whole: no temp, no lock
    x = np.random.default_rng(1).uniform(0, 1, size=(3, 3, 32, 32)).astype(np.float32)
    with runner_for(art) as runner:
        out = runner.infer({"images": x})["out"]
    np.testing.assert_allclose(out, reference(fp32, x), atol=atol, rtol=atol)


def test_enqueue_checks_shapes_against_the_profile(tmp_path):
    from polygraphy import cuda

    path = tmp_path / "engine.onnx"
    onnx.save(segment(), path)
    art = build_engine(path, settings("fp32", tmp_path), cache_dir=tmp_path / "plans")
    stream = cuda.Stream()
    try:
        with TrtEngineRunner(art.files["engine.plan"]) as runner:
            with pytest.raises(RuntimeInputError, match="outside the engine's profile"):
                runner.enqueue(stream.ptr, {"images": 1, "out": 2}, {"images": (9, 3, 32, 32)})
            with pytest.raises(RuntimeInputError, match="no device pointer"):
                runner.enqueue(stream.ptr, {"images": 1}, {"images": (1, 3, 32, 32)})
    finally:
        stream.free()


def test_materialize_builds_deferred_segments(tmp_path):
    path = tmp_path / "engine.onnx"
    onnx.save(segment(), path)
    plans = materialize({"engine": path}, json.dumps(deferred_settings(settings("fp32", tmp_path))))
    assert list(plans) == ["engine"] and plans["engine"].plan.file == "engine.plan"
    # the plan is a working engine of that segment, not just bytes
    x = np.random.default_rng(2).uniform(0, 1, size=(2, 3, 32, 32)).astype(np.float32)
    with TrtEngineRunner(plans["engine"].files["engine.plan"]) as runner:
        out = runner.infer({"images": x})["out"]
    np.testing.assert_allclose(out, reference(segment(), x), atol=1e-3, rtol=1e-3)
