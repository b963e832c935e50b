"""bench/nms_variants.py's and bench/decode_variants.py's variant arguments: NAME=CONTRACT[:param=int,...]
over each script's defaults, and a decode variant compiles (NVRTC, no GPU) as the contract it names."""
from __future__ import annotations

import sys

from conftest import REPO

from deepjit_compiler.jit.nvrtc import compile_site_kernel

sys.path.insert(0, str(REPO / "bench"))
from decode_variants import nms_params  # noqa: E402
from nms_variants import NMS_PARAMS, variant  # noqa: E402
from postprocess import decode_site  # noqa: E402


def test_a_variant_is_its_contract_with_int_params_over_the_defaults():
    assert variant("b512=nms:block=512,chunk=512") == ("b512", "nms", {**NMS_PARAMS, "block": 512, "chunk": 512})
    assert variant("old=OLD/nms.yaml") == ("old", "OLD/nms.yaml", NMS_PARAMS)
    assert NMS_PARAMS["block"] == 1024  # the H200 spec's, unless a variant says otherwise


def test_a_decode_variant_compiles_as_the_contract_it_names(tmp_path):
    name, ref, params = variant("l2=yolov8_decode:lanes_per_anchor=2", {"mode": "candidates", "anchors_per_thread": 1})
    k = compile_site_kernel(ref, params, decode_site("fp16").facts, sm=75, cache_dir=tmp_path)
    assert (name, k.params["lanes_per_anchor"], k.params["anchors_per_thread"], k.params["dtype"]) == \
        ("l2", 2, 1, "float16")


def test_the_nms_after_decode_variants_takes_its_params_over_block_1024_chunk_512():
    assert (nms_params("")["block"], nms_params("")["chunk"], nms_params("").get("cluster")) == (1024, 512, None)
    spec = nms_params("block=512,cluster=8")  # the H200 spec's nms
    assert (spec["block"], spec["chunk"], spec["cluster"], spec["max_det"]) == (512, 512, 8, 300)
