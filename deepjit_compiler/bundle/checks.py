"""What a bundle may hold, checked where BundleView reads it. A pulled bundle is input from elsewhere,
as a spec is, so its manifest gets a shape (pydantic models, like the spec's: the typed read side
then meets no surprise type), the names that end up in file names are plain, its ONNX keeps its
weights inline (ONNX Runtime resolves an external file against the working folder), and its spec
validates on generated data or on a folder inside it. A refusal is a BundleError naming the file or
field and what is allowed.
"""
from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import onnx
from onnx import helper
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from ..config import INT32_MAX  # TensorRT's and Triton's dims are int32
from ..errors import BundleError
from ..graph.tensors import TensorSig
from ..spec.models import NAME, NAME_RULE

STEP_KINDS = ("segment", "kernel", "added")
# A step's name becomes part of report file names: the spec's own name rule, so it can never be a path.
PLAIN_NAME = NAME
# What graph.tensors.np_dtype_name can write for an ONNX tensor type, less 'object' (strings).
TENSOR_DTYPES = tuple(sorted({np.dtype(helper.tensor_dtype_to_np_dtype(t)).name
                              for t in helper.get_all_tensor_dtypes()} - {"object"}))


def as_list(value: Any) -> Any:
    """A segment's files or plans may be one entry instead of a list of them (older bundles)."""
    return [value] if isinstance(value, (str, Mapping)) else value


Name = Annotated[StrictStr, Field(pattern=PLAIN_NAME)]
Dim = StrictInt | StrictStr  # a symbolic dim is a name
Size = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
DType = Literal[TENSOR_DTYPES]  # type: ignore[valid-type]
ONNX_FILE = r"\.onnx$"
OnnxFile = Annotated[StrictStr, Field(pattern=ONNX_FILE)]  # BundleView.file checks such a file before it is read
_PATTERNS = {PLAIN_NAME: f"a plain name ({NAME_RULE})",
             ONNX_FILE: "a bundle path ending in .onnx"}


class _Section(BaseModel):
    """Known fields typed; others are ignored (a newer DeepJIT may add some)."""

    model_config = ConfigDict(extra="ignore")


class _Tensor(_Section):
    name: StrictStr
    dtype: DType
    shape: list[Dim]


class _Input(_Section):
    dtype: DType | None = None
    shape: list[Dim] | None = None
    min: list[Size] | None = None
    opt: list[Size] | None = None
    max: list[Size] | None = None
    buckets: list[Size] | None = None


class _Kernel(_Section):
    contract: StrictStr
    params: dict[str, Any]
    arch: StrictStr = ""
    files: dict[str, StrictStr]


class _Step(_Section):
    name: Name
    kind: Literal[STEP_KINDS]  # type: ignore[valid-type]
    inputs: list[_Tensor] = []
    outputs: list[_Tensor] = []
    file: OnnxFile | None = None
    reference: OnnxFile | None = None
    kernels: list[_Kernel] | None = None
    facts: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    position: Literal["before", "after"] | None = None


class _Plan(_Section):
    inputs: list[_Tensor]
    outputs: list[_Tensor]
    steps: list[_Step]


class _PlanRecord(_Section):
    file: StrictStr
    flavour: StrictStr
    library: StrictStr = ""
    version: StrictStr = ""
    compute_capabilities: list[StrictStr] | None = None
    network_layers: StrictInt | None = None
    inputs: list[dict[str, Any]] | None = None
    outputs: list[dict[str, Any]] | None = None
    profiles: dict[str, Any] | None = None
    key: StrictStr = ""


class _Engine(_Section):
    backend: StrictStr = ""
    deferred: StrictBool | None = None
    reason: StrictStr = ""
    precision: StrictStr | None = None
    settings: dict[str, Any] | None = None
    segments: dict[str, Annotated[list[StrictStr], BeforeValidator(as_list)]] | None = None
    plans: dict[str, Annotated[list[StrictStr | _PlanRecord], BeforeValidator(as_list)]] | None = None


class _Output(_Section):
    """An output's record: the fields of validation.gate.OutputResult, nothing else."""

    model_config = ConfigDict(extra="forbid")
    passed: StrictBool
    max_abs: StrictFloat = 0.0
    median_abs: StrictFloat = 0.0
    max_rel: StrictFloat = 0.0
    median_rel: StrictFloat = 0.0
    detail: StrictStr = ""
    mean_abs: StrictFloat = 0.0
    mean_rel: StrictFloat = 0.0
    metrics: dict[str, Any] = {}
    tolerance: dict[str, Any] = {}


class _Level(_Section):
    status: Literal["passed", "failed", "not_run"]
    reason: StrictStr = ""
    outputs: dict[str, _Output] | None = None


class _Target(_Section):
    gpu: StrictStr | None = None
    sm: Annotated[StrictInt, Field(ge=10, le=999)] | None = None


class _Spec(_Section):
    file: StrictStr
    sha256: StrictStr | None = None


class _ModelRecord(_Section):
    sha256: StrictStr | None = None
    file: StrictStr | None = None


class _Validation(_Section):
    levels: dict[str, _Level] | None = None


class _Manifest(_Section):
    name: Name | Literal[""] | None = None
    target: _Target | None = None
    toolchain: dict[str, Any] | None = None
    spec: _Spec | None = None
    model: _ModelRecord | None = None
    inputs: dict[str, _Input] | None = None
    plan: _Plan | None = None
    engine: _Engine | None = None
    validation: _Validation | None = None


