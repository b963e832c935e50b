"""`deepjit inspect MODEL --suggest-cuts`: find the small-kernel wall.

A suggestion is a maximal connected region of cheap ops (data movement, elementwise math, softmax,
1x1 convs on a few channels) between the heavy ones (Conv, MatMul, Gemm, and anything else that is
not cheap). Each of its nodes is a launch TensorRT may not fuse, so regions rank by node count. A
region is only suggested if surgery could cut it as it stands (closed, convex, typed boundary).
"""
from __future__ import annotations

import graphlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import onnx
import yaml

from ..errors import SurgeryError
from ..graph.index import GraphIndex
from ..graph.shapes import infer_shapes
from .presets import PRESETS
from .regions import region_of

log = logging.getLogger("deepjit.suggest")

CHEAP_OPS = frozenset({
    # data movement and shape arithmetic
    "Reshape", "Transpose", "Slice", "Gather", "GatherElements", "GatherND", "Concat", "Split", "Squeeze",
    "Unsqueeze", "Flatten", "Expand", "Tile", "Identity", "Shape", "Size", "Cast", "Range", "ConstantOfShape",
    "Pad", "DepthToSpace", "SpaceToDepth", "Where",
    # elementwise
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Exp", "Log", "Abs", "Neg", "Reciprocal", "Min", "Max", "Clip",
    "Floor", "Ceil", "Round", "Sign", "Mod", "Erf", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
    "Not", "And", "Or", "Xor",
    # activations and small reductions
    "Relu", "LeakyRelu", "PRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Softplus", "Elu", "Selu", "Gelu",
    "Softmax", "LogSoftmax", "ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "ArgMax", "ArgMin",
})
HEAVY_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "MatMulInteger", "QLinearConv", "QLinearMatMul"})
# A 1x1 Conv this narrow is a small reduction, not a heavy op (the DFL's is 16 -> 1 channels).
SMALL_CONV_MAX_OUT, SMALL_CONV_MAX_IN = 4, 64


@dataclass(frozen=True, slots=True)
class Suggestion:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: int
    ops: dict[str, int]
    position: str            # "head" (reads a model input), "tail" (makes a model output) or "middle"
    preset: str | None = None  # a preset that finds exactly this boundary

    def yaml_snippet(self, name: str = "wall", contract: str | None = None) -> str:
        """A `cuts:` entry ready to paste into a spec."""
        cut: dict[str, Any] = {"name": name}
        if self.preset:
            cut["preset"] = self.preset
        else:
            cut["inputs"], cut["outputs"] = list(self.inputs), list(self.outputs)
        cut["kernels"] = [{"contract": contract or self.preset or "YOUR_KERNEL"}]
        text = yaml.safe_dump({"cuts": [cut]}, sort_keys=False, width=120)
        if self.preset:
            text = (f"# preset '{self.preset}' finds this boundary: {len(self.inputs)} inputs -> "
                    f"{', '.join(self.outputs)}\n") + text
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": list(self.inputs), "outputs": list(self.outputs), "nodes": self.nodes,
                "ops": dict(self.ops), "position": self.position, "preset": self.preset,
                "yaml": self.yaml_snippet()}


def _is_cheap(idx: GraphIndex, i: int) -> bool:
    node = idx.nodes[i]
    if node.op in CHEAP_OPS:
        return True
    if node.op == "Conv" and len(node.inputs) > 1:
        shape = getattr(node.inputs[1], "shape", None)
        return (shape is not None and len(shape) == 4 and tuple(shape[2:]) == (1, 1)
                and node.attrs.get("group", 1) == 1 and shape[0] <= SMALL_CONV_MAX_OUT and shape[1] <= SMALL_CONV_MAX_IN)
    return False


def _components(idx: GraphIndex, cheap: set[int]) -> list[set[int]]:
    """Connected cheap nodes. A Shape node's input is not a data edge: it joins its consumers only."""
    parent = {i: i for i in cheap}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in cheap:
        if idx.nodes[i].op == "Shape":
            continue
        for t in idx.ins(i):
            p = idx.producer(t)
            if p in cheap and t not in idx.const:
                parent[find(i)] = find(p)
    groups: dict[int, set[int]] = {}
    for i in cheap:
        groups.setdefault(find(i), set()).add(i)
    return list(groups.values())


def _depths(idx: GraphIndex, cheap: set[int]) -> dict[int, int]:
    """Most barrier (non-cheap) nodes on any path from the inputs to each node."""
    deps = {i: {p for t in idx.ins(i) if (p := idx.producer(t)) is not None} for i in range(len(idx.nodes))}
    depth: dict[int, int] = {}
    for i in graphlib.TopologicalSorter(deps).static_order():
        depth[i] = max((depth[p] + (p not in cheap) for p in deps[i]), default=0)
    return depth


def _convex(idx: GraphIndex, region: set[int]) -> bool:
    """No path leaves the region and comes back into it."""
    stack = [c for i in region for t in idx.outs(i) for c in idx.consumers(t) if c not in region]
    seen: set[int] = set()
    while stack:
        n = stack.pop()
        if n in region:
            return False
        if n in seen:
            continue
        seen.add(n)
        stack.extend(c for t in idx.outs(n) for c in idx.consumers(t))
    return True


