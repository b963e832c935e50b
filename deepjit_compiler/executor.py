"""Run a Plan step by step on the CPU (ONNX Runtime), with any step swapped for another callable.

The gate uses this to build its candidates: precision-rewritten segments in place of the fp32 ones,
GPU kernels in place of their references. The reference side is one ONNX model: the original with
the added-stage references composed around it, so Polygraphy's OnnxrtRunner can run it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import compose
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

from .onnxutil import model_bytes, ort_session, pin_ir_version
from .surgery import Plan

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


def compose_reference(original: onnx.ModelProto, added) -> onnx.ModelProto:
    """`added`: stages with .position, .reference (ONNX), .inputs and .outputs (objects with .name)."""
    model = original
    for stage in added:
        # the stage's internal names get its own prefix, so two references never collide
        ref = compose.add_prefix(stage.reference, f"{stage.name}/" if hasattr(stage, "name") else "added/",
                                 rename_inputs=False, rename_outputs=False)
        if stage.position == "before":
            # only what the model reads is wired; the rest (letterbox's ratio_pad) stays an output
            reads = {i.name for i in model.graph.input}
            io = [(o.name, o.name) for o in stage.outputs if o.name in reads]
            model = _merge(ref, model, io)
        else:
            io = [(i.name, i.name) for i in stage.inputs]
            model = _merge(model, ref, io)
    return model


def _merge(first: onnx.ModelProto, second: onnx.ModelProto, io_map) -> onnx.ModelProto:
    """compose.merge_models needs equal IR versions and opsets: lift both to the larger ones."""
    opset = max(_opset(first), _opset(second))
    a, b = (_at_opset(m, opset) for m in (first, second))
    ir = max(a.ir_version, b.ir_version)
    a.ir_version = b.ir_version = ir
    return pin_ir_version(compose.merge_models(a, b, io_map=io_map))


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _at_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    if _opset(model) == opset:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        return m
    return onnx.version_converter.convert_version(model, opset)
