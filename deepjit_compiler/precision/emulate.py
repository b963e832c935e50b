"""The accuracy cost of a precision rewrite, measured on the CPU.

ORT's CPU provider cannot run the rewrites as they are: it has no bf16 Conv, and it runs fp16 Convs
in fp32 and drops the rounding between consecutive ones, which hides most of the fp16 error. So the
rewritten graph is measured through an fp32 twin (`emulate_in_fp32`) that rounds every fp16/bf16
tensor (Cast to the low type and back) exactly where the rewritten graph stores one, with ORT's graph
optimizations off (for the fp32 segment too) so nothing is fused away."""
from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import ModelError, closest
from ..graph.ort import ort_session
from .rewrite import LOW

log = logging.getLogger("deepjit.precision")


@dataclass(frozen=True, slots=True)
class OutputCost:
    """One output's error against fp32 (relative error as Polygraphy computes it: |a - b| / |ref|)."""

    name: str
    max_abs: float
    median_abs: float
    max_rel: float
    median_rel: float
    ref_max_abs: float  # the output's scale, to read the absolute errors against

    def to_dict(self) -> dict[str, float | str]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(frozen=True, slots=True)
class PrecisionCost:
    """The accuracy cost of a precision rewrite, per output, over `samples` inputs."""

    precision: str
    samples: int
    outputs: tuple[OutputCost, ...]

    def __getitem__(self, name: str) -> OutputCost:
        for o in self.outputs:
            if o.name == name:
                return o
        raise KeyError(f"no output '{name}'{closest(name, [o.name for o in self.outputs])}")

    def to_dict(self) -> dict:
        return {"precision": self.precision, "samples": self.samples, "outputs": [o.to_dict() for o in self.outputs]}

    def summary(self) -> str:
        return "; ".join(f"{o.name}: max abs {o.max_abs:.3g} (median {o.median_abs:.3g}), median rel "
                         f"{o.median_rel:.3g}, output scale {o.ref_max_abs:.3g}" for o in self.outputs)


def measure_cost(reference: onnx.ModelProto, rewritten: onnx.ModelProto,
                 feeds: Sequence[Mapping[str, np.ndarray]]) -> PrecisionCost:
    """Run `reference` (fp32) and `rewritten` on the CPU with ONNX Runtime over `feeds`, and report
    per output the max/median absolute and relative error of `rewritten` against `reference`."""
    if not feeds:
        raise ValueError("measure_cost needs at least one feed")
    # Both unoptimized: ORT's fusions (Conv+Activation...) reorder fp32 arithmetic, which is not
    # the precision's cost.
    ref = ort_session(reference)
    low = ort_session(emulate_in_fp32(rewritten))
    names = [o.name for o in ref.get_outputs()]
    missing = set(names) - {o.name for o in low.get_outputs()}
    if missing:
        raise ModelError(f"segment '{reference.graph.name}': the rewritten segment lacks outputs {sorted(missing)} "
                         "of the fp32 one")
    types = {i.name: i.type for i in low.get_inputs()}
    diffs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {n: [] for n in names}
    scale = dict.fromkeys(names, 0.0)
    for feed in feeds:
        expected = dict(zip(names, ref.run(names, dict(feed))))
        got = dict(zip(names, low.run(names, {k: _as_input(v, types[k]) for k, v in feed.items() if k in types})))
        for n in names:
            e, g = np.asarray(expected[n], np.float64), np.asarray(got[n], np.float64)
            absdiff = np.abs(g - e)
            ref_abs = np.where(e == 0, np.finfo(np.float64).eps, np.abs(e))  # Polygraphy's epsilon rule
            diffs[n].append((absdiff.ravel(), (absdiff / ref_abs).ravel()))
            scale[n] = max(scale[n], float(np.max(np.abs(e), initial=0.0)))
    outs = []
    for n in names:
        a = np.concatenate([d[0] for d in diffs[n]])
        r = np.concatenate([d[1] for d in diffs[n]])
        outs.append(OutputCost(n, _f(a.max(initial=0.0)), _f(np.median(a)), _f(r.max(initial=0.0)),
                               _f(np.median(r)), scale[n]))
    precision = next((p.value for p in rewritten.metadata_props if p.key == "deepjit.precision"), "rewritten")
    cost = PrecisionCost(precision, len(feeds), tuple(outs))
    log.info("%s cost against fp32 over %d samples: %s", precision, len(feeds), cost.summary())
    return cost


