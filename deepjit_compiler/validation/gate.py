"""The accuracy gate: Polygraphy's Comparator between a reference and a candidate, per level.

Levels: `graph` (reassembly, CPU), `precision` (precision-rewritten segments vs fp32, CPU), `kernels`
(each kernel vs its reference, GPU), `end_to_end` (whole pipeline vs reference, GPU), `engine`
(TensorRT plans vs ONNX Runtime, on the target). Written against Polygraphy 0.53, whose
`compare_accuracy` returns an `AccuracyResults` list (one `AccuracyResult` per compare function).
"""
from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.comparator import Comparator, RunResults
from polygraphy.comparator.compare import SimpleCompareFunc
from polygraphy.logger import G_LOGGER

from .. import config
from ..errors import OutputError
from ..files import atomic_write
from ..jit.contracts import DetectionOutputs
from ..spec.models import LEVELS
from .data import row_labels
from .detections import DETECTION_KEYS, evaluate_detections, images_from_batch

log = logging.getLogger("deepjit.gate")
EMPTY = "(on no detections at all: this proves nothing)"
G_LOGGER.module_severity = G_LOGGER.ERROR  # Polygraphy's per-output chatter goes to our summary instead

RUN_RESULTS = ".runresults.json"
BUILD_REPORT = "build-report.json"  # what build.py writes beside the RunResults
# A report's name is made of level and step names, a pulled bundle's among them: it must stay one
# plain file name inside the report folder, whatever a name holds.
_REPORT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,199}")


@dataclass(frozen=True, slots=True)
class OutputResult:
    name: str
    passed: bool
    max_abs: float = 0.0
    median_abs: float = 0.0
    max_rel: float = 0.0
    median_rel: float = 0.0
    detail: str = ""
    mean_abs: float = 0.0
    mean_rel: float = 0.0
    metrics: Mapping[str, Any] = field(default_factory=dict)    # detections: mAP, recall, counts
    tolerance: Mapping[str, Any] = field(default_factory=dict)  # what this output was judged by

    def describe(self) -> str:
        if self.detail:
            return f"{self.name}: {self.detail}"
        text = (f"{self.name}: max abs {self.max_abs:.3e} (median {self.median_abs:.3e}, mean {self.mean_abs:.3e}), "
                f"max rel {self.max_rel:.3e} (median {self.median_rel:.3e}, mean {self.mean_rel:.3e})")
        t = self.tolerance
        if "check_error_stat" in t:
            text += f"; allowed: atol {t['atol']:g} or rtol {t['rtol']:g} on the {t['check_error_stat']} error"
        return text

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in OutputResult.__slots__ if k != "name"}
        d.update(metrics=dict(self.metrics), tolerance=dict(self.tolerance))
        return d


@dataclass(frozen=True, slots=True)
class LevelResult:
    level: str
    status: str  # passed | failed | not_run
    reason: str = ""
    outputs: tuple[OutputResult, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"status": self.status, "reason": self.reason}
        if self.outputs:
            d["outputs"] = {o.name: o.to_dict() for o in self.outputs}
        return d


def not_run(level: str, reason: str) -> LevelResult:
    return LevelResult(level, "not_run", reason)


def from_outputs(level: str, outputs: Iterable[OutputResult], reason: str = "") -> LevelResult:
    outputs = tuple(outputs)
    status = "passed" if all(o.passed for o in outputs) else "failed"
    return LevelResult(level, status, reason, outputs)


@dataclass(frozen=True)
class GateReport:
    levels: Mapping[str, LevelResult] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.status != "failed" for r in self.levels.values())

    def failures(self) -> list[str]:
        return [f"{lvl}: {o.describe()}" for lvl, r in self.levels.items() if r.status == "failed"
                for o in r.outputs if not o.passed] + \
               [f"{lvl}: {r.reason}" for lvl, r in self.levels.items() if r.status == "failed" and not r.outputs]

    @classmethod
    def from_record(cls, levels: Mapping[str, Any]) -> GateReport:
        """The inverse of to_record's levels (a bundle's validation record, as `BundleView.levels`)."""
        return cls({name: LevelResult(name, lv["status"], lv.get("reason", ""), tuple(
            OutputResult(o, **v) for o, v in (lv.get("outputs") or {}).items())) for name, lv in levels.items()})

    def to_record(self) -> dict[str, Any]:
        """The validation record stored in the bundle's manifest (levels in canonical order)."""
        return {"levels": {lvl: self.levels[lvl].to_dict() if lvl in self.levels
                           else not_run(lvl, "not attempted").to_dict() for lvl in LEVELS}}

    def with_levels(self, *results: LevelResult) -> "GateReport":
        merged = dict(self.levels)
        merged.update({r.level: r for r in results})
        return GateReport(merged)


