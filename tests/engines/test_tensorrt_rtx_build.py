"""TensorRT-RTX plans built here, with no GPU: a real plan for SM75 from a tiny seeded segment, through
the same Polygraphy loaders and plan cache as TensorRT (engines/plans.py, worker.py), the network it
parsed, the plan cache, and the refusals. Running a plan needs a GPU of its compute capability: those
tests are in test_tensorrt_build.py / the gpu-marked runtime tests."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from tiny_segments import conv_relu_conv

from deepjit_compiler.engines import worker

trt_rtx = pytest.importorskip("tensorrt_rtx", reason="needs TensorRT-RTX (pip install deepjit[tensorrt-rtx]); "
                                                     "the mapping is covered by test_tensorrt_config.py")

from deepjit_compiler.engines import (  # noqa: E402
    TENSORRT,
    TENSORRT_RTX,
    Decision,
    EngineSettings,
    InputProfile,
    engine_from_segment,
    rtx_sms,
    select_backend,
)
from deepjit_compiler.engines import plans as plans_mod  # noqa: E402
from deepjit_compiler.engines.plans import build_engine, plan_key  # noqa: E402
from deepjit_compiler.engines.tensorrt import build_plan, parse_network, plan_refusal  # noqa: E402
from deepjit_compiler.errors import EngineError, MissingDependency, SpecError  # noqa: E402
from deepjit_compiler.jit.cache import KernelCache  # noqa: E402
from deepjit_compiler.precision.rewrite import apply_precision  # noqa: E402
from deepjit_compiler.spec.targets import TENSORRT_RTX_SM  # noqa: E402

segment = conv_relu_conv


PROFILE = InputProfile("images", (1, 3, 32, 32), (2, 3, 32, 32), (4, 3, 32, 32))


def settings(**kw) -> EngineSettings:
    return EngineSettings(**{"backend": "tensorrt-rtx", "precision": "fp32", "workspace_bytes": 2**28,
                             "profiles": (PROFILE,), "target_sm": 75, **kw})


def save(model: onnx.ModelProto, tmp_path, name: str = "engine") -> str:
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    return str(path)


def test_the_installed_library_builds_what_the_spec_check_allows():
    assert TENSORRT_RTX.supported_sms() == TENSORRT_RTX_SM == (75, 80, 86, 89, 120, 121)
    assert rtx_sms() == TENSORRT_RTX_SM and 90 not in rtx_sms()


def test_a_plan_for_sm75_is_built_here_without_a_gpu(tmp_path):
    art = build_engine(save(segment(), tmp_path), settings(), flavour=TENSORRT_RTX, cache_dir=tmp_path / "cache")
    plan = art.files["engine.rtx.plan"]
    assert art.backend == "tensorrt-rtx" and not art.deferred and sorted(art.files) == ["engine.onnx", "engine.rtx.plan"]
    assert art.files["engine.onnx"] == (tmp_path / "engine.onnx").read_bytes()  # the fallback travels with it
    assert len(plan) > 10_000 and art.plan.size == len(plan)
    info = art.plan
    assert (info.flavour, info.library, info.version) == ("tensorrt-rtx", "tensorrt_rtx", trt_rtx.__version__)
    assert info.compute_capabilities == ("7.5",)
    assert info.network_layers == 3  # Conv, Relu, Conv: one layer per node, the weights inside the convs
    assert info.inputs == ({"name": "images", "dtype": "float32", "shape": [-1, 3, 32, 32]},)
    assert info.outputs == ({"name": "out", "dtype": "float32", "shape": [-1, 8, 32, 32]},)
    assert info.profiles == {"images": {"min": [1, 3, 32, 32], "opt": [2, 3, 32, 32], "max": [4, 3, 32, 32]}}
    assert info.build_seconds > 0 and not info.from_cache
    record = info.to_record()
    assert "build_seconds" not in record and "from_cache" not in record  # timings stay out of the manifest
    assert (record["key"], record["compute_capabilities"], record["profiles"]) == (info.key, ["7.5"], info.profiles)
    assert json.loads(art.settings_json)["built_with"] == {"tensorrt_rtx": trt_rtx.__version__}
    # Deserializing needs a GPU; what a CPU can check is that TensorRT-RTX reads it as one of its plans.
    assert "malformed" not in (plan_refusal(plan) or "")
    assert "malformed" in plan_refusal(b"\0" * len(plan))


def test_fp16_in_the_graph_builds_strongly_typed(tmp_path):
    fp16 = apply_precision(segment(1), "fp16", keep_fp32=())
    casts = sum(n.op_type == "Cast" for n in fp16.graph.node)
    assert casts >= 2  # in at the input, out at the output
    art = build_engine(save(fp16, tmp_path), settings(precision="fp16"), flavour=TENSORRT_RTX,
                       cache_dir=tmp_path / "cache")
    assert art.plan.network_layers == len(fp16.graph.node) == 3 + casts
    assert [t["dtype"] for t in (*art.plan.inputs, *art.plan.outputs)] == ["float32", "float32"]  # I/O keep fp32


def test_the_parser_alone_counts_the_same_layers(tmp_path):
    net = parse_network(segment().SerializeToString(), TENSORRT_RTX)
    assert net["layers"] == 3 and [t["name"] for t in net["outputs"]] == ["out"]
    with pytest.raises(EngineError, match="TensorRT-RTX .* ONNX parser rejects it"):
        bad = segment()
        bad.graph.node[1].op_type = "NoSuchOp"
        parse_network(bad.SerializeToString(), TENSORRT_RTX)


def test_a_rebuild_comes_from_the_plan_cache_with_the_same_bytes(tmp_path):
    path = save(segment(2), tmp_path)
    cache = tmp_path / "cache"
    hits, misses = plans_mod.stats.hits, plans_mod.stats.misses
    first = build_engine(path, settings(), flavour=TENSORRT_RTX, cache_dir=cache)
    again = build_engine(path, settings(), flavour=TENSORRT_RTX, cache_dir=cache)
    assert (plans_mod.stats.hits - hits, plans_mod.stats.misses - misses) == (1, 1)
    assert again.files == first.files and again.plan.key == first.plan.key and again.plan.from_cache
    assert again.plan.to_record() == first.plan.to_record()
    # what builds the plan is its key: another compute capability, precision or segment is another plan
    data = (tmp_path / "engine.onnx").read_bytes()
    version = trt_rtx.__version__
    key = plan_key(data, settings(), TENSORRT_RTX, version)
    assert key == first.plan.key
    assert len({key, plan_key(data, settings(target_sm=86), TENSORRT_RTX, version),
                plan_key(data, settings(optimization_level=4), TENSORRT_RTX, version),
                plan_key(data + b"\0", settings(), TENSORRT_RTX, version),
                plan_key(data, settings(), TENSORRT_RTX, "1.7.2")}) == 5
    sm86 = build_engine(path, settings(target_sm=86), flavour=TENSORRT_RTX, cache_dir=cache)
    assert sm86.plan.compute_capabilities == ("8.6",) and not sm86.plan.from_cache


def test_past_its_size_bound_the_plan_cache_drops_the_least_recently_used(tmp_path, monkeypatch):
    path, cache = save(segment(3), tmp_path), tmp_path / "cache"
    monkeypatch.setenv("DEEPJIT_PLAN_CACHE_MB", "0.000001")  # room for the plan just built alone
    first = build_engine(path, settings(), flavour=TENSORRT_RTX, cache_dir=cache)
    second = build_engine(path, settings(target_sm=86), flavour=TENSORRT_RTX, cache_dir=cache)
    store = KernelCache(cache / "plans")
    assert not store.folder(first.plan.key).exists() and store.folder(second.plan.key).exists()
    assert not build_engine(path, settings(), flavour=TENSORRT_RTX, cache_dir=cache).plan.from_cache
    monkeypatch.setenv("DEEPJIT_PLAN_CACHE_MB", "100")
    assert build_engine(path, settings(), flavour=TENSORRT_RTX, cache_dir=cache).plan.from_cache


# The build child with spies: on build_plan (what the child is asked to build with) and on CreateConfigRTX
# (the real builder config TensorRT-RTX builds with, and the profile Polygraphy is handed); both call
# through, so the plan is built as usual.
SPY_CHILD = """
import json, os
from deepjit_compiler.engines import tensorrt as backend, worker
seen = {}
real_config, real_build = backend.CreateConfigRTX, worker.build_plan
def spy_config(**kwargs):
    loader = real_config(**kwargs)
    def config(builder, network):
        cfg = loader(builder, network)
        trt = backend.TENSORRT_RTX.module
        seen.update(workspace=cfg.get_memory_pool_limit(trt.MemoryPoolType.WORKSPACE),
                    optimization_level=cfg.builder_optimization_level,
                    compute_capabilities=[cfg.get_compute_capability(i).name
                                          for i in range(cfg.num_compute_capabilities)],
                    profiles=[{n: [list(p[n].min), list(p[n].opt), list(p[n].max)] for n in p.keys()}
                              for p in kwargs.get("profiles", [])])
        return cfg
    return config
