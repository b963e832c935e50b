"""The build: the only module that knows the order of the stages.

model -> surgery (segment -> kernel boundaries in the engine's dtype) -> graph level (reassembly) ->
precision (+ its level) -> kernels (NVRTC) -> engines -> bundle staged -> GPU levels when a GPU is here ->
gate -> bundle committed (or rejected/) -> publish. The graph and precision stages are cached by the
digest of what each reads (stagecache.py).
"""
from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from .bundle.contents import bundle_files, bundle_manifest
from .bundle.folder import StagedBundle, check_archive_replaceable, check_replaceable
from .engines import EngineSettings, decide, engine_from_segment
from .errors import GateFailed, KernelError, RuntimeInputError, SpecError
from .files import atomic_write, output_lock, replace_dir, staging_dir
from .graph.serialize import model_bytes
from .jit.contracts import declared_detections, load_contract, resolve_params
from .jit.fused import check_writers
from .jit.geometry import check_launch
from .jit.nvrtc import check_target as nvrtc_target
from .jit.nvrtc import compile_site_kernels
from .jit.thresholds import check_thresholds
from .log import StageTimes
from .model.source import ResolvedModel, check_inputs, check_stage_inputs, resolve_model
from .precision.boundaries import plan_at_precision
from .precision.calibration import CalibrationSettings
from .runtime.layout import Layout
from .spec.load import LoadedSpec, load_spec
from .stagecache import StageCache, arrays_digest, folder_digest, level_from_record, level_record
from .store.publish import publish as push
from .surgery.cut import plan_from_model
from .validation.data import feeds_for
from .validation.engine import engine_level
from .validation.gate import BUILD_REPORT, GateReport, LevelResult, check_report_folder
from .validation.gpu import gpu_levels
from .validation.graph import graph_level
from .validation.names import check_names
from .validation.precision import precision_stage

log = logging.getLogger("deepjit.build")


@dataclass
class BuildResult:
    """What a build did, for the terminal and for `--json`."""

    spec: LoadedSpec
    model: ResolvedModel
    plan: Any = None
    times: StageTimes = field(default_factory=StageTimes)
    report: GateReport = field(default_factory=GateReport)
    decision: Any = None
    artifacts: list = field(default_factory=list)
    kernels: dict[str, list] = field(default_factory=dict)
    bundle: Any = None
    published: Any = None
    rejected: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def gate_failed(self) -> bool:
        return self.rejected is not None

    def to_dict(self) -> dict[str, Any]:
        s = self.spec.spec
        return {
            "name": s.name,
            "spec": str(self.spec.path),
            "model": {"path": str(self.model.path), "sha256": self.model.sha256, "synthesized": self.model.synthesized},
            "target": {"gpu": s.target.gpu, "sm": s.target.resolved_sm},
            "plan": self.plan.summary() if self.plan is not None else None,
            "engine": None if self.decision is None else {
                "backend": self.decision.backend, "deferred": self.decision.deferred, "reason": self.decision.reason,
                # with what the manifest leaves out: how long each plan took to build
                "plans": [{"segment": a.segment_name, **a.plan.to_record(), "size": a.plan.size,
                           "build_seconds": a.plan.build_seconds, "from_cache": a.plan.from_cache}
                          for a in self.artifacts if a.plan is not None]},
            "kernels": {stage: [k.to_dict() | {"from_cache": k.from_cache} for k in ks]
                        for stage, ks in self.kernels.items()},
            "validation": self.report.to_record(),
            "bundle": None if self.bundle is None else {"path": str(self.bundle.path), "digest": self.bundle.digest},
            "rejected": str(self.rejected) if self.rejected else None,
            "published": None if self.published is None else {"ref": self.published.ref,
                                                              "digest": self.published.digest},
            "seconds": self.times.seconds,
            "cached": self.times.cached,
            "gate_failed": self.gate_failed,
            "notes": self.notes,
        }


