"""Resolve the spec's model (load it, or synthesize it when missing) and check the spec's inputs fit it."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..errors import ModelError, SpecError, closest
from ..graph.shapes import input_stride, shape_problem, shape_skeleton
from ..spec.load import LoadedSpec
from .info import external_data, load_model, tensor_info
from .synth import synthesize_yolov8, write_synthetic

log = logging.getLogger("deepjit.model")


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: Path
    model: onnx.ModelProto
    data: bytes  # the file's bytes, read once: hashed here, copied into the bundle
    synthesized: bool
    external: tuple[str, ...]  # its external data files, relative to its folder (bundled beside it)
    sha256: str                # over the file and, by name, each external data file: the weights too


def _model_digest(path: Path, data: bytes, external: tuple[str, ...]) -> str:
    h = hashlib.sha256(data)
    for loc in external:
        h.update(b"\0" + loc.encode() + b"\0")
        with open(path.parent / loc, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def resolve_model(loaded: LoadedSpec, *, write: bool = True) -> ResolvedModel:
    """Load the spec's model; synthesize it first when the file is missing and `synthesize` is set.
    With `write=False` (a dry run) a synthesized model stays in memory: nothing is written."""
    src = loaded.spec.model
    if not src.path.exists():
        if src.synthesize is None:
            raise ModelError(f"{loaded.path}: model.path: {src.path} does not exist "
                             f"(export it from ultralytics, or set `model.synthesize: yolov8s` for a synthetic one)")
        options = dict(seed=src.seed, dynamic=src.dynamic, head_layout=src.head_layout)
        if not write:
            log.info("synthesizing %s (seed %d) in memory: a dry run writes nothing (a build writes it to %s)",
                     src.synthesize, src.seed, src.path)
            model = synthesize_yolov8(src.synthesize, **options)
            data = model.SerializeToString()
            return ResolvedModel(src.path, model, data, True, (), hashlib.sha256(data).hexdigest())
        log.info("synthesizing %s (seed %d) at %s", src.synthesize, src.seed, src.path)
        write_synthetic(src.synthesize, src.path, **options)
        synthesized = True
    else:
        synthesized = False
    model = load_model(src.path)
    data = src.path.read_bytes()
    external = external_data(onnx.load_from_string(data), src.path)
    return ResolvedModel(src.path, model, data, synthesized, external, _model_digest(src.path, data, external))


def check_inputs(loaded: LoadedSpec, model: onnx.ModelProto) -> None:
    """The spec's `inputs` must name graph inputs of the model, with matching rank, dtype and fixed dims.

    A stage added before an input (letterbox `add: before, at: images`) replaces that input; the spec
    then describes the pipeline's own input, and the model's input is checked by the surgery.
    """
    spec, where = loaded.spec, loaded.path
    initializers = {i.name for i in model.graph.initializer}
    graph_inputs = {i.name: i for i in model.graph.input if i.name not in initializers}
    replaced = {c.at for c in spec.cuts if c.add == "before"}
    for name, want in spec.inputs.items():
        if name not in graph_inputs:
            if replaced:
                continue
            raise SpecError(f"{where}: inputs.{name}: the model has no input '{name}'{closest(name, graph_inputs)}; "
                            f"model inputs: {', '.join(graph_inputs)}")
        _check_described(where, name, tensor_info(graph_inputs[name]), want, f"the model's '{name}'")
    missing = [n for n in graph_inputs if n not in spec.inputs and n not in replaced]
    if missing:
        raise SpecError(f"{where}: inputs: the model also needs {missing}; describe every model input")
    check_input_sizes(loaded, model, [n for n in spec.inputs if n in graph_inputs])


def check_stage_inputs(loaded: LoadedSpec, plan) -> None:
    """After the surgery: an input a stage added before the model brings (letterbox's raw_images) is
    described in `inputs` like a model input (its dtype, rank and fixed dims; a symbolic dim needs the
    profile's sizes), and every name in `inputs` is one the pipeline or its model takes."""
    spec, where = loaded.spec, loaded.path
    added = {t.name: (t, s.name) for s in plan.added if s.position == "before" for t in s.inputs}
    for name, (have, stage) in added.items():
        if name in spec.inputs:
            _check_described(where, name, have, spec.inputs[name],
                             f"'{name}' (what stage '{stage}', added before the model, reads)")
        elif have.shape is None or not all(isinstance(d, int) for d in have.shape):
            raise SpecError(f"{where}: inputs.{name}: the pipeline takes '{name}' {list(have.shape or ())} (stage "
                            f"'{stage}' added before the model reads it) and `inputs` does not describe it; allowed: "
                            f"describe every pipeline input (shape, dtype, profile) so its symbolic dims have sizes")
    known = [*(t.name for t in plan.inputs), *(c.at for c in spec.cuts if c.add == "before")]
    for name in spec.inputs:
        if name not in known:
            raise SpecError(f"{where}: inputs.{name}: neither the pipeline nor its model takes '{name}'"
                            f"{closest(name, known)}; allowed: {', '.join(known)}")


def _check_described(where: Path, name: str, have, want, what: str) -> None:
    """The spec's description of an input against the tensor it feeds (`what` names it): dtype, rank and
    fixed dims."""
    if have.dtype != want.dtype:
        raise SpecError(f"{where}: inputs.{name}.dtype: {what} is {have.dtype}, the spec says {want.dtype}")
    if have.shape is None:  # rank unknown: the first run tells
        return
    dims = list(have.shape)
    if len(dims) != len(want.shape):
        raise SpecError(f"{where}: inputs.{name}.shape: {what} has rank {len(dims)} {dims}, "
                        f"the spec gives {want.shape}")
    # The profile's whole range must fit a fixed dim: its min too, or the engine build refuses it later.
    for i, (m, lo, hi) in enumerate(zip(dims, want.min_shape, want.max_shape)):
        if isinstance(m, int) and m > 0 and not lo == m == hi:
            raise SpecError(f"{where}: inputs.{name}: dim {i} is fixed to {m} in {what}, "
                            f"the spec's shape/profile allows {lo if lo == hi else f'{lo}..{hi}'}")


def check_input_sizes(loaded: LoadedSpec, model: onnx.ModelProto, names: list[str]) -> None:
    """The model must run at each shape of the spec's profiles: an image size its strides do not
    divide (300 for a detector that halves it five times) fails here, naming the input and what is
    allowed, instead of deep inside ONNX Runtime later. Only symbolic model dims are checked: fixed
    ones were matched above."""
    spec, where = loaded.spec, loaded.path
    graph_inputs = {i.name: tensor_info(i) for i in model.graph.input}
    free = {n: [i for i, d in enumerate(graph_inputs[n].shape or ()) if i > 0 and not isinstance(d, int)]
            for n in names}
    if not any(free.values()):
        return
    skeleton = shape_skeleton(model)
    if shape_problem(skeleton, {}) is not None:
        log.debug("ONNX's strict shape inference cannot judge this model (custom ops?): input sizes not checked")
        return
    for which in ("min", "opt", "max"):
        shapes = {n: getattr(spec.inputs[n], f"{which}_shape") for n in names}
        problem = shape_problem(skeleton, shapes)
        if problem is None:
            continue
        stride = input_stride(skeleton, names)
        odd = [(n, i, shapes[n][i]) for n in names for i in free[n] if shapes[n][i] % stride]
        name = odd[0][0] if odd else names[0]
        allowed = "" if not odd else (
            f"dims {', '.join(map(str, free[name]))} must be multiples of {stride}, the model's feature maps going "
            f"down to 1/{stride} of its input (" + "; ".join(
                f"dim {i}: {max(d // stride, 1) * stride} or {(d // stride + 1) * stride}, not {d}"
                for n, i, d in odd if n == name) + "); ")
        raise SpecError(f"{where}: inputs.{name}.profile.{which}: the model cannot run at {list(shapes[name])}: "
                        f"{allowed}ONNX shape inference says: {problem}")