def spy_build(path, settings, flavour, *, timing_cache=None, segment_name=None):
    seen.update(timing_cache=timing_cache, segment_name=segment_name, precision=settings.precision)
    out = real_build(path, settings, flavour, timing_cache=timing_cache, segment_name=segment_name)
    with open(os.environ["DEEPJIT_TEST_SPY"], "w") as f:
        json.dump(seen, f)
    return out
backend.CreateConfigRTX, worker.build_plan = spy_config, spy_build
""" + worker._CHILD


def test_the_engine_settings_reach_the_builder_config(tmp_path, monkeypatch):
    """Workspace, optimization level, compute capability and the profile, through the build child, as the
    TensorRT-RTX builder config holds them (values unlike the defaults); the child is handed the timing
    cache and the segment's name too (TensorRT-RTX itself times nothing)."""
    monkeypatch.setattr(worker, "_CHILD", SPY_CHILD)
    monkeypatch.setenv("DEEPJIT_TEST_SPY", str(tmp_path / "seen.json"))
    profile = InputProfile("images", (2, 3, 32, 32), (3, 3, 32, 32), (5, 3, 32, 32))
    s = settings(workspace_bytes=3 * 2**26, optimization_level=2, target_sm=86, profiles=(profile,), precision="fp16")
    art = build_engine(save(segment(), tmp_path), s, flavour=TENSORRT_RTX, cache_dir=tmp_path / "cache",
                       timing_cache=tmp_path / "t.timing", segment_name="head")
    assert json.loads((tmp_path / "seen.json").read_text()) == {
        "workspace": 3 * 2**26, "optimization_level": 2, "compute_capabilities": ["SM86"],
        "profiles": [{"images": [[2, 3, 32, 32], [3, 3, 32, 32], [5, 3, 32, 32]]}],
        "timing_cache": str(tmp_path / "t.timing"), "segment_name": "head", "precision": "fp16"}
    assert art.plan.compute_capabilities == ("8.6",) and len(art.files["head.rtx.plan"]) > 10_000


