"""The validation levels a build runs: graph and precision on the CPU, always; engine on the target;
kernels and end_to_end on a GPU (`validate.py`)."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from polygraphy.backend.onnxrt import OnnxrtRunner

from .data import concrete_shape, validation_feeds
from .executor import PlanRunner, onnx_step, onnxrt_runner, reference_model
from .gate import FunctionRunner, LevelResult, OutputResult, compare_runs, from_outputs, not_run

log = logging.getLogger("deepjit.validation")


def _batch(spec, name: str) -> int:
    inp = spec.inputs.get(name)
    want = spec.validation.batch
    return want if inp is None else min(max(want, inp.min_shape[0]), inp.max_shape[0])


def symbolic_dims(spec) -> dict[str, int]:
    """Values for the spec inputs' symbolic dims: the batch from validation, the rest from `opt`."""
    dims = {}
    for name, inp in spec.inputs.items():
        for i, d in enumerate(inp.shape):
            if isinstance(d, str):
                dims[d] = _batch(spec, name) if i == 0 else inp.opt_shape[i]
    return dims


def feeds_for(spec, plan) -> list[dict[str, np.ndarray]]:
    """The spec's validation data for the pipeline's inputs."""
    inputs = {}
    for sig in plan.inputs:
        inp = spec.inputs.get(sig.name)
        inputs[sig.name] = (sig.dtype, concrete_shape(sig.shape, _batch(spec, sig.name),
                                                      inp.opt_shape if inp else None, name=sig.name))
    return validation_feeds(spec.validation, inputs)


def graph_level(spec, plan, model: onnx.ModelProto) -> LevelResult:
    """Reassembly: segments + references wired in order equal the original, bit for bit (fp32)."""
    from .reassembly import check_reassembly

    v = spec.validation
    rep = check_reassembly(plan, model, seed=v.seed, samples=v.samples,
                           input_ranges=v.data.random.ranges if v.data.random else None,
                           batch=v.batch, dims=symbolic_dims(spec))
    if rep.error:
        return LevelResult("graph", "failed", rep.error)
    outputs = [OutputResult(o.name, o.passed, max_abs=o.max_abs_diff,
                            detail="bit-identical" if o.passed else f"differs by up to {o.max_abs_diff:g}")
               for o in rep.outputs]
    return from_outputs("graph", outputs, rep.describe())


def reference_runner(plan, model: onnx.ModelProto, name: str = "onnxruntime") -> OnnxrtRunner:
    """Polygraphy's OnnxrtRunner over the original model with the added stages' references around it;
    the kernel sites' outputs (e.g. output0) are exported too, so they are compared as well."""
    ref = reference_model(plan, model)
    have = {o.name for o in ref.graph.output}
    extra = [t.name for s in plan.sites for t in s.outputs if t.name not in have]
    ref.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in extra)
    return onnxrt_runner(ref, name)


def pipeline_runner(plan, overrides: Mapping, name: str) -> FunctionRunner:
    """The plan with some steps swapped, exporting the pipeline outputs and the sites' outputs."""
    runner = PlanRunner(plan, overrides)
    names = [t.name for t in plan.outputs] + [t.name for s in plan.sites for t in s.outputs]

    def run(feed):
        env = runner.tensors(feed)
        return {n: env[n] for n in dict.fromkeys(names)}

    return FunctionRunner(run, name)


def precision_stage(spec, plan, model: onnx.ModelProto, feeds, report_dir: Path | None = None
                    ) -> tuple[dict[str, onnx.ModelProto], LevelResult]:
    """Rewrite the engine segments to the spec's precision and measure the cost against fp32."""
    from .calibration import CalibrationSettings
    from .precision import DEFAULT_KEEP_FP32, apply_precision, check_keep_fp32, emulate_in_fp32

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
    # that rounds every low-precision tensor where the rewritten graph stores one.
    twins = {name: onnx_step(emulate_in_fp32(m)) for name, m in segments.items()}
    level = compare_runs("precision", reference_runner(plan, model, "fp32"),
                         pipeline_runner(plan, twins, e.precision), feeds, spec.validation.precision_tolerances,
                         report_dir=report_dir, detection_params=spec.validation.precision_tolerances.detections.model_dump())
    return segments, LevelResult(level.level, level.status, f"{e.precision} segments vs the fp32 model", level.outputs)


def engine_level(decision, artifacts) -> LevelResult:
    """TensorRT plans vs ONNX Runtime: only where the plans were built (on the target)."""
    if decision.backend != "tensorrt" or decision.deferred:
        why = decision.reason if decision.backend == "tensorrt" else f"backend {decision.backend}: no plans to check"
        return not_run("engine", why)
    return not_run("engine", "TensorRT plans built; compared by `deepjit validate` on this GPU")


def gpu_levels(bundle_path: Path | None, spec, report_dir: Path | None = None) -> list[LevelResult]:
    """The kernels and end_to_end levels, where this machine has a GPU; recorded as not run elsewhere."""
    from .engines import local_device_sm

    if local_device_sm() is None:
        why = "no GPU on this machine: run `deepjit validate BUNDLE` on one"
        return [not_run("kernels", why), not_run("end_to_end", why)]
    from .validate import run_gpu_levels

    return run_gpu_levels(bundle_path, spec, report_dir)
