"""Kernels that share work across a chain: a tensor has one writer, and a kernel whose contract marks it
as done by the kernel before it (roles.done_before: the other half of a fused mode, like nms with
fused: true after yolov8_decode in mode nms) needs that kernel to write its outputs, with the same
semantics. Checked on the spec's kernels before any work, so a half-fused pipeline is a located error
rather than a bundle that fails on the GPU."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import KernelError
from .contracts import Contract, done_before, signature

Kernel = tuple[str, Contract, Mapping[str, Any]]  # (label, contract, resolved params), in pipeline order


def check_writers(kernels: Sequence[Kernel]) -> None:
    """KernelError when two kernels write one tensor, or a kernel done before is not done by the one before it."""
    writer: dict[str, str] = {}
    for i, (label, contract, params) in enumerate(kernels):
        if done_before(contract, params):
            _check_done_by(kernels[i - 1] if i else None, (label, contract, params))
        for t in signature(contract, params):
            if t.role != "output":
                continue
            if t.name in writer:
                raise KernelError(f"{label} writes '{t.name}', which {writer[t.name]} writes already: a tensor has one "
                                  "writer (where one kernel does the next one's work, the next one's contract says how "
                                  "to mark it: roles.done_before)")
            writer[t.name] = label


def _check_done_by(before: Kernel | None, kernel: Kernel) -> None:
    label, contract, params = kernel
    done = contract.model.roles.done_before
    if before is None:
        raise KernelError(f"{label} has {done.when}: true, but no kernel comes before it to do its work")
    before_label, before_contract, before_params = before
    alone = {t.name for t in signature(contract, {**params, done.when: False}) if t.role == "output"}
    made = {t.name for t in signature(before_contract, before_params) if t.role == "output"}
    if not alone <= made:
        raise KernelError(f"{label} has {done.when}: true, so the kernel before it must do its work, but "
                          f"{before_label} does not write {', '.join(sorted(alone - made))}: set its fused mode, or "
                          f"{done.when}: false")
    for name in done.same:
        if name not in before_params:
            raise KernelError(f"{label} has {done.when}: true, but {before_label} has no param '{name}' to do its "
                              "work with")
        if before_params[name] != params[name]:
            raise KernelError(f"{label}'s {name} is {params[name]!r} and {before_label}'s is {before_params[name]!r}: "
                              f"with {done.when}: true, {before_label} does its work, so give both the same {name}")
