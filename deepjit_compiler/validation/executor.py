"""Run a Plan step by step on the CPU (ONNX Runtime), with any step swapped for another callable.

The gate uses this to build its candidates: precision-rewritten segments in place of the fp32 ones,
GPU kernels in place of their references. The reference side is one ONNX model: the original with
the added-stage references composed around it, so Polygraphy's OnnxrtRunner can run it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

from ..graph.compose import compose_reference
from ..graph.ort import ort_session
from ..graph.serialize import model_bytes
from ..surgery.plan import Plan
from .gate import FunctionRunner

StepFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


def onnx_step(model: onnx.ModelProto) -> StepFn:
    """An ONNX model as a step: reads its inputs from the environment, returns its outputs."""
    sess = ort_session(model)
    inputs = [i.name for i in sess.get_inputs()]
    outputs = [o.name for o in sess.get_outputs()]

    def run(env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(outputs, sess.run(outputs, {n: env[n] for n in inputs})))

    return run


def onnxrt_runner(model: onnx.ModelProto, name: str) -> OnnxrtRunner:
    """Polygraphy's ONNX Runtime runner over a model (the reference side of a gate level)."""
    return OnnxrtRunner(SessionFromOnnx(model_bytes(model)), name=name)


class PlanRunner:
    """Runs the plan's steps in order over one environment of named tensors."""

    def __init__(self, plan: Plan, overrides: Mapping[str, StepFn] | None = None):
        self.plan = plan
        overrides = overrides or {}
        self._steps = [(s.name, overrides.get(s.name) or onnx_step(s.onnx)) for s in plan.steps]

    def tensors(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every tensor the pipeline produces (boundaries between steps included)."""
        env = dict(feed)
        for _, step in self._steps:
            env.update(step(env))
        return env

    def __call__(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        env = self.tensors(feed)
        return {t.name: env[t.name] for t in self.plan.outputs}


def reference_model(plan: Plan, original: onnx.ModelProto) -> onnx.ModelProto:
    """The original model with the added stages' references composed before and after it."""
    return compose_reference(original, plan.added)


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
