"""precision/boundaries.py: an fp16 engine hands the decode its head maps in fp16, decided by the
contracts (not by kernel names), and every CPU level runs the typed plan."""
from __future__ import annotations

import dataclasses
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

from deepjit_compiler.config import data_dir
from deepjit_compiler.graph.steps import StepRunner
from deepjit_compiler.graph.tensors import TensorSig
from deepjit_compiler.jit.contracts import load_contract, resolve_params
from deepjit_compiler.model.synth import synthesize_yolov8
from deepjit_compiler.precision.boundaries import boundary_dtypes, plan_at_precision, retyped
from deepjit_compiler.precision.rewrite import apply_precision
from deepjit_compiler.surgery.cut import plan_from_model
from deepjit_compiler.surgery.plan import AddedStage, CutRequest, KernelRequest, KernelSite, Plan, Segment
from deepjit_compiler.validation.graph import check_reassembly

F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
HEADS = [f"/model.22/cv{k}.{i}/cv{k}.{i}.2/Conv_output_0" for k in (2, 3) for i in range(3)]


@lru_cache(maxsize=1)
def model() -> onnx.ModelProto:
    return synthesize_yolov8("yolov8n", seed=0)


def plan(decode_params=None, decode_contract="yolov8_decode"):
    params = {"mode": "candidates", **(decode_params or {})}
    cuts = [CutRequest("decode", preset="yolov8_decode", kernels=[KernelRequest(decode_contract, params)]),
            CutRequest("nms", add="after", at="output0", kernels=[KernelRequest("nms", {})])]
    return plan_from_model(model(), cuts)


@pytest.fixture(scope="module")
def fp32_plan():
    return plan()


@pytest.fixture(scope="module")
def fp16_plan(fp32_plan):
    return plan_at_precision(fp32_plan, "fp16")


def elem_types(vis) -> dict[str, int]:
    return {vi.name: vi.type.tensor_type.elem_type for vi in vis}


