"""Regions: which nodes a cut removes, found from its boundary tensors (or a preset's).

    region = region_for_cut(idx, cut)

A cut's region is every node on a path from its outputs back to its inputs; it must be closed
(nothing outside reads a removed tensor except through the cut's outputs) and must not reach a
model input. A Shape node inside the cut that reads a tensor outside it reads a cut input with the
same dims instead. surgery.py schedules the regions and extracts the pieces.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from ..errors import SurgeryError, closest
from ..graph.index import GraphIndex, constant_value
from .presets import PRESETS

log = logging.getLogger("deepjit.surgery")

__all__ = ["Region", "check_overlaps", "region_for_cut", "region_of"]


@dataclass(frozen=True, slots=True)
class Region:
    """The nodes one cut removes, its boundary, and what its preset found."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: frozenset[int]  # positions of the non-constant nodes removed
    facts: Mapping[str, Any]
    cut: Any
    shape_subs: Mapping[int, str]  # Shape node position -> the cut input it reads instead
    verify: Callable[[onnx.ModelProto], None] | None = None  # the preset's check of the extracted cut


def _check_names(idx: GraphIndex, cut: str, role: str, names: Sequence[str] | None) -> tuple[str, ...]:
    if not names:
        raise SurgeryError(f"cut '{cut}': `{role}` is empty; list the tensor names at the cut's boundary")
    for n in names:
        if n not in idx.tensors:
            raise SurgeryError(f"cut '{cut}': tensor '{n}' is not in the model{closest(n, idx.tensors)}")
        if n in idx.const:
            raise SurgeryError(f"cut '{cut}': {role[:-1]} '{n}' is a constant; constants are copied into "
                               "the cut, list only computed tensors")
    dupes = [n for n, c in Counter(names).items() if c > 1]
    if dupes:
        raise SurgeryError(f"cut '{cut}': tensor '{dupes[0]}' is listed twice in `{role}`")
    return tuple(names)


def region_of(idx: GraphIndex, cut: str, inputs: Sequence[str], outputs: Sequence[str]) -> tuple[frozenset[int], dict[int, str]]:
    """Positions of the nodes between `outputs` and `inputs`, and for Shape nodes that read a tensor
    outside the cut, the cut input they read the same dims from. Raises if the cut is not closed."""
    ins = _check_names(idx, cut, "inputs", inputs)
    outs = _check_names(idx, cut, "outputs", outputs)
    both = set(ins) & set(outs)
    if both:
        raise SurgeryError(f"cut '{cut}': tensor '{sorted(both)[0]}' is both an input and an output")
    nodes: set[int] = set()
    reached: set[str] = set()
    shape_reads: list[tuple[int, str]] = []
    stack = [(o, None) for o in outs]
    while stack:
        name, via = stack.pop()
        if name in ins:
            reached.add(name)
            continue
        if name in idx.const:
            continue
        p = idx.producer(name)
        if p is None:
            where = f" (used by node '{idx.label(via)}')" if via is not None else ""
            raise SurgeryError(f"cut '{cut}' contains the model input '{name}'{where}: a cut must not "
                               f"reach a model input; add '{name}' to the cut's inputs or move its boundary")
        if p in nodes:
            continue
        nodes.add(p)
        if idx.nodes[p].op == "Shape" and idx.ins(p)[0] not in ins:
            shape_reads.append((p, idx.ins(p)[0]))  # only its shape is read: decided below
        else:
            stack.extend((i, p) for i in idx.ins(p))
    subs = {}
    for p, x in shape_reads:
        if idx.producer(x) not in nodes and x not in idx.const:
            subs[p] = _shape_substitute(idx, cut, p, x, ins)
    unused = [i for i in ins if i not in reached and i not in subs.values()]
    if unused:
        raise SurgeryError(f"cut '{cut}': input '{unused[0]}' does not lead to any of the cut's outputs "
                           f"{list(outs)}")
    for p in sorted(nodes):
        for t in idx.outs(p):
            if t in outs:
                continue
            if t in idx.outputs:
                raise SurgeryError(f"cut '{cut}' is not closed: '{t}' is removed but is a model output; "
                                   "add it to the cut's outputs")
            outside = [c for c in idx.consumers(t) if c not in nodes]
            if outside:
                raise SurgeryError(f"cut '{cut}' is not closed: '{t}' is removed but used by node "
                                   f"'{idx.label(outside[0])}' outside the cut; add '{t}' to the cut's outputs")
    return frozenset(nodes), subs