def test_a_segment_fed_by_an_internal_tensor_builds_with_the_specs_batch_range(tmp_path):
    """A second segment's input (here 'feat', dynamic batch) has no profile of its own in the spec: it takes
    the batch range of the spec's first input."""
    model = segment()
    model.graph.input[0].name = "feat"
    model.graph.node[0].input[0] = "feat"
    art = build_engine(save(model, tmp_path), settings(), flavour=TENSORRT_RTX, cache_dir=tmp_path / "cache")
    assert art.plan.profiles == {"feat": {"min": [1, 3, 32, 32], "opt": [2, 3, 32, 32], "max": [4, 3, 32, 32]}}
    assert [t["name"] for t in art.plan.inputs] == ["feat"]


def test_an_error_the_build_child_raises_comes_back_as_its_own_class(tmp_path):
    """The child cannot import TensorRT here: the parent raises the child's MissingDependency, with its words."""
    if TENSORRT.importable():
        pytest.skip("TensorRT is installed here: the child would build")
    with pytest.raises(MissingDependency, match=r"building TensorRT engines needs TensorRT: install deepjit\[tensorrt\]"):
        worker.build_in_child(save(segment(), tmp_path), settings(backend="tensorrt"), TENSORRT)


def test_engine_from_segment_builds_what_the_decision_says(tmp_path):
    s = settings(backend="auto")
    decision = select_backend(s, tensorrt_importable=False, device_sm=None, rtx_sms=rtx_sms())
    assert decision == Decision("tensorrt-rtx", False, decision.reason) and "no GPU needed" in decision.reason
    art = engine_from_segment("segment", segment(), s, decision, workdir=tmp_path, cache_dir=tmp_path / "cache")
    assert art.plan.file == "segment.rtx.plan" and art.plan.network_layers == 3
    assert KernelCache(tmp_path / "cache" / "plans").folder(art.plan.key).is_dir()  # the cache it was given


