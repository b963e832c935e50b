"""What an ONNX model is, at a glance: its IO, opset, op histogram and size (`deepjit describe`).

    info = describe_model("models/yolov8n.onnx")
    info.inputs[0]        # TensorSig(name='images', dtype='float32', shape=('batch', 3, 640, 640))
    json.dumps(info.to_dict())
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import onnx
from google.protobuf import json_format, text_format
from google.protobuf.message import DecodeError
from onnx import parser as onnx_parser
from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_model, uses_external_data

from ..errors import ModelError
from ..graph.tensors import TensorSig, all_graphs

# onnx.load reads a .json, .textproto or .onnxtxt file as that format, whose parsers raise these.
_TEXT_ERRORS = (json_format.ParseError, text_format.ParseError, onnx_parser.ParseError)
log = logging.getLogger("deepjit.modelinfo")

UNKNOWN_DIM = "?"  # a dim with neither a value nor a name


@dataclass(frozen=True, slots=True)
class ModelInfo:
    path: str | None
    producer: str
    ir_version: int
    opset: int  # of the default ONNX domain; 0 when the model imports none
    opsets: tuple[tuple[str, int], ...]  # every (domain, version), "" for the default domain
    inputs: tuple[TensorSig, ...]  # initializers listed as inputs (old IR) are left out
    outputs: tuple[TensorSig, ...]
    ops: tuple[tuple[str, int], ...]  # op histogram, most frequent first, ties by name
    parameter_count: int  # elements in all initializers, subgraphs included
    node_count: int  # nodes, subgraphs included
    metadata: tuple[tuple[str, str], ...]

    def op_histogram(self) -> Counter:
        return Counter(dict(self.ops))

    def to_dict(self) -> dict:
        """A JSON-ready dict (for `--json`), keys in a fixed order."""
        return {
            "path": self.path,
            "producer": self.producer,
            "ir_version": self.ir_version,
            "opset": self.opset,
            "opsets": dict(self.opsets),
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "ops": dict(self.ops),
            "parameter_count": self.parameter_count,
            "node_count": self.node_count,
            "metadata": dict(self.metadata),
        }

    def to_text(self) -> str:
        """A short human-readable summary."""
        def io(ts):
            return ", ".join(f"{t.name} {t.dtype}{'[?]' if t.shape is None else list(t.shape)}" for t in ts)
        lines = [
            f"model:      {self.path or '(in memory)'}",
            f"producer:   {self.producer or '?'}  (ir_version {self.ir_version}, opset {self.opset})",
            f"inputs:     {io(self.inputs)}",
            f"outputs:    {io(self.outputs)}",
            f"nodes:      {self.node_count}   parameters: {self.parameter_count:,}",
            "ops:        " + ", ".join(f"{op} {n}" for op, n in self.ops),
        ]
        return "\n".join(lines)


def external_data(model: onnx.ModelProto, path: Path) -> tuple[str, ...]:
    """The external data files `model` (read from `path`, without its data) names, relative to its
    folder, sorted; ModelError for a location outside that folder or a file that is missing."""
    locations = set()
    for g in all_graphs(model.graph):
        tensors = [*g.initializer, *(a.t for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR)]
        locations.update(ExternalDataInfo(t).location for t in tensors if uses_external_data(t))
    for loc in sorted(locations):
        parts = PurePosixPath(loc).parts
        if not loc or PurePosixPath(loc).is_absolute() or ".." in parts or "\\" in loc:
            raise ModelError(f"{path}: its external data location '{loc}' is outside the model's folder; "
                             "external data must sit beside the .onnx file")
        where = path.parent / loc
        if not where.is_file():
            state = "is not a file in" if where.exists() else "is missing from"
            raise ModelError(f"{path}: its weights are stored in '{loc}', which {state} {path.parent}: "
                             "copy it beside the model (ONNX external data)")
    return tuple(sorted(locations))


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Read an ONNX file with its external data; ModelError naming the file (or the missing data
    file) if it cannot be."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such ONNX model file")
    if not path.is_file():
        raise ModelError(f"{path}: is not a file; expected an ONNX model (.onnx)")
    try:
        model = onnx.load(str(path), load_external_data=False)
        if external_data(model, path):
            load_external_data_for_model(model, str(path.parent))
    except ModelError:
        raise
    except (DecodeError, *_TEXT_ERRORS, ValueError, RuntimeError, OSError, onnx.checker.ValidationError) as e:
        raise ModelError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from None
    # Protobuf parses some non-ONNX bytes (an empty file, for one) as an empty message.
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise ModelError(f"{path}: not an ONNX model (no ir_version or graph in the file)")
    newest = onnx.defs.onnx_opset_version()
    too_new = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx") and o.version > newest]
    if too_new:  # ONNX Runtime would refuse it deep inside a stage
        raise ModelError(f"{path}: opset {too_new[0]} is newer than this onnx knows (up to {newest}); export the "
                         f"model with opset {newest} or lower")
    log.debug("loaded %s (%d nodes)", path, len(model.graph.node))
    return model


def describe_model(model: onnx.ModelProto | str | os.PathLike) -> ModelInfo:
    """A ModelInfo for an in-memory model or an ONNX file."""
    path = None
    if not isinstance(model, onnx.ModelProto):
        path, model = str(model), load_model(model)
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    graphs = list(all_graphs(graph))
    ops = Counter(n.op_type for g in graphs for n in g.node)
    opsets = tuple(sorted((o.domain, o.version) for o in model.opset_import))
    default = [v for d, v in opsets if d in ("", "ai.onnx")]
    return ModelInfo(
        path=path,
        producer=f"{model.producer_name} {model.producer_version}".strip(),
        ir_version=model.ir_version,
        opset=default[0] if default else 0,
        opsets=opsets,
        inputs=tuple(tensor_info(v) for v in graph.input if v.name not in initializers),
        outputs=tuple(tensor_info(v) for v in graph.output),
        ops=tuple(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        parameter_count=sum(_numel(t.dims) for g in graphs for t in g.initializer)
        + sum(_numel(s.dims) for g in graphs for s in g.sparse_initializer),
        node_count=sum(len(g.node) for g in graphs),
        metadata=tuple((p.key, p.value) for p in model.metadata_props),
    )


def _numel(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def tensor_info(value: onnx.ValueInfoProto) -> TensorSig:
    """A graph input or output's name, numpy dtype name and dims ('?' for an anonymous one)."""
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        return TensorSig(value.name, kind or "unknown", None)
    tt = value.type.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or UNKNOWN_DIM)
                      for d in tt.shape.dim)
    return TensorSig(value.name, _dtype_name(tt.elem_type), shape)


def _dtype_name(elem_type: int) -> str:
    """numpy's name for an ONNX element type ('float32', 'int64'), else the ONNX name lowercased."""
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).name
    except (KeyError, TypeError, ValueError):
        return onnx.TensorProto.DataType.Name(elem_type).lower() if elem_type else "undefined"
