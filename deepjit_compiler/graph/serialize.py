"""ONNX models as bytes: deterministic serialization and an IR version ONNX Runtime reads.

Models are saved with a pinned IR version because the installed onnx writes IR versions that older
ONNX Runtime releases reject."""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from ..files import atomic_write

# ONNX Runtime >= 1.18 (the oldest DeepJIT supports) reads IR version 10.
MAX_IR_VERSION = 10


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
