"""Stages a model lacks, added before or after it (letterbox before `images`, NMS after `output0`):
each is a kernel with a reference graph of standard ONNX ops from references.py, checked against the
model tensor it attaches to. Which reference a stage gets is its kernel contract's `roles.reference`,
so a user's copy of a built-in contract is added the same way.
"""
from __future__ import annotations

from pathlib import Path

import onnx

from ..errors import KernelError, SurgeryError, closest
from ..graph.index import GraphIndex
from ..graph.tensors import TensorSig, sig_from_value_info
from ..jit.contracts import load_contract
from . import references
from .plan import AddedStage


def _reference(cut, spec_dir: Path | None) -> str:
    """The reference its kernel's contract declares (roles.reference): what the stage is checked against."""
    if not cut.kernels:
        raise SurgeryError(f"added stage '{cut.name}' needs a kernel whose contract declares its reference "
                           f"(roles.reference: {' or '.join(_STAGES)})")
    try:
        contract = load_contract(str(cut.kernels[0].contract), spec_dir=spec_dir)
    except KernelError as e:
        raise SurgeryError(f"added stage '{cut.name}': {e}") from None
    kind = contract.model.roles.reference
    if kind is None:
        raise SurgeryError(f"added stage '{cut.name}': kernel contract '{contract.name}' ({contract.path}) declares "
                           f"no reference for a stage the model lacks; set roles.reference: {' or '.join(_STAGES)}")
    position = _STAGES[kind][0]
    if cut.add != position:
        raise SurgeryError(f"added stage '{cut.name}': kernel '{contract.name}' is a {kind} stage, which goes "
                           f"{position} the model, not {cut.add}")
    return kind


def added_stages(idx: GraphIndex, cuts, plan_in: list[TensorSig], plan_out: list[TensorSig],
                 spec_dir: Path | None = None):
    """The stages of `cuts` with `add:` (a letterbox before a model input, NMS after an output: what their
    kernel contracts' roles.reference says), as (before, after); plan_in/plan_out, the plan's boundary,
    are updated to what the stages expose."""
    before, after, used, made = [], [], {}, {}
    for cut in (c for c in cuts if c.add is not None):
        if cut.at in used:
            raise SurgeryError(f"added stages '{used[cut.at]}' and '{cut.name}' both attach at '{cut.at}'")
        used[cut.at] = cut.name
        boundary, where = (idx.inputs, "input") if cut.add == "before" else (idx.outputs, "output")
        if cut.at not in boundary:
            raise SurgeryError(f"added stage '{cut.name}': `at: {cut.at}` is not a model {where}"
                               f"{closest(cut.at, boundary)}; {where}s: {boundary}")
        kind = _reference(cut, spec_dir)
        _, build = _STAGES[kind]
        params = dict(cut.kernels[0].params or {})
        if cut.add == "before":  # at its place now: an earlier stage may have replaced a tensor before it
            i = [s.name for s in plan_in].index(cut.at)
            stage = build(idx, cut, params, plan_in[i])
            before.append(stage)
            plan_in[i:i + 1] = stage.inputs
            plan_out.extend(s for s in stage.outputs if s.name != cut.at)
        else:
            i = [s.name for s in plan_out].index(cut.at)
            stage = build(idx, cut, params, plan_out[i])
            after.append(stage)
            plan_out[i:i + 1] = stage.outputs
        for t in (*stage.inputs, *stage.outputs):  # the stages' own tensors have fixed names
            if t.name != cut.at and made.setdefault(t.name, cut.name) != cut.name:
                raise SurgeryError(f"added stages '{made[t.name]}' and '{cut.name}' both make tensor '{t.name}': "
                                   f"a pipeline takes one {kind} stage")
    return before, after


def _new_names_free(idx: GraphIndex, cut, ref: onnx.ModelProto, keep: str) -> None:
    for vi in (*ref.graph.input, *ref.graph.output):
        if vi.name != keep and vi.name in idx.tensors:
            raise SurgeryError(f"added stage '{cut.name}' produces tensor '{vi.name}', but the model already has one")


def _ref_sigs(ref: onnx.ModelProto) -> tuple[tuple[TensorSig, ...], tuple[TensorSig, ...]]:
    return (tuple(sig_from_value_info(v) for v in ref.graph.input),
            tuple(sig_from_value_info(v) for v in ref.graph.output))


def _letterbox_stage(idx: GraphIndex, cut, params: dict, images: TensorSig) -> AddedStage:
    p = _stage_params(cut, references.letterbox_params, params)
    if images.dtype != p["dtype"]:
        raise SurgeryError(f"added stage '{cut.name}': letterbox dtype '{p['dtype']}' does not match model "
                           f"input '{images.name}' ({images.dtype}); set params.dtype: {images.dtype}")
    shape = images.shape
    if len(shape) != 4 or shape[1] != 3 or any(isinstance(d, int) and d != p["size"] for d in shape[2:]):
        raise SurgeryError(f"added stage '{cut.name}': letterbox makes [B, 3, {p['size']}, {p['size']}] but model "
                           f"input '{images.name}' is {list(shape)}; set params.size to the model's input size")
    ref = references.letterbox_reference(**p, output_name=cut.at)
    _new_names_free(idx, cut, ref, cut.at)
    ins, outs = _ref_sigs(ref)
    outs = tuple(images if s.name == cut.at else s for s in outs)  # the model's own, more precise
    return AddedStage(cut.name, "before", ref, ins, outs, p, tuple(cut.kernels))


def _nms_stage(idx: GraphIndex, cut, params: dict, det: TensorSig) -> AddedStage:
    p = _stage_params(cut, references.nms_params, params)
    if det.dtype != "float32" or len(det.shape) != 3 or not isinstance(det.shape[1], int) or det.shape[1] < 5:
        raise SurgeryError(f"added stage '{cut.name}': nms needs detections float32 [B, 4 + nc, anchors] with a "
                           f"fixed 4 + nc, but '{det.name}' is {det.dtype} {list(det.shape)}")
    ref = references.nms_reference(det.shape[1] - 4, **p, input_name=cut.at)
    _new_names_free(idx, cut, ref, cut.at)
    _, outs = _ref_sigs(ref)
    return AddedStage(cut.name, "after", ref, (det,), outs, {**p, "num_classes": det.shape[1] - 4}, tuple(cut.kernels))


def _stage_params(cut, check, params: dict) -> dict:
    try:
        return check(params)
    except SurgeryError as e:
        raise SurgeryError(f"added stage '{cut.name}': {e}") from None


# roles.reference -> (where the stage goes, what builds it)
_STAGES = {"letterbox": ("before", _letterbox_stage), "nms": ("after", _nms_stage)}
