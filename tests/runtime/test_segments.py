"""Which runner runs a segment (runtime/segments.py): a plan where this machine can run it, else the
segment's ONNX on ONNX Runtime with a warning that says why; `engine="plan"` makes that an
EngineError with the reason, never a traceback. On the T4 bundle built here (a TensorRT-RTX plan for
7.5), with the device's compute capability given, so no GPU is needed: ONNX Runtime runs on the CPU."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from conftest import HAS_GPU

from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.engines import Flavour
from deepjit_compiler.errors import EngineError
from deepjit_compiler.runtime.layout import Layout
from deepjit_compiler.runtime.segments import engine_runner, runnable_plan

pytest.importorskip("tensorrt_rtx", reason="needs TensorRT-RTX (pip install deepjit[tensorrt-rtx]): without it the "
                                           "T4 bundle has no plan")


@pytest.fixture(scope="module")
def t4(t4_build):
    view = read_bundle(t4_build.bundle.path)
    layout = Layout.from_bundle(view)
    return view, layout, next(s for s in layout.steps if s.kind == "segment")


def test_an_h200_runs_the_onnx_and_says_why(t4, caplog):
    view, layout, step = t4
    plan, refused = runnable_plan(view.engine, step.name, 90)
    assert plan is None and len(refused) == 1
    assert "built for compute capability 7.5 and this GPU is 9.0 (sm_90): TensorRT-RTX does not support 9.0" \
        in refused[0]
    with caplog.at_level(logging.WARNING, logger="deepjit.runtime"):
        runner, on_device = engine_runner(view, layout, step, device_sm=90)
    try:
        assert not on_device and runner.name == "ort:segment"
    finally:
        runner.deactivate()
    assert "running its ONNX on ONNX Runtime instead of a plan" in caplog.text and "does not support 9.0" in caplog.text
    with pytest.raises(EngineError, match="asked for as a plan, and no plan of it runs here: .*does not support 9.0"):
        engine_runner(view, layout, step, engine="plan", device_sm=90)


@pytest.mark.skipif(HAS_GPU, reason="on a GPU machine the library may accept the plan")
def test_without_a_usable_gpu_the_library_refuses_in_its_own_words(t4, caplog):
    view, layout, step = t4
    plan, refused = runnable_plan(view.engine, step.name, 75)
    assert plan is not None and plan.file == "engines/segment.rtx.plan" and refused == []
    with pytest.raises(EngineError, match=r"segment.rtx.plan: TensorRT-RTX 1\.7\.\S+ refuses the plan"):
        engine_runner(view, layout, step, engine="plan", device_sm=75)
    with caplog.at_level(logging.WARNING, logger="deepjit.runtime"):
        runner, on_device = engine_runner(view, layout, step, device_sm=75)
    runner.deactivate()
    assert not on_device and "refuses the plan" in caplog.text


def test_onnxruntime_when_asked_and_when_the_library_is_missing(t4, caplog, monkeypatch):
    view, layout, step = t4
    with caplog.at_level(logging.WARNING, logger="deepjit.runtime"):
        runner, on_device = engine_runner(view, layout, step, engine="onnxruntime", device_sm=75)
    runner.deactivate()
    assert not on_device and caplog.text == ""
    monkeypatch.setattr(Flavour, "importable", lambda self: False)
    plan, refused = runnable_plan(view.engine, step.name, 75)
    assert plan is None and "needs TensorRT-RTX 1.7" in refused[0] and "install deepjit[tensorrt-rtx]" in refused[0]
    with pytest.raises(EngineError, match="not importable here"):
        engine_runner(view, layout, step, engine="plan", device_sm=75)
    with pytest.raises(EngineError, match="engine must be one of auto, plan, onnxruntime"):
        engine_runner(view, layout, step, engine="trt", device_sm=75)


def test_tensorrt_plans_are_tried_before_tensorrt_rtx_ones_and_none_runs_without_a_gpu(t4, monkeypatch):
    view, _, step = t4
    (rtx,) = view.engine.plans[step.name]
    trt = replace(rtx, file="engines/segment.trt.plan", flavour="tensorrt", library="tensorrt", version="10.9.0")
    engine = replace(view.engine, plans={step.name: (rtx, trt)})
    monkeypatch.setattr(Flavour, "importable", lambda self: self.name != "tensorrt")
    plan, refused = runnable_plan(engine, step.name, 75)
    assert plan is rtx and len(refused) == 1 and refused[0].startswith("engines/segment.trt.plan needs TensorRT 10.9.0")
    monkeypatch.setattr(Flavour, "importable", lambda self: True)
    plan, refused = runnable_plan(engine, step.name, None)
    assert plan is None and refused == ["engines/segment.trt.plan: this machine has no GPU",
                                        "engines/segment.rtx.plan: this machine has no GPU"]
