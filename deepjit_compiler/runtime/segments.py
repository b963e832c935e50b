"""Which runner runs a bundle's engine segment: one of its plans on the GPU (TensorRT before
TensorRT-RTX) when this machine can run it (its enqueue goes into the CUDA graph), else ONNX Runtime
on the segment's ONNX, with a warning that says why: with onnxruntime-gpu on its CUDA provider, over
the runtime's own device buffers and stream (IO binding), else on the CPU between device phases.

`engine`: "auto" (that), "plan" (a plan or an EngineError naming why none runs: `--engine plan` of
run / bench / validate) or "onnxruntime" (the ONNX, even where a plan would run).
"""
from __future__ import annotations

import logging

from ..bundle.view import BundleView, EngineView, PlanView
from ..choices import ENGINE_CHOICES
from ..engines import EngineArtifact, flavour, runner_for
from ..engines.tensorrt import plan_refusal
from ..errors import EngineError, MissingDependency
from ..spec.targets import compute_capability
from .layout import Layout, StepInfo

log = logging.getLogger("deepjit.runtime")


def engine_files(layout: Layout, step: StepInfo) -> list[str]:
    """The segment's files: its ONNX and its plans (built with the bundle or by `deepjit materialize`)."""
    files = [*layout.engine.segments.get(step.name, ()), *layout.engine.plan_files(step.name)]
    return list(dict.fromkeys([*files, *([step.file] if step.file else [])]))


def runnable_plan(engine: EngineView, segment: str, device_sm: int | None) -> tuple[PlanView | None, list[str]]:
    """The first of the segment's plans this machine may run (TensorRT first), judged by the manifest
    and what imports here, and why each plan before it cannot."""
    refused = []
    for plan in sorted(engine.plans.get(segment, ()), key=lambda p: p.flavour != "tensorrt"):
        f = flavour(plan.flavour)
        if not f.importable():
            refused.append(f"{plan.file} needs {f.title} {plan.version}, which is not importable here "
                           f"(install deepjit[{f.extra}])")
        elif device_sm is None:
            refused.append(f"{plan.file}: this machine has no GPU")
        elif plan.runs_on(device_sm) is False:
            cc = compute_capability(device_sm)
            unsupported = f.ahead_of_time and device_sm not in (f.supported_sms() or ())
            refused.append(f"{plan.file} is built for compute capability {', '.join(plan.compute_capabilities)} and "
                           f"this GPU is {cc} (sm_{device_sm})"
                           + (f": {f.title} does not support {cc}" if unsupported else ""))
        else:
            return plan, refused
    return None, refused


def plan_artifact(bundle: BundleView, step_name: str, plan: PlanView) -> EngineArtifact:
    return EngineArtifact(plan.flavour, step_name, {plan.file: bundle.file(plan.file).read_bytes()})


def activated_plan_runner(bundle: BundleView, step_name: str, plan: PlanView):
    """The plan's runner, activated; EngineError with the library's reason when it refuses the plan or
    this GPU (TensorRT-RTX: Runtime.get_engine_validity first, then the deserialization itself)."""
    artifact = plan_artifact(bundle, step_name, plan)
    f = flavour(plan.flavour)
    if f.ahead_of_time:
        refusal = plan_refusal(artifact.files[plan.file], f)
        if refusal:
            raise EngineError(f"{plan.file}: {refusal}")
    runner = runner_for(artifact, name=f"{f.name}:{step_name}")
    try:
        runner.activate()
    except (EngineError, MissingDependency):
        raise
    except RuntimeError as e:  # what the bindings raise for a plan they cannot deserialize
        raise EngineError(f"{plan.file}: {f.title} cannot load it: {e}") from None
    return runner


def engine_runner(bundle: BundleView, layout: Layout, step: StepInfo, *, engine: str = "auto",
                  device_sm: int | None = None, device_id: int = 0):
    """(runner, on the GPU?) for a segment step, activated. `device_sm`: this GPU's; `device_id`: its
    ordinal (a plan runs on the current CUDA device, which the runtime made this one)."""
    if engine not in ENGINE_CHOICES:
        raise EngineError(f"engine must be one of {', '.join(ENGINE_CHOICES)}, got '{engine}'")
    refused: list[str] = []
    if engine != "onnxruntime":
        plan, refused = runnable_plan(layout.engine, step.name, device_sm)
        if plan is not None:
            try:
                return activated_plan_runner(bundle, step.name, plan), True
            except (EngineError, MissingDependency) as e:
                refused.append(str(e))
        if engine == "plan":
            raise EngineError(f"segment '{step.name}': the engine was asked for as a plan, and no plan of it runs "
                              f"here: {'; '.join(refused) or 'the bundle has none (deferred: `deepjit materialize`)'}")
    onnx_files = [f for f in engine_files(layout, step) if f.endswith(".onnx")]
    if not onnx_files:
        raise MissingDependency(f"segment '{step.name}' has no ONNX to fall back on, and its plans cannot run here: "
                                + "; ".join(refused))
    if refused:
        log.warning("segment '%s': running its ONNX on ONNX Runtime instead of a plan: %s", step.name, "; ".join(refused))
    artifact = EngineArtifact("onnxruntime", step.name, {onnx_files[0]: bundle.file(onnx_files[0]).read_bytes()})
    runner = runner_for(artifact, name=f"ort:{step.name}", tf32=bool(layout.engine.settings.get("tf32", False)),
                        device_id=device_id)
    runner.activate()
    return runner, runner.device == "cuda"