def fp32_only_copy(folder: Path, allowed=("float32",)) -> Path:
    """A user's copy of yolov8_decode whose dtype param allows float32 only (or `allowed`, None: any)."""
    folder.mkdir(exist_ok=True)
    data = yaml.safe_load((data_dir("kernels") / "yolov8_decode.yaml").read_text())
    data["name"] = "fp32_decode"
    if allowed is None:
        del data["params"]["dtype"]["allowed"]
    else:
        data["params"]["dtype"]["allowed"] = list(allowed)
    (folder / "fp32_decode.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return folder / "fp32_decode.yaml"


def test_an_fp16_engine_hands_the_head_maps_over_in_fp16(fp32_plan, fp16_plan):
    seg, site, nms = fp16_plan.segments[0], fp16_plan.sites[0], fp16_plan.added[0]
    assert sorted(t.name for t in seg.outputs) == sorted(HEADS)
    assert {t.dtype for t in seg.outputs} == {t.dtype for t in site.inputs} == {"float16"}
    assert set(elem_types(seg.model.graph.output).values()) == set(elem_types(site.reference.graph.input).values()) \
        == {F16}
    assert fp16_plan.model_dtypes == dict.fromkeys(HEADS, "float32")
    # the kernel reads what the segment makes: its dtype param is inferred from the site's facts
    assert site.facts["input_dtype"] == "float16" and {t["dtype"] for t in site.facts["inputs"]} == {"float16"}
    contract = load_contract("yolov8_decode")
    assert resolve_params(contract, site.kernels[0].params, fp16_plan.kernel_facts(site))["dtype"] == "float16"
    # past the decode nothing changes: nms reads output0 in fp32, and does not inherit the site's dtype
    assert nms.inputs == fp32_plan.added[0].inputs and nms.reference is fp32_plan.added[0].reference
    assert "input_dtype" not in fp16_plan.kernel_facts(nms)
    assert [t.dtype for t in fp16_plan.outputs] == [t.dtype for t in fp32_plan.outputs]


@pytest.mark.parametrize("precision", ["fp32", "int8", "bf16"])
def test_other_precisions_keep_the_models_boundaries(fp32_plan, precision):
    assert plan_at_precision(fp32_plan, precision) is fp32_plan


def test_a_bf16_engine_keeps_fp32_boundaries_even_for_a_kernel_allowing_any_dtype(tmp_path):
    users = plan(decode_contract=str(fp32_only_copy(tmp_path, allowed=None)))
    assert plan_at_precision(users, "bf16") is users


def test_a_kernel_that_reads_fp32_keeps_its_boundary_fp32(tmp_path):
    # set in the spec, or the only dtype a user's contract allows: the boundary follows the contract
    explicit = plan({"dtype": "float32"})
    assert plan_at_precision(explicit, "fp16") is explicit
    users = plan(decode_contract=str(fp32_only_copy(tmp_path)))
    assert plan_at_precision(users, "fp16") is users


def test_a_kernel_set_to_fp16_or_allowing_any_dtype_gets_fp16_boundaries(tmp_path):
    # set in the spec: the boundary and the site's input facts follow it, though nothing is inferred
    site = plan_at_precision(plan({"dtype": "float16"}), "fp16").sites[0]
    assert {t.dtype for t in site.inputs} == {t["dtype"] for t in site.facts["inputs"]} == {"float16"}
    # a user's contract whose inferred dtype lists no allowed values takes the engine's
    users = plan_at_precision(plan(decode_contract=str(fp32_only_copy(tmp_path, allowed=None))), "fp16")
    assert {t.dtype for t in users.segments[0].outputs} == {"float16"}
    assert users.sites[0].facts["input_dtype"] == "float16"


def test_two_kernels_that_disagree_on_a_tensor_both_read_the_models_dtype(fp32_plan, tmp_path):
    site = fp32_plan.sites[0]
    other = dataclasses.replace(site, name="decode_fp32",
                                kernels=(KernelRequest(str(fp32_only_copy(tmp_path)), {"mode": "output0"}),))
    steps = list(fp32_plan.steps)
    steps.insert(steps.index(site) + 1, other)
    both = dataclasses.replace(fp32_plan, steps=tuple(steps))
    assert boundary_dtypes(both, "float16") == ({}, set())  # the decode would read fp16, its neighbour cannot
    alone = boundary_dtypes(fp32_plan, "float16")
    assert alone == (dict.fromkeys(HEADS, "float16"), {"decode"})


def test_the_fp16_segment_makes_its_outputs_in_the_convs(fp32_plan, fp16_plan):
    typed = apply_precision(fp16_plan.segments[0].model, "fp16", keep_fp32=["Softmax"])
    before = apply_precision(fp32_plan.segments[0].model, "fp16", keep_fp32=["Softmax"])
    onnx.checker.check_model(typed)
    assert set(elem_types(typed.graph.output).values()) == {F16}
    assert set(elem_types(before.graph.output).values()) == {F32}
    makers = {o: n.op_type for n in typed.graph.node for o in n.output}
    assert {makers[h] for h in HEADS} == {"Conv"}  # no Cast left between the conv and the kernel
    casts = lambda m: Counter(n.op_type for n in m.graph.node)["Cast"]  # noqa: E731
    assert casts(typed) == casts(before) - len(HEADS)


def heads_of(plan_, feed):
    return StepRunner([(plan_.segments[0].name, plan_.segments[0].model)]).tensors(feed)


def test_the_sites_reference_takes_fp16_and_computes_as_the_cut_on_those_values(fp32_plan, fp16_plan):
    rng = np.random.default_rng(5)
    feed = {"images": rng.uniform(0, 1, (2, 3, 640, 640)).astype(np.float32)}
    heads = heads_of(fp16_plan, feed)
    assert {heads[h].dtype for h in HEADS} == {np.dtype(np.float16)}
    exact = heads_of(fp32_plan, feed)
    for h in HEADS:  # the fp32 segment's values, stored in fp16
        np.testing.assert_array_equal(heads[h], exact[h].astype(np.float16))
    typed = StepRunner([("decode", fp16_plan.sites[0].reference)]).tensors({h: heads[h] for h in HEADS})
    cut = StepRunner([("decode", fp32_plan.sites[0].reference)]).tensors({h: heads[h].astype(np.float32) for h in HEADS})
    np.testing.assert_array_equal(typed["output0"], cut["output0"])


def test_the_graph_level_checks_the_cut_with_the_boundary_stored_in_fp16(fp16_plan):
    report = check_reassembly(fp16_plan, model(), seed=3, samples=1, input_ranges={"images": (0.0, 1.0)})
    assert report.passed, report.describe()
    # without the same rounding on the model's side the pieces differ: the check sees the fp16 boundary
    unrounded = check_reassembly(dataclasses.replace(fp16_plan, model_dtypes={}), model(), seed=3, samples=1,
                                 input_ranges={"images": (0.0, 1.0)})
    assert not unrounded.passed and unrounded.first_mismatch.startswith("step 'segment' output '/model.22/")


# -- toy plans: segments, sites and added stages reading what user contracts say --------------------

DT = {"float32": F32, "float16": F16, "int32": onnx.TensorProto.INT32}
INFERRED = "{{ dtype }}"  # an input read in the dtype the kernel's input_dtype fact gives


def sig(name, dtype="float32"):
    return TensorSig(name, dtype, ("N",))


def casts_model(inputs, outputs):
    """A graph from `inputs` to `outputs` ({name: dtype}), each output a Cast of the first input."""
    first = next(iter(inputs))
    nodes = [onnx.helper.make_node("Cast", [first], [o], to=DT[d]) for o, d in outputs.items()]
    graph = onnx.helper.make_graph(nodes, "toy", [onnx.helper.make_tensor_value_info(n, DT[d], ["N"])
                                                  for n, d in inputs.items()],
                                   [onnx.helper.make_tensor_value_info(n, DT[d], ["N"]) for n, d in outputs.items()])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def user_kernel(folder: Path, name, inputs, *, by_name=()) -> KernelRequest:
    """A user's contract reading `inputs` ([(name, dtype)]) at site positions 0, 1, ... and `by_name`
    (the same) as the pipeline tensors of their names; its `dtype` param infers input_dtype."""
    (folder / f"{name}.cu.j2").write_text("")
    data = {"name": name, "template": f"{name}.cu.j2",
            "params": {"dtype": {"type": "str", "default": "float32", "allowed": ["float32", "float16"],
                                 "infer": "input_dtype"}},
            "inputs": [{"name": n, "dtype": d, "shape": ["N"], "site_input": k} for k, (n, d) in enumerate(inputs)]
            + [{"name": n, "dtype": d, "shape": ["N"]} for n, d in by_name],
            "outputs": [{"name": f"{name}_out", "dtype": "float32", "shape": ["N"]}],
            "entry_points": [{"name": name, "symbol": name, "block": [128], "grid": [1],
                              "args": [{"name": f"{name}_out", "type": "ptr"}]}]}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return KernelRequest(str(folder / f"{name}.yaml"), {})


def segment(name, inputs, outputs):
    return Segment(name, casts_model(inputs, outputs), tuple(sig(n, d) for n, d in inputs.items()),
                   tuple(sig(n, d) for n, d in outputs.items()))


def site(name, inputs, *kernels):
    facts = {"input_dtype": "float32", "inputs": [sig(n, d).to_dict() for n, d in inputs.items()]}
    return KernelSite(name, casts_model(inputs, {f"{name}_out": "float32"}),
                      tuple(sig(n, d) for n, d in inputs.items()), (sig(f"{name}_out"),), facts, kernels)


def stage(name, inputs, *kernels):
    return AddedStage(name, "after", casts_model(inputs, {f"{name}_out": "float32"}),
                      tuple(sig(n, d) for n, d in inputs.items()), (sig(f"{name}_out"),), {}, kernels)


def toy_plan(*steps, inputs=None, outputs=()):
    return Plan(steps, tuple(sig(n, d) for n, d in (inputs or {"x": "float32"}).items()),
                tuple(sig(n) for n in outputs) or steps[-1].outputs)


def test_only_float_boundaries_change_and_an_unchanged_integer_read_does_not_hold_a_step_back(tmp_path):
    # the kernel reads the segment's int32 `n` in its float dtype: `n` stays int32 and the step reads as before
    seg = segment("seg", {"x": "float32"}, {"a": "float32", "n": "int32"})
    k = site("k", {"a": "float32", "n": "int32"}, user_kernel(tmp_path, "k", [("a", INFERRED), ("n", INFERRED)]))
    assert boundary_dtypes(toy_plan(seg, k), "float16") == ({}, set())
    # a float32 tensor a contract reads as int32 stays float32; the pipeline's int32 input `i` read as
    # int32 either way does not keep the step from taking `b` in fp16
    seg = segment("seg", {"x": "float32"}, {"a": "float32", "b": "float32"})
    k = site("k", {"a": "float32", "b": "float32", "i": "int32"},
             user_kernel(tmp_path, "k2", [("a", "int32"), ("b", INFERRED), ("i", "int32")]))
    assert boundary_dtypes(toy_plan(seg, k, inputs={"x": "float32", "i": "int32"}), "float16") == \
        ({"b": "float16"}, {"k"})


def test_a_step_that_cannot_get_all_it_reads_in_fp16_reads_the_models_dtypes(tmp_path):
    # `p` is a pipeline output: it stays float32, so the kernel cannot read it in fp16, nor `a` then
    seg = segment("seg", {"x": "float32"}, {"a": "float32", "p": "float32"})
    k = site("k", {"a": "float32", "p": "float32"}, user_kernel(tmp_path, "k", [("a", INFERRED), ("p", INFERRED)]))
    plan_ = toy_plan(seg, k, outputs=("k_out", "p"))
    assert boundary_dtypes(plan_, "float16") == ({}, set())
    assert plan_at_precision(plan_, "fp16") is plan_


def test_two_kernels_of_one_step_that_read_a_tensor_in_two_dtypes_read_the_models(tmp_path):
    # k1 would read `a` in fp16, k2 reads it in float32 whatever the engine: one stored `a` cannot be
    # both, so the step reads as before (the first kernel's dtype won: k2 was handed fp16)
    seg = segment("seg", {"x": "float32"}, {"a": "float32"})
    k = site("k", {"a": "float32"}, user_kernel(tmp_path, "k1", [("a", INFERRED)]),
             user_kernel(tmp_path, "k2", [("a", "float32")]))
    assert boundary_dtypes(toy_plan(seg, k), "float16") == ({}, set())
    both = site("k", {"a": "float32"}, user_kernel(tmp_path, "k1", [("a", INFERRED)]),
                user_kernel(tmp_path, "k3", [("a", INFERRED)]))
    assert boundary_dtypes(toy_plan(seg, both), "float16") == ({"a": "float16"}, {"k"})


def test_a_tensor_another_segment_reads_or_the_pipeline_outputs_keeps_its_dtype(tmp_path):
    seg = segment("seg", {"x": "float32"}, {"a": "float32", "b": "float32", "c": "float32"})
    k1 = site("k1", {"a": "float32"}, user_kernel(tmp_path, "k1", [("a", INFERRED)]))
    k2 = site("k2", {"b": "float32"}, user_kernel(tmp_path, "k2", [("b", INFERRED)]))
    seg2 = segment("seg2", {"b": "float32"}, {"y": "float32"})
    k3 = stage("k3", {"c": "float32"}, user_kernel(tmp_path, "k3", [("c", INFERRED)]))
    plan_ = toy_plan(seg, k1, k2, seg2, k3, outputs=("k1_out", "k2_out", "y", "c", "k3_out"))
    assert boundary_dtypes(plan_, "float16") == ({"a": "float16"}, {"k1"})


def test_an_added_stage_reading_a_segment_output_gets_it_in_fp16_as_its_input_dtype_param(tmp_path):
    seg = segment("seg", {"x": "float32"}, {"a": "float32"})
    nms = stage("post", {"a": "float32"}, user_kernel(tmp_path, "post", [("a", INFERRED)]))
    typed = plan_at_precision(toy_plan(seg, nms), "fp16")
    post = typed.added[0]
    assert post.params == {"input_dtype": "float16"} and [t.dtype for t in post.inputs] == ["float16"]
    assert resolve_params(load_contract(post.kernels[0].contract), {}, typed.kernel_facts(post))["dtype"] == "float16"
    assert elem_types(post.reference.graph.input) == {"a": F16}
    assert elem_types(typed.segments[0].model.graph.output) == {"a": F16}
    assert typed.model_dtypes == {"a": "float32"}


def test_retyping_again_keeps_the_models_dtype_of_every_tensor(tmp_path):
    seg = segment("seg", {"x": "float32"}, {"a": "float32", "b": "float32"})
    k = site("k", {"a": "float32", "b": "float32"}, user_kernel(tmp_path, "k", [("a", INFERRED), ("b", INFERRED)]))
    once = retyped(toy_plan(seg, k), {"a": "float16"}, {})
    assert once.model_dtypes == {"a": "float32"}
    assert retyped(once, {"b": "float16"}, {}).model_dtypes == {"a": "float32", "b": "float32"}
    assert retyped(once, {"a": "bfloat16"}, {}).model_dtypes == {"a": "float32"}  # not the float16 it had


def test_an_input_past_the_sites_inputs_reads_the_tensor_of_its_name(tmp_path):
    seg = segment("seg", {"x": "float32"}, {"a": "float32", "q": "float32"})
    # the contract puts `q` at position 1; the site has only `a`: `q` is the pipeline's `q`
    k = site("k", {"a": "float32"}, user_kernel(tmp_path, "k", [("a", INFERRED), ("q", INFERRED)]))
    assert boundary_dtypes(toy_plan(seg, k), "float16") == ({"a": "float16", "q": "float16"}, {"k"})


def test_an_added_stage_reads_a_tensor_the_model_has_in_fp16_in_fp16(tmp_path):
    # no site fact gives the stage float16: lowering it reads `h` as the segment already makes it
    seg = segment("seg", {"x": "float32"}, {"h": "float16"})
    post = stage("post", {"h": "float16"}, user_kernel(tmp_path, "post", [("h", INFERRED)]))
    assert boundary_dtypes(toy_plan(seg, post), "float16") == ({}, {"post"})


def test_a_site_reading_a_tensor_the_model_has_in_fp16_gets_float16_as_its_input_dtype_fact(tmp_path):
    # no boundary changes, yet the site is lowered: its kernel's dtype must say float16, as the tensor is
    seg = segment("seg", {"x": "float32"}, {"h": "float16"})
    k = site("k", {"h": "float16"}, user_kernel(tmp_path, "k", [("h", INFERRED)]))
    typed = plan_at_precision(toy_plan(seg, k), "fp16")
    assert typed.sites[0].facts["input_dtype"] == "float16"
    assert resolve_params(load_contract(k.kernels[0].contract), {}, typed.kernel_facts(typed.sites[0]))["dtype"] == "float16"


def test_a_later_segments_outputs_are_handed_over_in_fp16_too(tmp_path):
    seg = segment("seg", {"x": "float32"}, {"a": "float32"})
    k1 = site("k1", {"a": "float32"}, user_kernel(tmp_path, "k1", [("a", INFERRED)]))
    seg2 = segment("seg2", {"k1_out": "float32"}, {"b": "float32"})
    k2 = site("k2", {"b": "float32"}, user_kernel(tmp_path, "k2", [("b", INFERRED)]))
    assert boundary_dtypes(toy_plan(seg, k1, seg2, k2), "float16") == ({"a": "float16", "b": "float16"}, {"k1", "k2"})
