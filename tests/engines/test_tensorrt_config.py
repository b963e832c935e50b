"""The spec-to-TensorRT mapping (pure: no TensorRT needed), engine settings, and the `auto` decision."""
from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from deepjit_compiler.engines import (
    EngineArtifact,
    EngineSettings,
    InputProfile,
    deferred_settings,
    engine_from_segment,
    materialize,
    select_backend,
    tensorrt_importable,
)
from deepjit_compiler.engines.base import Decision
from deepjit_compiler.engines.flavours import TENSORRT, TENSORRT_RTX, flavour_of_plan
from deepjit_compiler.engines.plans import plan_key
from deepjit_compiler.engines.tensorrt import (
    config_from_settings,
    network_kwargs,
    profiles_for,
    resolve_enums,
    segment_inputs,
)
from deepjit_compiler.errors import BundleError, EngineError, MissingDependency, SpecError

IMAGES = InputProfile("images", (1, 3, 640, 640), (4, 3, 640, 640), (8, 3, 640, 640))


def settings(**kw) -> EngineSettings:
    base = dict(backend="tensorrt", precision="fp16", workspace_bytes=3 * 2**30, timing_cache=Path("/cache/t4.timing"),
                optimization_level=5, hardware_compatibility="none", profiles=(IMAGES,), target_sm=75)
    return EngineSettings(**{**base, **kw})


# -- config_from_settings -------------------------------------------------------------------------

def test_workspace_timing_cache_and_optimization_level():
    kw = config_from_settings(settings())
    assert kw["memory_pool_limits"] == {"WORKSPACE": 3 * 2**30}
    assert kw["load_timing_cache"] == "/cache/t4.timing"
    assert kw["builder_optimization_level"] == 5
    assert "load_timing_cache" not in config_from_settings(settings(timing_cache=None))


def test_profiles_carry_min_opt_max():
    (profile,) = config_from_settings(settings())["profiles"]
    assert list(profile.keys()) == ["images"]
    shapes = profile["images"]
    assert (tuple(shapes.min), tuple(shapes.opt), tuple(shapes.max)) == ((1, 3, 640, 640), (4, 3, 640, 640),
                                                                        (8, 3, 640, 640))


@pytest.mark.parametrize("level,expected", [("none", None), ("ampere_plus", "AMPERE_PLUS"),
                                            ("same_compute_capability", "SAME_COMPUTE_CAPABILITY")])
def test_hardware_compatibility(level, expected):
    kw = config_from_settings(settings(hardware_compatibility=level))
    assert kw.get("hardware_compatibility_level") == expected


@pytest.mark.parametrize("precision,flag", [("fp16", "fp16"), ("bf16", "bf16"), ("int8", "int8")])
def test_builder_flags_only_for_tensorrt_10_weakly_typed(precision, flag):
    weak = settings(precision=precision, strongly_typed=False)
    assert config_from_settings(weak, trt_version="10.9.0.34")[flag] is True
    assert network_kwargs(weak, "10.9.0.34") == {"strongly_typed": False}
    for s, version in ((weak, "11.1.0"), (settings(precision=precision), "10.9.0.34")):
        assert not {"fp16", "bf16", "int8"} & set(config_from_settings(s, trt_version=version)), version
        assert network_kwargs(s, version) == {"strongly_typed": True}
    assert not {"fp16", "bf16", "int8"} & set(config_from_settings(settings(precision="fp32", strongly_typed=False),
                                                                 trt_version="10.9"))


