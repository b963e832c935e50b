"""One way to run a pipeline's steps on the CPU: `StepRunner`, steps in order over one environment of
named tensors, each an ONNX model on ONNX Runtime (graph optimizations off) or any callable.

The levels use it for everything they run on the CPU: the graph level runs the plan's pieces, the
precision level the plan with its segments swapped for their precision twins, the GPU levels the
bundle's segments and references to get each kernel's inputs. The reference side of a level is one
ONNX model, the original with the added-stage references composed around it, run by Polygraphy's
OnnxrtRunner.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import onnx
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

from ..graph.compose import compose_reference
from ..graph.ort import ort_session
from ..graph.serialize import model_bytes
from ..surgery.plan import Plan
from .gate import FunctionRunner

StepFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


class WiringError(Exception):
    """A step cannot run: it reads a tensor no earlier step makes, or ONNX Runtime refuses its inputs."""


class OnnxStep:
    """An ONNX model as a step (one session, made once): reads its inputs from the environment."""

    def __init__(self, name: str, model: onnx.ModelProto):
        self.name, self.sess = name, ort_session(model)
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]

    def __call__(self, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.inputs if n not in env]
        if missing:
            raise WiringError(f"step '{self.name}' reads '{missing[0]}', which no earlier step produces")
        try:
            outs = self.sess.run(self.outputs, {n: env[n] for n in self.inputs})
        except Exception as e:  # ORT raises its own types for shape/type mismatches
            raise WiringError(f"step '{self.name}' failed in ONNX Runtime: {e}") from None
        return dict(zip(self.outputs, outs))


class StepRunner:
    """Named steps run in order: each an ONNX model or a StepFn (env -> its outputs)."""

    def __init__(self, steps: Iterable[tuple[str, onnx.ModelProto | StepFn]]):
        self.steps = [(name, OnnxStep(name, s) if isinstance(s, onnx.ModelProto) else s) for name, s in steps]

    def tensors(self, feed: Mapping[str, np.ndarray],
                after: Callable[[str, Mapping[str, np.ndarray]], None] | None = None) -> dict[str, np.ndarray]:
        """Every tensor the steps make, the feed's included; `after(name, outputs)` sees each step's."""
        env = dict(feed)
        for name, step in self.steps:
            out = step(env)
            env.update(out)
            if after is not None:
                after(name, out)
        return env


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
