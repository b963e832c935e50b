"""The levels that need a GPU (kernels, end_to_end) on a bundle's files: run by `deepjit build` when
its machine has a GPU, and by `deepjit validate BUNDLE` on the GPU machine later, which records them
in the bundle."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import onnx
import yaml

from ..bundle.folder import Bundle, read_bundle
from ..graph.tensors import TensorSig
from .end_to_end import end_to_end_level
from .executor import onnx_step
from .gate import LevelResult, OutputResult, not_run
from .kernels import kernels_level


def spec_of(bundle: Bundle):
    """The bundle's spec (its text is in the bundle); paths resolve inside the bundle, unused here."""
    from ..spec.models import Spec

    return Spec.model_validate(yaml.safe_load(bundle.file("spec.yaml").read_text()),
                               context={"base": bundle.root})


def _sigs(items) -> tuple[TensorSig, ...]:
    return tuple(TensorSig.from_dict(t) for t in items)


def _steps(bundle: Bundle) -> list[SimpleNamespace]:
    steps = []
    for s in bundle.manifest["plan"]["steps"]:
        file = s.get("file") or s["reference"]
        steps.append(SimpleNamespace(**s, inputs_sig=_sigs(s["inputs"]), outputs_sig=_sigs(s["outputs"]),
                                     onnx=onnx.load(str(bundle.file(file)))))
    return steps


def _cpu_tensors(step_fns, feed) -> dict:
    """Every tensor of the pipeline with the bundle's segments and references on the CPU."""
    env = dict(feed)
    for run in step_fns:
        env.update(run(env))
    return env


def run_gpu_levels(bundle_path: Path | Bundle, spec=None, report_dir: Path | None = None) -> list[LevelResult]:
    from ..runtime.gpu import Gpu
    from .data import feeds_for

    bundle = bundle_path if isinstance(bundle_path, Bundle) else read_bundle(bundle_path)
    spec = spec or spec_of(bundle)
    steps = _steps(bundle)
    plan = SimpleNamespace(inputs=_sigs(bundle.manifest["plan"]["inputs"]))
    feeds = feeds_for(spec, plan)
    step_fns = [onnx_step(s.onnx) for s in steps]  # one ONNX Runtime session per step, for every feed
    envs = [_cpu_tensors(step_fns, f) for f in feeds]
    gpu = Gpu()
    return [kernels_level(gpu, bundle, steps, envs, spec, report_dir),
            end_to_end_level(bundle, steps, feeds, spec, report_dir)]


def gpu_levels(bundle_path: Path | None, spec, report_dir: Path | None = None) -> list[LevelResult]:
    """The kernels and end_to_end levels, where this machine has a GPU; recorded as not run elsewhere."""
    from ..engines import local_device_sm

    if local_device_sm() is None:
        why = "no GPU on this machine: run `deepjit validate BUNDLE` on one"
        return [not_run("kernels", why), not_run("end_to_end", why)]
    from .gpu import run_gpu_levels

    return run_gpu_levels(bundle_path, spec, report_dir)


def validate_bundle(bundle_path: Path) -> tuple[Bundle, list[LevelResult]]:
    """Re-run the levels this machine can run (GPU levels; the engine level where plans exist) and
    record them in the bundle. graph and precision results stay as the build recorded them."""
    from ..bundle.folder import update_bundle
    from ..engines import local_device_sm
    from .gate import GateReport, not_run

    if not Path(bundle_path).is_dir():
        from ..errors import BundleError

        raise BundleError(f"{bundle_path}: `deepjit validate` records its results in a bundle folder; "
                          "unpack the archive first (`deepjit pull REF DIR`)")
    bundle = read_bundle(bundle_path)
    record = bundle.manifest["validation"]["levels"]
    if local_device_sm() is None:
        raise_no_gpu()
    levels = run_gpu_levels(bundle, report_dir=Path(f"{bundle.root}.report"))  # verified once, above
    if not bundle.manifest["engine"].get("plans"):
        levels.append(not_run("engine", "no TensorRT plans in the bundle: `deepjit materialize` on the target"))
    kept = [LevelResult(name, lv["status"], lv.get("reason", ""), tuple(
        OutputResult(o, v["passed"], v["max_abs"], v["median_abs"], v["max_rel"], v["median_rel"], v["detail"])
        for o, v in lv.get("outputs", {}).items())) for name, lv in record.items()]
    report = GateReport({lv.level: lv for lv in kept}).with_levels(*levels)
    update_bundle(Path(bundle_path), {}, {"validation": report.to_record()})
    return read_bundle(bundle_path), levels


def raise_no_gpu():
    from ..errors import MissingDependency

    raise MissingDependency("`deepjit validate` runs the kernels and end_to_end levels, which need an NVIDIA GPU; "
                            "none is available here")
