"""The levels that need a GPU (kernels, end_to_end), run on a built bundle.

`deepjit build` runs them when its machine has a GPU; `deepjit validate BUNDLE` runs them on the
GPU machine later and updates the bundle's validation record.

kernels: each kernel against its reference on the reference's own inputs (computed on the CPU by the
bundle's segments and references, so a kernel is judged alone): yolov8_decode in `output0` mode
against the cut subgraph, nms (fed by the decode's candidates, as in the pipeline) against the decode
and NMS references, letterbox against its reference, any other contract by output name.
end_to_end: the loaded pipeline (engine + kernels, CUDA graphs) against the original model with the
added stages' references around it.
"""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import onnx
import yaml

from .bundle import Bundle, read_bundle
from .executor import compose_reference, onnx_step, onnxrt_runner
from .gate import FunctionRunner, LevelResult, OutputResult, compare_runs, from_outputs
from .onnxutil import TensorSig

log = logging.getLogger("deepjit.validation")


def spec_of(bundle: Bundle):
    """The bundle's spec (its text is in the bundle); paths resolve inside the bundle, unused here."""
    from .spec import Spec

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
    from .gpu import Gpu
    from .levels import feeds_for

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


def _compiled(bundle: Bundle, entry: dict):
    from .runtime import compiled_from_manifest

    return compiled_from_manifest(bundle, entry)


def kernels_level(gpu, bundle: Bundle, steps, envs, spec, report_dir: Path | None = None) -> LevelResult:
    outputs: list[OutputResult] = []
    tol = spec.validation.tolerances
    det = tol.detections.model_dump()
    sites = {s.name: s for s in steps if s.kind == "kernel"}
    for step in steps:
        if step.kind == "segment":
            continue
        for entry in step.kernels:
            check = _CHECKS.get(entry["contract"], _generic)
            result = check(gpu, bundle, step, entry, envs, tol, det, sites,
                           dict(report_dir=report_dir, report_name=f"kernels.{step.name}.{entry['contract']}"))
            outputs += [OutputResult(f"{step.name}/{o.name}", o.passed, o.max_abs, o.median_abs, o.max_rel,
                                     o.median_rel, o.detail) for o in result.outputs]
    return from_outputs("kernels", outputs, f"each kernel against its reference on sm_{gpu.sm} ({gpu.name})")


def _feeds(envs, sigs) -> list[dict]:
    return [{t.name: env[t.name] for t in sigs} for env in envs]


def output0_twin_params(params: dict, declared) -> dict:
    """Params of the decode's `output0` twin: the bundle's declared params (its manifest also lists
    derived values), in mode output0, with the candidates-only lane split off."""
    twin = {k: v for k, v in params.items() if k in declared}
    return {**twin, "mode": "output0", **({"lanes_per_anchor": 1} if "lanes_per_anchor" in declared else {})}


def _decode_output0(gpu, bundle, step, entry, envs, tol, det, sites, report) -> LevelResult:
    """The decode compiled in `output0` mode for this GPU, against the cut subgraph."""
    from .contracts import load_contract
    from .kernel_launch import ContractKernel, decode_input_names
    from .nvrtc import compile_site_kernel

    contract = str(bundle.file(entry["files"]["contract"]))  # the bundle's copy of the contract
    params = output0_twin_params(entry["params"], load_contract(contract).model.params)
    compiled = compile_site_kernel(contract, params, None, sm=gpu.sm)
    kernel = ContractKernel(gpu, compiled)
    names = decode_input_names(step.facts)

    def run(feed):
        inputs = {k: gpu.upload(feed[v]) for k, v in names.items()}
        dims = kernel.bind(inputs)
        outs = kernel.allocate_outputs(dims)
        kernel.launch({**inputs, **outs}, dims)
        return {"output0": gpu.download(outs["output0"])}

    return compare_runs("kernels", onnxrt_runner(step.onnx, "reference"), FunctionRunner(run, "decode"),
                        _feeds(envs, step.inputs_sig), tol, **report)


