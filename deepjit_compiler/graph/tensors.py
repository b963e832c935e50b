"""Tensor signatures (one type for every stage: plan boundaries, model I/O, kernel contracts, bundle
manifests), and the value infos of an ONNX graph they come from."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

Dim = int | str


@dataclass(frozen=True, slots=True)
class TensorSig:
    """A named tensor: numpy dtype name and dims, ints or str (symbolic names; in a kernel contract
    also expressions over them, e.g. '4 + nc'); `shape` None when the rank is unknown. A contract's
    tensors also say which side of the kernel they are on and whether they start zeroed."""

    name: str
    dtype: str
    shape: tuple[Dim, ...] | None
    role: str = ""            # a contract's tensor: "input" | "output"
    zero_init: bool = False   # a contract's output zeroed once at allocation (a counter)

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": None if self.shape is None else list(self.shape)}

    @classmethod
    def from_dict(cls, d: Mapping) -> TensorSig:
        """The inverse of to_dict (a bundle manifest's tensor entries)."""
        return cls(d["name"], d["dtype"], None if d["shape"] is None else tuple(d["shape"]))

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)


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


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and, depth first, every subgraph of its If/Loop/Scan nodes."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from all_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from all_graphs(g)
