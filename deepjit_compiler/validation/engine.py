"""The engine level: plans against ONNX Runtime on the same segments, where a plan runs on this GPU.

Without such a GPU (a CPU box building TensorRT-RTX plans), the level records what can be known
without one: that the plans were built, for which compute capabilities, their size, the network
TensorRT parsed and its I/O; it is `not_run`, and `deepjit validate` on a GPU of that compute
capability runs it. Build times go to build-report.json, never into this record.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..bundle.view import BundleView
from ..engines import EngineArtifact, runner_for
from ..errors import EngineError, MissingDependency
from ..runtime.segments import activated_plan_runner, runnable_plan
from .data import feeds_for
from .gate import LevelResult, compare_runs, from_outputs, not_run


def describe_plan(plan) -> str:
    """One line on a built plan (engines.PlanInfo): flavour, version, compute capabilities, size, layers, I/O."""
    ccs = ", ".join(plan.compute_capabilities) or "its build GPU"
    io = ", ".join(f"{t['name']} {t['dtype']}" for t in plan.inputs)
    return (f"{plan.file}: {plan.flavour} {plan.version} plan for compute capability {ccs}, {plan.size / 1e6:.1f} MB, "
            f"{plan.network_layers} network layers, inputs {io} -> {len(plan.outputs)} outputs (engine.plans in the "
            "manifest lists its I/O and profile)")


def engine_level(decision, artifacts) -> LevelResult:
    """What the build knows of its plans before any GPU runs them (the GPU levels may run them after)."""
    if decision.backend == "onnxruntime":
        return not_run("engine", f"backend {decision.backend}: no plans to check")
    if decision.deferred:
        return not_run("engine", decision.reason)
    plans = [a.plan for a in artifacts if a.plan is not None]
    ccs = sorted({c for p in plans for c in p.compute_capabilities})
    where = f"a GPU of compute capability {', '.join(ccs)}" if ccs else "the GPU they were built on"
    return not_run("engine", "built " + "; ".join(describe_plan(p) for p in plans)
                   + f". Running the plans against ONNX Runtime needs {where} (`deepjit validate BUNDLE` there)")


def plans_level(view: BundleView, spec, plans: Mapping[str, EngineArtifact]) -> LevelResult:
    """Each segment's plan (`plans`: segment name -> an artifact holding it) against ONNX Runtime on
    the segment's ONNX, on the spec's validation data for the segment's inputs."""
    outputs = []
    for step in view.steps:
        if step.kind != "segment" or step.name not in plans:
            continue
        art = plans[step.name]
        plan = next(rel for rel in art.files if rel.endswith(".plan"))
        trt = runner_for(EngineArtifact(art.backend, step.name, {plan: art.files[plan]}), name=art.backend)
        ort = runner_for(EngineArtifact("onnxruntime", step.name, {step.file: view.file(step.file).read_bytes()}),
                         name="onnxruntime")
        outputs += compare_runs("engine", ort, trt, feeds_for(spec, step.inputs), spec.validation.tolerances).outputs
    return from_outputs("engine", outputs, "plans against ONNX Runtime on the same segments")


def bundle_plans_level(view: BundleView, spec, device_sm: int, *, engine: str = "auto") -> LevelResult | None:
    """The engine level on this GPU over the bundle's plans that run here; None when the bundle has no
    plans or none of them runs here (the build's record, which says where they run, stands; the
    runtime warns why), an EngineError naming why for `engine="plan"`."""
    if not view.engine.plans or engine == "onnxruntime":
        return None
    runnable, refused = {}, []
    for step in view.steps:
        if step.kind != "segment":
            continue
        plan, why = runnable_plan(view.engine, step.name, device_sm)
        refused += why
        if plan is not None:
            try:  # the library's own check first: it says why it refuses this GPU
                activated_plan_runner(view, step.name, plan).deactivate()
            except (EngineError, MissingDependency) as e:
                refused.append(str(e))
                continue
            runnable[step.name] = EngineArtifact(plan.flavour, step.name,
                                                 {plan.file: view.file(plan.file).read_bytes()})
    if not runnable:
        if engine == "plan":
            raise EngineError("the engine was asked for as a plan, and no plan runs here: " + "; ".join(refused))
        return None
    return plans_level(view, spec, runnable)
