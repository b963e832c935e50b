"""bench/nms_variants.py's and bench/decode_variants.py's variant arguments: NAME=CONTRACT[:param=int,...]
over each script's defaults, and a decode variant compiles (NVRTC, no GPU) as the contract it names."""
from __future__ import annotations

import sys

import numpy as np
from conftest import REPO

from deepjit_compiler.jit.contracts import bind_dims, launches, load_contract, signature
from deepjit_compiler.jit.nvrtc import compile_site_kernel

sys.path.insert(0, str(REPO / "bench"))
from anchor_major import write_variant  # noqa: E402
from decode_variants import anchor_major_maps, nms_params  # noqa: E402
from fused_cluster import write_variant as write_fused_cluster  # noqa: E402
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


def test_anchor_major_maps_keep_their_shape_and_put_an_anchors_channels_together():
    rng = np.random.default_rng(5)
    maps = [{"box": rng.normal(size=(2, 64, 4, 3)).astype(np.float16), "cls": rng.normal(size=(2, 80, 4, 3))}]
    out = anchor_major_maps(maps, {"box"})[0]
    assert out["box"].shape == (2, 64, 4, 3) and out["cls"] is maps[0]["cls"]
    flat = out["box"].reshape(2, -1)
    # image 1, anchor (y 2, x 1) is local anchor 2 * 3 + 1 = 7: its 64 box logits are 64 * 7 on, in channel order
    assert np.array_equal(flat[1, 64 * 7:64 * 8], maps[0]["box"][1, :, 2, 1])
    both = anchor_major_maps(maps, {"box", "cls"})[0]
    assert np.array_equal(both["cls"].reshape(2, -1)[0, 80 * 11:80 * 12], maps[0]["cls"][0, :, 3, 2])


def test_the_anchor_major_decode_variant_compiles_and_reads_the_box_maps_by_anchor(tmp_path):
    contract = write_variant(tmp_path / "am")
    code = (tmp_path / "am" / "yolov8_decode.cu.j2").read_text()
    assert "box + (size_t)p * (4 * REG) + k * REG + r" in code and "(size_t)(k * REG + r) * cs" not in code
    facts = decode_site("fp16").facts
    for class_nhwc in (0, 1):
        k = compile_site_kernel(str(contract), {"mode": "candidates", "anchors_per_thread": 1, "lanes_per_anchor": 2,
                                                "class_nhwc": class_nhwc}, facts, sm=90, cache_dir=tmp_path)
        assert k.params["class_nhwc"] == class_nhwc


def test_the_fused_cluster_variant_pads_each_image_to_whole_clusters_and_compiles_for_sm_90(tmp_path):
    contract = write_fused_cluster(tmp_path / "fc")
    c, facts = load_contract(str(contract)), decode_site("fp16").facts
    params = {"mode": "nms", "anchors_per_thread": 1, "lanes_per_anchor": 4, "large_batch_lanes": 2, "large_batch": 4,
              "iou_threshold": 0.45, "max_det": 300, "block": 512, "chunk": 512}

    def launch(batch: int, cluster: int):
        k = compile_site_kernel(str(contract), {**params, "cluster": cluster}, facts, sm=90, cache_dir=tmp_path)
        shapes = {f"{role}_{i}": (batch, ch, 640 // s, 640 // s) for i, s in enumerate((8, 16, 32))
                  for role, ch in (("box", 64), ("cls", 80))}
        values = {"workspace": 1, **{t.name: 1 for t in signature(c, k.params)}}
        (one,) = launches(c, k.params, bind_dims(c, k.params, shapes), values)
        return one

    # batch 1, 4 lanes: 8400 x 4 / 512 = 65.6 blocks an image, padded to whole clusters
    for cluster, blocks in ((1, 66), (8, 72), (4, 68)):
        one = launch(1, cluster)
        assert one.grid == (blocks, 1, 1)
        assert one.symbol == ("deepjit_yolov8_decode_nms<__half, 4, 300, false>" if cluster == 1 else
                              f"deepjit_yolov8_decode_nms_cluster<__half, 4, 300, false, {cluster}>")
    # from batch 4 on, 2 lanes: 8400 x 2 / 512 = 32.8 blocks an image, 40 in clusters of 8
    one = launch(8, 8)
    assert one.grid == (40, 8, 1) and one.symbol == "deepjit_yolov8_decode_nms_cluster<__half, 2, 300, false, 8>"
