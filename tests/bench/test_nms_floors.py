"""bench/nms_floors.py's CPU side: each copy of the nms that stops early compiles (NVRTC, no GPU) for the
T4's and the H200's SMs, stops where it says (less code than the one after it), and the plain kernel has
no stop."""
from __future__ import annotations

import sys

import pytest
import yaml
from conftest import REPO

from deepjit_compiler.jit.nvrtc import compile_site_kernel

sys.path.insert(0, str(REPO / "bench"))
from decode_variants import nms_params  # noqa: E402
from nms_floors import SPEC_NMS, STEPS, decode_params, stop_copies  # noqa: E402


@pytest.mark.parametrize("sm, params", [(75, {"block": 512, "chunk": 256}),
                                        (90, {"block": 512, "chunk": 512, "cluster": 8})])
def test_each_stop_compiles_and_stops_before_the_next(tmp_path, sm, params):
    params = {"max_candidates": 8400, **params}
    refs = stop_copies(tmp_path)
    assert list(refs) == [stop for stop, _ in STEPS] and refs[None] == "nms"
    kernels = {stop: compile_site_kernel(ref, params, sm=sm, spec_dir=tmp_path, cache_dir=tmp_path / "cache")
               for stop, ref in refs.items()}
    for stop, k in kernels.items():
        assert (f"#define DJ_NMS_STOP {stop}\n" in k.source.code) == (stop is not None)
    sizes = [len(kernels[stop].cubin) for stop, _ in STEPS]
    assert sizes[0] <= sizes[1] < sizes[2] < sizes[3] < sizes[4]  # the loads, the counting pass, then the rest
    if params.get("cluster", 1) > 1:
        assert sizes[0] < sizes[1]  # the cluster's barrier


def test_the_kernels_are_the_h200_specs_unless_told():
    spec = yaml.safe_load((REPO / "pipelines" / "yolov8_h200.yaml").read_text())
    decode = next(k["params"] for c in spec["cuts"] for k in c["kernels"] if k["contract"] == "yolov8_decode")
    nms = next(k["params"] for c in spec["cuts"] for k in c["kernels"] if k["contract"] == "nms")
    assert decode_params("") == decode
    assert {k: nms_params(SPEC_NMS)[k] for k in ("block", "chunk", "cluster")} == \
        {k: nms[k] for k in ("block", "chunk", "cluster")}
    assert decode_params("lanes_per_anchor=2")["lanes_per_anchor"] == 2
