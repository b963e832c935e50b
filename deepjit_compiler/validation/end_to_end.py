"""The end_to_end level (GPU): the loaded pipeline (engine + kernels, CUDA graphs) against the original
model with the added stages' references around it."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import onnx

from ..bundle.folder import Bundle
from ..graph.compose import compose_reference
from .executor import onnxrt_runner
from .gate import FunctionRunner, LevelResult, compare_runs


def end_to_end_level(bundle: Bundle, steps, feeds, spec, report_dir: Path | None = None) -> LevelResult:
    """The whole loaded pipeline (graph replay) against the original model + added references."""
    from ..runtime.pipeline import Pipeline

    added = [SimpleNamespace(name=s.name, position=s.position, reference=s.onnx, inputs=s.inputs_sig,
                             outputs=s.outputs_sig) for s in steps if s.kind == "added"]
    reference = compose_reference(onnx.load(str(bundle.file(bundle.manifest["model"]["file"]))), added)
    lossy = bundle.manifest["engine"]["precision"] != "fp32"
    tol = spec.validation.precision_tolerances if lossy else spec.validation.tolerances
    with Pipeline.load(bundle) as pipeline:
        result = compare_runs("end_to_end", onnxrt_runner(reference, "reference"), FunctionRunner(pipeline, "deepjit"),
                              feeds, tol, detection_params=tol.detections.model_dump(), report_dir=report_dir)
    why = "the pipeline on this GPU (CUDA graphs) against ONNX Runtime on the original model"
    return LevelResult(result.level, result.status, why + (" (lossy precision: precision tolerances)" if lossy else ""),
                       result.outputs)
