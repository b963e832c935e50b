"""How the levels run plans on the CPU: `plan_runner` (a `graph.steps.StepRunner` over a plan's steps,
some swapped), and the reference side.

The levels use it for everything they run on the CPU: the graph level runs the plan's pieces, the
precision level the plan with its segments swapped for their precision twins, the GPU levels the
bundle's segments and references to get each kernel's inputs. The reference side of a level is one
ONNX model, the original with the added-stage references composed around it, run by Polygraphy's
OnnxrtRunner.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import onnx
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

from ..graph.compose import compose_reference
from ..graph.serialize import model_bytes
from ..graph.steps import StepFn, StepRunner
from ..surgery.plan import Plan
from .gate import FunctionRunner


def plan_runner(plan: Plan, overrides: Mapping[str, onnx.ModelProto | StepFn] | None = None) -> StepRunner:
    """The plan's steps, each on its own ONNX graph unless `overrides` swaps it."""
    return StepRunner((s.name, (overrides or {}).get(s.name) or s.onnx) for s in plan.steps)


def onnxrt_runner(model: onnx.ModelProto, name: str) -> OnnxrtRunner:
    """Polygraphy's ONNX Runtime runner over a model (the reference side of a gate level)."""
    return OnnxrtRunner(SessionFromOnnx(model_bytes(model)), name=name)


def reference_model(plan: Plan, original: onnx.ModelProto) -> onnx.ModelProto:
    """The original model with the added stages' references composed before and after it."""
    return compose_reference(original, [(s.name, s.position, s.reference) for s in plan.added])


def reference_runner(plan: Plan, model: onnx.ModelProto, name: str = "onnxruntime") -> OnnxrtRunner:
    """Polygraphy's OnnxrtRunner over the original model with the added stages' references around it;
    the kernel sites' outputs (e.g. output0) are exported too, so they are compared as well."""
    ref = reference_model(plan, model)
    have = {o.name for o in ref.graph.output}
    extra = [t.name for s in plan.sites for t in s.outputs if t.name not in have]
    ref.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in extra)
    return onnxrt_runner(ref, name)


def pipeline_runner(plan: Plan, overrides: Mapping[str, onnx.ModelProto | StepFn], name: str,
                    on_run: Callable[[], None] | None = None) -> FunctionRunner:
    """The plan with some steps swapped, exporting the pipeline outputs and the sites' outputs;
    `on_run` is called after each sample (a progress count)."""
    runner = plan_runner(plan, overrides)
    names = [t.name for t in plan.outputs] + [t.name for s in plan.sites for t in s.outputs]

    def run(feed):
        env = runner.tensors(feed)
        if on_run is not None:
            on_run()
        return {n: env[n] for n in dict.fromkeys(names)}

    return FunctionRunner(run, name)
