"""The levels a build records besides graph (test_reassembly.py): precision on the CPU, engine where
plans exist, and the GPU levels, recorded as not run without a GPU. The kernels level's grouping of a
bundle's steps into chains and twins, from the contracts' roles, is checked here without a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from conftest_models import chain_model, tiny_detector

from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.engines.base import Decision, EngineArtifact, PlanInfo
from deepjit_compiler.errors import EngineError, MissingDependency, SpecError
from deepjit_compiler.jit.contracts import declared_detections, load_contract, resolve_params
from deepjit_compiler.spec.load import load_spec
from deepjit_compiler.surgery.cut import plan_from_model
from deepjit_compiler.surgery.plan import CutRequest, KernelRequest
from deepjit_compiler.validation import gpu as gpu_levels_mod
from deepjit_compiler.validation.data import Feeds, feeds_for
from deepjit_compiler.validation.end_to_end import end_to_end_level
from deepjit_compiler.validation.engine import bundle_plans_level, engine_level
from deepjit_compiler.validation.kernels import _Check, _kernel_runs, _report_name
from deepjit_compiler.validation.precision import precision_stage

FACTS = {"reg_max": 16, "num_classes": 80, "strides": [8, 16, 32], "anchors": 8400,
         "levels": [[80, 80], [40, 40], [20, 20]]}  # yolov8's head at 640


@pytest.fixture(scope="module")
def detector_spec(tmp_path_factory):
    """A spec for tiny_detector with NMS added (its inputs and validation data are what the levels read)."""
    folder = tmp_path_factory.mktemp("levels")
    onnx.save(tiny_detector(), folder / "tiny.onnx")
    (folder / "spec.yaml").write_text(
        "name: tiny\nmodel: {path: tiny.onnx}\ntarget: {gpu: T4}\n"
        "inputs:\n  images: {shape: [N, 3, 32, 32], profile: {min: [1, 3, 32, 32], opt: [2, 3, 32, 32], max: [2, 3, 32, 32]}}\n"
        "engine: {precision: fp16}\n"
        "cuts:\n  - {name: nms, add: after, at: output0, kernels: [{contract: nms, params: {max_det: 20, conf_threshold: 0.01}}]}\n"
        "validation:\n  samples: 2\n  data: {random: {ranges: {images: [0.0, 1.0]}}}\n")
    return load_spec(folder / "spec.yaml")


def test_precision_level_measures_the_rewrite_and_compares_detections_as_sets(detector_spec):
    spec = detector_spec.spec
    model = tiny_detector()
    plan = plan_from_model(model, spec.cuts)
    feeds = feeds_for(spec, plan.inputs)
    assert [f["images"].shape for f in feeds] == [(2, 3, 32, 32)] * 2
    detections = declared_detections([("nms", {})])
    segments, level = precision_stage(spec, plan, model, feeds, None, detections)
    assert set(segments) == {"segment"} and level.status == "passed"
    assert "fp16 segments vs the fp32 model" == level.reason
    assert {o.name for o in level.outputs} == {"detections"}   # NMS outputs as sets, nothing dense
    # conf_threshold 0.01 above: tiny_detector's scores stay below the default 0.25, and two empty sets
    # would match perfectly whatever the rewrite did
    assert level.outputs[0].metrics["reference"] > 0
    _, dense = precision_stage(spec, plan, model, feeds, None, ())
    assert {o.name for o in dense.outputs} == {"num_dets", "boxes", "scores", "classes"}
    assert dense.status == "passed"


def with_engine(spec, **fields):
    return spec.model_copy(update={"engine": spec.engine.model_copy(update=fields)})


def test_the_precision_level_compares_the_cut_sites_outputs_too(detector_spec):
    """A cut's output (what its kernel writes: `mid` here) is compared, as well as the pipeline's."""
    model = chain_model()
    plan = plan_from_model(model, [CutRequest("soft", inputs=["a"], outputs=["mid"], kernels=(KernelRequest("soft"),))])
    rng = np.random.default_rng(8)
    feeds = [{"x": rng.uniform(0, 1, (2, 4, 8, 8)).astype(np.float32)} for _ in range(2)]
    _, level = precision_stage(detector_spec.spec, plan, model, feeds)
    assert {o.name for o in level.outputs} == {"y", "mid"} and level.status == "passed"


def test_the_specs_keep_fp32_reaches_the_rewrite_and_a_misspelt_entry_is_refused(detector_spec):
    """tiny_detector's one Conv: its weights are fp16 by default, fp32 when keep_fp32 names Conv."""
    plan = plan_from_model(tiny_detector(), detector_spec.spec.cuts)
    feeds = feeds_for(detector_spec.spec, plan.inputs)
    weights = {}
    for keep in (None, ["Conv"]):
        segments, _ = precision_stage(with_engine(detector_spec.spec, keep_fp32=keep), plan, tiny_detector(), feeds)
        weights[keep and keep[0]] = {i.name: i.data_type for i in segments["segment"].graph.initializer}["w"]
    assert weights == {None: onnx.TensorProto.FLOAT16, "Conv": onnx.TensorProto.FLOAT}
    with pytest.raises(SpecError, match=r"engine.keep_fp32\[0\]: 'Cnov' is neither an ONNX op type nor a node name"):
        precision_stage(with_engine(detector_spec.spec, keep_fp32=["Cnov"]), plan, tiny_detector(), feeds)