def build_pipeline(spec_path: str | Path, *, dry_run: bool = False, publish: bool = True) -> BuildResult:
    """Build the pipeline a spec describes; raises GateFailed (exit 1) after writing a rejected bundle."""
    loaded = load_spec(spec_path)
    spec = loaded.spec
    check_target(loaded)
    times = StageTimes()
    with times.stage("model"):
        resolved = resolve_model(loaded, write=not dry_run)
        check_inputs(loaded, resolved.model)
    result = BuildResult(loaded, resolved, times=times)
    with times.stage("surgery"):
        plan = plan_from_model(resolved.model, spec.cuts, spec_dir=loaded.folder)
        check_stage_inputs(loaded, plan)
        warnings = check_kernel_params(loaded, plan)  # bad params are named before the boundaries read them
        # the segments hand kernels their tensors in the engine's dtype where the kernels read it
        result.plan = plan_at_precision(plan, spec.engine.precision, loaded.folder)
        detections = declared_detections(((k.contract, k.params) for s in (*result.plan.sites, *result.plan.added)
                                          for k in s.kernels), loaded.folder)
        check_names(loaded, result.plan, detections)
        unchecked = check_launch_limits(loaded, result.plan)  # at the params the kernels are compiled with
    for warning in warnings:
        log.warning("%s", warning)
    for note in unchecked:
        log.info("%s", note)
    result.notes += warnings + unchecked
    if dry_run:
        if resolved.synthesized:
            result.notes.append(f"dry run: the synthetic model was made in memory; a build writes it to "
                                f"{resolved.path} ({len(resolved.data) / 1e6:.0f} MB)")
        return result

    # One build of a bundle path at a time; nothing of the user's is replaced (checked before the
    # work, and again when the bundle and its report are put in place, atomically, at the end).
    with output_lock(spec.bundle.path), staging_dir(report_path(spec.bundle.path)) as stage:
        check_replaceable(spec.bundle.path)
        if spec.bundle.archive:
            check_archive_replaceable(spec.bundle.path)
        check_report_folder(report_path(spec.bundle.path))
        (report_dir := stage / "report").mkdir()
        _build(result, report_dir, detections)
    if result.rejected is not None:
        raise GateFailed("accuracy gate failed; bundle written to " + str(result.bundle.path) + " with its report:\n  "
                         + "\n  ".join(result.report.failures()), result.report, result)
    if publish and spec.publish is not None:
        with times.stage("publish"):
            result.published = push(result.bundle.path, spec.publish.store, spec.publish.tag, spec.publish.require)
    return result


def _build(result: BuildResult, report_dir: Path, detections) -> None:
    """The stages after surgery; the report's files are written to `report_dir` (a staging folder).
    `detections`: the detection outputs the plan's kernels declare, compared as sets."""
    loaded, resolved, plan, times = result.spec, result.model, result.plan, result.times
    spec = loaded.spec
    feeds = feeds_for(spec, plan.inputs)
    cache, plan_digest = StageCache(), plan.digest()
    with times.stage("graph"):
        report = GateReport().with_levels(_graph(cache, times, plan, plan_digest, resolved, feeds))
    with times.stage("precision"):
        segments, precision_level = _precision(cache, times, spec, plan, plan_digest, resolved, feeds, report_dir,
                                               detections)
        report = report.with_levels(precision_level)
    with times.stage("kernels"):
        result.kernels = compile_kernels(loaded, plan)
        if all(k.from_cache for ks in result.kernels.values() for k in ks):
            times.mark_cached("kernels")
    settings = EngineSettings.from_spec(spec)
    with times.stage("engines"), tempfile.TemporaryDirectory(prefix="deepjit-engines-") as workdir:
        result.decision = decide(settings)
        result.notes.append(f"engine: {result.decision.backend}"
                            f"{' (deferred to the target)' if result.decision.deferred else ''}: {result.decision.reason}")
        result.artifacts = artifacts = [
            engine_from_segment(name, model, settings, result.decision, workdir=workdir,
                                timing_cache=spec.engine.timing_cache, cache_dir=spec.compile.cache_dir)
            for name, model in segments.items()]
    report = report.with_levels(engine_level(result.decision, artifacts))

    files = bundle_files(loaded, resolved, plan, result.kernels, artifacts)
    manifest = bundle_manifest(loaded, resolved, plan, result.kernels, settings, result.decision, artifacts, report)
    # Written once: the GPU levels (where a GPU is) run on the staged files, then the manifest with
    # their record goes in and the bundle moves to its path, or under rejected/ if the gate says no.
    with times.stage("bundle"), StagedBundle(spec.bundle.path, files) as staged:
        result.report = report = report.with_levels(*gpu_levels(staged.view(manifest), spec, report_dir,
                                                                resolved.model))
        passed = report.passed or not spec.validation.gate
        dest = spec.bundle.path if passed else spec.bundle.path.parent / "rejected" / spec.bundle.path.name
        result.bundle = staged.commit(dest, {**manifest, "validation": report.to_record()},
                                      archive=spec.bundle.archive)
    if result.bundle.path != spec.bundle.path:  # rejected: the report goes with the bundle
        result.rejected = result.bundle.path
    final = report_path(result.bundle.path)
    check_report_folder(final)
    _write_report(result, report_dir)
    replace_dir(report_dir, final)




def check_target(loaded: LoadedSpec) -> None:
    """Before any work: the target's SM is one the installed NVRTC compiles for (a spec's `sm` has no
    table of its own: each NVRTC release adds architectures)."""
    target = loaded.spec.target
    try:
        nvrtc_target(target.resolved_sm)
    except KernelError as e:
        raise SpecError(f"{loaded.path}: target: {e}") from None


def check_kernel_params(loaded: LoadedSpec, plan) -> list[str]:
    """Before any work: every kernel's params resolved against what the surgery found (a given param
    that contradicts the model is an error) and the confidence thresholds along the pipeline checked.
    Returns the warnings."""
    kernels = []
    for step in (s for s in plan.steps if s.kind != "segment"):
        for i, k in enumerate(step.kernels):
            label = f"cut '{step.name}' kernels[{i}] ({k.contract})"
            try:
                contract = load_contract(str(k.contract), spec_dir=loaded.folder)
                kernels.append((label, contract, resolve_params(contract, k.params, plan.kernel_facts(step))))
            except KernelError as e:
                raise KernelError(f"{loaded.path}: {label}: {e}") from None
    try:
        check_writers(kernels)
        return check_thresholds(kernels)
    except KernelError as e:
        raise KernelError(f"{loaded.path}: {e}") from None