def test_resolve_enums_uses_tensorrts_names():
    fake_trt = SimpleNamespace(
        __version__="11.1.0",
        MemoryPoolType=enum.Enum("MemoryPoolType", "WORKSPACE DLA_MANAGED_SRAM"),
        HardwareCompatibilityLevel=enum.Enum("HardwareCompatibilityLevel", "NONE AMPERE_PLUS SAME_COMPUTE_CAPABILITY"))
    kw = resolve_enums(config_from_settings(settings(hardware_compatibility="ampere_plus")), fake_trt)
    assert kw["memory_pool_limits"] == {fake_trt.MemoryPoolType.WORKSPACE: 3 * 2**30}
    assert kw["hardware_compatibility_level"] is fake_trt.HardwareCompatibilityLevel.AMPERE_PLUS
    old_trt = SimpleNamespace(__version__="10.2.0", MemoryPoolType=fake_trt.MemoryPoolType,
                              HardwareCompatibilityLevel=enum.Enum("HardwareCompatibilityLevel", "NONE AMPERE_PLUS"))
    with pytest.raises(EngineError, match="TensorRT 10.2.0 lacks.*SAME_COMPUTE_CAPABILITY"):
        resolve_enums(config_from_settings(settings(hardware_compatibility="same_compute_capability")), old_trt)


# -- what differs for TensorRT-RTX (flavours.py), as names: no library needed -------------------------

def test_tensorrt_rtx_config_names_the_compute_capability_and_nothing_tensorrt_only():
    kw = config_from_settings(settings(hardware_compatibility="ampere_plus", strongly_typed=False),
                              trt_version="1.7.1.116", flavour=TENSORRT_RTX)
    assert kw["compute_capabilities"] == [(7, 5)]
    assert kw["memory_pool_limits"] == {"WORKSPACE": 3 * 2**30} and kw["builder_optimization_level"] == 5
    # no timing cache (it times nothing ahead of time), no hardware compatibility level, no precision flags
    assert not {"load_timing_cache", "hardware_compatibility_level", "fp16", "bf16", "int8"} & set(kw)
    assert network_kwargs(settings(strongly_typed=False), "1.7.1.116", TENSORRT_RTX) == {"strongly_typed": True}
    assert config_from_settings(settings(target_sm=120), flavour=TENSORRT_RTX)["compute_capabilities"] == [(12, 0)]
    assert "compute_capabilities" not in config_from_settings(settings(), flavour=TENSORRT)
    with pytest.raises(EngineError, match="TensorRT-RTX builds for named compute capabilities"):
        config_from_settings(settings(target_sm=None), flavour=TENSORRT_RTX)


def test_plan_files_name_their_flavour():
    assert (TENSORRT.plan_file("segment"), TENSORRT_RTX.plan_file("segment")) == ("segment.plan", "segment.rtx.plan")
    assert flavour_of_plan("engines/segment.rtx.plan") is TENSORRT_RTX
    assert flavour_of_plan("engines/segment.plan") is TENSORRT
    assert flavour_of_plan("engines/cortx.plan") is TENSORRT  # a segment whose name ends in "rtx"


RTX = (75, 80, 86, 89, 120, 121)


def test_auto_prefers_tensorrt_when_it_builds_for_the_target():
    d = select_backend(settings(backend="auto", target_sm=75), tensorrt_importable=True, device_sm=75, rtx_sms=RTX)
    assert (d.backend, d.deferred) == ("tensorrt", False)


@pytest.mark.parametrize("trt_ok,device", [(False, None), (True, None), (True, 90), (False, 75)])
def test_auto_takes_tensorrt_rtx_when_tensorrt_cannot_build_for_the_target(trt_ok, device):
    d = select_backend(settings(backend="auto", target_sm=75), tensorrt_importable=trt_ok, device_sm=device,
                       rtx_sms=RTX)
    assert (d.backend, d.deferred) == ("tensorrt-rtx", False)
    assert "TensorRT-RTX builds the plan ahead of time for compute capability 7.5 (sm_75), no GPU needed" in d.reason


def test_auto_defers_where_tensorrt_rtx_does_not_support_the_target_or_is_missing():
    d = select_backend(settings(backend="auto", target_sm=90), tensorrt_importable=False, device_sm=90, rtx_sms=RTX)
    assert (d.backend, d.deferred) == ("tensorrt", True)
    assert "TensorRT-RTX does not support 9.0 (it builds 7.5, 8.0, 8.6, 8.9, 12.0, 12.1)" in d.reason
    assert "materialize" in d.reason and "sm_90" in d.reason
    d = select_backend(settings(backend="auto", target_sm=75), tensorrt_importable=False, device_sm=None)
    assert d.deferred and "TensorRT-RTX is not importable here" in d.reason
    # backend: tensorrt never takes TensorRT-RTX
    d = select_backend(settings(backend="tensorrt", target_sm=75), tensorrt_importable=False, device_sm=None,
                       rtx_sms=RTX)
    assert (d.backend, d.deferred) == ("tensorrt", True)


