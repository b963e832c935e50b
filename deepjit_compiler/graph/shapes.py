"""Tensor shapes: ONNX's shape inference, completed by ONNX Runtime, and symbolic dims named after
the input dims they follow.

ONNX's own inference runs first; what it misses (custom or contrib ops, data-dependent shapes) is
filled by ONNX Runtime: its symbolic shape inference, then, as a last resort, a run on random inputs.
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from .ort import ort_session, random_array
from .tensors import is_complete, np_dtype_name, sig_from_value_info, value_info_map

log = logging.getLogger("deepjit.surgery")


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference with data propagation (so Reshape targets built from Shape ops resolve).
    A model ONNX cannot infer is returned as it is: ONNX Runtime fills in later. Inference runs on the
    model's weightless skeleton (a 44 MB model is then not serialized for it) and what it found is
    copied into a copy of the model."""
    try:
        found = onnx.shape_inference.infer_shapes(shape_skeleton(model, value_info=True), check_type=False,
                                                  strict_mode=False, data_prop=True)
    except Exception as e:  # onnx raises InferenceError, ValidationError or RuntimeError
        log.warning("ONNX shape inference failed (%s); relying on ONNX Runtime", e)
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    out.graph.value_info.extend(found.graph.value_info)
    for mine, inferred in zip(out.graph.output, found.graph.output):
        mine.CopyFrom(inferred)
    return out


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


# --- naming dims ---------------------------------------------------------------------------------


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
    m = shape_skeleton(model)  # no value_info, and no weights to copy: they are typed inputs there
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


PROBE_SIZES = ((1, 640), (2, 384))
# Odd dims (321, 289, ...): PROBE_SIZES' dims are all multiples of 32, so a stride's floor and ceil
# (MaxPool's ceil_mode, a padded strided Conv) agree at both; here they can differ.
ODD_PROBE = (3, 321)


def canonical_dims(model: onnx.ModelProto, names: Iterable[str],
                   probe_shapes: Callable[[], Sequence[Mapping[str, tuple[int, ...]]]] | None = None
                   ) -> onnx.ModelProto:
    """Rename the symbolic dims of tensors `names` after the input dims they follow, so boundaries
    read ['batch', 64, 'height/8', 'width/8'] rather than ['unk__1', 64, 'unk__7', 'unk__8']: checked
    by ONNX shape inference at two input sizes, a dim equal to an input dim takes its name and one
    equal to it divided by a fixed k becomes 'name/k'. Other dims keep their names.

    `probe_shapes`: gives the model's concrete_shapes at those two sizes (GraphIndex.concrete_shapes
    of the same model, which caches them), so that the two shape inferences are not run again."""
    values = [input_dim_values(model, batch=b, size=z) for b, z in PROBE_SIZES]
    if not values[0]:
        return model  # no symbolic input dim: nothing to name after
    shapes = probe_shapes() if probe_shapes is not None else None
    if shapes is None or len(shapes) != len(PROBE_SIZES):
        shapes = [concrete_shapes(model, batch=b, size=z) for b, z in PROBE_SIZES]
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


# --- which input sizes a model takes -------------------------------------------------------------

_WEIGHTS_BYTES = 4096  # initializers larger than this are weights, not shape constants


def shape_skeleton(model: onnx.ModelProto, *, value_info: bool = False) -> onnx.ModelProto:
    """`model` for shape inference only: its weights become typed graph inputs (their shapes are all
    inference needs), so checking a 44 MB model at several input sizes copies none of its weights.
    `value_info`: keep what the model already says about its tensors."""
    out = onnx.ModelProto()
    out.ir_version = model.ir_version
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    g = out.graph
    g.name = model.graph.name
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    if value_info:
        g.value_info.extend(model.graph.value_info)
    for t in model.graph.initializer:
        if t.ByteSize() > _WEIGHTS_BYTES:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            g.initializer.append(t)
    return out


def _at(skeleton: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(skeleton)
    for vi in m.graph.input:
        if vi.name in shapes:
            for d, v in zip(vi.type.tensor_type.shape.dim, shapes[vi.name]):
                d.Clear()
                d.dim_value = int(v)
    return m


def shape_problem(skeleton: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> str | None:
    """Why ONNX's strict shape inference rejects the model with its inputs at `shapes` (an input
    size its layers do not fit, such as a Concat of feature maps 19 and 20 wide), or None."""
    try:
        onnx.shape_inference.infer_shapes(_at(skeleton, shapes), check_type=True, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError) as e:
        first = str(e).replace("[ShapeInferenceError] Inference error(s): ", "").strip().splitlines()[0]
        return first[:300]
    return None


def input_stride(skeleton: onnx.ModelProto, inputs: Iterable[str], size: int = 1024) -> int:
    """The largest factor by which the model's tensors shrink the symbolic non-batch dims of
    `inputs` (32 for a detector whose coarsest feature map is 1/32 of the image), from shape
    inference at two sizes: a tensor dim that doubles with them is the input size over that factor."""
    names = set(inputs)

    def dims_at(value: int) -> dict[str, tuple[int, ...]]:
        shapes = {vi.name: [d.dim_value if d.HasField("dim_value") else (1 if i == 0 else value)
                            for i, d in enumerate(vi.type.tensor_type.shape.dim)]
                  for vi in skeleton.graph.input if vi.name in names}
        inferred = infer_shapes(_at(skeleton, shapes))
        return {vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
                for vi in (*inferred.graph.value_info, *inferred.graph.output)}  # an output can be the coarsest map

    small, large = dims_at(size), dims_at(2 * size)
    factors = {size // a for name, dims in small.items() if len(dims) == len(large.get(name, ()))
               for a, b in zip(dims, large[name]) if a > 0 and b == 2 * a and size % a == 0}
    return max(factors, default=1)