def check_manifest(manifest: Mapping[str, Any], label: str) -> None:
    """BundleError naming the first field of `manifest` whose type or value is not what DeepJIT writes."""
    try:
        _Manifest.model_validate(manifest)
    except ValidationError as e:
        raise BundleError(f"{label}: manifest.json {_first_problem(manifest, e)}") from None


def _first_problem(manifest: Mapping[str, Any], e: ValidationError) -> str:
    """The deepest of the errors (a union's other branches report shallower ones), its field as a path."""
    errors = [(_where(manifest, err), err) for err in e.errors(include_url=False)]
    where, err = max(errors, key=lambda item: item[0].count(".") + item[0].count("["))
    pattern = (err.get("ctx") or {}).get("pattern")
    msg = f"should be {_PATTERNS[pattern]}" if pattern in _PATTERNS else err["msg"].split(" or instance of ")[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if err["type"] == "missing":
        return f"'{where}' is missing{more}"
    return f"'{where}': {msg}, got {_short(err['input'])}{more}"


def _where(data: Any, err: Mapping[str, Any]) -> str:
    """The error's location as the manifest's path (`plan.steps[1].kernels[0].params`), keeping only the
    parts that are keys or indexes of the data (pydantic adds union branch names)."""
    out, loc = "", err["loc"]
    for i, part in enumerate(loc):
        if isinstance(data, list) and isinstance(part, int) and part < len(data):
            out, data = f"{out}[{part}]", data[part]
        elif isinstance(data, Mapping) and part in data:
            out, data = f"{out}.{part}" if out else str(part), data[part]
        elif err["type"] == "missing" and i == len(loc) - 1:
            out = f"{out}.{part}" if out else str(part)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def input_profile(t: TensorSig, declared: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
    """The input's min/opt/max: buffers are sized and graphs captured by them, so each has the input's
    rank (at least the batch), whole dims in TensorRT's range, its static dims, and min <= opt <= max."""
    lo, opt, hi = profile = tuple(tuple(declared.get(k) or t.shape) for k in ("min", "opt", "max"))
    whole = all(isinstance(v, int) and 1 <= v <= INT32_MAX for p in profile for v in p)
    if not (t.shape and whole and len(lo) == len(opt) == len(hi) == len(t.shape)
            and all(a <= b <= c and (isinstance(d, str) or a == c == d) for d, a, b, c in zip(t.shape, lo, opt, hi))):
        raise BundleError(f"manifest: 'inputs.{t.name}': min {list(lo)}, opt {list(opt)}, max {list(hi)} do not fit "
                          f"its shape {list(t.shape)}: each needs its rank, dims from 1 to {INT32_MAX} that keep "
                          "its static dims, and min <= opt <= max")
    return profile


# ----------------------------------------------------------------------------- ONNX
def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a node holds: its attributes' (dense and sparse) and its subgraphs' (If, Loop, Scan)."""
    for a in node.attribute:
        yield from [a.t] if a.HasField("t") else ()
        yield from a.tensors
        for sparse in [*([a.sparse_tensor] if a.HasField("sparse_tensor") else ()), *a.sparse_tensors]:
            yield from (sparse.values, sparse.indices)
        for graph in [*([a.g] if a.HasField("g") else ()), *a.graphs]:
            yield from _graph_tensors(graph)


def model_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model: the graph's, its subgraphs' and its local functions'."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def check_external_data(model: onnx.ModelProto, rel: str, allowed: Callable[[str], bool], label: str) -> None:
    """BundleError unless each tensor of the bundle file `rel` that keeps its data in another file names
    (relative to `rel`'s folder) a bundle file that `allowed` accepts."""
    for t in model_tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL and not t.external_data:
            continue
        locations = [e.value for e in t.external_data if e.key == "location"]
        # one location, a bundle file beside it: with none or several, readers differ in which they take
        location = locations[0] if len(locations) == 1 else ", ".join(locations)
        if len(locations) != 1 or not _beside(rel, location, allowed):
            raise BundleError(f"{label}: '{rel}' keeps tensor '{t.name}' in an external file {location!r}, "
                              "which is not one of the bundle's files beside it; DeepJIT writes a bundle's ONNX "
                              "with its weights inline, and a bundle never chooses which local files are read")


def _beside(rel: str, location: str, allowed: Callable[[str], bool]) -> bool:
    """Whether `location`, relative to the bundle file `rel`'s folder, is a bundle file `allowed` accepts."""
    if not location or location.startswith("/") or "\\" in location:
        return False
    return allowed(posixpath.normpath(posixpath.join(posixpath.dirname(rel), location)))


# ----------------------------------------------------------------------------- spec
def check_data_folder(folder: Path | None, root: Path, label: str) -> None:
    """A bundle's spec validates on generated data or on a folder inside the bundle (resolved, so a link
    cannot lead out): it never makes validation read this machine's files."""
    if folder is None:
        return
    if not Path(folder).resolve().is_relative_to(Path(root).resolve()):
        raise BundleError(f"{label}: its spec.yaml's validation.data.folder '{folder}' is outside the bundle; "
                          "a bundle's spec validates on `random` data or on a folder inside the bundle "
                          "(name a folder of this machine with --data)")