def _nms_chain(gpu, bundle, step, entry, envs, tol, det, sites, report) -> LevelResult:
    """nms reads the decode's candidates: the bundle's decode + nms binaries, against both references."""
    from .kernel_launch import Postprocess, decode_input_names

    site = next(iter(sites.values()))
    decode = _compiled(bundle, site.kernels[0])
    nms = _compiled(bundle, entry)
    names = decode_input_names(site.facts)

    def run(feed):
        chain = Postprocess(gpu, decode, nms, {k: gpu.upload(feed[v]) for k, v in names.items()})
        chain.launch()
        return chain.results()

    nms_ref = SimpleNamespace(name=step.name, position="after", reference=step.onnx, inputs=step.inputs_sig,
                              outputs=step.outputs_sig)
    reference = compose_reference(site.onnx, [nms_ref])
    return compare_runs("kernels", onnxrt_runner(reference, "reference"), FunctionRunner(run, "decode+nms"),
                        _feeds(envs, site.inputs_sig), tol, detection_params=det, **report)


def _letterbox(gpu, bundle, step, entry, envs, tol, det, sites, report) -> LevelResult:
    from .kernel_launch import Letterbox

    compiled = _compiled(bundle, entry)

    def run(feed):
        lb = Letterbox(gpu, compiled, gpu.upload(feed["raw_images"]))
        lb.launch()
        return lb.results()

    return compare_runs("kernels", onnxrt_runner(step.onnx, "reference"), FunctionRunner(run, "letterbox"),
                        _feeds(envs, step.inputs_sig), tol, **report)


def _generic(gpu, bundle, step, entry, envs, tol, det, sites, report) -> LevelResult:
    """A user's contract: its inputs and outputs carry the reference's tensor names."""
    from .kernel_launch import ContractKernel

    kernel = ContractKernel(gpu, _compiled(bundle, entry))

    def run(feed):
        inputs = {s.name: gpu.upload(feed[s.name]) for s in kernel.inputs}
        dims = kernel.bind(inputs)
        outs = kernel.allocate_outputs(dims)
        kernel.launch({**inputs, **outs}, dims)
        return {k: gpu.download(v) for k, v in outs.items()}

    return compare_runs("kernels", onnxrt_runner(step.onnx, "reference"), FunctionRunner(run, entry["contract"]),
                        _feeds(envs, step.inputs_sig), tol, **report)


_CHECKS = {"yolov8_decode": _decode_output0, "nms": _nms_chain, "letterbox": _letterbox}


def end_to_end_level(bundle: Bundle, steps, feeds, spec, report_dir: Path | None = None) -> LevelResult:
    """The whole loaded pipeline (graph replay) against the original model + added references."""
    from .runtime import Pipeline

    added = [SimpleNamespace(name=s.name, position=s.position, reference=s.onnx, inputs=s.inputs_sig,
                             outputs=s.outputs_sig) for s in steps if s.kind == "added"]
    reference = compose_reference(onnx.load(str(bundle.file(bundle.manifest["model"]["file"]))), added)
    lossy = bundle.manifest["engine"]["precision"] != "fp32"
    tol = spec.validation.precision_tolerances if lossy else spec.validation.tolerances
    with Pipeline.load(bundle) as pipeline:
        result = compare_runs("end_to_end", onnxrt_runner(reference, "reference"), FunctionRunner(pipeline, "deepjit"),
                              feeds, tol, detection_params=tol.detections.model_dump(), report_dir=report_dir)
    why = "the pipeline on this GPU (CUDA graphs) against ONNX Runtime on the original model"
    return LevelResult(result.level, result.status, why + (" (lossy precision: precision tolerances)" if lossy else ""),
                       result.outputs)


def validate_bundle(bundle_path: Path) -> tuple[Bundle, list[LevelResult]]:
    """Re-run the levels this machine can run (GPU levels; the engine level where plans exist) and
    record them in the bundle. graph and precision results stay as the build recorded them."""
    from .bundle import update_bundle
    from .engines import local_device_sm
    from .gate import GateReport, not_run

    if not Path(bundle_path).is_dir():
        from .errors import BundleError

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
    from .errors import MissingDependency

    raise MissingDependency("`deepjit validate` runs the kernels and end_to_end levels, which need an NVIDIA GPU; "
                            "none is available here")
