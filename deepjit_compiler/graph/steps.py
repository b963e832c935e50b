"""Steps run in order on the CPU: `StepRunner`, over one environment of named tensors, each step an
ONNX model on ONNX Runtime (graph optimizations off) or any callable. The validation levels run
plans and bundles with it; `deepjit run --device cpu` runs a bundle's segments and kernel
references with it."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import onnx

from .ort import ort_session

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
