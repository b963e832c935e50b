"""Which runner runs a bundle's engine segment: TensorRT on the GPU when the bundle has a plan and
TensorRT imports, else ONNX Runtime on the segment's ONNX: with onnxruntime-gpu on its CUDA
provider, over the runtime's own device buffers and stream (IO binding), else on the CPU between
device phases."""
from __future__ import annotations

import logging

from ..bundle.view import BundleView
from ..engines import EngineArtifact, runner_for, tensorrt_importable
from ..errors import MissingDependency
from .layout import Layout, StepInfo

log = logging.getLogger("deepjit.runtime")


def engine_files(layout: Layout, step: StepInfo) -> list[str]:
    """The segment's files: its ONNX and the plans `deepjit materialize` built for it."""
    files = [*layout.engine.segments.get(step.name, ()), *layout.engine.plans.get(step.name, ())]
    return list(dict.fromkeys([*files, *([step.file] if step.file else [])]))


def engine_runner(bundle: BundleView, layout: Layout, step: StepInfo):
    """(runner, on the GPU?) for a segment step; the runner is not activated yet."""
    files = engine_files(layout, step)
    plans = [f for f in files if f.endswith(".plan")]
    onnx_files = [f for f in files if f.endswith(".onnx")]
    if plans and tensorrt_importable():
        artifact = EngineArtifact("tensorrt", step.name, {plans[0]: bundle.file(plans[0]).read_bytes()})
        return runner_for(artifact, name=f"trt:{step.name}"), True
    if not onnx_files:
        raise MissingDependency(f"segment '{step.name}' is a TensorRT plan ({', '.join(plans) or 'none listed'}) "
                                "and TensorRT is not importable here: install deepjit[tensorrt]")
    if plans:
        log.warning("segment %s: TensorRT is not importable; running its ONNX on ONNX Runtime", step.name)
    artifact = EngineArtifact("onnxruntime", step.name, {onnx_files[0]: bundle.file(onnx_files[0]).read_bytes()})
    runner = runner_for(artifact, name=f"ort:{step.name}", tf32=bool(layout.engine.settings.get("tf32", False)))
    return runner, runner.device == "cuda"
