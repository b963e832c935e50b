"""The end_to_end level (GPU): the loaded pipeline (engine + kernels, CUDA graphs) against the original
model with the added stages' references around it."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import onnx

from ..bundle.view import BundleView
from ..graph.compose import compose_reference
from ..runtime.pipeline import Pipeline
from .executor import onnxrt_runner
from .gate import FunctionRunner, LevelResult, compare_runs


def end_to_end_level(bundle: BundleView, models: Mapping[str, onnx.ModelProto], feeds, spec,
                     report_dir: Path | None = None, *, engine: str = "auto") -> LevelResult:
    """The whole loaded pipeline (graph replay) against the original model + added references;
    `models`: each step's ONNX (the added stages' references among them)."""
    added = [(s.name, s.position, models[s.name]) for s in bundle.steps if s.kind == "added"]
    reference = compose_reference(bundle.onnx(bundle.model_file()), added)
    lossy = bundle.precision != "fp32"
    tol = spec.validation.precision_tolerances if lossy else spec.validation.tolerances
    with Pipeline.load(bundle, engine=engine) as pipeline:
        result = compare_runs("end_to_end", onnxrt_runner(reference, "reference"), FunctionRunner(pipeline, "deepjit"),
                              feeds, tol, detections=bundle.detections, report_dir=report_dir)
        about = pipeline.describe()
    why = (f"the pipeline on {about['device']} (engine {about['engine']}, CUDA graphs {about['capture']}) against "
           "ONNX Runtime on the original model")
    return LevelResult(result.level, result.status, why + (" (lossy precision: precision tolerances)" if lossy else ""),
                       result.outputs)