def test_backend_tensorrt_rtx_builds_or_says_why_not():
    d = select_backend(settings(backend="tensorrt-rtx", target_sm=86), tensorrt_importable=True, device_sm=86,
                       rtx_sms=RTX)
    assert (d.backend, d.deferred) == ("tensorrt-rtx", False) and d.reason.startswith("engine.backend is tensorrt-rtx")
    with pytest.raises(SpecError, match=r"tensorrt-rtx: TensorRT-RTX does not support 9\.0 .*use backend auto"):
        select_backend(settings(backend="tensorrt-rtx", target_sm=90), tensorrt_importable=False, device_sm=None,
                       rtx_sms=RTX)
    with pytest.raises(MissingDependency, match=r"needs TensorRT-RTX: install deepjit\[tensorrt-rtx\]"):
        select_backend(settings(backend="tensorrt-rtx"), tensorrt_importable=False, device_sm=None, rtx_sms=None)
    with pytest.raises(SpecError, match="give target.gpu or target.sm"):
        select_backend(settings(backend="tensorrt-rtx", target_sm=None), tensorrt_importable=False, device_sm=None,
                       rtx_sms=RTX)


def test_a_plans_key_names_the_build_gpu_for_tensorrt_only_and_never_the_timing_cache_path():
    """A TensorRT plan is timed on the GPU it is built on; a TensorRT-RTX plan is built for its target,
    anywhere. Where the timing cache lives does not change what is built."""
    data = _tiny().SerializeToString()
    s = settings()
    assert plan_key(data, s, TENSORRT, "10.13.0", 75) != plan_key(data, s, TENSORRT, "10.13.0", 86)
    assert plan_key(data, s, TENSORRT_RTX, "1.7.1", 75) == plan_key(data, s, TENSORRT_RTX, "1.7.1", 86)
    assert plan_key(data, s, TENSORRT, "10.13.0", 75) == plan_key(
        data, dataclasses.replace(s, timing_cache=Path("/elsewhere/t4.timing")), TENSORRT, "10.13.0", 75)


# -- profiles for a segment's own inputs ----------------------------------------------------------

def test_segment_profiles_follow_its_inputs():
    inputs = [("images", (None, 3, 640, 640)), ("feat", (None, 64, 80, 80)), ("static", (1, 4))]
    (profile,) = profiles_for(settings(), inputs)
    assert list(profile.keys()) == ["images", "feat"]  # a static input needs no profile
    feat = profile["feat"]
    assert (tuple(feat.min), tuple(feat.opt), tuple(feat.max)) == ((1, 64, 80, 80), (4, 64, 80, 80), (8, 64, 80, 80))
    assert profiles_for(settings(), [("static", (1, 4))]) == []


def test_segment_profile_errors_name_the_input():
    with pytest.raises(EngineError, match=r"'feat' \[\?, 64, \?, \?\].*beyond the batch"):
        profiles_for(settings(), [("feat", (None, 64, None, None))])
    with pytest.raises(EngineError, match=r"profile for 'images' \[4, 3, 640, 640\].*\[\?, 3, 320, 320\]"):
        profiles_for(settings(), [("images", (None, 3, 320, 320))])
    with pytest.raises(EngineError, match=r"profile for 'images' \[4, 3, 640, 640\] does not fit the segment's input "
                                          r"\[\?, 3, 640\]"):
        profiles_for(settings(), [("images", (None, 3, 640))])


def test_segment_inputs_reads_names_and_dims(tmp_path):
    """An initializer an older exporter also lists as a graph input is a weight, not an input to profile."""
    bias = onnx.numpy_helper.from_array(np.random.default_rng(7).normal(size=(1, 3, 1, 1)).astype(np.float32), "bias")
    graph = helper.make_graph([helper.make_node("Add", ["x", "bias"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8]),
                               helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, 3, 1, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 8, 8])], [bias])
    onnx.save(helper.make_model(graph), tmp_path / "seg.onnx")
    assert segment_inputs(tmp_path / "seg.onnx") == [("x", (None, 3, 8, 8))]