def _dims_read(idx: GraphIndex, shape_node: int, rank: int) -> set[int]:
    """Which dims of its input a Shape node's consumers use (all of them unless provably fewer)."""
    node = idx.nodes[shape_node]
    start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
    base = list(range(rank))[start:end]
    used: set[int] = set()
    for c in idx.consumers(idx.outs(shape_node)[0]):
        op = idx.nodes[c]
        vals = [constant_value(t) for t in op.inputs[1:]]
        if op.op == "Gather" and op.attrs.get("axis", 0) == 0 and vals and vals[0] is not None:
            used.update(base[int(i)] for i in np.ravel(vals[0]))
        elif op.op == "Slice" and len(vals) >= 2 and all(v is not None for v in vals[:2]) and \
                all(v is None or np.all(v == 0) for v in vals[2:3]) and all(np.all(v == 1) for v in vals[3:4] if v is not None):
            used.update(base[int(vals[0][0]):int(vals[1][0])])
        else:
            return set(base)
    return used


def _same_dims(shapes: dict[str, tuple[int, ...]], x: str, y: str, dims: set[int], rank: int) -> bool | None:
    """Whether x and y agree on `dims` in these concrete shapes; None when either has no shape of that rank."""
    sx, sy = shapes.get(x, ()), shapes.get(y, ())
    if len(sx) != rank or len(sy) != rank:
        return None
    return all(sx[d] == sy[d] for d in dims)


def _shape_substitute(idx: GraphIndex, cut: str, shape_node: int, x: str, ins: Sequence[str]) -> str:
    """A cut input whose dims equal `x`'s on every axis the Shape node's consumers read, checked at two
    input sizes (anchors need the feature map's H and W, which the head maps share) and, where both
    are known there, at odd dims too (a floor and a ceil of a stride agree at the two)."""
    sx = idx.sig(x)
    rank = len(sx.shape) if sx is not None else None
    dims = _dims_read(idx, shape_node, rank) if rank is not None else set()
    if rank is not None and dims:
        for y in ins:
            sy = idx.sig(y)
            if sy is None or len(sy.shape) != rank:
                continue
            if all(_same_dims(s, x, y, dims, rank) is True for s in idx.concrete_shapes()) \
                    and _same_dims(idx.odd_shapes(), x, y, dims, rank) is not False:
                log.info("cut '%s': %s reads the shape of '%s' outside the cut; it reads '%s' instead (same dims %s)",
                         cut, idx.label(shape_node), x, y, sorted(dims))
                return y
    raise SurgeryError(f"cut '{cut}': node '{idx.label(shape_node)}' reads the shape of '{x}', which is outside "
                       f"the cut, and no cut input has the same dims; add '{x}' to the cut's inputs")


def region_for_cut(idx: GraphIndex, cut) -> Region:
    """The region of a spec cut: its boundary from `inputs`/`outputs` or from its preset's finder."""
    if cut.preset is not None:
        finder = PRESETS.get(cut.preset)
        if finder is None:
            raise SurgeryError(f"cut '{cut.name}': unknown preset '{cut.preset}'{closest(cut.preset, PRESETS)}; "
                               f"presets: {sorted(PRESETS)}")
        try:
            match = finder(idx)
        except SurgeryError as e:
            raise SurgeryError(f"cut '{cut.name}': {e}") from None
        inputs, outputs, facts, verify = match.inputs, match.outputs, dict(match.facts), match.verify
    else:
        inputs, outputs, facts, verify = tuple(cut.inputs or ()), tuple(cut.outputs or ()), {}, None
    nodes, subs = region_of(idx, cut.name, inputs, outputs)
    if subs:
        facts["shape_reads"] = {idx.ins(p)[0]: y for p, y in sorted(subs.items())}
    return Region(cut.name, tuple(inputs), tuple(outputs), nodes, facts, cut, subs, verify)


def check_overlaps(idx: GraphIndex, regions: Sequence[Region]) -> None:
    """Raise if two cuts remove the same node."""
    for i, a in enumerate(regions):
        for b in regions[i + 1:]:
            shared = a.nodes & b.nodes
            if shared:
                raise SurgeryError(f"cuts '{a.name}' and '{b.name}' overlap: both contain node "
                                   f"'{idx.label(min(shared))}'")
