"""Graph surgery: cut regions out of the model so JIT kernels can replace them.

    plan = plan_from_model(model, spec.cuts)

A cut names its boundary tensors (or a preset finds them). Its region (regions.py) is every node on
a path from its outputs back to its inputs; constants (initializers, Constant nodes and what is
computed only from them) are copied into whichever piece needs them. What is left of the model
becomes engine segments, split wherever a cut sits in the middle. Each cut keeps the exact subgraph
it removed as the reference its kernel must match; stages added before/after the model (stages.py)
get reference graphs from references.py. Extraction is onnx.utils.Extractor's, over a shape-inferred
model.
"""
from __future__ import annotations

import graphlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnx.utils

from ..errors import SurgeryError
from ..graph.index import GraphIndex
from ..graph.serialize import pin_ir_version
from ..graph.shapes import canonical_dims, complete_value_info, infer_shapes
from ..graph.tensors import TensorSig, sig_from_value_info, value_info_map
from .plan import KernelSite, Plan, Segment, Step, _ops
from .regions import Region, check_overlaps, region_for_cut
from .stages import added_stages

log = logging.getLogger("deepjit.surgery")


def _schedule(idx: GraphIndex, regions: Sequence[Region]) -> dict[int, list]:
    """Slots in run order: even slots hold engine nodes, odd slots one cut each. Every unit (a plain
    node or a whole cut) goes to the earliest slot after everything it reads."""
    owner: dict[int, Any] = {}
    for k, r in enumerate(regions):
        owner.update({p: ("cut", k) for p in r.nodes})
    plain = [i for i, n in enumerate(idx.nodes)
             if i not in owner and not all(t in idx.const for t in idx.outs(i))]
    owner.update({p: ("node", p) for p in plain})

    def deps_of(names) -> set:
        return {owner[p] for n in names if n not in idx.const and (p := idx.producer(n)) is not None}

    deps = {("node", p): deps_of(idx.ins(p)) for p in plain}
    deps.update({("cut", k): deps_of(r.inputs) for k, r in enumerate(regions)})
    try:
        order = list(graphlib.TopologicalSorter(deps).static_order())
    except graphlib.CycleError as e:
        cycle = e.args[1]
        cut = next((regions[u[1]].name for u in cycle if u[0] == "cut"), "?")
        via = [idx.label(u[1]) for u in cycle if u[0] == "node"]
        raise SurgeryError(f"cut '{cut}' is not convex: its outputs flow through node '{via[0] if via else '?'}' "
                           "back into its inputs; widen the cut to include that path") from None
    slot: dict[Any, int] = {}
    taken: set[int] = set()
    for u in order:
        if u[0] == "node":
            slot[u] = max([slot[d] + (d[0] == "cut") for d in deps[u]], default=0)
        else:
            s = max([slot[d] + (1 if d[0] == "node" else 2) for d in deps[u]], default=1)
            while s in taken:  # two independent cuts: run them one after the other
                s += 2
            taken.add(s)
            slot[u] = s
    slots: dict[int, list] = {}
    for u in order:
        slots.setdefault(slot[u], []).append(u)
    return dict(sorted(slots.items()))


def _segment_io(idx: GraphIndex, members: set[int], later_reads: set[str]) -> tuple[list[str], list[str]]:
    ins: dict[str, int] = {}
    outs: dict[str, int] = {}
    for p in sorted(members):
        for t in idx.ins(p):
            q = idx.producer(t)
            if t not in idx.const and (q is None or q not in members):
                ins.setdefault(t, len(ins))
        for t in idx.outs(p):
            if t in idx.outputs or t in later_reads:
                outs.setdefault(t, len(outs))
    rank_in = {n: i for i, n in enumerate(idx.inputs)}
    rank_out = {n: i for i, n in enumerate(idx.outputs)}
    return (sorted(ins, key=lambda n: (rank_in.get(n, len(rank_in)), ins[n])),
            sorted(outs, key=lambda n: (rank_out.get(n, len(rank_out)), outs[n])))


# --- building the plan --------------------------------------------------------------------------


@dataclass(slots=True)
class _Piece:
    name: str
    inputs: list[str]
    outputs: list[str]
    region: Region | None


def _pieces(idx: GraphIndex, regions: Sequence[Region]) -> list[_Piece]:
    slots = _schedule(idx, regions)
    units = list(slots.items())
    pieces: list[_Piece] = []
    for n, (s, us) in enumerate(units):
        if s % 2:
            r = regions[us[0][1]]
            pieces.append(_Piece(r.name, list(r.inputs), list(r.outputs), r))
            continue
        members = {u[1] for u in us}
        later = {t for _, vs in units[n + 1:] for u in vs
                 for t in (regions[u[1]].inputs if u[0] == "cut" else idx.ins(u[1]))}
        ins, outs = _segment_io(idx, members, later)
        if not outs:
            log.debug("dropping %d nodes whose outputs nothing uses", len(members))
            continue
        pieces.append(_Piece("", ins, outs, None))
    segs = [p for p in pieces if p.region is None]
    for i, p in enumerate(segs):
        p.name = "segment" if len(segs) == 1 else f"segment_{i}"
    return pieces


