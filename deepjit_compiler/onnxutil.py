"""Small ONNX helpers shared by surgery, presets, references and the reassembly check.

Shape inference runs ONNX's own first; what it misses (custom or contrib ops, data-dependent shapes)
is filled by ONNX Runtime: its symbolic shape inference, then, as a last resort, a run on random
inputs. Models are saved with a pinned IR version because the installed onnx writes IR versions that
older ONNX Runtime releases reject.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from .archive import atomic_write

log = logging.getLogger("deepjit.surgery")

# ONNX Runtime >= 1.18 (the oldest DeepJIT supports) reads IR version 10.
MAX_IR_VERSION = 10

Dim = int | str


@dataclass(frozen=True, slots=True)
class TensorSig:
    """A tensor at a stage boundary: its name, numpy dtype name and shape (ints or symbolic names)."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: Mapping) -> TensorSig:
        """The inverse of to_dict (a bundle manifest's tensor entries)."""
        return cls(d["name"], d["dtype"], tuple(d["shape"]))

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)


# --- saving -------------------------------------------------------------------------------------


def pin_ir_version(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with an IR version ONNX Runtime reads: the lowest its opsets allow, never above
    the model's own, capped at MAX_IR_VERSION."""
    model.ir_version = max(min_ir_version(model), min(model.ir_version or MAX_IR_VERSION, MAX_IR_VERSION))
    return model


def min_ir_version(model: onnx.ModelProto) -> int:
    """The lowest IR version that the model's default-domain opset allows."""
    opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    return helper.find_min_ir_version_for(opsets, ignore_unknown=True) if opsets else 3


def model_bytes(model: onnx.ModelProto) -> bytes:
    """Deterministic serialization (map fields sorted), so rebuilds write identical bytes."""
    return model.SerializeToString(deterministic=True)


def save_model(model: onnx.ModelProto, path: str | Path) -> Path:
    path = Path(path)
    atomic_write(path, model_bytes(pin_ir_version(model)))
    return path


# --- types and shapes ---------------------------------------------------------------------------


def np_dtype_name(elem_type: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def sig_from_value_info(vi: onnx.ValueInfoProto) -> TensorSig | None:
    """The tensor's signature, or None when its dtype or rank is unknown. Anonymous dims (no value,
    no name) get a name of their own so that the signature stays printable."""
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or t.elem_type == 0 or not t.HasField("shape"):
        return None
    dims: list[Dim] = []
    for i, d in enumerate(t.shape.dim):
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        else:
            dims.append(d.dim_param or f"{vi.name}:{i}")
    return TensorSig(vi.name, np_dtype_name(t.elem_type), tuple(dims))


def value_info_map(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    g = model.graph
    out = {vi.name: vi for vi in g.value_info}
    out.update({vi.name: vi for vi in g.input})
    out.update({vi.name: vi for vi in g.output})
    return out


def is_complete(vi: onnx.ValueInfoProto | None) -> bool:
    """Dtype and rank are known and every dim has a value or a name."""
    if vi is None or sig_from_value_info(vi) is None:
        return False
    return all(d.HasField("dim_value") or d.dim_param for d in vi.type.tensor_type.shape.dim)


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference with data propagation (so Reshape targets built from Shape ops resolve).
    A model ONNX cannot infer is returned as it is: ONNX Runtime fills in later."""
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as e:  # onnx raises InferenceError, ValidationError or RuntimeError
        log.warning("ONNX shape inference failed (%s); relying on ONNX Runtime", e)
        return model


def complete_value_info(model: onnx.ModelProto, names: Iterable[str]) -> tuple[onnx.ModelProto, list[str]]:
    """Make sure `names` have a dtype and a shape in `model.graph.value_info`: ONNX Runtime's symbolic
    shape inference first, then a run on random inputs. Returns the model and the names still unknown."""
    missing = _incomplete(model, dict.fromkeys(names))
    if not missing:
        return model, []
    log.debug("ONNX shape inference left %d boundary tensors incomplete: %s", len(missing), missing)
    model = _merge_infos(model, _ort_symbolic(model), missing)
    missing = _incomplete(model, missing)
    if missing:
        model = _merge_infos(model, _ort_run_infos(model, missing), missing)
        missing = _incomplete(model, missing)
    return model, missing


def _incomplete(model: onnx.ModelProto, names: Iterable[str]) -> list[str]:
    infos = value_info_map(model)
    return [n for n in names if not is_complete(infos.get(n))]


def _merge_infos(model: onnx.ModelProto, infos: Mapping[str, onnx.ValueInfoProto], names: Sequence[str]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph_io = {vi.name: vi for vi in (*out.graph.input, *out.graph.output)}
    by_name = {vi.name: vi for vi in out.graph.value_info}
    for name in names:
        new = infos.get(name)
        if new is None or sig_from_value_info(new) is None:
            continue
        target = graph_io.get(name) or by_name.get(name)
        if target is None:
            out.graph.value_info.append(new)
        else:
            target.type.CopyFrom(new.type)
    return out


def _ort_symbolic(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="deepjit-shapes-") as tmp:
        os.chdir(tmp)  # on failure it saves sym_shape_infer_temp.onnx into the working directory
        try:
            inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=False)
        except Exception as e:  # it raises bare Exceptions on ops it does not know
            log.debug("ONNX Runtime symbolic shape inference failed: %s", e)
            return {}
        finally:
            os.chdir(cwd)
    return value_info_map(inferred) if inferred is not None else {}


def _ort_run_infos(model: onnx.ModelProto, names: Sequence[str]) -> dict[str, onnx.ValueInfoProto]:
    """Dtype and shape of `names` from ONNX Runtime runs on random inputs. With symbolic inputs it runs
    twice at two sizes; a dim that changes between the runs stays symbolic."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in known)
    inputs = [vi for vi in probe.graph.input if vi.name not in {i.name for i in probe.graph.initializer}]
    symbolic = any(not d.HasField("dim_value") for vi in inputs for d in vi.type.tensor_type.shape.dim)
    try:
        sess = ort_session(probe)
        runs = [_run_once(sess, inputs, size) for size in ((1, 64), (2, 96))[: 2 if symbolic else 1]]
    except Exception as e:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
        log.debug("ONNX Runtime could not run the model to find shapes: %s", e)
        return {}
    out = {}
    for n in names:
        arrays = [r[n] for r in runs]
        if any(a.ndim != arrays[0].ndim for a in arrays):
            continue
        dims = [d if all(a.shape[i] == d for a in arrays) else f"{n}:{i}" for i, d in enumerate(arrays[0].shape)]
        out[n] = helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(arrays[0].dtype), dims)
    return out


def _run_once(sess, inputs, size: tuple[int, int]) -> dict[str, np.ndarray]:
    batch, other = size
    rng = np.random.default_rng(0)
    feed = {}
    for vi in inputs:
        dims = [d.dim_value if d.HasField("dim_value") else (batch if i == 0 else other)
                for i, d in enumerate(vi.type.tensor_type.shape.dim)]
        feed[vi.name] = random_array(rng, np_dtype_name(vi.type.tensor_type.elem_type), dims)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


# --- running ------------------------------------------------------------------------------------


def ort_session(model: onnx.ModelProto, *, threads: int = 0):
    """An ONNX Runtime CPU session with graph optimizations disabled: fusions would reorder float
    math and break bit-identity between a model and its pieces."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return ort.InferenceSession(model_bytes(pin_ir_version(m)), opts, providers=["CPUExecutionProvider"])


def random_array(rng: np.random.Generator, dtype: str, shape: Sequence[int],
                 low: float | None = None, high: float | None = None) -> np.ndarray:
    """Seeded random data of any tensor dtype: floats uniform in [low, high) (default [0, 1)),
    uint8 over its full range, other integers in [0, 10), bools fair."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        lo, hi = (0.0 if low is None else low), (1.0 if high is None else high)
        return rng.uniform(lo, hi, size=shape).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt == np.uint8:
        lo, hi = int(0 if low is None else low), int(256 if high is None else high)
        return rng.integers(lo, hi, size=shape, dtype=np.uint8)
    lo, hi = int(0 if low is None else low), int(10 if high is None else high)
    return rng.integers(lo, hi, size=shape).astype(dt)


# --- graph navigation ---------------------------------------------------------------------------


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
            static = all(s is not None and s.is_static for s in (self.sig(n) for n in self.inputs))
            sizes = _PROBE_SIZES[:1] if static else _PROBE_SIZES
            self._concrete = [concrete_shapes(self.model, batch=b, size=z) for b, z in sizes]
        return self._concrete

    def sig(self, name: str) -> TensorSig | None:
        vi = self.infos.get(name)
        return sig_from_value_info(vi) if vi is not None else None


def input_dim_values(model: onnx.ModelProto, *, batch: int = 1, size: int = 640) -> dict[str, int]:
    """A value for each symbolic input dim: the first axis gets `batch`, each other name its own
    value counting down from `size` in steps of 32 (so height and width cannot be mistaken)."""
    values: dict[str, int] = {}
    for vi in model.graph.input:
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if not d.HasField("dim_value"):
                key = d.dim_param or f"{vi.name}:{axis}"
                if key not in values:
                    values[key] = batch if axis == 0 else max(size - 32 * len(values), 32)
    return values


def concrete_shapes(model: onnx.ModelProto, *, batch: int = 1, size: int = 640) -> dict[str, tuple[int, ...]]:
    """Shapes of every tensor ONNX can infer once the inputs' symbolic dims take the values of
    input_dim_values(model, batch=batch, size=size)."""
    values = input_dim_values(model, batch=batch, size=size)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    for vi in m.graph.input:
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if not d.HasField("dim_value"):
                v = values[d.dim_param or f"{vi.name}:{axis}"]
                d.Clear()
                d.dim_value = v
    inferred = infer_shapes(m)
    out = {}
    for name, vi in value_info_map(inferred).items():
        sig = sig_from_value_info(vi)
        if sig is not None and sig.is_static:
            out[name] = sig.shape
    for t in inferred.graph.initializer:
        out[t.name] = tuple(t.dims)
    return out


_PROBE_SIZES = ((1, 640), (2, 384))


def canonical_dims(model: onnx.ModelProto, names: Iterable[str],
                   probe_shapes: Callable[[], Sequence[Mapping[str, tuple[int, ...]]]] | None = None
                   ) -> onnx.ModelProto:
    """Rename the symbolic dims of tensors `names` after the input dims they follow, so boundaries
    read ['batch', 64, 'height/8', 'width/8'] rather than ['unk__1', 64, 'unk__7', 'unk__8']: checked
    by ONNX shape inference at two input sizes, a dim equal to an input dim takes its name and one
    equal to it divided by a fixed k becomes 'name/k'. Other dims keep their names.

    `probe_shapes`: gives the model's concrete_shapes at those two sizes (GraphIndex.concrete_shapes
    of the same model, which caches them), so that the two shape inferences are not run again."""
    values = [input_dim_values(model, batch=b, size=z) for b, z in _PROBE_SIZES]
    if not values[0]:
        return model  # no symbolic input dim: nothing to name after
    shapes = probe_shapes() if probe_shapes is not None else None
    if shapes is None or len(shapes) != len(_PROBE_SIZES):
        shapes = [concrete_shapes(model, batch=b, size=z) for b, z in _PROBE_SIZES]
    probes = list(zip(values, shapes))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    infos = value_info_map(out)
    for name in dict.fromkeys(names):
        vi = infos.get(name)
        if vi is None or not vi.type.HasField("tensor_type"):
            continue
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                continue
            seen = [shapes.get(name) for _, shapes in probes]
            if any(s is None or len(s) <= axis for s in seen):
                continue
            new = _dim_name([s[axis] for s in seen], [v for v, _ in probes])
            if new is not None and new != d.dim_param:
                d.dim_param = new
    return out


def _dim_name(observed: list[int], values: list[dict[str, int]]) -> str | None:
    for key in values[0]:
        ref = [v[key] for v in values]
        if observed == ref:
            return key
        if all(o > 0 and r % o == 0 for o, r in zip(observed, ref)):
            ks = {r // o for o, r in zip(observed, ref)}
            if len(ks) == 1 and (k := ks.pop()) > 1:
                return f"{key}/{k}"
    return None