def test_fp32_precision_level_is_the_models_own(detector_spec):
    spec = detector_spec.spec.model_copy(update={"engine": detector_spec.spec.engine.model_copy(update={"precision": "fp32"})})
    plan = plan_from_model(tiny_detector(), spec.cuts)
    segments, level = precision_stage(spec, plan, tiny_detector(), [], None)
    assert level.status == "passed" and "fp32" in level.reason and level.outputs == ()


def test_engine_level_runs_only_where_plans_were_built():
    deferred = engine_level(Decision("tensorrt", True, "no TensorRT here"), [])
    assert deferred.status == "not_run" and deferred.reason == "no TensorRT here"
    ort = engine_level(Decision("onnxruntime", False, "engine.backend is onnxruntime"), [])
    assert ort.status == "not_run" and "no plans to check" in ort.reason


def _plan(file: str, ccs: tuple[str, ...]) -> PlanInfo:
    return PlanInfo(file, "tensorrt-rtx", "tensorrt_rtx", "1.7.1", ccs, 12, ({"name": "images", "dtype": "float16"},),
                    ({"name": "a"}, {"name": "b"}), {}, "k" * 64, size=2_450_000)


def test_the_engine_level_of_built_plans_says_what_was_built_and_where_it_runs():
    arts = [EngineArtifact("tensorrt-rtx", "seg", plan=_plan("seg.rtx.plan", ("8.6",))),
            EngineArtifact("tensorrt-rtx", "head", plan=_plan("head.rtx.plan", ("7.5",))),
            EngineArtifact("onnxruntime", "deferred")]
    level = engine_level(Decision("tensorrt-rtx", False, "ahead of time"), arts)
    line = ("{}: tensorrt-rtx 1.7.1 plan for compute capability {}, 2.5 MB, 12 network layers, inputs images float16 "
            "-> 2 outputs (engine.plans in the manifest lists its I/O and profile)")
    assert (level.level, level.status) == ("engine", "not_run")
    assert level.reason == ("built " + line.format("seg.rtx.plan", "8.6") + "; " + line.format("head.rtx.plan", "7.5")
                            + ". Running the plans against ONNX Runtime needs a GPU of compute capability 7.5, 8.6 "
                            "(`deepjit validate BUNDLE` there)")
    anywhere = engine_level(Decision("tensorrt", False, "this GPU"), [EngineArtifact("tensorrt", "seg",
                                                                                       plan=_plan("seg.plan", ()))])
    assert "plan for compute capability its build GPU" in anywhere.reason
    assert anywhere.reason.endswith("needs the GPU they were built on (`deepjit validate BUNDLE` there)")


def test_a_bundles_plans_that_cannot_run_here_leave_the_engine_level_to_its_record(t4_build):
    """No GPU here: TensorRT-RTX refuses the T4 bundle's plan, so no engine level is run; asked for as a plan,
    the engine is an EngineError saying why; with the engine on ONNX Runtime no plan is looked at."""
    view = read_bundle(t4_build.bundle.path)
    assert view.engine.plans and bundle_plans_level(view, view.spec(), 75) is None
    assert bundle_plans_level(view, view.spec(), 75, engine="onnxruntime") is None
    with pytest.raises(EngineError, match="the engine was asked for as a plan, and no plan runs here: .+"):
        bundle_plans_level(view, view.spec(), 75, engine="plan")


