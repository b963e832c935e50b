"""The reassembly check: the graph level of the accuracy gate, run on every build, on the CPU.

ONNX Runtime over the plan's steps wired in order (segments, cut references, added-stage references)
must equal ONNX Runtime over the original model with the same added-stage references around it:
bit for bit, on the validation data (every level's: the spec's shapes, its folder of images or
arrays, or seeded random inputs). Both sides run with graph optimizations disabled, so that no
fusion reorders float math on one side only. The original side also exports every step boundary
tensor, so a failure names the first step whose outputs differ.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..graph.casts import round_through
from ..graph.ort import random_array
from ..graph.steps import StepRunner, WiringError
from ..graph.tensors import TensorSig
from ..log import Progress
from ..surgery.plan import AddedStage, Plan
from .executor import plan_runner
from .gate import LevelResult, OutputResult, from_outputs

log = logging.getLogger("deepjit.reassembly")


@dataclass(frozen=True, slots=True)
class OutputCheck:
    name: str
    dtype: str
    shape: tuple[int, ...]  # of the last sample
    max_abs_diff: float
    bit_identical: bool

    @property
    def passed(self) -> bool:
        return self.bit_identical

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "max_abs_diff": self.max_abs_diff, "bit_identical": self.bit_identical, "passed": self.passed}


@dataclass(frozen=True, slots=True)
class ReassemblyReport:
    outputs: tuple[OutputCheck, ...]
    batches: int
    rows: int  # over all batches
    first_mismatch: str | None = None  # "step 'decode' output 'x'" where the pieces first disagree
    error: str | None = None           # the plan could not be run at all (a wiring error)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and all(o.passed for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "batches": self.batches, "rows": self.rows,
                "first_mismatch": self.first_mismatch, "error": self.error, "seconds": round(self.seconds, 3),
                "outputs": [o.to_dict() for o in self.outputs]}

    def describe(self) -> str:
        if self.passed:
            return (f"reassembly check passed: {len(self.outputs)} outputs bit-identical over {self.batches} batches "
                    f"({self.rows} rows) of the validation data")
        if self.error:
            return f"reassembly check failed: {self.error}"
        bad = [f"'{o.name}' (max abs diff {o.max_abs_diff:g})" for o in self.outputs if not o.passed]
        where = f"; first difference at {self.first_mismatch}" if self.first_mismatch else ""
        return f"reassembly check failed: {', '.join(bad)} differ from the original model{where}"


def _with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in have)
    return m


def _feed(sigs: tuple[TensorSig, ...], rng: np.random.Generator, batch: int,
          ranges: Mapping[str, tuple[float, float]], dims: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Random inputs. Symbolic dims: the first axis is `batch`, names in `dims` take that value, any
    other name a random multiple of 32 in [160, 480] (valid for strided CNNs), shared by name."""
    sizes = dict(dims)
    feed = {}
    for s in sigs:
        shape = []
        for axis, d in enumerate(s.shape):
            if isinstance(d, int):
                shape.append(d)
            elif d in sizes:
                shape.append(sizes[d])
            else:
                shape.append(sizes.setdefault(d, batch if axis == 0 else int(rng.integers(5, 16)) * 32))
        lo, hi = ranges.get(s.name, (None, None))
        feed[s.name] = random_array(rng, s.dtype, shape, lo, hi)
    return feed


def _same(a: np.ndarray, b: np.ndarray) -> tuple[bool, float]:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, float("inf")
    if a.dtype.kind == "f":
        identical = a.tobytes() == b.tobytes() or bool(np.array_equal(a, b, equal_nan=True))
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        return identical, float(np.nanmax(diff)) if diff.size else 0.0
    identical = bool(np.array_equal(a, b))
    return identical, float(np.max(np.abs(a.astype(np.int64) - b.astype(np.int64)))) if a.size else 0.0


def check_reassembly(plan: Plan, original: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]] | None = None,
                     *, seed: int = 0, samples: int = 1, input_ranges: Mapping[str, tuple[float, float]] | None = None,
                     batch: int = 1, dims: Mapping[str, int] | None = None) -> ReassemblyReport:
    """Run the plan's pieces and the original model (both wrapped in the added stages) on `feeds` (the
    validation data) and compare every pipeline output bit for bit. Without feeds, on `samples` seeded
    random inputs whose symbolic dims not in `dims` take random sizes (the surgery tests' shapes).
    Where the plan hands a tensor over in another dtype than the model's (plan.model_dtypes), the
    original stores it in that dtype too, so what is checked is the cut, not that rounding."""
    t0 = time.perf_counter()
    if feeds is None:
        rng = np.random.default_rng(seed)
        feeds = [_feed(plan.inputs, rng, batch, input_ranges or {}, dims or {}) for _ in range(samples)]
    boundary = [t.name for s in plan.steps if not isinstance(s, AddedStage) for t in s.outputs]
    stored = {t.name: t.dtype for s in plan.segments for t in s.outputs if t.name in plan.model_dtypes}
    original = round_through(original, stored, plan.model_dtypes) if stored else original
    reference = StepRunner([*((s.name, s.reference) for s in plan.added if s.position == "before"),
                            ("original model", _with_outputs(original, boundary)),
                            *((s.name, s.reference) for s in plan.added if s.position == "after")])
    pieces = plan_runner(plan)
    worst: dict[str, tuple[bool, float, np.ndarray]] = {}
    first = None
    with Progress("graph level", len(feeds), unit="samples", logger=log.name) as progress:
        for feed in feeds:
            ref = reference.tensors(feed)

            def compare(step: str, outputs) -> None:
                nonlocal first
                first = first or _first_mismatch(step, outputs, ref)

            try:
                got = pieces.tensors(feed, after=compare)
                missing = [t.name for t in plan.outputs if t.name not in got]
                if missing:
                    raise WiringError(f"pipeline output '{missing[0]}' is produced by no step")
            except WiringError as e:
                return ReassemblyReport((), len(feeds), _rows(feeds), first, str(e), time.perf_counter() - t0)
            for t in plan.outputs:
                same, diff = _same(got[t.name], ref[t.name])
                prev = worst.get(t.name)
                worst[t.name] = (same and (prev is None or prev[0]), max(diff, prev[1] if prev else 0.0), got[t.name])
            progress.advance()
    checks = tuple(OutputCheck(n, str(a.dtype), tuple(a.shape), d, s) for n, (s, d, a) in worst.items())
    report = ReassemblyReport(checks, len(feeds), _rows(feeds), first, None, time.perf_counter() - t0)
    (log.info if report.passed else log.warning)("%s (%.2f s)", report.describe(), report.seconds)
    return report


def _first_mismatch(step: str, outputs, ref: dict) -> str | None:
    for n, value in outputs.items():
        if n in ref and not _same(value, ref[n])[0]:
            return f"step '{step}' output '{n}'"
    return None


def _rows(feeds) -> int:
    return sum(len(next(iter(f.values()), ())) for f in feeds)


def graph_level(plan, model: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]]) -> LevelResult:
    """Reassembly on the validation data: segments + references wired in order equal the original,
    bit for bit (fp32, and tensors the plan hands over in the engine's dtype stored so in the
    original too)."""
    rep = check_reassembly(plan, model, feeds)
    if rep.error:
        return LevelResult("graph", "failed", rep.error)
    outputs = [OutputResult(o.name, o.passed, max_abs=o.max_abs_diff, tolerance={"bit_identical": True},
                            detail="bit-identical" if o.passed else f"differs by up to {o.max_abs_diff:g}")
               for o in rep.outputs]
    return from_outputs("graph", outputs, rep.describe())
