"""Confidence thresholds along a pipeline's kernels (roles.score_threshold): a kernel that drops what
a later kernel reading its outputs would keep loses detections; one that keeps more only does work
the later one throws away."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import KernelError
from .contracts import Contract, score_threshold, signature


def check_thresholds(kernels: Sequence[tuple[str, Contract, Mapping[str, Any]]]) -> list[str]:
    """`kernels`: (label, contract, resolved params) in pipeline order. Raises KernelError when a
    kernel's threshold is above that of a later kernel reading its outputs (detections between the
    two would be silently lost); returns a warning for each one below it (only unusual)."""
    warnings = []
    for i, (label, contract, params) in enumerate(kernels):
        mine = score_threshold(contract, params)
        if mine is None:
            continue
        written = {t.name for t in signature(contract, params) if t.role == "output"}
        for later_label, later, later_params in kernels[i + 1:]:
            theirs = score_threshold(later, later_params)
            reads = {t.name for t in signature(later, later_params) if t.role == "input"}
            if theirs is None or not written & reads:
                continue
            what = (f"{label}'s {contract.model.roles.score_threshold} {mine:g} and {later_label}'s "
                    f"{later.model.roles.score_threshold} {theirs:g}")
            if mine > theirs:
                raise KernelError(f"{what}: {label} drops the scores in ({theirs:g}, {mine:g}] that {later_label} "
                                  f"would keep, so those detections would be lost; give both the same threshold")
            if mine < theirs:
                warnings.append(f"warning: {what}: the candidates {label} keeps in ({mine:g}, {theirs:g}] are "
                                f"dropped by {later_label} (the same detections, more work); give both the same "
                                "threshold")
    return warnings