def test_gpu_levels_without_a_gpu_are_recorded_as_not_run(monkeypatch):
    monkeypatch.setattr(gpu_levels_mod, "local_device_sm", lambda: None)
    kernels, end_to_end = gpu_levels_mod.gpu_levels(None, None)
    assert (kernels.level, kernels.status, end_to_end.level, end_to_end.status) == \
        ("kernels", "not_run", "end_to_end", "not_run")
    assert "deepjit validate BUNDLE" in kernels.reason


def test_validate_bundle_needs_a_gpu(t4_build, monkeypatch):
    monkeypatch.setattr(gpu_levels_mod, "local_device_sm", lambda: None)
    with pytest.raises(MissingDependency, match="need an NVIDIA GPU"):
        gpu_levels_mod.validate_bundle(t4_build.bundle.path)


def test_end_to_end_is_not_run_on_a_bundle_without_its_reference_model(t4_build):
    """A deployed bundle does not carry the fp32 model: `deepjit validate` records why end_to_end did
    not run instead of failing (the build itself compares against the model it has)."""
    view = read_bundle(t4_build.bundle.path)
    assert view.reference_model is None
    level = end_to_end_level(view, {}, [], view.spec())
    assert (level.level, level.status) == ("end_to_end", "not_run")
    assert "bundle.reference_model: true" in level.reason


def test_kernel_steps_run_as_chains_between_segments():
    step = lambda name, kind: SimpleNamespace(name=name, kind=kind)  # noqa: E731
    steps = [step("letterbox", "added"), step("segment", "segment"), step("decode", "kernel"), step("nms", "added")]
    assert [[s.name for s in run] for run in _kernel_runs(steps)] == [["letterbox"], ["decode", "nms"]]
    assert _kernel_runs([step("segment", "segment")]) == []


def test_the_decode_is_checked_as_its_twin_and_nms_in_the_chain(t4_build):
    """The T4 bundle's decode writes candidates, not its cut's output0: its contract's twin is checked
    alone; nms writes its step's outputs and is only checked in the chain decode + nms."""
    view = read_bundle(t4_build.bundle.path)
    check = _Check(None, view, {}, [], SimpleNamespace(validation=SimpleNamespace(tolerances=None)), None)
    decode, nms = view.step("decode"), view.step("nms")
    assert check.needs_twin(decode, decode.kernels[0])
    assert not check.needs_twin(nms, nms.kernels[0])
    assert check._external_inputs([decode, nms]) == [t.name for t in decode.inputs]  # output0 is made inside


@pytest.mark.parametrize("feed_batches, large_batch, extra", [((2, 2), 4, [4]), ((2, 4), 4, []), ((2, 2), 16, []),
                                                              ((1,), 2, [2])])
def test_the_kernels_level_runs_each_kernel_a_bucket_can_launch(feed_batches, large_batch, extra):
    """A decode with large_batch_lanes launches another kernel from large_batch on: where no feed's batch
    reaches it but a bucket does, the first feed's rows repeated up to that bucket are checked too."""
    contract = load_contract("yolov8_decode")
    params = resolve_params(contract, {"lanes_per_anchor": 4, "large_batch_lanes": 2, "large_batch": large_batch},
                            FACTS)
    kernels = [(SimpleNamespace(contract_path=str(contract.path), params=params), {})]
    bundle = SimpleNamespace(inputs=[SimpleNamespace(buckets=(1, 2, 4, 8))])
    check = _Check(None, bundle, {}, [], SimpleNamespace(validation=SimpleNamespace(tolerances=None)), None)
    rng = np.random.default_rng(0)
    feeds = Feeds([{"cls_0": rng.normal(size=(b, 80, 3)).astype(np.float32), "scale": np.float32(2.0),
                    "strides": np.array([8.0, 16.0, 32.0], np.float32)} for b in feed_batches], [[f"f{k} r{i}" for i in range(b)] for k, b in enumerate(feed_batches)])
    out = check._every_bucket(kernels, feeds)
    assert [len(rows) for rows in out.labels] == [*feed_batches, *extra]
    for k, bucket in enumerate(extra, start=len(feed_batches)):
        take = np.arange(bucket) % feed_batches[0]
        np.testing.assert_array_equal(out[k]["cls_0"], feeds[0]["cls_0"][take])
        assert out[k]["scale"] == np.float32(2.0)  # not a batch: as it is
        np.testing.assert_array_equal(out[k]["strides"], [8.0, 16.0, 32.0])  # its first dim is not the batch
        assert out.labels[k] == [f"f0 r{i} (batch {bucket})" for i in take]


