"""bench/nms_floors.py's CPU side: each copy of the decode and of the nms that stops early compiles (NVRTC,
no GPU) for the T4's and the H200's SMs, stops where it says (less code than the one after it), and the
plain kernels have no stop."""
from __future__ import annotations

import sys

import pytest
import yaml
from conftest import REPO

from deepjit_compiler.jit.nvrtc import compile_site_kernel

sys.path.insert(0, str(REPO / "bench"))
from decode_variants import nms_params  # noqa: E402
from nms_floors import DECODE_STOPS, NMS_STOPS, SPEC_NMS, decode_params, stop_copies  # noqa: E402
from postprocess import decode_site  # noqa: E402


@pytest.mark.parametrize("sm, params", [(75, {"block": 512, "chunk": 256}),
                                        (90, {"block": 512, "chunk": 512, "cluster": 8})])
def test_each_nms_stop_compiles_and_stops_before_the_next(tmp_path, sm, params):
    params = {"max_candidates": 8400, **params}
    refs = stop_copies(tmp_path, "nms", "DJ_NMS_STOP", NMS_STOPS)
    assert list(refs) == [0, 1, 2, 3, None] and refs[None] == "nms"
    kernels = {stop: compile_site_kernel(ref, params, sm=sm, spec_dir=tmp_path, cache_dir=tmp_path / "cache")
               for stop, ref in refs.items()}
    for stop, k in kernels.items():
        assert (f"#define DJ_NMS_STOP {stop}\n" in k.source.code) == (stop is not None)
    sizes = [len(kernels[stop].cubin) for stop in NMS_STOPS]
    assert sizes[0] <= sizes[1] < sizes[2] < sizes[3] < sizes[4]  # the loads, the counting pass, then the rest
    if params.get("cluster", 1) > 1:
        assert sizes[0] < sizes[1]  # the cluster's barrier


@pytest.fixture(scope="module")
def fp16_facts():
    return decode_site("fp16").facts


@pytest.mark.parametrize("sm", [75, 90])
@pytest.mark.parametrize("lanes", ["", "lanes_per_anchor=1,large_batch_lanes=0"])  # the spec's, and append_own
def test_each_decode_stop_compiles_and_stops_before_the_next(tmp_path, fp16_facts, sm, lanes):
    refs = stop_copies(tmp_path, "yolov8_decode", "DJ_DECODE_STOP", DECODE_STOPS)
    assert list(refs) == [0, 1, None] and refs[None] == "yolov8_decode"
    kernels = {stop: compile_site_kernel(ref, decode_params(lanes), fp16_facts, sm=sm, spec_dir=tmp_path,
                                         cache_dir=tmp_path / "cache") for stop, ref in refs.items()}
    for stop, k in kernels.items():
        assert (f"#define DJ_DECODE_STOP {stop}\n" in k.source.code) == (stop is not None)
    assert kernels[0].entries == kernels[1].entries == kernels[None].entries  # each lanes kernel of the entries
    sizes = [len(kernels[stop].cubin) for stop in DECODE_STOPS]
    assert sizes[0] < sizes[1] < sizes[2]  # the class pass, then the candidates


def test_the_kernels_are_the_h200_specs_unless_told():
    spec = yaml.safe_load((REPO / "pipelines" / "yolov8_h200.yaml").read_text())
    decode = next(k["params"] for c in spec["cuts"] for k in c["kernels"] if k["contract"] == "yolov8_decode")
    nms = next(k["params"] for c in spec["cuts"] for k in c["kernels"] if k["contract"] == "nms")
    assert decode_params("") == decode
    assert {k: nms_params(SPEC_NMS)[k] for k in ("block", "chunk", "cluster")} == \
        {k: nms[k] for k in ("block", "chunk", "cluster")}
    assert decode_params("lanes_per_anchor=2")["lanes_per_anchor"] == 2
