"""The engine level: TensorRT plans against ONNX Runtime on the same segments, where plans exist."""
from __future__ import annotations

from .gate import LevelResult, not_run


def engine_level(decision, artifacts) -> LevelResult:
    """TensorRT plans vs ONNX Runtime: only where the plans were built (on the target)."""
    if decision.backend != "tensorrt" or decision.deferred:
        why = decision.reason if decision.backend == "tensorrt" else f"backend {decision.backend}: no plans to check"
        return not_run("engine", why)
    return not_run("engine", "TensorRT plans built; compared by `deepjit validate` on this GPU")
