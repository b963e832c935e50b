"""Small ONNX helpers shared by every stage: tensor signatures, saving, value infos and running.

Models are saved with a pinned IR version because the installed onnx writes IR versions that older
ONNX Runtime releases reject. Shape inference is in shapes.py, graph navigation in graphindex.py.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from .archive import atomic_write

# ONNX Runtime >= 1.18 (the oldest DeepJIT supports) reads IR version 10.
MAX_IR_VERSION = 10

Dim = int | str


@dataclass(frozen=True, slots=True)
class TensorSig:
    """A tensor at a stage boundary: its name, numpy dtype name and shape (ints or symbolic names)."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: Mapping) -> TensorSig:
        """The inverse of to_dict (a bundle manifest's tensor entries)."""
        return cls(d["name"], d["dtype"], tuple(d["shape"]))

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)


# --- saving -------------------------------------------------------------------------------------


def pin_ir_version(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with an IR version ONNX Runtime reads: the lowest its opsets allow, never above
    the model's own, capped at MAX_IR_VERSION."""
    model.ir_version = max(min_ir_version(model), min(model.ir_version or MAX_IR_VERSION, MAX_IR_VERSION))
    return model


def min_ir_version(model: onnx.ModelProto) -> int:
    """The lowest IR version that the model's default-domain opset allows."""
    opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    return helper.find_min_ir_version_for(opsets, ignore_unknown=True) if opsets else 3


def model_bytes(model: onnx.ModelProto) -> bytes:
    """Deterministic serialization (map fields sorted), so rebuilds write identical bytes."""
    return model.SerializeToString(deterministic=True)


def save_model(model: onnx.ModelProto, path: str | Path) -> Path:
    path = Path(path)
    atomic_write(path, model_bytes(pin_ir_version(model)))
    return path


# --- types ----------------------------------------------------------------------------------------


def np_dtype_name(elem_type: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def sig_from_value_info(vi: onnx.ValueInfoProto) -> TensorSig | None:
    """The tensor's signature, or None when its dtype or rank is unknown. Anonymous dims (no value,
    no name) get a name of their own so that the signature stays printable."""
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or t.elem_type == 0 or not t.HasField("shape"):
        return None
    dims: list[Dim] = []
    for i, d in enumerate(t.shape.dim):
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        else:
            dims.append(d.dim_param or f"{vi.name}:{i}")
    return TensorSig(vi.name, np_dtype_name(t.elem_type), tuple(dims))


def value_info_map(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    g = model.graph
    out = {vi.name: vi for vi in g.value_info}
    out.update({vi.name: vi for vi in g.input})
    out.update({vi.name: vi for vi in g.output})
    return out


def is_complete(vi: onnx.ValueInfoProto | None) -> bool:
    """Dtype and rank are known and every dim has a value or a name."""
    if vi is None or sig_from_value_info(vi) is None:
        return False
    return all(d.HasField("dim_value") or d.dim_param for d in vi.type.tensor_type.shape.dim)



# --- running ------------------------------------------------------------------------------------


def ort_session(model: onnx.ModelProto, *, threads: int = 0):
    """An ONNX Runtime CPU session with graph optimizations disabled: fusions would reorder float
    math and break bit-identity between a model and its pieces."""
    import onnxruntime as ort

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
