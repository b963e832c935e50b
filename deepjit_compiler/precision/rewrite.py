"""Precision as a graph transform on engine segments, and its accuracy cost against fp32.

TensorRT 11 removed the weak-typing builder flags (BuilderFlag.FP16/INT8/BF16, calibrators), so the
precision lives in the ONNX graph, and TensorRT builds the segment strongly typed:

- fp16: ONNX Runtime's `transformers.float16.convert_float_to_float16`, graph I/O kept fp32, the
  `keep_fp32` ops and nodes left in fp32 (plus ORT's own block list of ops without fp16 support);
- bf16: the same pass (it places the casts), then every float16 it produced retyped to bfloat16 with
  weights re-rounded from their fp32 values; ONNX has Conv and MaxPool in bfloat16 only from opset 22,
  so older segments are upgraded to 22 first, and ops without a bfloat16 schema stay fp32;
- int8: `onnxruntime.quantization.quantize_static`, Q/DQ format, symmetric int8 activations and
  per-channel symmetric int8 weights, fp32 bias (what TensorRT's explicit quantization takes), the
  `keep_fp32` nodes excluded, ranges from `calibration` (cached); see calibration.py.

`measure_cost` runs the fp32 segment and the rewritten one on the CPU with ONNX Runtime. ORT's CPU
provider cannot run the rewrites as they are: it has no bf16 Conv (the bf16 graph fails to load with
NOT_IMPLEMENTED), and it runs fp16 Convs in fp32 and drops the rounding between consecutive ones,
which hides most of the fp16 error. So the rewritten graph is measured through an fp32 twin
(`emulate_in_fp32`) that rounds every fp16/bf16 tensor (Cast to the low type and back) exactly where
the rewritten graph stores one, with ORT's graph optimizations off (for the fp32 segment too) so
nothing is fused away. int8 Q/DQ graphs run as they are, also unoptimized: fake quantization, as
the graph says. That is the error of the graph's own semantics (low-precision storage, fp32
arithmetic); a GPU that also multiplies in fp16 can add a little, TensorRT's fusions remove a little.
"""
from __future__ import annotations

import copy
import fnmatch
import logging
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper, version_converter
from onnx_graphsurgeon.logger import G_LOGGER
from onnxruntime.transformers.float16 import (
    DEFAULT_OP_BLOCK_LIST,
    convert_float_to_float16,
)

from ..errors import ModelError, SpecError, closest
from ..graph.ort import ort_session
from ..graph.tensors import all_graphs
from ..spec.models import PRECISIONS, calibration_problem
from . import calibration as cal

log = logging.getLogger("deepjit.precision")


LOW = {TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}
BF16_OPSET = 22  # first opset whose Conv, MaxPool, ConstantOfShape... accept bfloat16

# Entries are op types, exact node names, or fnmatch patterns over node names.
# The /model.22/ patterns are the ultralytics YOLOv8 Detect head's node names.
KEEP_FP32_REASONS: dict[str, str] = {
    "Softmax": "DFL: the expectation over 16 bins is multiplied by the stride (up to 32 px), so a "
               "1e-3 error in a bin probability becomes a visible box shift; exp and the sum also "
               "lose digits in fp16",
    "/model.22/dfl/*": "DFL expectation: the 1x1 Conv with weights 0..15 and its reshapes, same reason",
    "/model.22/Sub*": "dist2bbox: box corners in input pixels (up to 640), where fp16 spacing is 0.5 px",
    "/model.22/Add*": "dist2bbox: box corners and centres in input pixels, same reason",
    "/model.22/Div*": "dist2bbox: box centres in input pixels, same reason",
    "/model.22/Mul*": "grid units times stride: the final pixel coordinates, same reason",
    "TopK": "ranking: fp16 ties reorder candidates",
    "NonMaxSuppression": "IoU thresholds compared in fp16 flip keep/suppress decisions",
    "ReduceSum": "normalisation statistics: sums of squares overflow fp16 past 65504",
    "ReduceMean": "normalisation statistics: same reason",
}
DEFAULT_KEEP_FP32: tuple[str, ...] = tuple(KEEP_FP32_REASONS)