def _extract(extractor: onnx.utils.Extractor, piece: _Piece, source: onnx.ModelProto) -> onnx.ModelProto:
    m = extractor.extract_model(piece.inputs, piece.outputs)
    m.graph.name = piece.name
    m.producer_name, m.producer_version = "deepjit", ""
    m.ir_version = source.ir_version
    return pin_ir_version(m)


def _with_shape_subs(model: onnx.ModelProto, subs: Mapping[int, str]) -> onnx.utils.Extractor:
    """An extractor over a copy of `model` whose Shape nodes in `subs` read their substitute."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for pos, name in subs.items():
        assert m.graph.node[pos].op_type == "Shape", "node positions must match GraphSurgeon's import order"
        m.graph.node[pos].input[0] = name
    return onnx.utils.Extractor(m)


def _sigs(infos: Mapping[str, onnx.ValueInfoProto], names: Sequence[str]) -> tuple[TensorSig, ...]:
    return tuple(sig_from_value_info(infos[n]) for n in names)


def plan_from_model(model: onnx.ModelProto, cuts: Sequence[Any], *, spec_dir: Path | None = None) -> Plan:
    """Cut `model` as `cuts` say; returns the pipeline's steps in run order. An added stage's kernel
    contract (by name, or a path relative to `spec_dir`) says which reference the stage gets."""
    t0 = time.perf_counter()
    cuts = list(cuts)
    _check_cut_names(cuts)
    inferred = infer_shapes(model)
    idx = GraphIndex(inferred)
    regions = [region_for_cut(idx, c) for c in cuts if c.add is None]
    check_overlaps(idx, regions)
    pieces = _pieces(idx, regions)
    taken = {c.name for c in cuts} & {p.name for p in pieces if p.region is None}
    if taken:
        raise SurgeryError(f"cut name '{sorted(taken)[0]}' is reserved for engine segments; rename the cut")

    names = [n for p in pieces for n in (*p.inputs, *p.outputs)] + idx.inputs + idx.outputs
    complete, missing = complete_value_info(inferred, names)
    if missing:
        owners = [p for p in pieces if missing[0] in (*p.inputs, *p.outputs)]
        owner = next((p for p in owners if p.region is not None), owners[0] if owners else None)
        where = (f"cut '{owner.name}'" if owner is not None and owner.region is not None
                 else f"segment '{owner.name}'" if owner is not None else "the model")
        raise SurgeryError(f"{where}: cannot infer the dtype and shape of tensor '{missing[0]}' (ONNX shape "
                           "inference and ONNX Runtime both failed); move the boundary to a tensor whose "
                           "type is known")
    # When ONNX inferred every boundary, `complete` is `inferred`: reuse the index's probe shapes.
    complete = canonical_dims(complete, names, idx.concrete_shapes if complete is inferred else None)
    extractor = onnx.utils.Extractor(complete)
    infos = value_info_map(complete)
    steps: list[Step] = []
    for p in pieces:
        subs = p.region.shape_subs if p.region is not None else {}
        m = _extract(_with_shape_subs(complete, subs) if subs else extractor, p, model)
        ins, outs = _sigs(infos, p.inputs), _sigs(infos, p.outputs)
        if p.region is None:
            steps.append(Segment(p.name, m, ins, outs))
        else:
            _verify(p.region, m)
            facts = {**p.region.facts, "inputs": [s.to_dict() for s in ins], "outputs": [s.to_dict() for s in outs],
                     "nodes": len(p.region.nodes), "ops": _ops(m)}
            steps.append(KernelSite(p.name, m, ins, outs, facts, tuple(p.region.cut.kernels)))
    plan_in = list(_sigs(infos, idx.inputs))
    plan_out = list(_sigs(infos, idx.outputs))
    before, after = added_stages(idx, cuts, plan_in, plan_out, spec_dir)
    plan = Plan((*before, *steps, *after), tuple(plan_in), tuple(plan_out))
    log.info("surgery: %d steps (%s) in %.2f s", len(plan.steps),
             ", ".join(f"{s.kind} '{s.name}'" for s in plan.steps), time.perf_counter() - t0)
    return plan


def _verify(region: Region, cut: onnx.ModelProto) -> None:
    """The preset's check that the subgraph cut out computes what it found (none for named tensors)."""
    if region.verify is not None:
        try:
            region.verify(cut)
        except SurgeryError as e:
            raise SurgeryError(f"cut '{region.name}': {e}") from None


def _check_cut_names(cuts: Sequence[Any]) -> None:
    seen = set()
    for c in cuts:
        if c.name in seen:
            raise SurgeryError(f"two cuts are named '{c.name}'; cut names must be unique")
        seen.add(c.name)
        if c.add is not None and c.add not in ("before", "after"):
            raise SurgeryError(f"cut '{c.name}': add must be 'before' or 'after', got {c.add!r}")