class FunctionRunner(BaseRunner):
    """A Polygraphy runner around a Python callable `feeds -> outputs` (the compiled pipeline, a kernel)."""

    def __init__(self, fn: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]], name: str,
                 input_metadata=None):
        super().__init__(name=name)
        self._fn, self._meta = fn, input_metadata

    def get_input_metadata_impl(self):
        return self._meta if self._meta is not None else TensorMetadata()

    def infer_impl(self, feed_dict):
        start = time.perf_counter()
        outputs = OrderedDict((k, np.asarray(v)) for k, v in self._fn(feed_dict).items())
        self.inference_time = time.perf_counter() - start
        return outputs


def metadata_from(feeds: Sequence[Mapping[str, np.ndarray]]) -> TensorMetadata:
    """Polygraphy input metadata describing example feeds (Comparator feeds only listed inputs); a
    dim that differs between them (the batch, when a folder is batched by the buckets) is dynamic."""
    meta = TensorMetadata()
    for name, value in feeds[0].items():
        shapes = {tuple(f[name].shape) for f in feeds}
        meta.add(name, value.dtype, [d if len({s[i] for s in shapes}) == 1 else -1 for i, d in enumerate(value.shape)])
    return meta


def tolerance_for(tolerances, name: str):
    """The Tolerance in force for output `name`: its own entry, else the level's default."""
    return tolerances.outputs.get(name, tolerances.default)


def _tolerance_maps(tolerances, names: Iterable[str]):
    atol, rtol, stat = {"": tolerances.default.atol}, {"": tolerances.default.rtol}, {"": tolerances.default.check_error_stat}
    for name in names:
        t = tolerances.outputs.get(name)
        if t is not None:
            atol[name], rtol[name], stat[name] = t.atol, t.rtol, t.check_error_stat
    return atol, rtol, stat


def compare_runs(level: str, reference: BaseRunner, candidate: BaseRunner, feeds: list[dict[str, np.ndarray]],
                 tolerances, *, report_dir: Path | None = None, report_name: str | None = None,
                 detections: Sequence[DetectionOutputs] = ()) -> LevelResult:
    """Run both runners on `feeds` with Polygraphy's Comparator and judge every output.

    The outputs of each `detections` group (as the kernels' contracts declare them: count, boxes,
    scores, classes, and the threshold they were cut at) are scored as detection sets against
    `tolerances.detections`; the rest go through `SimpleCompareFunc` with the spec's
    atol/rtol/check_error_stat (default + per output). With `report_dir`, Polygraphy's RunResults of a
    failed comparison (of every one with $DEEPJIT_KEEP_RUN_RESULTS) are saved there as
    `<report_name or level>.runresults.json`.
    """
    report = report_file(report_dir, report_name or level) if report_dir is not None else None
    for runner in (reference, candidate):
        if isinstance(runner, FunctionRunner) and runner._meta is None:
            runner._meta = metadata_from(feeds)
    run_results = Comparator.run([reference, candidate], data_loader=feeds, use_subprocess=False)
    ref_iters, test_iters = run_results[reference.name], run_results[candidate.name]
    names = [n for n in ref_iters[0].keys() if n in test_iters[0]]
    missing = [n for n in ref_iters[0].keys() if n not in test_iters[0]]
    outputs = [OutputResult(n, False, detail="missing from the candidate's outputs") for n in missing]
    groups = [g for g in detections if all(n in names for n in g.names)]
    as_sets = {n for g in groups for n in g.names}
    dense = [n for n in names if n not in as_sets]
    if dense:
        outputs += _compare_dense(run_results, reference.name, candidate.name, dense, tolerances)
    labels = row_labels(feeds)
    for g in groups:
        label = "detections" if len(groups) == 1 else f"detections ({g.count})"
        outputs.append(_compare_detections(level, label, g, ref_iters, test_iters, tolerances.detections, labels))
    result = from_outputs(level, outputs)
    if report is not None and (result.status == "failed" or config.keep_run_results()):
        atomic_write(report, run_results.to_json().encode())
    return result


