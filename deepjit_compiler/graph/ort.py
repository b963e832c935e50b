"""Running ONNX graphs on the CPU with ONNX Runtime, exactly (no graph optimizations), on seeded data."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort

from .serialize import model_bytes, pin_ir_version


def ort_session(model: onnx.ModelProto, *, threads: int = 0):
    """An ONNX Runtime CPU session with graph optimizations disabled: fusions would reorder float
    math and break bit-identity between a model and its pieces."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return ort.InferenceSession(model_bytes(pin_ir_version(m)), opts, providers=["CPUExecutionProvider"])


def random_array(rng: np.random.Generator, dtype: str, shape: Sequence[int],
                 low: float | None = None, high: float | None = None) -> np.ndarray:
    """Seeded random data of any tensor dtype: floats uniform in [low, high) (default [0, 1)),
    uint8 over its full range, other integers in [0, 10), bools fair."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        lo, hi = (0.0 if low is None else low), (1.0 if high is None else high)
        return rng.uniform(lo, hi, size=shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt == np.uint8:
        lo, hi = int(0 if low is None else low), int(256 if high is None else high)
        return rng.integers(lo, hi, size=shape, dtype=np.uint8)
    lo, hi = int(0 if low is None else low), int(10 if high is None else high)
    return rng.integers(lo, hi, size=shape).astype(dt)
