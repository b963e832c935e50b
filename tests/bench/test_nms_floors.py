"""bench/nms_floors.py's CPU side: each copy of the nms that stops early compiles (NVRTC, no GPU) for the
T4's and the H200's SMs, stops where it says (less code than the one after it), and the plain kernel has
no stop."""
from __future__ import annotations

import sys

import pytest
from conftest import REPO

from deepjit_compiler.jit.nvrtc import compile_site_kernel

sys.path.insert(0, str(REPO / "bench"))
from nms_floors import STEPS, decode_params, stop_copies  # noqa: E402


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


def test_the_decode_is_the_h200_specs_unless_told():
    assert {k: decode_params("")[k] for k in ("lanes_per_anchor", "large_batch_lanes", "anchors_per_thread")} == \
        {"lanes_per_anchor": 4, "large_batch_lanes": 2, "anchors_per_thread": 1}
    assert decode_params("lanes_per_anchor=2")["lanes_per_anchor"] == 2