def _split_by_depth(idx: GraphIndex, region: set[int], depth: dict[int, int]) -> list[set[int]]:
    """Pieces of a non-convex region whose nodes share a barrier depth (each is convex)."""
    pieces = []
    for d in sorted({depth[i] for i in region}):
        level = {i for i in region if depth[i] == d}
        pieces.extend(_components(idx, level))
    return pieces


def _boundary(idx: GraphIndex, region: set[int]) -> tuple[list[str], list[str]]:
    ins: dict[str, None] = {}
    outs: dict[str, None] = {}
    for i in sorted(region):
        if idx.nodes[i].op != "Shape":  # shape-only reads: surgery takes the shape from an input
            for t in idx.ins(i):
                if t not in idx.const and idx.producer(t) not in region:
                    ins[t] = None
        for t in idx.outs(i):
            if t in idx.outputs or any(c not in region for c in idx.consumers(t)):
                outs[t] = None
    return list(ins), list(outs)


def _as_cut(idx: GraphIndex, region: set[int]) -> tuple[list[str], list[str], frozenset[int]] | None:
    """The region's boundary if surgery accepts it; shape-only reads become inputs if it must."""
    ins, outs = _boundary(idx, region)
    if not outs or not ins:
        return None
    try:
        nodes, _ = region_of(idx, "suggestion", ins, outs)
    except SurgeryError:
        extra = [t for i in sorted(region) if idx.nodes[i].op == "Shape"
                 for t in idx.ins(i) if idx.producer(t) not in region and t not in ins]
        try:
            nodes, _ = region_of(idx, "suggestion", ins + list(dict.fromkeys(extra)), outs)
            ins = ins + list(dict.fromkeys(extra))
        except SurgeryError as e:
            log.debug("skipping a region of %d nodes: %s", len(region), e)
            return None
    return ins, outs, nodes


def suggest_cuts(model: onnx.ModelProto, *, min_nodes: int = 2) -> list[Suggestion]:
    """Regions of cheap ops worth a JIT kernel, most nodes first."""
    idx = GraphIndex(infer_shapes(model))
    cheap = {i for i in range(len(idx.nodes))
             if _is_cheap(idx, i) and not all(t in idx.const for t in idx.outs(i))}
    depth = None
    regions = []
    for comp in _components(idx, cheap):
        if _convex(idx, comp):
            regions.append(comp)
        else:
            depth = depth or _depths(idx, cheap)
            regions.extend(_split_by_depth(idx, comp, depth))
    presets = _preset_boundaries(idx)
    out = []
    for region in regions:
        if len(region) < min_nodes:
            continue
        cut = _as_cut(idx, region)
        if cut is None:
            continue
        ins, outs, nodes = cut
        if len(nodes) < min_nodes:
            continue
        position = "tail" if set(outs) & set(idx.outputs) else "head" if set(ins) & set(idx.inputs) else "middle"
        ops = dict(Counter(idx.nodes[i].op for i in nodes).most_common())
        preset, ins, outs = presets.get((frozenset(ins), frozenset(outs)), (None, ins, outs))
        out.append((len(nodes), max(nodes), Suggestion(tuple(ins), tuple(outs), len(nodes), ops, position, preset)))
    out.sort(key=lambda x: (-x[0], -x[1]))
    log.info("suggest: %d regions of cheap ops (largest %s nodes)", len(out), out[0][0] if out else 0)
    return [s for _, _, s in out]


def _preset_boundaries(idx: GraphIndex) -> dict[tuple[frozenset, frozenset], tuple[str, tuple, tuple]]:
    """Boundaries the presets find in this model (with the preset's input order)."""
    found = {}
    for name, finder in PRESETS.items():
        try:
            m = finder(idx)
        except SurgeryError:
            continue
        found[(frozenset(m.inputs), frozenset(m.outputs))] = (name, m.inputs, m.outputs)
    return found


def format_suggestions(suggestions: Sequence[Suggestion], top: int = 5, notes: Sequence[str] = ()) -> str:
    """Plain text for the terminal: boundary, node count, op mix, `notes[i]` (the network layers the cut
    removes, counted by the caller with a TensorRT parser) and the YAML to paste."""
    if not suggestions:
        return "no region of cheap ops worth a kernel was found"
    lines = []
    for n, s in enumerate(suggestions[:top], 1):
        mix = ", ".join(f"{op} x{c}" for op, c in s.ops.items())
        lines.append(f"{n}. {s.nodes} nodes at the {s.position}" + (f" (preset {s.preset})" if s.preset else ""))
        lines.append(f"   ops: {mix}")
        if n <= len(notes):
            lines.append(f"   {notes[n - 1]}")
        lines.append(f"   inputs:  {', '.join(s.inputs)}")
        lines.append(f"   outputs: {', '.join(s.outputs)}")
        lines.extend("   " + line for line in s.yaml_snippet(name=f"wall_{n}").rstrip().splitlines())
    return "\n".join(lines)