# -- settings -------------------------------------------------------------------------------------

def test_settings_reject_bad_values_by_field():
    with pytest.raises(SpecError, match="engine.backend.*did you mean 'tensorrt'"):
        settings(backend="tensorrtt")
    with pytest.raises(SpecError, match="engine.hardware_compatibility"):
        settings(hardware_compatibility="ampere")
    with pytest.raises(SpecError, match="engine.optimization_level: must be 0..5"):
        settings(optimization_level=6)
    with pytest.raises(SpecError, match="dim 0 needs 1 <= min <= opt <= max, got 4, 2, 8"):
        InputProfile("images", (4, 3), (2, 3), (8, 3))


@pytest.mark.parametrize("make, says", [
    (lambda: InputProfile("images", (1, 3), (2, 3), (4, 3, 1)), r"'images': min/opt/max have different ranks"),
    (lambda: InputProfile("images", (0, 3), (1, 3), (2, 3)), r"dim 0 needs 1 <= min <= opt <= max, got 0, 1, 2"),
    (lambda: InputProfile("images", (1, 3), (4, 3), (2, 3)), r"dim 0 needs 1 <= min <= opt <= max, got 1, 4, 2"),
    (lambda: settings(optimization_level=-1), r"engine.optimization_level: must be 0..5, got -1"),
    (lambda: settings(workspace_bytes=0), r"engine.workspace: must be a positive number of bytes, got 0"),
    (lambda: settings(profiles=(IMAGES, IMAGES)), r"engine profiles name an input twice: \['images', 'images'\]"),
    (lambda: settings(precision="fp8"), r"engine.precision: must be one of fp32, .*got 'fp8'"),
], ids=["ranks", "min-0", "opt-above-max", "level", "workspace", "twice", "precision"])
def test_settings_and_profiles_outside_what_tensorrt_takes_are_refused(make, says):
    with pytest.raises(SpecError, match=says):
        make()


def test_settings_json_round_trip_and_digest():
    s = settings(hardware_compatibility="ampere_plus", strongly_typed=False, tf32=True)
    assert EngineSettings.from_dict(json.loads(s.to_json())) == s
    assert s.digest() != settings(optimization_level=4).digest()
    with pytest.raises(SpecError, match="format"):
        EngineSettings.from_dict({**s.to_dict(), "format": 99})


def test_settings_from_spec(write_spec):
    """Every engine field of a spec reaches the settings (values unlike the defaults, written out here)."""
    from deepjit_compiler.spec.load import load_spec

    spec = load_spec(write_spec({
        "  backend: auto ": "  backend: tensorrt ", "  precision: fp16 ": "  precision: bf16 ",
        "  workspace: 2GiB": "  workspace: 3GiB\n  hardware_compatibility: ampere_plus\n  tf32: true",
        "  optimization_level: 3": "  optimization_level: 5", "  gpu: T4 ": "  gpu: A10 ",
        "      opt: [4, 3, 640, 640]": "      opt: [2, 3, 640, 640]"})).spec
    s = EngineSettings.from_spec(spec)
    assert (s.backend, s.precision, s.workspace_bytes, s.optimization_level, s.hardware_compatibility, s.tf32,
            s.target_sm) == ("tensorrt", "bf16", 3 * 2**30, 5, "ampere_plus", True, 86)
    assert s.timing_cache == spec.engine.timing_cache and s.timing_cache.name == "t4.timing"
    assert s.profiles == (InputProfile("images", (1, 3, 640, 640), (2, 3, 640, 640), (8, 3, 640, 640)),)


# -- the auto decision ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["auto", "tensorrt"])
def test_tensorrt_now_when_importable_and_this_gpu_is_the_target(backend):
    d = select_backend(settings(backend=backend, target_sm=75), tensorrt_importable=True, device_sm=75)
    assert d == Decision("tensorrt", False, d.reason) and "sm_75" in d.reason


