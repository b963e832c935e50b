"""The bytes a kernel moves: each tensor of its contract's signature at bound dims, inputs read once
and outputs written once. That is the memory floor of a kernel whose time is its traffic (the decode
reading the head maps), and what a GPU's bandwidth turns into a time another machine can check.

A capacity buffer (say, candidates sized by a `max_candidates` param) counts at the size its params
give it: to count only the rows the data fills, resolve the params with that count instead.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .contracts import Contract, concrete_shape, signature
from .expressions import evaluate


@dataclass(frozen=True, slots=True)
class TensorBytes:
    name: str
    role: str  # input (read) | output (written)
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Traffic:
    """What one launch of a kernel reads and writes, tensor by tensor."""

    kernel: str
    tensors: tuple[TensorBytes, ...]

    @property
    def read(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.role == "input")

    @property
    def written(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.role == "output")

    @property
    def total(self) -> int:
        return self.read + self.written

    def seconds_at(self, bytes_per_second: float) -> float:
        """The time these bytes take at that bandwidth: a floor, reached only by a kernel at the memory limit."""
        return self.total / bytes_per_second


def kernel_traffic(contract: Contract, params: Mapping[str, Any], dims: Mapping[str, int]) -> Traffic:
    """The tensors of `contract` under resolved `params`, with `dims` (at least the batch, `B`) and the
    contract's own `dims:` section binding their shapes."""
    bound = dict(dims)
    for name, expr in contract.model.dims.items():
        value = evaluate(expr, {**params, **bound}, f"{contract.path}: dims.{name}")
        if isinstance(value, int):  # a dim left symbolic (no inputs to bind it here) stays unbound
            bound.setdefault(name, value)
    tensors = []
    for sig in signature(contract, params):
        shape = concrete_shape(sig, params, bound, f"kernel {contract.name}: {sig.role} '{sig.name}'")
        tensors.append(TensorBytes(sig.name, sig.role, sig.dtype, shape,
                                   math.prod(shape) * np.dtype(sig.dtype).itemsize))
    return Traffic(contract.name, tuple(tensors))
