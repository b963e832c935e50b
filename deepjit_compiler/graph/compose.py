"""Composing ONNX models: a model with added stages' reference graphs before and after it."""
from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import compose

from .serialize import pin_ir_version


def compose_reference(original: onnx.ModelProto,
                      added: Iterable[tuple[str, str, onnx.ModelProto]]) -> onnx.ModelProto:
    """`original` with each added stage's reference graph, `(name, "before" | "after", graph)` in plan
    order, wired on by tensor name: a stage before feeds the model inputs it makes, a stage after reads
    the model outputs its graph takes."""
    model = original
    for name, position, reference in added:
        # the stage's internal names get its own prefix, so two references never collide
        ref = compose.add_prefix(reference, f"{name}/", rename_inputs=False, rename_outputs=False)
        if position == "before":
            # only what the model reads is wired; the rest (letterbox's ratio_pad) stays an output
            reads = {i.name for i in model.graph.input}
            model = _merge(ref, model, [(o.name, o.name) for o in reference.graph.output if o.name in reads])
        else:
            model = _merge(model, ref, [(i.name, i.name) for i in reference.graph.input])
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
