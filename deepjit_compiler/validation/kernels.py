"""The kernels level (GPU): each kernel against its reference, on the reference's own inputs
(computed on the CPU by the bundle's segments and references, so a kernel is judged alone)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import onnx

from ..bundle.view import BundleView, KernelView
from ..graph.compose import compose_reference
from ..jit.contracts import load_contract
from ..jit.nvrtc import compile_site_kernel
from ..runtime.launch import ContractKernel, Letterbox, Postprocess, decode_input_names
from ..runtime.pipeline import compiled_from_manifest
from .executor import onnxrt_runner
from .gate import FunctionRunner, LevelResult, OutputResult, compare_runs, from_outputs


def _compiled(bundle: BundleView, kernel: KernelView):
    return compiled_from_manifest(bundle, kernel.entry)


def kernels_level(gpu, bundle: BundleView, models: Mapping[str, onnx.ModelProto], envs, spec,
                  report_dir: Path | None = None) -> LevelResult:
    """`models`: each step's ONNX (segment or reference); `envs`: every tensor of the pipeline on the
    CPU, per validation feed."""
    outputs: list[OutputResult] = []
    tol = spec.validation.tolerances
    det = tol.detections.model_dump()
    sites = {s.name: s for s in bundle.steps if s.kind == "kernel"}
    for step in bundle.steps:
        if step.kind == "segment":
            continue
        for kernel in step.kernels:
            check = _CHECKS.get(kernel.contract, _generic)
            result = check(gpu, bundle, models, step, kernel, envs, tol, det, sites,
                           dict(report_dir=report_dir, report_name=f"kernels.{step.name}.{kernel.contract}"))
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


def _decode_output0(gpu, bundle, models, step, kernel, envs, tol, det, sites, report) -> LevelResult:
    """The decode compiled in `output0` mode for this GPU, against the cut subgraph."""
    contract = str(bundle.file(kernel.files["contract"]))  # the bundle's copy of the contract
    params = output0_twin_params(kernel.params, load_contract(contract).model.params)
    compiled = compile_site_kernel(contract, params, None, sm=gpu.sm)
    twin = ContractKernel(gpu, compiled)
    names = decode_input_names(step.facts)

    def run(feed):
        inputs = {k: gpu.upload(feed[v]) for k, v in names.items()}
        dims = twin.bind(inputs)
        outs = twin.allocate_outputs(dims)
        twin.launch({**inputs, **outs}, dims)
        return {"output0": gpu.download(outs["output0"])}

    return compare_runs("kernels", onnxrt_runner(models[step.name], "reference"), FunctionRunner(run, "decode"),
                        _feeds(envs, step.inputs), tol, **report)


def _nms_chain(gpu, bundle, models, step, kernel, envs, tol, det, sites, report) -> LevelResult:
    """nms reads the decode's candidates: the bundle's decode + nms binaries, against both references."""
    site = next(iter(sites.values()))
    decode = _compiled(bundle, site.kernels[0])
    nms = _compiled(bundle, kernel)
    names = decode_input_names(site.facts)

    def run(feed):
        chain = Postprocess(gpu, decode, nms, {k: gpu.upload(feed[v]) for k, v in names.items()})
        chain.launch()
        return chain.results()

    reference = compose_reference(models[site.name], [(step.name, "after", models[step.name])])
    return compare_runs("kernels", onnxrt_runner(reference, "reference"), FunctionRunner(run, "decode+nms"),
                        _feeds(envs, site.inputs), tol, detection_params=det, **report)


def _letterbox(gpu, bundle, models, step, kernel, envs, tol, det, sites, report) -> LevelResult:
    compiled = _compiled(bundle, kernel)

    def run(feed):
        lb = Letterbox(gpu, compiled, gpu.upload(feed["raw_images"]))
        lb.launch()
        return lb.results()

    return compare_runs("kernels", onnxrt_runner(models[step.name], "reference"), FunctionRunner(run, "letterbox"),
                        _feeds(envs, step.inputs), tol, **report)


def _generic(gpu, bundle, models, step, kernel, envs, tol, det, sites, report) -> LevelResult:
    """A user's contract: its inputs and outputs carry the reference's tensor names."""
    loaded = ContractKernel(gpu, _compiled(bundle, kernel))

    def run(feed):
        inputs = {s.name: gpu.upload(feed[s.name]) for s in loaded.inputs}
        dims = loaded.bind(inputs)
        outs = loaded.allocate_outputs(dims)
        loaded.launch({**inputs, **outs}, dims)
        return {k: gpu.download(v) for k, v in outs.items()}

    return compare_runs("kernels", onnxrt_runner(models[step.name], "reference"), FunctionRunner(run, kernel.contract),
                        _feeds(envs, step.inputs), tol, **report)


_CHECKS = {"yolov8_decode": _decode_output0, "nms": _nms_chain, "letterbox": _letterbox}