@pytest.mark.parametrize("backend", ["auto", "tensorrt"])
def test_deferred_without_tensorrt(backend):
    d = select_backend(settings(backend=backend), tensorrt_importable=False, device_sm=75)
    assert (d.backend, d.deferred) == ("tensorrt", True)
    assert "not importable" in d.reason and "materialize" in d.reason


def test_deferred_without_a_gpu():
    d = select_backend(settings(backend="auto"), tensorrt_importable=True, device_sm=None)
    assert (d.backend, d.deferred) == ("tensorrt", True) and "no GPU" in d.reason


def test_deferred_on_another_gpu():
    d = select_backend(settings(backend="auto", target_sm=75), tensorrt_importable=True, device_sm=90)
    assert (d.backend, d.deferred) == ("tensorrt", True) and "sm_90" in d.reason and "sm_75" in d.reason


def test_ampere_plus_builds_on_any_ampere_or_newer_gpu():
    s = settings(hardware_compatibility="ampere_plus", target_sm=86)
    assert select_backend(s, tensorrt_importable=True, device_sm=90).deferred is False
    # a Turing target, or a Turing build machine, is outside ampere_plus
    assert select_backend(settings(hardware_compatibility="ampere_plus", target_sm=75), tensorrt_importable=True,
                          device_sm=90).deferred is True
    assert select_backend(s, tensorrt_importable=True, device_sm=75).deferred is True
    # same_compute_capability is exact
    assert select_backend(settings(hardware_compatibility="same_compute_capability", target_sm=86),
                          tensorrt_importable=True, device_sm=90).deferred is True


def test_onnxruntime_is_onnxruntime_everywhere():
    for trt_ok, sm in ((True, 75), (False, None)):
        assert select_backend(settings(backend="onnxruntime"), tensorrt_importable=trt_ok,
                              device_sm=sm) == Decision("onnxruntime", False, "engine.backend is onnxruntime")


def test_auto_without_a_target():
    assert select_backend(settings(backend="auto", target_sm=None), tensorrt_importable=True,
                          device_sm=89) == Decision("tensorrt", False, "TensorRT builds for this GPU (sm_89)")
    d = select_backend(settings(backend="auto", target_sm=None), tensorrt_importable=False, device_sm=None)
    assert (d.backend, d.deferred) == ("onnxruntime", False)
    d = select_backend(settings(backend="tensorrt", target_sm=None), tensorrt_importable=False, device_sm=None)
    assert (d.backend, d.deferred) == ("tensorrt", True) and "the target GPU" in d.reason


# -- deferred engines -----------------------------------------------------------------------------

def _tiny() -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["images"], ["out"])], "g",
                              [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["b", 3, 640, 640])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", 3, 640, 640])])
    return helper.make_model(graph)


def test_deferred_artifact_carries_the_segment_and_portable_settings():
    s = settings()
    art = engine_from_segment("engine", _tiny(), s, Decision("tensorrt", True, "test"), workdir="unused")
    assert isinstance(art, EngineArtifact) and art.deferred and list(art.files) == ["engine.onnx"]
    stored = json.loads(art.settings_json)
    assert stored["timing_cache"] is None  # a path of the building machine is not portable
    assert EngineSettings.from_dict(stored) == dataclasses.replace(s, timing_cache=None)  # the rest, whole


@pytest.mark.skipif(tensorrt_importable(), reason="TensorRT is installed here")
def test_materialize_needs_tensorrt(tmp_path):
    onnx.save(_tiny(), tmp_path / "engine.onnx")
    with pytest.raises(MissingDependency, match=r"install deepjit\[tensorrt\] or set engine.backend: onnxruntime"):
        materialize({"engine": tmp_path / "engine.onnx"}, json.dumps(deferred_settings(settings())))


def test_materialize_rejects_malformed_settings(tmp_path):
    with pytest.raises(BundleError, match="deferred engine settings are malformed"):
        materialize([tmp_path / "engine.onnx"], '{"backend": "tensorrt"}')
