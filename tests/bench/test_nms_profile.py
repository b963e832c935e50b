"""bench/nms_profile.py's CPU side: the profiled copy of the nms contract compiles (NVRTC, no GPU) with
its clock64() marks and printf for the T4's and the H200's SMs, and the plain kernel has none of them."""
from __future__ import annotations

import sys

import pytest
from conftest import REPO

from deepjit_compiler.jit.nvrtc import compile_site_kernel

sys.path.insert(0, str(REPO / "bench"))
from nms_profile import defined_copy  # noqa: E402


@pytest.mark.parametrize("sm, block, chunk", [(75, 512, 256), (90, 1024, 512)])
def test_the_profiled_nms_compiles_with_its_marks(tmp_path, sm, block, chunk):
    template = (REPO / "templates" / "nms.cu.j2").read_text()
    ref = defined_copy(REPO / "kernels" / "nms.yaml", tmp_path)
    params = {"max_candidates": 8400, "block": block, "chunk": chunk}
    profiled = compile_site_kernel(str(ref), params, sm=sm, spec_dir=tmp_path, cache_dir=tmp_path / "cache")
    plain = compile_site_kernel("nms", params, sm=sm, cache_dir=tmp_path / "cache")
    assert profiled.source.code.startswith("#define DJ_NMS_PROFILE\n")
    assert "DJ_NMS_PROFILE" not in plain.source.code
    assert b"nms profile: candidates" in profiled.cubin and b"nms profile" not in plain.cubin  # the printf format
    assert (REPO / "templates" / "nms.cu.j2").read_text() == template  # the copy, not the template, changed
