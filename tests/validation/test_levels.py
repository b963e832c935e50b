"""The levels a build records besides graph (test_reassembly.py): precision on the CPU, engine where
plans exist, and the GPU levels, recorded as not run without a GPU. The kernels level's grouping of a
bundle's steps into chains and twins, from the contracts' roles, is checked here without a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from conftest_models import tiny_detector

from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.engines.base import Decision
from deepjit_compiler.errors import MissingDependency
from deepjit_compiler.jit.contracts import declared_detections
from deepjit_compiler.spec.load import load_spec
from deepjit_compiler.surgery.cut import plan_from_model
from deepjit_compiler.validation import gpu as gpu_levels_mod
from deepjit_compiler.validation.data import Feeds, feeds_for
from deepjit_compiler.validation.end_to_end import end_to_end_level
from deepjit_compiler.validation.engine import engine_level
from deepjit_compiler.validation.kernels import _Check, _kernel_runs
from deepjit_compiler.validation.precision import precision_stage


@pytest.fixture(scope="module")
def detector_spec(tmp_path_factory):
    """A spec for tiny_detector with NMS added (its inputs and validation data are what the levels read)."""
    folder = tmp_path_factory.mktemp("levels")
    import onnx

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
    from deepjit_compiler.jit.contracts import load_contract, resolve_params

    contract = load_contract("yolov8_decode")
    facts = {"reg_max": 16, "num_classes": 80, "strides": [8, 16, 32], "anchors": 8400,
             "levels": [[80, 80], [40, 40], [20, 20]]}
    params = resolve_params(contract, {"lanes_per_anchor": 4, "large_batch_lanes": 2, "large_batch": large_batch},
                            facts)
    kernels = [(SimpleNamespace(contract_path=str(contract.path), params=params), {})]
    bundle = SimpleNamespace(inputs=[SimpleNamespace(buckets=(1, 2, 4, 8))])
    check = _Check(None, bundle, {}, [], SimpleNamespace(validation=SimpleNamespace(tolerances=None)), None)
    rng = np.random.default_rng(0)
    feeds = Feeds([{"cls_0": rng.normal(size=(b, 80, 3)).astype(np.float32), "scale": np.float32(2.0)}
                   for b in feed_batches], [[f"f{k} r{i}" for i in range(b)] for k, b in enumerate(feed_batches)])
    out = check._every_bucket(kernels, feeds)
    assert [len(rows) for rows in out.labels] == [*feed_batches, *extra]
    for k, bucket in enumerate(extra, start=len(feed_batches)):
        take = np.arange(bucket) % feed_batches[0]
        np.testing.assert_array_equal(out[k]["cls_0"], feeds[0]["cls_0"][take])
        assert out[k]["scale"] == np.float32(2.0)  # not a batch: as it is
        assert out.labels[k] == [f"f0 r{i} (batch {bucket})" for i in take]