def check_launch_limits(loaded: LoadedSpec, plan) -> list[str]:
    """Before any work: every kernel launch at every batch the bundle runs (its buckets, the profile's min
    and max) within CUDA's limits for the target (jit/geometry.py), so a contract's grid, block or
    shared_mem that no target GPU launches (or an arg or workspace that does not evaluate) is named here
    rather than on the GPU. Returns a note for each kernel whose input shapes only its engine tells: the
    runtime checks those at load."""
    layout, target = Layout.from_plan(plan, loaded.spec, loaded.folder), loaded.spec.target
    label = f"the target sm_{target.resolved_sm}" + (f" ({target.gpu})" if target.gpu else "")
    checked = set()
    for batch in layout.launch_batches:
        try:
            found = list(layout.planned_launches(batch))
        except (KernelError, RuntimeInputError) as e:  # a contract whose shapes or expressions do not fit the plan
            raise KernelError(f"{loaded.path}: at batch {batch}: {e}") from None
        for kernel, launches in found:
            where = f"{loaded.path}: cut '{kernel.step}' kernels[{kernel.index}] ({kernel.view.contract})"
            checked.add((kernel.step, kernel.index))
            for launch in launches:
                check_launch(launch, target.resolved_sm, where, batch=batch, target=label)
    return [f"cut '{k.step}' kernels[{k.index}] ({k.view.contract}): launch geometry checked when the bundle "
            "loads (its input shapes come from the engine)" for k in layout.kernels if (k.step, k.index) not in checked]


def _graph(cache: StageCache, times: StageTimes, plan, plan_digest: str, resolved: ResolvedModel,
           feeds) -> LevelResult:
    """The graph level, or its cached result: it reads the plan, the model and the validation feeds."""
    material = {"plan": plan_digest, "model": resolved.sha256, "feeds": arrays_digest(feeds)}
    hit = cache.get("graph", material)
    if hit is not None:
        times.mark_cached("graph")
        return level_from_record(hit[0]["level"])
    level = graph_level(plan, resolved.model, feeds)
    if level.status != "failed":
        cache.put("graph", material, {}, {"level": level_record(level)})
    return level


def _precision(cache: StageCache, times: StageTimes, spec, plan, plan_digest: str, resolved: ResolvedModel, feeds,
               report_dir: Path, detections) -> tuple[dict[str, onnx.ModelProto], LevelResult]:
    """The rewritten segments and the precision level, or their cached copies: they read the plan, the
    model, the engine's precision fields, calibration (and its data), the precision tolerances and
    the validation feeds."""
    e = spec.engine
    calibration = CalibrationSettings.from_spec(spec)
    material = {"plan": plan_digest, "model": resolved.sha256, "precision": e.precision, "keep_fp32": e.keep_fp32,
                "calibration": None if calibration is None else [repr(calibration), folder_digest(calibration.data)],
                "tolerances": spec.validation.precision_tolerances.model_dump(mode="json"),
                "feeds": arrays_digest(feeds), "detections": [[d.declared.model_dump(), d.threshold] for d in detections]}
    hit = cache.get("precision", material)
    if hit is not None:
        meta, blobs = hit
        times.mark_cached("precision")
        return ({name: onnx.load_from_string(blobs[f"{name}.onnx"]) for name in meta["segments"]},
                level_from_record(meta["level"]))
    segments, level = precision_stage(spec, plan, resolved.model, feeds, report_dir, detections)
    if level.status != "failed":
        cache.put("precision", material, {f"{name}.onnx": model_bytes(m) for name, m in segments.items()},
                  {"segments": list(segments), "level": level_record(level)})
    return segments, level


def compile_kernels(loaded: LoadedSpec, plan) -> dict[str, list]:
    """NVRTC for every kernel of every cut and added stage: cubin for the target SM + PTX, cached."""
    spec = loaded.spec
    out = {}
    for step in (*plan.sites, *plan.added):
        out[step.name] = compile_site_kernels(
            [(k.contract, k.params) for k in step.kernels], plan.kernel_facts(step),
            sm=spec.target.resolved_sm, options=spec.compile.options, fast_math=spec.compile.fast_math,
            debug=spec.compile.debug, cache_dir=spec.compile.cache_dir, spec_dir=loaded.folder)
    return out


def report_path(bundle_path: Path) -> Path:
    """`<bundle>.report/`: Polygraphy RunResults per level and build-report.json (timings)."""
    return Path(f"{bundle_path}.report")


def _write_report(result: BuildResult, folder: Path) -> None:
    """build-report.json: timings and everything that must not be in the manifest."""
    text = json.dumps(result.to_dict(), indent=2, sort_keys=True, default=str) + "\n"
    atomic_write(folder / BUILD_REPORT, text.encode())