def report_file(report_dir: Path, name: str) -> Path:
    """`<report_dir>/<name>.runresults.json`; OutputError unless `name` is a plain file name."""
    if not _REPORT_NAME.fullmatch(name):
        raise OutputError(f"{report_dir}: cannot name a report {name!r}: a report's name is letters, digits, '_', "
                          "'.', '+' and '-', not starting with '.', '+' or '-', at most 200 characters")
    return Path(report_dir) / f"{name}{RUN_RESULTS}"


def check_report_folder(folder: Path) -> None:
    """OutputError unless `folder` is absent or a report folder as DeepJIT writes it (RunResults and a
    build report, nothing else): a user's own folder of that name, or a link, is never written into."""
    folder = Path(folder)
    if not folder.exists() and not folder.is_symlink():
        return
    if folder.is_symlink() or not folder.is_dir():
        raise OutputError(f"{folder}: exists and is not a report folder; refusing to write the report there")
    foreign = sorted(p.name for p in folder.iterdir()
                     if p.is_symlink() or not p.is_file() or not (p.name == BUILD_REPORT or p.name.endswith(RUN_RESULTS)))
    if foreign:
        raise OutputError(f"{folder}: holds files DeepJIT did not write ({', '.join(foreign[:3])}); refusing to "
                          "write the report there: move them away")


def _compare_dense(run_results: RunResults, ref_name: str, test_name: str, names: list[str], tolerances):
    only = RunResults()
    for runner in (ref_name, test_name):
        iters = []
        for it in run_results[runner]:
            sub = type(it)(OrderedDict((n, it[n]) for n in names), runner_name=runner)
            iters.append(sub)
        only.append((runner, iters))
    atol, rtol, stat = _tolerance_maps(tolerances, names)
    results = Comparator.compare_accuracy(only, compare_func=SimpleCompareFunc(atol=atol, rtol=rtol,
                                                                               check_error_stat=stat))
    per_iter = results[0][(ref_name, test_name)]
    out = []
    for name in names:
        stats = [it[name] for it in per_iter]
        out.append(OutputResult(name, all(bool(s) for s in stats),
                                max(float(s.max_absdiff) for s in stats), float(np.median([s.median_absdiff for s in stats])),
                                max(float(s.max_reldiff) for s in stats), float(np.median([s.median_reldiff for s in stats])),
                                mean_abs=float(np.mean([s.mean_absdiff for s in stats])),
                                mean_rel=float(np.mean([s.mean_reldiff for s in stats])),
                                tolerance=tolerance_for(tolerances, name).model_dump()))
    return out


def _compare_detections(level: str, label: str, group: DetectionOutputs, ref_iters, test_iters, tolerance,
                        labels: Sequence[Sequence[str]]) -> OutputResult:
    """Every image of every feed, the reference's detections as ground truth (detections.py)."""
    def images(iters):
        return [img for k, it in enumerate(iters)
                for img in images_from_batch(dict(zip(DETECTION_KEYS, (it[n] for n in group.names))), labels[k])]

    metrics = evaluate_detections(images(ref_iters), images(test_iters), threshold=group.threshold,
                                  margin=tolerance.margin)
    short = metrics.shortfalls(tolerance)
    verdict = "passed" if not short else "failed on " + ", ".join(short)
    if not metrics.total.reference and not metrics.total.produced:
        # a trained detector on random inputs: both sides agree on nothing, and the gate would pass blind
        verdict += f" {EMPTY}"
        log.warning("%s: %s: neither side detected anything on the validation data (%d images), so this "
                    "comparison proves nothing; validate on real images: validation.data: {folder: ...}", level, label,
                    metrics.images)
    return OutputResult(label, not short, max_abs=metrics.max_score_diff, detail=f"{verdict} | {metrics.describe()}",
                        metrics=metrics.to_dict(), tolerance={**tolerance.model_dump(), "threshold": group.threshold})
