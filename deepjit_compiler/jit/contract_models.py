"""Kernel contract files: the pydantic models a kernels/*.yaml is validated against.

The format is documented in docs/kernel-contracts.md; contracts.py loads a file into these models
and evaluates their expressions (an `Expr` is a literal or a Jinja expression over params and dims).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Expr = Union[int, float, str]
ARG_TYPES = ("ptr", "i32", "u32", "i64", "u64", "f32", "f64")
# Added stages' ONNX references (surgery/references.py) and host-computed launch args (runtime/launch.py)
# a contract can name in its roles.
REFERENCES = ("letterbox", "nms")
HOST_ARGS = ("letterbox_geometry",)


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
    overridable: bool = Field(False, description="the spec may give another value than the inferred fact (a "
                              "capacity, not a property of the model); otherwise a given value must agree with it")
    doc: str = ""

    @model_validator(mode="after")
    def _bounds_are_numbers(self) -> "ParamSpec":
        # compared with the value as numbers: on a str or list param they raised TypeError (exit 3)
        if self.type not in ("int", "float") and (self.min is not None or self.max is not None):
            raise ValueError(f"min and max bound an int or float param; this one is {self.type} (use allowed:)")
        if self.min is not None and self.max is not None and self.min > self.max:  # no value could be given
            raise ValueError(f"min {self.min:g} is above max {self.max:g}")
        return self


class TensorSpec(_Model):
    name: str
    dtype: str
    shape: list[Expr]
    repeat: Expr | None = None
    when: str | None = None
    zero_init: bool = Field(False, description="must be zeroed once at allocation; the kernels keep it so")
    site_input: Expr | None = Field(None, description="which of the kernel site's inputs (by position) this "
                                    "input reads; default: the pipeline tensor of the same name")
    doc: str = ""


class ArgSpec(_Model):
    name: str
    type: Literal[ARG_TYPES]  # type: ignore[valid-type]
    value: Expr | None = None
    repeat: Expr | None = None
    when: str | None = None


class FromBatch(_Model):
    """From batch `at` on, an entry point launches another instantiation of its kernel: its symbol,
    geometry and args evaluated with `params` in place of the contract's. The code is rendered once, so
    only what the symbol's template arguments and the launch carry may differ (bench/RESULTS.md: 4 lanes
    an anchor at batch 1, 2 from batch 4 on)."""

    at: Expr = Field(description="the first batch (dim B) that takes it: an int or an expression over params")
    params: dict[str, Expr] = Field(min_length=1, description="param -> its value from batch `at` on (an expression "
                                    "over params)")
    when: str | None = Field(None, description="a bool expression over params: whether it applies at all")


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
    from_batch: FromBatch | None = None


class Detections(_Model):
    """Outputs that are detections in TensorRT EfficientNMS's layout: compared as sets, never by order."""

    count: str = "num_dets"
    boxes: str = "boxes"
    scores: str = "scores"
    classes: str = "classes"

    @property
    def names(self) -> tuple[str, str, str, str]:
        return self.count, self.boxes, self.scores, self.classes


class ImageInput(_Model):
    """An input that takes decoded images, uint8 [B, H, W, 3], as they are."""

    tensor: str
    channels: str = Field("'bgr'", description="an expression over params: 'bgr' or 'rgb', the order it reads")
    ratio_pad: str | None = Field(None, description="an output of (r, left, top) per image, so boxes map back "
                                  "to the image as (x - left) / r")


class DoneBefore(_Model):
    """A fused mode's other half: when the bool param `when` is true, the kernel before this one in its
    chain does this kernel's work in its own launch, so this one has no tensors, launches or workspace;
    it keeps its reference and its detections for validation."""

    when: str = Field(description="a bool param of this contract")
    same: list[str] = Field(default_factory=list, description="params the kernel before must have with the "
                            "same values (what this kernel would compute with)")


class Roles(_Model):
    """What is special about a kernel, declared, so that a user's contract gets the same treatment."""

    reference: Literal[REFERENCES] | None = Field(  # type: ignore[valid-type]
        None, description="an added stage's ONNX reference (surgery/references.py)")
    twin: dict[str, Any] = Field(default_factory=dict, description="params under which the kernel writes its "
                                 "cut's own outputs: the kernels level checks that twin against the cut")
    detections: Detections | None = None
    image_input: ImageInput | None = None
    host_args: Literal[HOST_ARGS] | None = Field(  # type: ignore[valid-type]
        None, description="launch args the runtime computes on the host from the bound dims and params")
    score_threshold: str | None = Field(
        None, description="the float param below which (score <= it) the kernel drops detections or candidates: "
        "the gate's borderline band is around it, and a later kernel's must not be lower")
    done_before: DoneBefore | None = None


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
    roles: Roles = Roles()

    @field_validator("headers", "entry_points")
    @classmethod
    def _names_once(cls, items: list) -> list:
        # an entry point's name labels its launches and kernels; a header is read once
        names = [getattr(i, "name", i) for i in items]
        twice = next((n for k, n in enumerate(names) if n in names[:k]), None)
        if twice is not None:
            raise ValueError(f"'{twice}' is given twice; allowed: each once")
        return items

    @model_validator(mode="after")
    def _from_batch_names_params(self) -> "ContractModel":
        for k, e in enumerate(self.entry_points):
            unknown = [n for n in (e.from_batch.params if e.from_batch else ()) if n not in self.params]
            if unknown:
                raise ValueError(f"entry_points[{k}].from_batch.params: '{unknown[0]}' is not one of the contract's "
                                 "params")
        return self

    @model_validator(mode="after")
    def _roles_name_params(self) -> "ContractModel":
        name = self.roles.score_threshold
        if name is not None and (name not in self.params or self.params[name].type != "float"):
            raise ValueError(f"roles.score_threshold: '{name}' must be one of the contract's float params")
        done = self.roles.done_before
        if done is not None:
            if done.when not in self.params or self.params[done.when].type != "bool":
                raise ValueError(f"roles.done_before.when: '{done.when}' must be one of the contract's bool params")
            unknown = [n for n in done.same if n not in self.params]
            if unknown:
                raise ValueError(f"roles.done_before.same: '{unknown[0]}' is not one of the contract's params")
        return self
