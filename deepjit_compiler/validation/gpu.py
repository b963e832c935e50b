"""The levels that need a GPU (kernels, end_to_end, and engine where a plan runs on it) on a bundle's
files: run by `deepjit build` when its machine has a GPU, and by `deepjit validate BUNDLE` on the GPU
machine later, which records them in the bundle."""
from __future__ import annotations

from pathlib import Path

import onnx

from ..bundle.folder import read_bundle, update_bundle
from ..bundle.view import BundleView
from ..engines import local_device_sm
from ..errors import BundleError, MissingDependency
from ..graph.steps import StepRunner
from ..runtime.gpu import Gpu
from .data import Feeds, feeds_for, row_labels
from .end_to_end import end_to_end_level
from .engine import bundle_plans_level
from .gate import GateReport, LevelResult, check_report_folder, not_run
from .kernels import kernels_level


def run_gpu_levels(bundle: Path | BundleView, spec=None, report_dir: Path | None = None,
                   original: onnx.ModelProto | None = None, *, engine: str = "auto") -> list[LevelResult]:
    """The kernels and end_to_end levels on this GPU, and the engine level where a plan runs on it;
    `spec`: the build's (default: the bundle's own); `original`: the fp32 model (default: the bundle's
    copy, if it carries one); `engine`: how end_to_end runs the segments."""
    view = read_bundle(bundle)
    spec = spec or view.spec()
    models = {s.name: view.onnx(s.file) for s in view.steps}
    cpu = StepRunner((s.name, models[s.name]) for s in view.steps)  # one ONNX Runtime session per step
    feeds = feeds_for(spec, view.inputs)
    envs = Feeds([cpu.tensors(f) for f in feeds], row_labels(feeds))
    gpu = Gpu()
    levels = [kernels_level(gpu, view, models, envs, spec, report_dir),
              end_to_end_level(view, models, feeds, spec, report_dir, original, engine=engine)]
    plans = bundle_plans_level(view, spec, gpu.sm, engine=engine)
    return levels + ([plans] if plans is not None else [])


def gpu_levels(bundle: BundleView, spec, report_dir: Path | None = None,
               original: onnx.ModelProto | None = None) -> list[LevelResult]:
    """The kernels and end_to_end levels, where this machine has a GPU; recorded as not run elsewhere."""
    if local_device_sm() is None:
        why = "no GPU on this machine: run `deepjit validate BUNDLE` on one"
        return [not_run("kernels", why), not_run("end_to_end", why)]
    return run_gpu_levels(bundle, spec, report_dir, original)


def validate_bundle(bundle_path: Path, *, engine: str = "auto",
                    data: Path | None = None) -> tuple[BundleView, list[LevelResult]]:
    """Re-run the levels this machine can run (GPU levels; the engine level where plans exist) and
    record them in the bundle. graph and precision results stay as the build recorded them. `data`: a
    folder of validation data here, instead of what the bundle's spec names."""
    if not Path(bundle_path).is_dir():
        raise BundleError(f"{bundle_path}: `deepjit validate` records its results in a bundle folder; "
                          "unpack the archive first (`deepjit pull REF DIR`)")
    view = read_bundle(bundle_path)
    report_dir = Path(f"{view.root}.report")  # as the build names it, and refused as it refuses it
    check_report_folder(report_dir)
    spec = view.spec(data)  # before the GPU check: a bad data folder is named wherever validate runs
    if local_device_sm() is None:
        raise_no_gpu()
    levels = run_gpu_levels(view, spec, report_dir=report_dir, engine=engine)
    if not view.engine.plans:
        levels.append(not_run("engine", "no TensorRT plans in the bundle: `deepjit materialize` on the target"))
    report = GateReport.from_record(view.levels).with_levels(*levels)
    update_bundle(Path(bundle_path), {}, {"validation": report.to_record()})
    return read_bundle(bundle_path), levels


def raise_no_gpu():
    raise MissingDependency("`deepjit validate` runs the kernels and end_to_end levels, which need an NVIDIA GPU; "
                            "none is available here")