def apply_precision(model: onnx.ModelProto, precision: str, *, keep_fp32: Sequence[str] = DEFAULT_KEEP_FP32,
                    calibration: cal.CalibrationSettings | None = None) -> onnx.ModelProto:
    """`model` (an fp32 engine segment) rewritten to `precision`; graph inputs and outputs keep their
    types, the `keep_fp32` ops/nodes stay fp32. int8 needs `calibration`. Returns a new model."""
    if precision not in PRECISIONS:
        raise SpecError(f"engine.precision: must be one of {', '.join(PRECISIONS)}, got "
                        f"'{precision}'{closest(precision, PRECISIONS)}")
    model = copy.deepcopy(model)
    if precision == "fp32":
        return model
    problem = calibration_problem(precision, calibration)
    if problem:
        raise SpecError(f"engine.calibration: {problem}")
    ops, nodes = resolve_keep_fp32(model, keep_fp32)
    if precision == "int8":
        kept = nodes | {n.name for n in model.graph.node if n.op_type in ops}
        out = cal.quantize_int8(model, calibration, exclude=kept)
    else:
        out = _to_float16(model, ops, nodes) if precision == "fp16" else _to_bfloat16(model, ops, nodes)
        out = _fold_round_trips(out)
    # an opset upgrade (bf16) needs the IR version that goes with it; otherwise keep the model's own
    out.ir_version = max(out.ir_version, helper.find_min_ir_version_for(list(out.opset_import), ignore_unknown=True))
    # the model's own metadata: the fp16/bf16 fold (a graphsurgeon export) drops it from `out`
    helper.set_model_props(out, {**{p.key: p.value for p in model.metadata_props}, "deepjit.precision": precision})
    log.info("rewrote segment '%s' to %s (%d nodes kept fp32)", model.graph.name or "segment", precision,
             sum(1 for n in model.graph.node if n.op_type in ops or n.name in nodes))
    return out


def resolve_keep_fp32(model: onnx.ModelProto, keep_fp32: Sequence[str]) -> tuple[set[str], set[str]]:
    """(op types, node names) that `keep_fp32` names in `model`. An entry is an op type when ONNX
    has an op of that name, else a node name or an fnmatch pattern over node names."""
    ops, nodes, names = set(), set(), [n.name for g in all_graphs(model.graph) for n in g.node]
    for entry in keep_fp32:
        if onnx.defs.has(entry):
            ops.add(entry)
        else:
            nodes.update(fnmatch.filter(names, entry))
    return ops, nodes


def check_keep_fp32(models: Sequence[onnx.ModelProto], keep_fp32: Sequence[str]) -> None:
    """SpecError for a user's keep_fp32 entry that names no op type and matches no node in any segment;
    a warning for an op type no segment has (it may be inside a cut: its kernel replaced it)."""
    nodes = [n for m in models for g in all_graphs(m.graph) for n in g.node]  # If/Loop bodies' too
    names, ops = [n.name for n in nodes], {n.op_type for n in nodes}
    for i, entry in enumerate(keep_fp32):
        if not onnx.defs.has(entry) and not fnmatch.filter(names, entry):
            raise SpecError(f"engine.keep_fp32[{i}]: '{entry}' is neither an ONNX op type nor a node name "
                            f"(or pattern) of the engine segments{closest(entry, names)}")
        if onnx.defs.has(entry) and entry not in ops:
            log.warning("engine.keep_fp32[%d]: no engine segment has a %s node (one inside a cut is replaced "
                        "by its kernel): it keeps nothing in fp32", i, entry)


# -- fp16 / bf16 ----------------------------------------------------------------------------------

def _to_float16(model: onnx.ModelProto, ops: set[str], nodes: set[str]) -> onnx.ModelProto:
    # op_block_list replaces ORT's default list, so extend it rather than pass ours alone.
    blocked = set(DEFAULT_OP_BLOCK_LIST) | ops
    # The pass would infer the types itself (this same call, on a copy): infer once, for the check too.
    typed = onnx.shape_inference.infer_shapes(model)
    _type_kept_outputs(typed, blocked, nodes)
    out = convert_float_to_float16(typed, keep_io_types=True, disable_shape_infer=True,
                                   op_block_list=sorted(blocked), node_block_list=sorted(nodes))
    _casts_into_bodies(out)
    return out


_SHAPE_ONLY = {"Shape", "Size"}  # ops that read only their input's shape