def _f(x) -> float:
    x = float(x)
    return x if math.isfinite(x) else float("inf")


_ORT_NP = {"tensor(float)": np.float32, "tensor(double)": np.float64}


def _as_input(value: np.ndarray, ort_type: str) -> np.ndarray:
    want = _ORT_NP.get(ort_type)
    return value.astype(want) if want is not None and value.dtype != want else value


def emulate_in_fp32(model: onnx.ModelProto) -> onnx.ModelProto:
    """An fp32 twin of `model` that ONNX Runtime's CPU provider runs: every fp16/bf16 tensor becomes
    fp32 rounded through its low type (Cast to it and back) where the model produces it, low
    weights become their exact fp32 values, low graph inputs/outputs become fp32. If/Loop/Scan bodies
    alike."""
    inferred = onnx.shape_inference.infer_shapes(model)
    return helper.make_model(_emulate_graph(inferred.graph, {}), opset_imports=list(inferred.opset_import),
                             ir_version=inferred.ir_version)


def _emulate_graph(g: onnx.GraphProto, outer: Mapping[str, str]) -> onnx.GraphProto:
    """`g`'s twin; `outer` renames the enclosing graphs' rounded inputs, which a body may read."""
    low = {vi.name: vi.type.tensor_type.elem_type for vi in (*g.input, *g.output, *g.value_info)
           if vi.type.tensor_type.elem_type in LOW}
    low.update({t.name: t.data_type for t in g.initializer if t.data_type in LOW})
    low.update({n.output[0]: a.i for n in g.node if n.op_type == "Cast" for a in n.attribute
                if a.name == "to" and a.i in LOW})  # even where shape inference gave up
    nodes: list[onnx.NodeProto] = []
    renamed = dict(outer)
    for vi in g.input:
        renamed.pop(vi.name, None)  # a body's own input hides an outer tensor of its name
        if vi.name in low:
            nodes += _round_trip(vi.name, vi.name + "__rt", low[vi.name])
            renamed[vi.name] = vi.name + "__rt"
    for node in g.node:
        node = copy.deepcopy(node)
        node.input[:] = [renamed.get(i, i) for i in node.input]
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in LOW:
                attr.t.CopyFrom(_as_fp32(attr.t))
            elif attr.name == "dtype" and attr.type == onnx.AttributeProto.INT and attr.i in LOW:
                attr.i = TensorProto.FLOAT
            elif node.op_type == "Cast" and attr.name == "to" and attr.i in LOW:
                attr.i = TensorProto.FLOAT  # the round trip right after does the rounding
            elif attr.type == onnx.AttributeProto.GRAPH:
                attr.g.CopyFrom(_emulate_graph(attr.g, renamed))
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for body in attr.graphs:
                    body.CopyFrom(_emulate_graph(body, renamed))
        tails = []
        for k, out in enumerate(node.output):
            if out in low:
                node.output[k] = out + "__raw"
                tails += _round_trip(out + "__raw", out, low[out])
        nodes += [node, *tails]
    return helper.make_graph(nodes, g.name, [_fp32_vi(vi) for vi in g.input], [_fp32_vi(vi) for vi in g.output],
                             [_as_fp32(t) if t.data_type in LOW else t for t in g.initializer])


def _round_trip(src: str, dst: str, low_type: int) -> list[onnx.NodeProto]:
    return [helper.make_node("Cast", [src], [dst + "__lp"], to=low_type, name=dst + "__to_low"),
            helper.make_node("Cast", [dst + "__lp"], [dst], to=TensorProto.FLOAT, name=dst + "__to_fp32")]


def _as_fp32(t: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


def _fp32_vi(vi: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    vi = copy.deepcopy(vi)
    if vi.type.tensor_type.elem_type in LOW:
        vi.type.tensor_type.elem_type = TensorProto.FLOAT
    return vi
