"""The engine level: TensorRT plans against ONNX Runtime on the same segments, where plans exist."""
from __future__ import annotations

from collections.abc import Mapping

from ..bundle.view import BundleView
from ..engines import EngineArtifact, runner_for
from .data import feeds_for
from .gate import LevelResult, compare_runs, from_outputs, not_run


def engine_level(decision, artifacts) -> LevelResult:
    """TensorRT plans vs ONNX Runtime: only where the plans were built (on the target)."""
    if decision.backend != "tensorrt" or decision.deferred:
        why = decision.reason if decision.backend == "tensorrt" else f"backend {decision.backend}: no plans to check"
        return not_run("engine", why)
    return not_run("engine", "TensorRT plans built; compared by `deepjit validate` on this GPU")


def plans_level(view: BundleView, spec, plans: Mapping[str, bytes]) -> LevelResult:
    """Each TensorRT plan (`plans`: {"<segment>.plan": bytes}) against ONNX Runtime on its segment's
    ONNX, on the spec's validation data for the segment's inputs."""
    outputs = []
    for step in view.steps:
        if step.kind != "segment":
            continue
        plan = f"{step.name}.plan"
        trt = runner_for(EngineArtifact("tensorrt", step.name, {plan: plans[plan]}), name="tensorrt")
        ort = runner_for(EngineArtifact("onnxruntime", step.name, {step.file: view.file(step.file).read_bytes()}),
                         name="onnxruntime")
        outputs += compare_runs("engine", ort, trt, feeds_for(spec, step.inputs), spec.validation.tolerances).outputs
    return from_outputs("engine", outputs, "TensorRT plans against ONNX Runtime on the same segments")