def _type_kept_outputs(model: onnx.ModelProto, blocked: set[str], nodes: set[str]) -> None:
    """ORT's fp16 pass casts an fp32 node's output back to fp16 for the converted nodes that read it only
    where the output's type is known; an op ONNX has no schema for (com.microsoft's Gelu, say) leaves it
    untyped, and the pass would hand those readers fp32: an invalid model. ONNX Runtime knows those ops,
    so their types come from a session of the segment and go into `model`'s value_info (a float output
    is then cast, an integer one left alone). ModelError naming the node where it cannot tell (an op it
    does not know, or a tensor inside an If/Loop body). `model` is shape-inferred already."""
    graphs = list(all_graphs(model.graph))
    typed = {v.name for g in graphs for v in (*g.input, *g.output, *g.value_info)}
    readers: dict[str, list[str]] = {}
    for n in (n for g in graphs for n in g.node if n.op_type not in blocked and n.name not in nodes):
        if n.op_type in _SHAPE_ONLY:  # reads any dtype: fp32 is as good as fp16 there
            continue
        for i in n.input:
            readers.setdefault(i, []).append(n.name or n.op_type)
    untyped = {o: n for g in graphs for n in g.node if n.op_type in blocked or n.name in nodes
               for o in n.output if o and o not in typed and o in readers}
    if not untyped:
        return
    top = {o for n in model.graph.node for o in n.output}
    found, why = _ort_types(model, [o for o in untyped if o in top])
    for name, elem in found.items():
        model.graph.value_info.append(helper.make_tensor_value_info(name, elem, None))
    for o, n in untyped.items():
        if o not in found:
            op = f"{n.domain}.{n.op_type}" if n.domain else n.op_type
            because = why if o in top else "it is inside an If/Loop body, where ONNX Runtime is not asked"
            raise ModelError(f"segment '{model.graph.name}': node '{n.name}' ({op}) stays fp32, but neither ONNX nor "
                             f"ONNX Runtime gives a type for its output '{o}' ({because}), so the rewrite cannot "
                             f"cast it back for the nodes that read it ({', '.join(readers[o])}): keep them in fp32 "
                             "too (engine.keep_fp32) or build this engine in fp32")


def _ort_types(model: onnx.ModelProto, names: list[str]) -> tuple[dict[str, int], str]:
    """The element types ONNX Runtime infers for main-graph tensors `names` (as extra graph outputs of a
    CPU session: loading resolves every node's types, nothing runs), and why any are missing."""
    if not names:
        return {}, ""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    try:
        outputs = ort_session(probe).get_outputs()
    except Exception as e:  # ORT raises its own Fail/InvalidGraph/NotImplemented per problem
        return {}, f"ONNX Runtime cannot load it: {str(e).splitlines()[0][:300]}"
    types = {o.name: o.type for o in outputs if o.name in names}
    found = {n: _ORT_TYPES[t] for n, t in types.items() if t in _ORT_TYPES}
    return found, "ONNX Runtime infers no tensor type for it"


# ONNX Runtime's type strings ("tensor(float)") -> ONNX element types
_ORT_TYPES = {f"tensor({name.lower()})": elem for name, elem in TensorProto.DataType.items() if elem}


def _casts_into_bodies(model: onnx.ModelProto) -> None:
    """ORT's fp16 pass puts the Casts around a blocked node of an If/Loop/Scan body in the main graph,
    where the body's tensors they read do not exist (an invalid model): move each such Cast into the
    body that makes its input (`_fold_round_trips` sorts the bodies after). Casts of main-graph tensors
    stay: a body may read them from there. The types it records for body tensors (the blocked node's
    renamed outputs, the Casts') go into their bodies too: gs reads a body's types from the body only.
    (A body's tensor name is never a main-graph one: ONNX forbids a body to shadow an outer name.)"""
    top = model.graph
    makers = {o: g for g in list(all_graphs(top))[1:] for n in g.node for o in n.output}
    moving = True
    while moving:  # a Cast may read another's output (fp16 -> fp32 -> fp16 around two blocked nodes)
        moving = [n for n in top.node if n.op_type == "Cast" and n.input[0] in makers]
        for cast in moving:
            top.node.remove(cast)
            body = makers[cast.input[0]]
            body.node.append(cast)
            makers[cast.output[0]] = body
    for vi in [vi for vi in top.value_info if vi.name in makers]:  # else gs sees two tensors of one name
        top.value_info.remove(vi)
        makers[vi.name].value_info.append(vi)


def _to_bfloat16(model: onnx.ModelProto, ops: set[str], nodes: set[str]) -> onnx.ModelProto:
    opset = _opset(model)
    if opset < BF16_OPSET:
        try:
            model = version_converter.convert_version(model, BF16_OPSET)
        except Exception as e:  # the converter raises bare RuntimeErrors/ValueErrors per op
            raise ModelError(f"segment '{model.graph.name}': bf16 needs ONNX opset {BF16_OPSET} (Conv takes "
                             f"bfloat16 from there); upgrading the segment from opset {opset} failed: {e}") from None
    opset = max(opset, BF16_OPSET)
    graphs = list(all_graphs(model.graph))  # If/Loop bodies too: the fp16 pass converts them
    no_bf16 = {n.op_type for g in graphs for n in g.node if not _has_bf16(n.op_type, opset, n.domain)}
    # fp32 originals by initializer name, and Constant values by the tensor the node makes (node names
    # may be empty or repeated, tensor names are unique): bf16 keeps fp32's range, so weights are
    # rounded from these rather than from their fp16 (range-clamped) copies.
    originals = {t.name: t for g in graphs for t in g.initializer}
    originals.update({n.output[0]: a.t for g in graphs for n in g.node if n.output for a in n.attribute
                      if a.type == onnx.AttributeProto.TENSOR})
    fp16 = _to_float16(model, ops | no_bf16, nodes)
    for g in all_graphs(fp16.graph):
        _retype_graph(g, originals)
    return fp16


