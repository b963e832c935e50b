"""Composing ONNX models: a model with added stages' reference graphs before and after it."""
from __future__ import annotations

import onnx
from onnx import compose

from .serialize import pin_ir_version


def compose_reference(original: onnx.ModelProto, added) -> onnx.ModelProto:
    """`added`: stages with .position, .reference (ONNX), .inputs and .outputs (objects with .name)."""
    model = original
    for stage in added:
        # the stage's internal names get its own prefix, so two references never collide
        ref = compose.add_prefix(stage.reference, f"{stage.name}/" if hasattr(stage, "name") else "added/",
                                 rename_inputs=False, rename_outputs=False)
        if stage.position == "before":
            # only what the model reads is wired; the rest (letterbox's ratio_pad) stays an output
            reads = {i.name for i in model.graph.input}
            io = [(o.name, o.name) for o in stage.outputs if o.name in reads]
            model = _merge(ref, model, io)
        else:
            io = [(i.name, i.name) for i in stage.inputs]
            model = _merge(model, ref, io)
    return model


def _merge(first: onnx.ModelProto, second: onnx.ModelProto, io_map) -> onnx.ModelProto:
    """compose.merge_models needs equal IR versions and opsets: lift both to the larger ones."""
    opset = max(_opset(first), _opset(second))
    a, b = (_at_opset(m, opset) for m in (first, second))
    ir = max(a.ir_version, b.ir_version)
    a.ir_version = b.ir_version = ir
    return pin_ir_version(compose.merge_models(a, b, io_map=io_map))


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _at_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    if _opset(model) == opset:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        return m
    return onnx.version_converter.convert_version(model, opset)
