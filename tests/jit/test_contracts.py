"""Kernel contracts: loading, params from spec/facts/defaults, tensor signatures, dim binding,
launch geometry and typed args, plus the host-side letterbox geometry."""
from __future__ import annotations

import re
import textwrap

import numpy as np
import pytest
import yaml

from deepjit_compiler.errors import BundleError, KernelError, RuntimeInputError
from deepjit_compiler.graph.tensors import TensorSig
from deepjit_compiler.jit import contract_models, expressions
from deepjit_compiler.jit.bounds import memory_bound
from deepjit_compiler.jit.contracts import (
    batch_thresholds,
    bind_dims,
    concrete_shape,
    declared_detections,
    entry_symbols,
    image_channels,
    is_contract_path,
    launches,
    load_contract,
    normalize_facts,
    resolve_params,
    signature,
    site_inputs,
    workspace_bytes,
)
from deepjit_compiler.runtime import launch
from deepjit_compiler.runtime.launch import letterbox_geometry, pack_arg
from deepjit_compiler.runtime.layout import site_aliases

# Facts as surgery's yolov8_decode preset writes them (presets.py), static 640x640.
FACTS = {"reg_max": 16, "num_classes": 80, "strides": [8, 16, 32], "anchors": 8400,
         "levels": [{"level": i, "stride": s, "height": 640 // s, "width": 640 // s} for i, s in enumerate((8, 16, 32))],
         "dtypes": {"head": "float32", "output": "float32"}, "input_size": [640, 640],
         "head_inputs": [{"name": f"/m/{r}{i}", "role": r, "level": i} for i in range(3) for r in ("box", "cls")]}
DYNAMIC = {**FACTS, "anchors": "anchors", "input_size": ["height", "width"],
           "levels": [{"level": i, "stride": s, "height": f"height/{s}", "width": f"width/{s}"}
                      for i, s in enumerate((8, 16, 32))]}


def head_shapes(batch: int, size: int = 640, nc: int = 80) -> dict[str, tuple[int, ...]]:
    out = {}
    for i, s in enumerate((8, 16, 32)):
        out[f"box_{i}"] = (batch, 64, size // s, size // s)
        out[f"cls_{i}"] = (batch, nc, size // s, size // s)
    return out


def test_builtin_contracts_load_and_name_their_files():
    for name in ("yolov8_decode", "nms", "letterbox"):
        c = load_contract(name)
        assert c.name == name and c.template_path.name == f"{name}.cu.j2"
        want = ["deepjit_common.cuh"] + (["deepjit_nms.cuh"] if name != "letterbox" else [])  # nms's body, shared
        assert [p.name for p in c.header_paths] == want
        assert len(c.digest()) == 64


def test_facts_are_normalized_from_the_preset_format():
    f = normalize_facts(DYNAMIC)
    assert f["levels"] == [["H0", "W0"], ["H1", "W1"], ["H2", "W2"]]
    assert f["anchors"] == "A" and f["input_dtype"] == "float32" and f["input_size"] is None
    s = normalize_facts(FACTS)
    assert s["levels"] == [[80, 80], [40, 40], [20, 20]] and s["input_size"] == 640
    assert normalize_facts({"input_size": [640, 480]})["input_size"] is None  # no square side to infer


def test_params_come_from_spec_then_facts_then_defaults():
    c = load_contract("yolov8_decode")
    p = resolve_params(c, {"conf_threshold": 0.4, "reg_max": 16, "max_candidates": 1000}, FACTS)
    assert p["conf_threshold"] == 0.4          # spec
    assert p["reg_max"] == 16                  # spec, agreeing with the fact
    assert p["max_candidates"] == 1000         # spec beats the fact 'anchors': the contract says overridable
    assert p["num_classes"] == 80              # fact
    assert p["mode"] == "candidates"           # default
    assert p["num_levels"] == 3 and p["static_levels"] is True and p["channels"] == 4 * 16 + 80
    assert resolve_params(c, {}, FACTS)["max_candidates"] == 8400  # fact 'anchors'


def test_a_given_param_that_contradicts_the_kernel_site_is_an_error():
    c = load_contract("yolov8_decode")
    with pytest.raises(KernelError, match=r"param 'num_classes' is given as 18, but the kernel site has 80 "
                                          r"\(its 'num_classes', found in the model\).*set it to 80"):
        resolve_params(c, {"num_classes": 18}, FACTS)
    with pytest.raises(KernelError, match=r"param 'reg_max' is given as 8, but the kernel site has 16"):
        resolve_params(c, {"reg_max": 8}, FACTS)
    # a symbolic fact (a dynamic model's levels) is no concrete value to contradict: the spec's stands
    dynamic = {**FACTS, "levels": [{"height": "h8", "width": "w8"}, {"height": "h16", "width": "w16"},
                                   {"height": "h32", "width": "w32"}]}
    given = [[80, 80], [40, 40], [20, 20]]
    assert resolve_params(c, {"levels": given}, dynamic)["levels"] == given


def test_missing_param_is_named_with_where_it_would_come_from():
    facts = {k: v for k, v in FACTS.items() if k != "num_classes"}
    with pytest.raises(KernelError, match=r"param 'num_classes' was neither given nor inferable.*'num_classes'"):
        resolve_params(load_contract("yolov8_decode"), {}, facts)


def test_unknown_and_disallowed_params_name_the_allowed_ones():
    c = load_contract("yolov8_decode")
    with pytest.raises(KernelError, match=r"unknown param 'conf_treshold' \(did you mean 'conf_threshold'\?\)"):
        resolve_params(c, {"conf_treshold": 0.3}, FACTS)
    with pytest.raises(KernelError, match=r"'mode' must be one of \['candidates', 'output0', 'nms'\], got 'output'"):
        resolve_params(c, {"mode": "output"}, FACTS)
    with pytest.raises(KernelError, match=r"'conf_threshold' must be in \[0.0, 1.0\], got 1.5"):
        resolve_params(c, {"conf_threshold": 1.5}, FACTS)
    with pytest.raises(KernelError, match=r"'anchors_per_thread' must be int, got '4'"):
        resolve_params(c, {"anchors_per_thread": "4"}, FACTS)
    with pytest.raises(KernelError, match=r"'anchors_per_thread' must be int, got True"):  # a bool is no int
        resolve_params(c, {"anchors_per_thread": True}, FACTS)


def test_decode_signature_static_and_dynamic():
    c = load_contract("yolov8_decode")
    sig = {s.name: s for s in signature(c, resolve_params(c, {"mode": "output0"}, FACTS))}
    assert list(sig) == ["box_0", "box_1", "box_2", "cls_0", "cls_1", "cls_2", "output0"]
    assert sig["box_1"].shape == ("B", 64, 40, 40) and sig["cls_2"].shape == ("B", 80, 20, 20)
    assert sig["output0"].shape == ("B", 84, "A") and sig["output0"].role == "output"
    dyn = {s.name: s for s in signature(c, resolve_params(c, {"dtype": "float16"}, DYNAMIC))}
    assert dyn["box_0"].shape == ("B", 64, "H0", "W0") and dyn["box_0"].dtype == "float16"
    assert dyn["cand_count"].zero_init and dyn["cand_boxes"].shape == ("B", "A", 4)


def test_bind_dims_and_output_shapes():
    c = load_contract("yolov8_decode")
    p = resolve_params(c, {"mode": "output0"}, DYNAMIC)
    dims = bind_dims(c, p, head_shapes(3, size=320))
    assert dims["B"] == 3 and (dims["H0"], dims["W2"]) == (40, 10)
    assert dims["A"] == 40 * 40 + 20 * 20 + 10 * 10
    out = next(s for s in signature(c, p) if s.name == "output0")
    assert concrete_shape(out, p, dims) == (3, 84, 2100)


def test_bad_input_shapes_name_tensor_and_dim():
    c = load_contract("yolov8_decode")
    p = resolve_params(c, {}, FACTS)
    shapes = head_shapes(2)
    with pytest.raises(RuntimeInputError, match=r"input 'cls_1' dim 2 is 41, expected 40"):
        bind_dims(c, p, {**shapes, "cls_1": (2, 80, 41, 40)})
    with pytest.raises(RuntimeInputError, match=r"input 'box_2' dim 0 is 3, expected 2"):
        bind_dims(c, p, {**shapes, "box_2": (3, 64, 20, 20)})
    with pytest.raises(RuntimeInputError, match=r"input 'box_0' is missing"):
        bind_dims(c, p, {k: v for k, v in shapes.items() if k != "box_0"})


def test_decode_launch_geometry_and_typed_arg_order():
    c = load_contract("yolov8_decode")
    p = resolve_params(c, {"anchors_per_thread": 2, "block": 64}, FACTS)
    dims = bind_dims(c, p, head_shapes(5))
    tensors = {s.name: 1000 + k for k, s in enumerate(signature(c, p))}
    (launch,) = launches(c, p, dims, tensors)
    assert launch.symbol == "deepjit_yolov8_decode_candidates<float, 1>"
    assert launch.grid == (-(-8400 // (2 * 64)), 5, 1) and launch.block == (64, 1, 1)
    names = [a[0] for a in launch.args]
    assert names == ["box_0", "box_1", "box_2", "cls_0", "cls_1", "cls_2", "H0", "H1", "H2", "W0", "W1", "W2", "A",
                     "cand_count", "cand_boxes", "cand_scores", "cand_classes", "cand_index", "capacity"]
    args = {a[0]: a for a in launch.args}
    assert args["H1"] == ("H1", "i32", 40) and args["capacity"] == ("capacity", "i32", 8400)
    assert args["cls_0"] == ("cls_0", "ptr", tensors["cls_0"])


@pytest.mark.parametrize("lanes, per_thread, threads", [(4, 1, 8400 * 4), (2, 2, 8400), (4, 2, 8400 * 2)])
def test_lanes_per_anchor_launch_lanes_over_anchors_per_thread_threads_per_anchor(lanes, per_thread, threads):
    c = load_contract("yolov8_decode")
    p = resolve_params(c, {"anchors_per_thread": per_thread, "lanes_per_anchor": lanes}, FACTS)
    (launch,) = launches(c, p, bind_dims(c, p, head_shapes(3)), {s.name: 1 for s in signature(c, p)})
    assert launch.grid == (-(-threads // 128), 3, 1) and launch.block == (128, 1, 1)


@pytest.mark.parametrize("batch, lanes", [(1, 4), (3, 4), (4, 2), (32, 2)])
def test_large_batch_lanes_launch_their_kernel_and_grid_from_large_batch_on(batch, lanes):
    c = load_contract("yolov8_decode")
    p = resolve_params(c, {"anchors_per_thread": 1, "lanes_per_anchor": 4, "large_batch_lanes": 2,
                           "large_batch": 4}, FACTS)
    (launch,) = launches(c, p, bind_dims(c, p, head_shapes(batch)), {s.name: 1 for s in signature(c, p)})
    assert launch.symbol == f"deepjit_yolov8_decode_candidates<float, {lanes}>"
    assert launch.grid == (-(-8400 * lanes // 128), batch, 1)


@pytest.mark.parametrize("way, thresholds", [({"large_batch_lanes": 2}, (4,)),
                                             ({"large_batch_lanes": 2, "large_batch": 8}, (8,)),
                                             ({"large_batch_lanes": 4}, ()), ({}, ())])
def test_batch_thresholds_are_where_another_kernel_starts(way, thresholds):
    c = load_contract("yolov8_decode")
    assert batch_thresholds(c, resolve_params(c, {"anchors_per_thread": 1, "lanes_per_anchor": 4, **way}, FACTS)) == \
        thresholds


@pytest.mark.parametrize("batch, cluster", [(1, 4), (8, 4), (16, 2), (32, 2)])
def test_nms_cluster_launches_that_many_blocks_an_image_and_large_batch_cluster_from_large_batch_on(batch, cluster):
    c = load_contract("nms")
    p = resolve_params(c, {"max_candidates": 640, "block": 1024, "chunk": 512, "cluster": 4,
                           "large_batch_cluster": 2}, {})
    shapes = {s.name: tuple({"B": batch, "K": 640}.get(d, d) for d in s.shape) for s in signature(c, p)
              if s.role == "input"}
    (launch,) = launches(c, p, bind_dims(c, p, shapes), {s.name: 1 for s in signature(c, p)} | {"workspace": 0})
    assert launch.symbol == f"deepjit_nms_cluster<300, false, {cluster}>"
    assert launch.grid == (batch * cluster, 1, 1) and launch.block == (1024, 1, 1)
    assert entry_symbols(c, p) == (("nms", "deepjit_nms_cluster<300, false, 4>"),
                                   ("nms (batch 16+)", "deepjit_nms_cluster<300, false, 2>"))
    assert batch_thresholds(c, p) == (16,)


def test_nms_cluster_1_is_the_plain_kernel():
    c = load_contract("nms")
    p = resolve_params(c, {"max_candidates": 640}, {})
    assert entry_symbols(c, p) == (("nms", "deepjit_nms<300, false>"),) and batch_thresholds(c, p) == ()


def test_from_batch_must_name_params_and_give_a_batch(tmp_path):
    c = load_contract("yolov8_decode")
    raw = yaml.safe_load(c.path.read_text())
    raw["entry_points"][0]["from_batch"]["params"] = {"lanes": "large_batch_lanes"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(KernelError, match=r"from_batch.params: 'lanes' is not one of the contract's params"):
        load_contract(str(tmp_path / "bad.yaml"))
    raw["entry_points"][0]["from_batch"] = {"at": "large_batch - 4", "params": {"lanes_per_anchor": 2}}
    (tmp_path / "zero.yaml").write_text(yaml.safe_dump(raw))
    z = load_contract(str(tmp_path / "zero.yaml"))
    p = resolve_params(z, {"anchors_per_thread": 1}, FACTS)
    with pytest.raises(KernelError, match=r"entry_points\[0\].from_batch.at: need a batch of at least 1, got 0"):
        launches(z, p, bind_dims(z, p, head_shapes(2)), {s.name: 1 for s in signature(z, p)})
    raw["entry_points"][0]["from_batch"]["at"] = "large_batch > 0"  # a bool is no batch
    (tmp_path / "bool.yaml").write_text(yaml.safe_dump(raw))
    b = load_contract(str(tmp_path / "bool.yaml"))
    with pytest.raises(KernelError, match=r"entry_points\[0\].from_batch.at: need a batch of at least 1, got True"):
        batch_thresholds(b, resolve_params(b, {"anchors_per_thread": 1}, FACTS))


@pytest.mark.parametrize("value, says", [
    ("3", r"from_batch\.params\.cluster: param 'cluster' must be one of \[1, 2, 4, 8\], got 3"),
    ("'4'", r"from_batch\.params\.cluster: param 'cluster' must be int, got '4'"),
])
def test_a_from_batch_value_is_checked_as_its_param_is(tmp_path, value, says):
    """The large-batch kernel takes it as that param: `cluster: 3` rendered a cluster kernel the nms's
    own `allowed` refuses, and passed the dry run (found only by NVRTC, or not at all)."""
    c = load_contract("nms")
    raw = yaml.safe_load(c.path.read_text())
    raw["entry_points"][0]["from_batch"] = {"at": 2, "params": {"cluster": value}}
    (tmp_path / "nms.yaml").write_text(yaml.safe_dump(raw))
    bad = load_contract(str(tmp_path / "nms.yaml"))
    p = resolve_params(bad, {"max_candidates": 640, "chunk": 512}, {})
    with pytest.raises(KernelError, match=says):
        batch_thresholds(bad, p)


def test_a_from_batch_that_changes_one_of_its_params_launches_another_kernel(tmp_path):
    """`chunk` is 512 already, `cluster` 4 becomes 2: from batch 2 on the nms launches the cluster-2 kernel."""
    raw = yaml.safe_load(load_contract("nms").path.read_text())
    raw["entry_points"][0]["from_batch"] = {"at": 2, "params": {"cluster": 2, "chunk": 512}}
    (tmp_path / "nms.yaml").write_text(yaml.safe_dump(raw))
    c = load_contract(str(tmp_path / "nms.yaml"))
    p = resolve_params(c, {"max_candidates": 640, "chunk": 512, "cluster": 4}, {})
    assert batch_thresholds(c, p) == (2,)


def test_the_threshold_of_detections_is_the_given_one_and_only_declared_ones_count():
    kernels = [("yolov8_decode", resolve_params(load_contract("yolov8_decode"), {"mode": "candidates"}, FACTS)),
               ("nms", resolve_params(load_contract("nms"), {"max_candidates": 640, "conf_threshold": 0.4}, {}))]
    (nms,) = declared_detections(kernels)  # the decode declares none
    assert nms.threshold == 0.4 and nms.names == ("num_dets", "boxes", "scores", "classes")


def test_image_channels_must_be_bgr_or_rgb(tmp_path):
    raw = yaml.safe_load(load_contract("letterbox").path.read_text())
    raw["roles"]["image_input"]["channels"] = "'rbg'"
    (tmp_path / "lb.yaml").write_text(yaml.safe_dump(raw))
    c = load_contract(str(tmp_path / "lb.yaml"))
    with pytest.raises(KernelError, match=r"lb\.yaml: roles\.image_input\.channels must give 'bgr' or 'rgb', "
                                          r"got 'rbg'"):
        image_channels(c, resolve_params(c, {}, {}))


def _entries_contract(tmp_path):
    """Two entry points that `mode` selects, each with a from_batch (at 16 and at 4) changing `lanes`."""
    (tmp_path / "w.cu.j2").write_text("template <int L> __global__ void a() {}\n"
                                      "template <int L> __global__ void b() {}\n")
    (tmp_path / "w.yaml").write_text(textwrap.dedent("""\
        name: w
        template: w.cu.j2
        params:
          mode: {type: str, default: both, allowed: [a, b, both, none]}
          lanes: {type: int, default: 1}
        entry_points:
          - {name: a, symbol: "a<{{ lanes }}>", block: [1], grid: [W], args: [], when: "mode in ('a', 'both')",
             from_batch: {at: 16, params: {lanes: 2}}}
          - {name: b, symbol: "b<{{ lanes }}>", block: [1], grid: [B], args: [], when: "mode in ('b', 'both')",
             from_batch: {at: 4, params: {lanes: 4}}}
        """))
    c = load_contract(str(tmp_path / "w.yaml"))
    return c, lambda mode: resolve_params(c, {"mode": mode}, {})


def test_entry_points_are_those_their_when_selects(tmp_path):
    c, params = _entries_contract(tmp_path)
    assert batch_thresholds(c, params("both")) == (4, 16)  # ascending
    assert entry_symbols(c, params("a")) == (("a", "a<1>"), ("a (batch 16+)", "a<2>"))
    only_b = launches(c, params("b"), {"B": 8, "W": 3}, {})
    assert [(x.entry, x.symbol, x.grid) for x in only_b] == [("b", "b<4>", (8, 1, 1))]
    with pytest.raises(KernelError, match=r"w\.yaml: no entry point applies to params \{'mode': 'none', 'lanes': 1\}"):
        entry_symbols(c, params("none"))


def test_a_launch_without_its_dims_is_a_kernel_error_naming_the_field(tmp_path):
    c, params = _entries_contract(tmp_path)
    with pytest.raises(KernelError, match=r"w\.yaml: entry_points\[0\]\.grid: 'W' is neither a param nor a bound dim; "
                                          r"allowed: an int expression"):
        launches(c, params("a"), {"B": 1}, {})
    with pytest.raises(KernelError, match=r"w\.yaml: entry_points\[0\]\.from_batch: the launch has no batch dim "
                                          r"B bound"):
        launches(c, params("a"), {"W": 3}, {})


def test_a_negative_workspace_is_refused_naming_it(tmp_path):
    """`workspace: 100 - B * 64` passed the build and failed when the bundle loaded, as a broken manifest."""
    c = load_contract("nms")
    raw = yaml.safe_load(c.path.read_text())
    raw["workspace"] = "100 - B * 64"
    (tmp_path / "nms.yaml").write_text(yaml.safe_dump(raw))
    bad = load_contract(str(tmp_path / "nms.yaml"))
    p = resolve_params(bad, {"max_candidates": 640}, {})
    assert workspace_bytes(bad, p, {"B": 1, "K": 640}) == 36
    with pytest.raises(KernelError, match=r"nms\.yaml: workspace: '100 - B \* 64' gives -28 bytes at \{'B': 2, 'K': 640\}; "
                                          r"allowed: 0 or more"):
        workspace_bytes(bad, p, {"B": 2, "K": 640})


def test_concatenated_form_binds_anchors_from_its_input():
    c = load_contract("yolov8_decode")
    p = resolve_params(c, {"input_form": "concatenated", "mode": "output0"}, FACTS)
    sig = signature(c, p)
    assert [s.name for s in sig] == ["x", "output0"] and sig[0].shape == ("B", 144, "A")
    assert bind_dims(c, p, {"x": (2, 144, 8400)})["A"] == 8400
    with pytest.raises(RuntimeInputError, match=r"dim A is 8000 from input 'x' dim 2, but the contract makes it 8400 \(80\*80\+40\*40\+20\*20\)"):
        bind_dims(c, p, {"x": (2, 144, 8000)})


def test_nms_workspace_only_when_candidates_overflow_shared_memory():
    c = load_contract("nms")
    p = resolve_params(c, {}, {})
    assert p["max_candidates"] == "K"
    shapes = lambda b, k: {"cand_count": (b,), "cand_boxes": (b, k, 4), "cand_scores": (b, k),  # noqa: E731
                           "cand_classes": (b, k), "cand_index": (b, k)}
    small = bind_dims(c, p, shapes(4, 2000))
    assert workspace_bytes(c, p, small) == 0
    big = bind_dims(c, p, shapes(4, 8400))
    assert workspace_bytes(c, p, big) == 4 * 16384 * 12
    (launch,) = launches(c, p, big, {**{k: 1 for k in shapes(1, 1)}, "workspace": 7, "num_dets": 2, "boxes": 3,
                                      "scores": 4, "classes": 5})
    assert launch.symbol == "deepjit_nms<300, false>" and launch.grid == (4, 1, 1)
    assert dict((a[0], a[2]) for a in launch.args)["ws_stride"] == 16384


def test_decode_mode_nms_writes_the_nms_outputs_in_one_launch():
    c = load_contract("yolov8_decode")
    p = resolve_params(c, {"mode": "nms", "block": 1024, "chunk": 256, "max_det": 100, "agnostic": True}, FACTS)
    sig = {s.name: s for s in signature(c, p)}
    outputs = [n for n, s in sig.items() if s.role == "output"]
    assert outputs == ["cand_count", "cand_boxes", "cand_scores", "cand_classes", "cand_index", "blocks_done",
                       "num_dets", "boxes", "scores", "classes"]
    assert sig["blocks_done"].zero_init and sig["cand_count"].zero_init and sig["boxes"].shape == ("B", 100, 4)
    dims = bind_dims(c, p, head_shapes(2))
    tensors = {s.name: 1000 + k for k, s in enumerate(signature(c, p))}
    (launch,) = launches(c, p, dims, {**tensors, "workspace": 7})
    assert launch.symbol == "deepjit_yolov8_decode_nms<float, 1, 100, true>"
    assert launch.block == (1024, 1, 1) and launch.grid == (-(-8400 // (4 * 1024)), 2, 1)
    assert launch.shared_mem == 256 * (256 // 8 + 28)  # the NMS chunk's, as the nms kernel's
    args = dict((a[0], a[2]) for a in launch.args)
    assert args["ws_stride"] == 16384 and args["workspace"] == 7 and args["num_dets"] == tensors["num_dets"]
    assert workspace_bytes(c, p, dims) == 2 * 16384 * 12  # 8400 candidates can pass sort_capacity
    small = resolve_params(c, {"mode": "nms", "max_candidates": 2000}, FACTS)
    assert workspace_bytes(c, small, bind_dims(c, small, head_shapes(2))) == 0
    two = resolve_params(c, {}, FACTS)
    assert "num_dets" not in {s.name for s in signature(c, two)} and workspace_bytes(c, two, dims) == 0


def test_a_stage_done_before_has_no_tensors_launches_or_workspace():
    """nms with fused: true (the decode before it in mode nms did its work): nothing of its own."""
    c = load_contract("nms")
    p = resolve_params(c, {"fused": True}, {})
    assert signature(c, p) == () and entry_symbols(c, p) == ()
    assert bind_dims(c, p, {}) == {} and launches(c, p, {}, {}) == () and workspace_bytes(c, p, {}) == 0
    assert c.model.roles.detections is not None  # still validated as detections, against its reference
    plain = resolve_params(c, {}, {})
    assert len(signature(c, plain)) == 9 and entry_symbols(c, plain) == (("nms", "deepjit_nms<300, false>"),)


def test_done_before_names_a_bool_param_and_params_of_the_contract(tmp_path):
    (tmp_path / "k.cu.j2").write_text("// nothing\n")
    (tmp_path / "k.yaml").write_text(textwrap.dedent("""\
        name: k
        template: k.cu.j2
        params: {chunk: {type: int, default: 1}}
        entry_points: [{name: k, symbol: k, block: [1], grid: [1], args: []}]
        roles: {done_before: {when: chunk}}
        """))
    with pytest.raises(KernelError, match="roles.done_before.when: 'chunk' must be one of the contract's bool params"):
        load_contract(str(tmp_path / "k.yaml"))
    text = (tmp_path / "k.yaml").read_text()
    (tmp_path / "k.yaml").write_text(text.replace("{chunk: {type: int, default: 1}}", "{fused: {type: bool, default: false}}")
                                     .replace("{when: chunk}", "{when: fused, same: [iou]}"))
    with pytest.raises(KernelError, match="roles.done_before.same: 'iou' is not one of the contract's params"):
        load_contract(str(tmp_path / "k.yaml"))


def test_entry_symbols_follow_params():
    c = load_contract("yolov8_decode")
    assert entry_symbols(c, resolve_params(c, {"mode": "output0", "dtype": "float16"}, FACTS)) == \
        (("decode", "deepjit_yolov8_decode_output0<__half, 1>"),)


def test_user_contract_by_path_with_yaml_errors_located(tmp_path):
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "scale.cu.j2").write_text("extern \"C\" __global__ void scale(float* x) { x[0] *= {{ factor }}; }\n")
    body = textwrap.dedent("""\
        name: scale
        template: scale.cu.j2
        params:
          factor: {type: float, default: 2.0}
        inputs:
          - {name: x, dtype: float32, shape: [N]}
        entry_points:
          - {name: scale, symbol: scale, block: [1], grid: [1], args: [{name: x, type: ptr}]}
        """)
    (tmp_path / "k" / "scale.yaml").write_text(body)
    c = load_contract("k/scale.yaml", spec_dir=tmp_path)
    assert c.template_path == (tmp_path / "k" / "scale.cu.j2").resolve()
    assert bind_dims(c, resolve_params(c, {}), {"x": (7,)})["N"] == 7
    (tmp_path / "k" / "bad.yaml").write_text(body.replace("    block:", "    blokc:").replace("{name: scale, symbol",
                                                                                            "{name: scale, blokc: [1], symbol"))
    with pytest.raises(KernelError, match=r"bad\.yaml:8:\d+: entry_points\[0\]\.blokc: unknown key 'blokc' \(did you mean 'block'\?\)"):
        load_contract("k/bad.yaml", spec_dir=tmp_path)
    with pytest.raises(KernelError, match=r"unknown kernel contract 'nmx' \(did you mean 'nms'\?\)"):
        load_contract("nmx")


# --- host side --------------------------------------------------------------------------------


@pytest.mark.parametrize("h, w, size, want", [
    (480, 640, 640, (1.0, 640, 480, 0, 80)),              # dw - 0.1 = -0.1 rounds to 0
    (1080, 1920, 640, (640 / 1920, 640, 360, 0, 140)),     # (640 - 360) / 2 - 0.1 = 139.9 -> 140
    (5, 1280, 640, (0.5, 640, 2, 0, 319)),                 # 5 * 0.5 = 2.5 -> 2 (half to even); 318.9 -> 319
    (7, 1280, 640, (0.5, 640, 4, 0, 318)),                 # 3.5 -> 4 (half to even); 317.9 -> 318
    (640, 427, 640, (1.0, 427, 640, 106, 0)),              # (640 - 427) / 2 - 0.1 = 106.4 -> 106
    (637, 640, 640, (1.0, 640, 637, 0, 1)),                # 1.5 - 0.1 = 1.4 -> 1, where 1.5 alone rounds to 2
    (640, 633, 640, (1.0, 633, 640, 3, 0)),                # 3.5 - 0.1 = 3.4 -> 3, where 3.5 alone rounds to 4
])
def test_letterbox_geometry_rounds_half_to_even(h, w, size, want):
    g = letterbox_geometry(h, w, size)
    assert g.r == pytest.approx(want[0], rel=1e-7)
    assert (g.new_w, g.new_h, g.left, g.top) == want[1:]
    assert g.scale_x == float(np.float32(g.new_w) / np.float32(w))


@pytest.mark.parametrize("h, w, says", [
    (1, 1280, r"a 1280x1 image has no pixel left in the 640x640 frame \(it scales to 640x0\)"),  # 0.5 -> 0 (half to even)
    (2600, 2, r"a 2x2600 image has no pixel left in the 640x640 frame \(it scales to 0x640\)"),   # 0.49 -> 0
    (0, 50, r"a 50x0 image has no pixels; allowed: at least 1x1"),
])
def test_letterbox_geometry_refuses_an_image_it_leaves_no_pixel_of(h, w, says):
    """The GPU letterbox's launch args and the host's resize share it: such an image divided by zero on the
    host, and on the GPU ran with nothing of it in the frame."""
    with pytest.raises(RuntimeInputError, match=says):
        letterbox_geometry(h, w, 640)
    assert letterbox_geometry(1, 1279, 640).new_h == 1  # 0.5004 -> 1: the thinnest image that keeps a row


def test_kernel_args_get_explicit_c_types():
    assert pack_arg("n", "i32", 5).dtype == np.int32
    assert pack_arg("t", "f32", 0.45).dtype == np.float32      # never a double
    assert pack_arg("p", "ptr", 0x7F00) == np.uint64(0x7F00)
    assert pack_arg("workspace", "ptr", None) == np.uint64(0)  # a kernel with no workspace gets a null pointer
    with pytest.raises(KernelError, match="'p' is a pointer"):
        pack_arg("p", "ptr", 1.5)
    assert pack_arg("agnostic", "i32", True) == 1 and pack_arg("n", "i64", 2.0) == 2
    assert pack_arg("agnostic", "i32", np.True_) == 1 and pack_arg("n", "u32", np.int64(2**32 - 1)) == 2**32 - 1
    assert pack_arg("t", "f32", float("inf")) == np.float32("inf")      # inf and NaN a float arg holds as they are
    assert np.isnan(pack_arg("t", "f32", float("nan"))) and np.isnan(pack_arg("t", "f64", float("nan")))
    assert np.isnan(pack_arg("t", "f32", np.float32("nan"))) and pack_arg("t", "f64", np.float32("-inf")) == -np.inf


@pytest.mark.parametrize("kind, value", [
    ("i32", "candidates"),     # a str param: numpy's ValueError, exit 3
    ("i64", float("nan")),     # ValueError, exit 3
    ("i32", 2**40),            # wrapped to 0
    ("u32", -1),               # wrapped to 4294967295
    ("i32", 2.5),              # truncated to 2
    ("f32", 1e300),            # inf
    ("f32", [1.0]),            # an array
])
def test_a_kernel_arg_its_c_type_cannot_hold_is_a_kernel_error_naming_it(kind, value):
    with pytest.raises(KernelError, match=rf"^kernel arg 'n' is {kind}; got {re.escape(repr(value))}, which {kind} "
                                          "cannot hold$"):
        pack_arg("n", kind, value)


def _site_contract(tmp_path, site_input):
    (tmp_path / "s.cu.j2").write_text("extern \"C\" __global__ void k() {}\n")
    (tmp_path / "s.yaml").write_text(textwrap.dedent(f"""\
        name: s
        template: s.cu.j2
        inputs: [{{name: x, dtype: float32, shape: [4], site_input: {site_input!r}}}]
        entry_points: [{{name: k, symbol: k, block: [1], grid: [1], args: []}}]
        """))
    return load_contract(str(tmp_path / "s.yaml"))


@pytest.mark.parametrize("site_input", ["-1", "true"])
def test_a_site_input_is_a_position(tmp_path, site_input):
    assert site_inputs(_site_contract(tmp_path, "1"), {}) == {"x": 1}
    with pytest.raises(KernelError, match=r"s\.yaml: inputs\[0\]\.site_input: must be a position \(an int >= 0\), "
                                          r"got (-1|True)$"):
        site_inputs(_site_contract(tmp_path, site_input), {})


def test_a_contract_path_is_a_yaml_or_yml_file_or_has_a_slash():
    assert [is_contract_path(r) for r in ("k.yaml", "k.yml", "mine/k", "nms")] == [True, True, True, False]


def test_decode_inputs_bind_to_the_cut_inputs_by_position():
    """The preset orders the cut's inputs box_0, cls_0, box_1, ...; the contract's site_input says which
    of them each of its inputs is, so its box_i/cls_i need not be the model's tensor names."""
    contract = load_contract("yolov8_decode")
    params = resolve_params(contract, {}, FACTS)
    assert site_inputs(contract, params) == {"box_0": 0, "box_1": 2, "box_2": 4, "cls_0": 1, "cls_1": 3, "cls_2": 5}
    site = [TensorSig(h["name"], "float32", ()) for h in FACTS["head_inputs"]]   # level by level, box first
    names = site_aliases(contract, params, site, "decode")
    assert names == {f"{r}_{i}": f"/m/{r}{i}" for i in range(3) for r in ("box", "cls")}
    concatenated = resolve_params(contract, {"input_form": "concatenated"}, FACTS)
    assert site_inputs(contract, concatenated) == {"x": 0}
    with pytest.raises(BundleError, match=r"decode: input 'box_2' reads site input 4, but the step has 3 inputs"):
        site_aliases(contract, params, site[:3], "decode")


def test_every_declared_host_arg_has_its_host_function():
    assert set(launch.HOST_ARGS) == set(contract_models.HOST_ARGS)
    values = launch.host_values(load_contract("letterbox"), {"size": 640}, {"H": 48, "W": 64})
    assert (values["new_w"], values["new_h"], values["left"], values["top"]) == (640, 480, 0, 80)
    assert launch.host_values(load_contract("nms"), {}, {}) == {}


# --- hostile expressions ------------------------------------------------------------------------


def _hostile(tmp_path, workspace: str = "0", name: str = "x", repeat: str | None = None):
    """A user's contract whose workspace expression, input name and its repeat are `workspace`, `name`, `repeat`."""
    (tmp_path / "h.cu.j2").write_text("extern \"C\" __global__ void k() {}\n")
    repeats = "" if repeat is None else f", repeat: {repeat!r}"
    (tmp_path / "h.yaml").write_text(textwrap.dedent(f"""\
        name: h
        template: h.cu.j2
        workspace: {workspace!r}
        inputs: [{{name: {name!r}, dtype: float32, shape: [4]{repeats}}}]
        entry_points: [{{name: k, symbol: k, block: [1], grid: [1], args: []}}]
        """))
    return load_contract(str(tmp_path / "h.yaml"))


@pytest.mark.parametrize("expr, message", [
    ("ceil_div.__code__", r"'ceil_div.__code__' is undefined: access to attribute '__code__' of 'function' object"),
    ("[1, ceil_div.__globals__]", r"is undefined: access to attribute '__globals__'"),
    ("len('a' * 5000000)", r"OverflowError: repeating a str of 1 items 5000000 times"),
    ("len([0] * 5000000)", r"OverflowError: repeating a list of 1 items 5000000 times"),
    ("len((0,) * 5000000)", r"OverflowError: repeating a tuple of 1 items 5000000 times"),
    ("2 ** 5000", r"OverflowError: 2 \*\* 5000 has more than 4096 bits"),
    # squared k deep it has 2**k times the bits: 20 deep multiplied for hours
    ("(2 ** 3000) * (2 ** 3000)", r"OverflowError: a product of 3001 and 3001 bits has more than 4096 bits"),
    # each multiplied for hours in one C call, which no deadline stops
    ("prod([2 ** 4000] * 30000)", r"OverflowError: a product of 4001 and 4001 bits has more than 4096 bits"),
    ("5|round(-100000000)", r"OverflowError: 10 \*\* 100000000 has more than 4096 bits"),
    ("1|round(100000000, 'floor')", r"OverflowError: 10 \*\* 100000000 has more than 4096 bits"),
    ("int('f' * 4000000, 16) // int('f' * 2000000, 16)", r"OverflowError: dividing ints of 16000000 and 8000000 bits"),
    ("int('f' * 4000000, 16) % int('f' * 2000000, 16)", r"OverflowError: dividing ints of 16000000 and 8000000 bits"),
    ("ceil_div(int('f' * 4000000, 16), int('f' * 2000000, 16))", r"OverflowError: dividing ints of 16000000 and"),
])
def test_a_hostile_expression_is_a_kernel_error_naming_the_file_and_field(tmp_path, expr, message):
    """The sandbox's unsafe-attribute Undefined and oversized results are the contract's fault (exit 2)."""
    c = _hostile(tmp_path, workspace=expr)
    with pytest.raises(KernelError, match=r"h\.yaml: workspace: .*" + message):
        workspace_bytes(c, {}, {})


def test_a_long_int_divided_by_a_short_one_is_allowed():
    """Only dividing two long ints is refused (quadratic, deaf to SIGALRM): by one of at most 4,096 bits it is
    linear. 16**2000 - 1 leaves 3 modulo 7 (16 is 2 mod 7, and 2**3 is 1)."""
    assert expressions.evaluate("int('f' * 2000, 16) % 7", {}, "t") == 3
    assert expressions.evaluate("ceil_div(int('f' * 2000, 16), 2 ** 4000)", {}, "t") == 2 ** 4000


@pytest.mark.parametrize("expr", [
    # 320 MB when called, in strings of 40 MB: malloc maps each afresh (smaller ones may reuse what the
    # process freed before, which its address space already holds and the bound cannot see)
    "([(['a' * 4000000] * 10)|join] * 8)|map('upper')|list|length",
    "'%500000000d' % 1",                                  # folded as a constant when parsed: 500 MB, twice
    "'%500000000d'|format(1)",
    "'{{ '%300000000d' % 1 }}'",                           # a template string, expanded first
])
def test_an_expression_that_builds_past_its_memory_bound_is_a_kernel_error(tmp_path, monkeypatch, expr):
    """Each took all the memory there was at full size (`'%9999999999d' % 1`). The parse folds constants, so
    it is bounded too: outside the expression's bound the fold took what the caller's bound (or, at full
    size, the machine) had, failing with no word of why."""
    monkeypatch.setattr(expressions, "EXPRESSION_BYTES", 64 << 20)
    c = _hostile(tmp_path, workspace=expr)
    with memory_bound(768 << 20, "the test"):
        with pytest.raises(KernelError, match=r"h\.yaml: workspace: cannot (evaluate|expand) .*: MemoryError: "
                                              r"the expression needs more than 64 MiB of memory"):
            workspace_bytes(c, {}, {})


@pytest.mark.parametrize("expr", [
    "[1]|slice(10**15)|select|list",       # a filter's loop: 10**15 empty slices, memory flat
    "[1]|slice(1000000000000000)|max",     # the same folded as a constant when parsed, its TimeoutError swallowed
    "sum([[0]] * 4000000, [])|length",      # one C call, quadratic (10**13 copies) and deaf to SIGALRM
    "([[0]] * 4000000)|sum(start=[])|length",
])
def test_an_expression_that_runs_past_its_deadline_is_a_kernel_error(tmp_path, monkeypatch, expr):
    """A plain expression has no `{% for %}`, but filters loop: each ran for days."""
    monkeypatch.setattr(expressions, "EXPRESSION_SECONDS", 0.5)
    c = _hostile(tmp_path, workspace=expr)
    with pytest.raises(KernelError, match=r"h\.yaml: workspace: cannot evaluate .*TimeoutError: the expression runs "
                                          r"for more than 0\.5 s"):
        workspace_bytes(c, {}, {})


@pytest.mark.parametrize("field, expr", [
    ("workspace", "['a' * 4000000] * 4000000"),      # 32 MB that printed in the message as 16 TB
    ("repeat", "['a' * 4000000] * 4000000"),
    ("workspace", "dict(a=['a' * 4000000] * 4000000)"),
    ("workspace", "[int('f' * 5000, 16)]"),           # 20,000 bits: printing it raised a bare ValueError
    ("workspace", "{'a' * 4000000: 'b' * 300000}"),   # a dict's keys print too
    ("workspace", "['a'.encode() * 4000000] * 2"),
    ("workspace", "[['a' * 1000] * 5000] * 4000000"),  # 2 * 10**13 characters, counted only until the bound
])
def test_a_result_too_large_to_print_is_a_kernel_error(tmp_path, field, expr):
    """A result is printed in messages (and written to manifests) whole, outside the expression's bounds:
    these took all the memory there was (a bare MemoryError under a cap), or raised ValueError."""
    c = _hostile(tmp_path, **{field: expr})
    with memory_bound(2 << 30, "the test"):
        with pytest.raises(KernelError, match=r"h\.yaml: .*cannot evaluate .*OverflowError: the value (prints as more than "
                                              r"4194304 items and characters|is an int of 20000 bits, over 4096)"):
            signature(c, {}) if field == "repeat" else workspace_bytes(c, {}, {})


def test_a_result_within_the_print_bound_is_returned_whole():
    """A list prints as one item and its string's characters: 1 + 4,194,303 is the bound."""
    assert expressions.evaluate("['a' * 4194303]", {}, "t") == ["a" * 4194303]
    with pytest.raises(KernelError, match=r"OverflowError: the value prints as more than 4194304 items"):
        expressions.evaluate("['a' * 4194304]", {}, "t")


def test_a_contract_string_that_expands_past_its_bound_is_a_kernel_error(tmp_path):
    """Each text an expansion made was cached (4,096 a cache) and printed outside the expression's bounds:
    a `repeat` of texts of a few hundred MB each ran the machine out of memory."""
    c = _hostile(tmp_path, name="x{{ 'a' * (65536 + i) }}", repeat="2")
    with pytest.raises(KernelError, match=r"h\.yaml: inputs\[0\]\.name: \"x\{\{ 'a' \* \(65536 \+ i\) \}\}\" expands "
                                          r"to 65537 characters; allowed: at most 65536 \(a name, a dtype or an expression\)"):
        signature(c, {})
    assert [len(s.name) for s in signature(_hostile(tmp_path, name="{{ 'a' * (65535 + i) }}", repeat="2"), {})] \
        == [65535, 65536]


@pytest.mark.parametrize("dtype, got", [("'[1]'", r"\[1\]"), ("float128", "'float128'")])
def test_a_dtype_that_is_no_c_type_is_a_kernel_error(tmp_path, dtype, got):
    """`dtype not in CTYPES` raised a bare TypeError (unhashable type: 'list'): exit 3, a DeepJIT bug."""
    (tmp_path / "h.cu.j2").write_text("extern \"C\" __global__ void k() {}\n")
    (tmp_path / "h.yaml").write_text(textwrap.dedent(f"""\
        name: h
        template: h.cu.j2
        inputs: [{{name: x, dtype: {dtype}, shape: [4]}}]
        entry_points: [{{name: k, symbol: k, block: [1], grid: [1], args: []}}]
        """))
    with pytest.raises(KernelError, match=rf"h\.yaml: inputs\[0\]: dtype must be one of float32, .*got {got}$"):
        signature(load_contract(str(tmp_path / "h.yaml")), {})


def test_a_hostile_template_string_is_a_kernel_error_naming_the_file_and_field(tmp_path):
    c = _hostile(tmp_path, name="x{{ range(10**6) | list | length }}")
    with pytest.raises(KernelError, match=r"h\.yaml: inputs\[0\]\.name: cannot expand .*OverflowError: Range too big"):
        signature(c, {})


@pytest.mark.parametrize("expr, value", [
    ("float('nan')", "nan"),       # int() raised ValueError: exit 3
    ("float('inf')", "inf"),       # int() raised OverflowError: exit 3
    ("10 / 4", "2.5"),             # int() truncated it to 2: fewer bytes (or blocks) than asked for
])
def test_a_launch_size_that_is_no_whole_number_is_a_kernel_error_naming_the_field(tmp_path, expr, value):
    c = _hostile(tmp_path, workspace=expr)
    with pytest.raises(KernelError, match=rf"h\.yaml: workspace: .* gives {value}, not a whole number; allowed: an int "
                                          r"expression .* \(ceil_div\(a, b\) rounds a division up\)"):
        workspace_bytes(c, {}, {})
    assert workspace_bytes(_hostile(tmp_path, workspace="16 / 4"), {}, {}) == 4


@pytest.mark.parametrize("repeat", ["10**9", "100001", "-2", "-1", "true"])
def test_a_repeat_past_its_bounds_is_a_kernel_error_naming_the_field(tmp_path, repeat):
    """10**9 made a context per tensor until memory ran out (exit 3); -2 made no tensor, true one, silently."""
    c = _hostile(tmp_path, name="x_{{ i }}", repeat=repeat)
    with pytest.raises(KernelError, match=r"h\.yaml: inputs\[0\]\.repeat: must be an int from 0 to 100000 once params "
                                          r"are known, got (1000000000|100001|-2|-1|True)$"):
        signature(c, {})
    assert [s.name for s in signature(_hostile(tmp_path, name="x_{{ i }}", repeat="2"), {})] == ["x_0", "x_1"]
    assert signature(_hostile(tmp_path, name="x_{{ i }}", repeat="0"), {}) == ()  # 0 is allowed: no tensor


@pytest.mark.parametrize("kind, default, bound", [("str", "'a'", "min"), ("list", "[1]", "min"), ("bool", "true", "min"),
                                                 ("str", "'a'", "max"), ("list", "[1]", "max")])
def test_min_and_max_bound_only_a_number_param(tmp_path, kind, default, bound):
    """Checking a str or list value against them raised TypeError (exit 3) when the param was resolved."""
    (tmp_path / "p.cu.j2").write_text("extern \"C\" __global__ void k() {}\n")
    (tmp_path / "p.yaml").write_text(textwrap.dedent(f"""\
        name: p
        template: p.cu.j2
        params:
          flavour: {{type: {kind}, default: {default}, {bound}: 2}}
        entry_points: [{{name: k, symbol: k, block: [1], grid: [1], args: []}}]
        """))
    with pytest.raises(KernelError, match=rf"p\.yaml:4:\d+: params\.flavour: min and max bound an int or float param; "
                                          rf"this one is {kind} \(use allowed:\)"):
        load_contract(str(tmp_path / "p.yaml"))


@pytest.mark.parametrize("param, says", [
    ("{type: int, default: 1, min: 2}", r"p\.yaml: params\.flavour\.default: param 'flavour' must be in \[2\.0, None\], "
                                        r"got 1"),
    ("{type: int, default: 3, allowed: [1, 2]}", r"p\.yaml: params\.flavour\.default: param 'flavour' must be one of "
                                                 r"\[1, 2\], got 3"),
    ("{type: float, default: 'x'}", r"p\.yaml: params\.flavour\.default: param 'flavour' must be float, got 'x'"),
    ("{type: int, min: 20, max: 3}", r"p\.yaml:4:\d+: params\.flavour: min 20 is above max 3"),
])
def test_a_param_default_outside_its_own_bounds_is_refused_at_load(tmp_path, param, says):
    """Such a default was named only when a spec left the param out, in words that blamed the spec's value;
    min above max allowed no value at all."""
    (tmp_path / "p.cu.j2").write_text("extern \"C\" __global__ void k() {}\n")
    (tmp_path / "p.yaml").write_text(textwrap.dedent(f"""\
        name: p
        template: p.cu.j2
        params:
          flavour: {param}
        entry_points: [{{name: k, symbol: k, block: [1], grid: [1], args: []}}]
        """))
    with pytest.raises(KernelError, match=says):
        load_contract(str(tmp_path / "p.yaml"))
    (tmp_path / "p.yaml").write_text((tmp_path / "p.yaml").read_text().replace(param, "{type: int, default: 3, min: 3, "
                                                                                      "max: 3}"))
    c = load_contract(str(tmp_path / "p.yaml"))  # min equal to max allows that one value
    assert resolve_params(c, {})["flavour"] == 3


@pytest.mark.parametrize("name, repeat, says", [
    ("workspace", None, r"h\.yaml: inputs\[0\]\.name: 'workspace' names the kernel's scratch buffer"),
    ("x", "2", r"h\.yaml: inputs\[0\]\.name: 'x' is already the name of inputs\[0\]; allowed: one tensor a name"),
])
def test_a_tensor_name_taken_by_another_tensor_or_the_workspace_is_refused(tmp_path, name, repeat, says):
    """Tensors bind to buffers by name: a repeated name (a repeat without `{{ i }}`) shared one buffer, and
    a tensor named workspace was given the scratch buffer at launch, silently."""
    c = _hostile(tmp_path, name=name, repeat=repeat)
    with pytest.raises(KernelError, match=says):
        signature(c, {})
    assert [s.name for s in signature(_hostile(tmp_path, name="x_{{ i }}", repeat="2"), {})] == ["x_0", "x_1"]


@pytest.mark.parametrize("output, says", [
    ("x", r"h\.yaml: outputs\[0\]\.name: 'x' is already the name of inputs\[0\]; allowed: one tensor a name"),
    ("workspace", r"h\.yaml: outputs\[0\]\.name: 'workspace' names the kernel's scratch buffer"),
])
def test_an_output_named_as_an_input_or_the_workspace_is_refused(tmp_path, output, says):
    """An output of an input's name wrote into the buffer the kernel reads, one named workspace into its scratch."""
    (tmp_path / "h.cu.j2").write_text("extern \"C\" __global__ void k() {}\n")
    (tmp_path / "h.yaml").write_text(textwrap.dedent(f"""\
        name: h
        template: h.cu.j2
        inputs: [{{name: x, dtype: float32, shape: [4]}}]
        outputs: [{{name: {output}, dtype: float32, shape: [4]}}]
        entry_points: [{{name: k, symbol: k, block: [1], grid: [1], args: []}}]
        """))
    with pytest.raises(KernelError, match=says):
        signature(load_contract(str(tmp_path / "h.yaml")), {})


def test_an_entry_point_name_given_twice_is_refused(tmp_path):
    """Entry point names label their launches and kernels (nms, 'nms (batch 16+)'); two of one name were accepted."""
    c = load_contract("nms")
    raw = yaml.safe_load(c.path.read_text())
    raw["entry_points"].append(dict(raw["entry_points"][0]))
    (tmp_path / "nms.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(KernelError, match=r"nms\.yaml:\d+:\d+: entry_points: 'nms' is given twice; allowed: each once"):
        load_contract(str(tmp_path / "nms.yaml"))