def _decode(mode: str):
    """yolov8_decode at 640 in `mode`, as the kernels level holds a compiled kernel: (its contract, params)."""
    contract = load_contract("yolov8_decode")
    return contract, resolve_params(contract, {"mode": mode}, FACTS)


def _tensors(*names: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=n) for n in names]


HEADS = ("box_0", "box_1", "box_2", "cls_0", "cls_1", "cls_2")


@pytest.mark.parametrize("mode, twin", [("output0", False), ("candidates", True)])
def test_a_kernel_is_checked_as_its_twin_only_where_it_does_not_write_its_steps_outputs(mode, twin):
    contract, params = _decode(mode)
    check = _Check(None, SimpleNamespace(contract=lambda kernel: contract), {}, [],
                   SimpleNamespace(validation=SimpleNamespace(tolerances=None)), None)
    step = SimpleNamespace(inputs=_tensors(*HEADS), outputs=_tensors("output0"))
    assert check.needs_twin(step, SimpleNamespace(params=params)) is twin


def _compare(envs, kernels, steps):
    check = _Check(None, None, {}, envs, SimpleNamespace(validation=SimpleNamespace(tolerances=None)), None)
    compiled = [(SimpleNamespace(contract_path=str(c.path), params=p), {}) for c, p in kernels]
    return check._compare("decode", compiled, steps, (), "yolov8_decode")


def test_a_chain_that_writes_none_of_its_steps_outputs_fails_naming_them():
    rng = np.random.default_rng(12)
    envs = [{n: rng.normal(size=(1, 4)).astype(np.float32) for n in HEADS}]
    step = SimpleNamespace(inputs=_tensors(*HEADS), outputs=_tensors("output0"))
    (result,) = _compare(envs, [_decode("candidates")], [step])
    assert (result.name, result.passed) == ("decode/outputs", False)
    assert result.detail == "yolov8_decode writes none of its steps' outputs (output0)"


def test_a_chain_input_no_step_makes_on_the_cpu_fails_naming_it():
    """The decode writes candidates that the nms after it reads: those are not asked of the CPU; a tensor
    the steps' references read and no step makes is."""
    rng = np.random.default_rng(13)
    envs = [{n: rng.normal(size=(1, 4)).astype(np.float32) for n in HEADS[1:]}]
    nms = load_contract("nms")
    steps = [SimpleNamespace(inputs=_tensors(*HEADS[1:], "scale"), outputs=_tensors("output0")),
             SimpleNamespace(inputs=_tensors("output0"), outputs=_tensors("num_dets", "boxes", "scores", "classes"))]
    missing_head, missing_scale = (_compare(envs, [_decode("candidates"), (nms, resolve_params(nms, {}, FACTS))], steps),
                                   _compare([{**envs[0], "box_0": envs[0]["box_1"]}],
                                            [_decode("candidates"), (nms, resolve_params(nms, {}, FACTS))], steps))
    assert [(r.name, r.passed, r.detail) for r in missing_head] == [
        ("decode/inputs", False, "yolov8_decode reads 'box_0', which no step of the bundle makes on the CPU")]
    assert [r.detail for r in missing_scale] == ["yolov8_decode reads 'scale', which no step of the bundle makes on "
                                                 "the CPU"]


def test_a_long_chains_report_name_keeps_a_digest_of_its_tail():
    """A RunResults file is named by the chain: a long chain's name is cut to fit a file name, and two
    chains that differ only past the cut keep different names."""
    long_a, long_b = "+".join(f"step{i:03d}" for i in range(40)), "+".join(f"step{i:03d}" for i in range(41))
    assert _report_name("decode+nms") == "kernels.decode+nms"
    names = {_report_name(long_a), _report_name(long_b)}
    assert len(names) == 2 and all(len(n) == 200 and n.startswith("kernels.step000+step001") for n in names)
