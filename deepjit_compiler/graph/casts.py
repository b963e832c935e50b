"""Retyping the tensors at a model's boundary: outputs stored in another float dtype, inputs taken in
one, and an inner tensor rounded through one (what a typed boundary does to the values that cross it).

Each helper returns a new model and keeps every tensor name: the value a boundary tensor had before
is renamed `<name>__<its dtype>` inside the graph, and a Cast makes the boundary tensor from it.
"""
from __future__ import annotations

from collections.abc import Mapping

import onnx
from onnx import TensorProto, helper

from .tensors import np_dtype_name

FLOAT_TYPES: Mapping[str, int] = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
                                  "bfloat16": TensorProto.BFLOAT16, "float64": TensorProto.DOUBLE}


def cast_outputs(model: onnx.ModelProto, dtypes: Mapping[str, str]) -> onnx.ModelProto:
    """`model` whose graph outputs named in `dtypes` are stored in that dtype (cast where they are
    made; nodes inside the graph that read them keep reading the value in its own dtype)."""
    m = _copy(model)
    g = m.graph
    _check_all_found(dtypes, [o.name for o in g.output], "output")
    for out in g.output:
        if out.name not in dtypes:
            continue
        _producer(g, out.name)
        own = out.type.tensor_type.elem_type
        inner = _inner_name(m, out.name, own)
        _rename_uses(g, out.name, inner, outputs=True)
        g.node.append(_cast(inner, out.name, FLOAT_TYPES[dtypes[out.name]]))
        out.type.tensor_type.elem_type = FLOAT_TYPES[dtypes[out.name]]
    _drop_value_info(g, dtypes)
    return m


def cast_inputs(model: onnx.ModelProto, dtypes: Mapping[str, str]) -> onnx.ModelProto:
    """`model` whose graph inputs named in `dtypes` take that dtype (cast to their own dtype before
    the first node reads them)."""
    m = _copy(model)
    g = m.graph
    _check_all_found(dtypes, [i.name for i in g.input], "input")
    casts = []
    for inp in g.input:
        if inp.name not in dtypes:
            continue
        own = inp.type.tensor_type.elem_type
        inner = _inner_name(m, inp.name, own)
        _rename_uses(g, inp.name, inner, outputs=False)
        casts.append(_cast(inp.name, inner, own))
        inp.type.tensor_type.elem_type = FLOAT_TYPES[dtypes[inp.name]]
    _drop_value_info(g, dtypes)
    nodes = [*casts, *g.node]
    del g.node[:]
    g.node.extend(nodes)
    return m


def round_through(model: onnx.ModelProto, dtypes: Mapping[str, str], own: Mapping[str, str]) -> onnx.ModelProto:
    """`model` in which each inner tensor named in `dtypes` is made in that dtype under its own name
    (Cast where it is produced) and read back in its own dtype (`own[name]`) by the nodes that used
    it: the values a pipeline has when that tensor crosses a boundary stored in that dtype."""
    m = _copy(model)
    g = m.graph
    _check_dtypes(dtypes)  # each on its own: merged, own[name] hid dtypes[name] (always the same names)
    _check_dtypes(own)
    for name, dtype in dtypes.items():
        at = _producer(g, name)
        inner, back = _inner_name(m, name, own[name]), f"{name}__{own[name]}_back"
        _rename_uses(g, name, back, outputs=False)
        g.node[at].output[:] = [inner if o == name else o for o in g.node[at].output]
        # right after the node that makes it, so the graph stays in topological order
        casts = [_cast(inner, name, FLOAT_TYPES[dtype]), _cast(name, back, FLOAT_TYPES[own[name]])]
        nodes = [*g.node[:at + 1], *casts, *g.node[at + 1:]]
        del g.node[:]
        g.node.extend(nodes)
        for out in g.output:  # a graph output shows the stored value
            if out.name == name and out.type.tensor_type.elem_type:
                out.type.tensor_type.elem_type = FLOAT_TYPES[dtype]
    _drop_value_info(g, dtypes)
    return m


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def _cast(src: str, dst: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [src], [dst], to=to, name=f"{dst}/cast")


def _inner_name(model: onnx.ModelProto, name: str, dtype: int | str) -> str:
    inner = f"{name}__{dtype if isinstance(dtype, str) else np_dtype_name(dtype)}"
    g = model.graph
    taken = {t for n in g.node for t in (*n.input, *n.output)} | {t.name for t in g.initializer}
    if inner in taken:
        raise ValueError(f"cannot retype '{name}': the graph already has a tensor named '{inner}'")
    return inner


def _rename_uses(g: onnx.GraphProto, old: str, new: str, *, outputs: bool) -> None:
    """Nodes read `new` where they read `old`; with `outputs`, the node that makes `old` makes `new`."""
    for n in g.node:
        n.input[:] = [new if i == old else i for i in n.input]
        if outputs:
            n.output[:] = [new if o == old else o for o in n.output]


def _producer(g: onnx.GraphProto, name: str) -> int:
    at = next((k for k, n in enumerate(g.node) if name in n.output), None)
    if at is None:
        raise ValueError(f"cannot retype '{name}': no node of graph '{g.name}' makes it")
    return at


def _check_all_found(dtypes: Mapping[str, str], names: list[str], what: str) -> None:
    missing = sorted(set(dtypes) - set(names))
    if missing:
        raise ValueError(f"no graph {what} named '{missing[0]}'; {what}s: {', '.join(names)}")
    _check_dtypes(dtypes)


def _check_dtypes(dtypes: Mapping[str, str]) -> None:
    bad = sorted(d for d in dtypes.values() if d not in FLOAT_TYPES)
    if bad:
        raise ValueError(f"cannot store a tensor as '{bad[0]}': only {', '.join(FLOAT_TYPES)}")


def _drop_value_info(g: onnx.GraphProto, names) -> None:
    """Stale value infos of the retyped names (their dtype changed); shape inference recomputes them."""
    keep = [vi for vi in g.value_info if vi.name not in names]
    del g.value_info[:]
    g.value_info.extend(keep)
