"""The precision level: the engine segments rewritten to the spec's precision, measured against the
fp32 model on the CPU (precision_tolerances)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx

from ..jit.contracts import DetectionOutputs
from ..log import Progress
from ..precision.calibration import CalibrationSettings, reader_for
from ..precision.emulate import emulate_in_fp32
from ..precision.rewrite import DEFAULT_KEEP_FP32, apply_precision, check_keep_fp32
from ..spec.models import CALIBRATED
from .executor import pipeline_runner, reference_runner
from .gate import LevelResult, compare_runs


def precision_stage(spec, plan, model: onnx.ModelProto, feeds, report_dir: Path | None = None,
                    detections: Sequence[DetectionOutputs] = ()) -> tuple[dict[str, onnx.ModelProto], LevelResult]:
    """Rewrite the engine segments to the spec's precision and measure the cost against fp32;
    `detections`: the outputs the plan's kernels declare as detections, compared as sets."""
    e = spec.engine
    keep = tuple(e.keep_fp32) if e.keep_fp32 is not None else DEFAULT_KEEP_FP32
    if e.keep_fp32 is not None:
        check_keep_fp32([s.model for s in plan.segments], keep)
    calibration = CalibrationSettings.from_spec(spec)
    segments = {s.name: apply_precision(s.model, e.precision, keep_fp32=keep, calibration=calibration)
                for s in plan.segments}
    if e.precision == "fp32":
        return segments, LevelResult("precision", "passed", "fp32: engine segments are the model's own")
    # ONNX Runtime's CPU kernels would hide fp16 rounding (and lack bf16 convs): run an fp32 twin
    # that rounds every low-precision tensor where the rewritten graph stores one. The references of
    # kernels handed fp16 tensors (plan.model_dtypes) take them through their twins too, which round
    # on entry what the segments' twins give as fp32.
    twins = {name: emulate_in_fp32(m) for name, m in segments.items()}
    twins.update({s.name: emulate_in_fp32(s.reference) for s in (*plan.sites, *plan.added)
                  if any(t.name in plan.model_dtypes for t in s.inputs)})
    with Progress("precision level", len(feeds), unit="samples", logger="deepjit.precision") as progress:
        level = compare_runs("precision", reference_runner(plan, model, "fp32"),
                             pipeline_runner(plan, twins, e.precision, progress.advance), feeds,
                             spec.validation.precision_tolerances, report_dir=report_dir, detections=detections)
    calibrated = ""
    if e.precision in CALIBRATED:
        sources = sorted({reader_for(s.model, calibration).source for s in plan.segments})
        calibrated = f" (calibrated on {', '.join(sources)})"
    return segments, LevelResult(level.level, level.status, f"{e.precision} segments{calibrated} vs the fp32 model",
                                 level.outputs)
