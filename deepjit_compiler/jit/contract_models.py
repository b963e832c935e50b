"""Kernel contract files: the pydantic models a kernels/*.yaml is validated against.

The format is documented in docs/kernel-contracts.md; contracts.py loads a file into these models
and evaluates their expressions (an `Expr` is a literal or a Jinja expression over params and dims).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ARG_TYPES", "ArgSpec", "ContractModel", "EntrySpec", "Expr", "ParamSpec", "TensorSpec"]

Expr = Union[int, float, str]
ARG_TYPES = ("ptr", "i32", "u32", "i64", "u64", "f32", "f64")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ParamSpec(_Model):
    """One template parameter. Absent `default` and no `infer` fact -> the spec must give it."""

    type: Literal["int", "float", "bool", "str", "list"]
    default: Any = None
    allowed: list[Any] | None = None
    min: float | None = None
    max: float | None = None
    infer: str | None = Field(None, description="kernel-site fact that supplies the value when not given")
    symbolic: bool = Field(False, description="a string value is a symbolic dim name (dynamic shape)")
    doc: str = ""


class TensorSpec(_Model):
    name: str
    dtype: str
    shape: list[Expr]
    repeat: Expr | None = None
    when: str | None = None
    zero_init: bool = Field(False, description="must be zeroed once at allocation; the kernels keep it so")
    doc: str = ""


class ArgSpec(_Model):
    name: str
    type: Literal[ARG_TYPES]  # type: ignore[valid-type]
    value: Expr | None = None
    repeat: Expr | None = None
    when: str | None = None


class EntrySpec(_Model):
    name: str
    symbol: str = Field(description="C++ name expression (a Jinja template over params), e.g. 'k<float>'")
    when: str | None = None
    block: list[Expr]
    grid: list[Expr]
    shared_mem: Expr = 0
    overlaps_previous: bool = Field(False, description="launched while the previous kernel in the stream "
                                    "still runs (sm_90+); the kernel calls deepjit::wait_previous() first")
    args: list[ArgSpec]


class ContractModel(_Model):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    description: str = ""
    template: str
    headers: list[str] = Field(default_factory=list)
    params: dict[str, ParamSpec] = Field(default_factory=dict)
    derived: dict[str, str] = Field(default_factory=dict)
    dims: dict[str, str] = Field(default_factory=dict)
    inputs: list[TensorSpec] = Field(default_factory=list)
    outputs: list[TensorSpec] = Field(default_factory=list)
    entry_points: list[EntrySpec] = Field(min_length=1)
    workspace: Expr = 0