def test_targets_it_does_not_support_are_refused(tmp_path):
    with pytest.raises(EngineError, match=r"TensorRT-RTX .* does not support 9\.0 \(sm_90\); it builds for 7\.5, 8\.0"):
        build_engine(save(segment(), tmp_path), settings(target_sm=90), flavour=TENSORRT_RTX, cache_dir=tmp_path)
    with pytest.raises(SpecError, match=r"tensorrt-rtx: TensorRT-RTX does not support 9\.0"):
        select_backend(settings(target_sm=90), tensorrt_importable=False, device_sm=90, rtx_sms=rtx_sms())
    auto = select_backend(settings(backend="auto", target_sm=90), tensorrt_importable=False, device_sm=90,
                          rtx_sms=rtx_sms())
    assert auto.deferred and "TensorRT-RTX does not support 9.0" in auto.reason


def test_what_it_cannot_build_is_an_engine_error_naming_the_segment(tmp_path):
    bad = segment()
    bad.graph.node[1].op_type = "NoSuchOp"
    with pytest.raises(EngineError, match=r"segment 'engine' \(engine.onnx\): TensorRT-RTX .* could not build it"):
        build_engine(save(bad, tmp_path), settings(), flavour=TENSORRT_RTX, cache_dir=tmp_path / "cache")
    (tmp_path / "junk.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(EngineError, match="junk.onnx: not a readable ONNX model"):
        build_engine(tmp_path / "junk.onnx", settings(), flavour=TENSORRT_RTX, cache_dir=tmp_path / "cache")


def test_polygraphy_builds_a_flavour_only_in_a_process_that_drives_it(tmp_path):
    """This process's Polygraphy drives TensorRT (POLYGRAPHY_USE_TENSORRT_RTX unset): building TensorRT-RTX
    in it is refused, which is why plans are built in a child (worker.py)."""
    from polygraphy import config as polygraphy_config

    if polygraphy_config.USE_TENSORRT_RTX:
        pytest.skip("this process's Polygraphy already drives TensorRT-RTX (POLYGRAPHY_USE_TENSORRT_RTX is set)")
    with pytest.raises(EngineError, match="Polygraphy drives TensorRT in this process, not TensorRT-RTX"):
        build_plan(save(segment(), tmp_path), settings(), TENSORRT_RTX)


@pytest.mark.gpu
def test_on_a_gpu_it_supports_the_plan_runs_like_onnx_runtime(tmp_path):
    """Needs a GPU of a compute capability TensorRT-RTX supports (not the H200: it has no 9.0)."""
    import onnxruntime as ort

    from deepjit_compiler.engines import local_device_sm
    from deepjit_compiler.engines.tensorrt import TrtEngineRunner

    sm = local_device_sm()
    if sm not in TENSORRT_RTX_SM:
        pytest.skip(f"TensorRT-RTX does not support this GPU's compute capability (sm_{sm})")
    art = build_engine(save(segment(), tmp_path), settings(target_sm=sm), flavour=TENSORRT_RTX,
                       cache_dir=tmp_path / "cache")
    x = np.random.default_rng(3).uniform(0, 1, size=(3, 3, 32, 32)).astype(np.float32)
    cache = tmp_path / "runtime.cache"
    with TrtEngineRunner(art.files["engine.rtx.plan"], flavour=TENSORRT_RTX, runtime_cache=cache) as runner:
        out = runner.infer({"images": x})["out"]
    want = ort.InferenceSession(segment().SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"images": x})[0]
    np.testing.assert_allclose(out, want, atol=1e-3, rtol=1e-3)
    assert cache.is_file() and cache.stat().st_size > 0  # the kernels it compiled for this GPU, for next time
