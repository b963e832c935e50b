"""Graph navigation over GraphSurgeon: constants, producers and consumers, computed once per model."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .shapes import ODD_PROBE, PROBE_SIZES, concrete_shapes
from .tensors import TensorSig, sig_from_value_info, value_info_map


def import_graph(model: onnx.ModelProto) -> gs.Graph:
    """The model as a GraphSurgeon graph, used for navigation only (never exported back)."""
    return gs.import_onnx(model)


def constant_value(t: gs.Tensor) -> np.ndarray | None:
    """The value of an initializer or of a Constant node's output; None for anything computed."""
    if isinstance(t, gs.Constant):
        return np.asarray(t.values)
    if len(t.inputs) == 1 and t.inputs[0].op == "Constant":
        attrs = t.inputs[0].attrs
        v = attrs.get("value")
        if isinstance(v, gs.Constant):
            return np.asarray(v.values)
        for key, dt in (("value_float", np.float32), ("value_int", np.int64)):
            if key in attrs:
                return np.asarray(attrs[key], dt)
        for key, dt in (("value_floats", np.float32), ("value_ints", np.int64)):
            if key in attrs:
                return np.asarray(list(attrs[key]), dt)
    return None


def constant_tensors(graph: gs.Graph) -> set[str]:
    """Names of tensors that depend on no graph input: initializers, Constant outputs and anything
    computed only from those. Such tensors can be copied into every piece that needs them."""
    const = {name for name, t in graph.tensors().items() if isinstance(t, gs.Constant)}
    changed = True
    while changed:  # fixpoint: does not rely on the node list being sorted
        changed = False
        for node in graph.nodes:
            if node.outputs and node.outputs[0].name not in const and all(
                    i.name in const or i.is_empty() for i in node.inputs) and not _has_subgraph(node) \
                    and node.op not in _RANDOM_OPS:
                const.update(o.name for o in node.outputs)
                changed = True
    return const


_RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                         "Bernoulli"})


def _has_subgraph(node: gs.Node) -> bool:
    return any(isinstance(v, gs.Graph) for v in node.attrs.values())


def node_label(node: gs.Node, index: int) -> str:
    return node.name or f"#{index} ({node.op})"


class GraphIndex:
    """A model's GraphSurgeon graph with node positions, producers, consumers and constant tensors
    worked out once. Nodes are keyed by position: gs.Node compares by value and is unhashable."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = import_graph(model)
        self.nodes: list[gs.Node] = list(self.graph.nodes)
        self._pos = {id(n): i for i, n in enumerate(self.nodes)}
        self.tensors: dict[str, gs.Tensor] = self.graph.tensors()
        self.const = constant_tensors(self.graph)
        self.inputs = [t.name for t in self.graph.inputs if not isinstance(t, gs.Constant)]
        self.outputs = [t.name for t in self.graph.outputs]
        self.infos = value_info_map(model)
        self._concrete: list[dict[str, tuple[int, ...]]] | None = None
        self._odd: dict[str, tuple[int, ...]] | None = None

    def pos(self, node: gs.Node) -> int:
        return self._pos[id(node)]

    def producer(self, name: str) -> int | None:
        t = self.tensors.get(name)
        return self.pos(t.inputs[0]) if t is not None and t.inputs else None

    def consumers(self, name: str) -> list[int]:
        t = self.tensors.get(name)
        return [self.pos(n) for n in t.outputs] if t is not None else []

    def ins(self, i: int) -> list[str]:
        """Names of node i's non-empty inputs."""
        return [t.name for t in self.nodes[i].inputs if not t.is_empty()]

    def outs(self, i: int) -> list[str]:
        return [t.name for t in self.nodes[i].outputs if not t.is_empty()]

    def label(self, i: int) -> str:
        return node_label(self.nodes[i], i)

    def concrete_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """Concrete shapes at two input sizes (one when the inputs are static), computed once."""
        if self._concrete is None:
            sizes = PROBE_SIZES[:1] if self._static_inputs() else PROBE_SIZES
            self._concrete = [concrete_shapes(self.model, batch=b, size=z) for b, z in sizes]
        return self._concrete

    def odd_shapes(self) -> dict[str, tuple[int, ...]]:
        """Concrete shapes at ODD_PROBE (empty when the inputs are static), computed once. A model that
        takes no odd size leaves the tensors past the failure out."""
        if self._odd is None:
            b, z = ODD_PROBE
            self._odd = {} if self._static_inputs() else concrete_shapes(self.model, batch=b, size=z)
        return self._odd

    def _static_inputs(self) -> bool:
        return all(s is not None and s.is_static for s in (self.sig(n) for n in self.inputs))

    def sig(self, name: str) -> TensorSig | None:
        vi = self.infos.get(name)
        return sig_from_value_info(vi) if vi is not None else None