def _has_bf16(op_type: str, opset: int, domain: str) -> bool:
    """Whether the op's schema at `opset` takes bfloat16 wherever it takes float (ops without float
    inputs, e.g. Shape's outputs, pass trivially)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return False
    floaty = [tc.allowed_type_strs for tc in schema.type_constraints if "tensor(float)" in tc.allowed_type_strs]
    return all("tensor(bfloat16)" in allowed for allowed in floaty)


def _retype_graph(graph: onnx.GraphProto, originals: Mapping[str, onnx.TensorProto]) -> None:
    """float16 -> bfloat16 everywhere in the graph (not its subgraphs) the fp16 pass put it; weights
    re-rounded from fp32."""
    for vi in (*graph.input, *graph.output, *graph.value_info):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT16:
            vi.type.tensor_type.elem_type = TensorProto.BFLOAT16
    for t in graph.initializer:
        if t.data_type == TensorProto.FLOAT16:
            t.CopyFrom(_as_bf16(t, originals.get(t.name)))
    for node in graph.node:
        for attr in node.attribute:
            if attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT and attr.i == TensorProto.FLOAT16:
                attr.i = TensorProto.BFLOAT16
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT16:
                attr.t.CopyFrom(_as_bf16(attr.t, originals.get(node.output[0]) if node.output else None))


def _as_bf16(t: onnx.TensorProto, original: onnx.TensorProto | None) -> onnx.TensorProto:
    src = original if original is not None and original.data_type == TensorProto.FLOAT else t
    values = numpy_helper.to_array(src).astype(np.float32)
    return numpy_helper.from_array(values.astype(ml_dtypes.bfloat16), t.name)


def _fold_round_trips(model: onnx.ModelProto) -> onnx.ModelProto:
    """Cast(fp32 -> low) -> Cast(-> fp32), which the fp16 pass leaves between two fp32 ops (the DFL
    Softmax and its Conv, a kept op and a graph output), becomes an Identity of the fp32 value: the
    rounding helps nothing there. A Cast to the type its input already has (a segment output stored
    in the engine's dtype, once its producer is fp16) goes: the producer makes the output itself.
    Both in If/Loop bodies too. Then topologically sort (TensorRT's parser needs it)."""
    with G_LOGGER.suppress(G_LOGGER.ERROR):  # gs warns that numpy lacks bfloat16; types are kept
        graph = gs.import_onnx(model)
    for g in (graph, *graph.subgraphs(recursive=True)):
        for node in list(g.nodes):
            _drop_if_no_op_cast(g, node)
        for node in g.nodes:
            _fold_round_trip(node)
    graph.cleanup().toposort()
    with G_LOGGER.suppress(G_LOGGER.ERROR):
        return gs.export_onnx(graph, do_type_check=False)


def _fold_round_trip(node: gs.Node) -> None:
    if node.op != "Cast" or node.attrs.get("to") != TensorProto.FLOAT:
        return
    mid = node.inputs[0]
    if len(mid.inputs) != 1 or mid.inputs[0].op != "Cast" or mid.inputs[0].attrs.get("to") not in LOW:
        return
    src = mid.inputs[0].inputs[0]
    if src.dtype == np.float32:
        node.op, node.attrs, node.inputs = "Identity", {}, [src]


def _drop_if_no_op_cast(graph: gs.Graph, node: gs.Node) -> None:
    if node.op != "Cast" or len(node.inputs) != 1 or not isinstance(node.inputs[0], gs.Variable):
        return
    mid, out = node.inputs[0], node.outputs[0]
    if len(mid.inputs) != 1 or len(mid.outputs) != 1 or mid in graph.outputs or mid.dtype is None:
        return
    try:
        same = np.dtype(helper.tensor_dtype_to_np_dtype(node.attrs.get("to"))) == np.dtype(mid.dtype)
    except (TypeError, KeyError, ValueError):
        return
    if same:
        producer = mid.inputs[0]
        node.outputs.clear()
        producer.outputs[producer.outputs.index(mid)] = out


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
