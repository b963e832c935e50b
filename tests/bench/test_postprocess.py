"""bench/postprocess.py's CPU side (--estimate-only): the bytes each kernel of a spec moves per batch
and that time at a bandwidth, for the T4 example's settings (a yolov8n variant: the same head maps).
Expected values are written out from the tensors' shapes and the issue's figures (batch 8's head maps:
121 µs to read at 320 GB/s in fp32, 60 µs in fp16)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, YOLOV8N_T4

HEAD_VALUES = 144 * 8400  # (4 * 16 + 80) channels over the 8400 anchors of a 640x640 input
CANDIDATE_ROW = 16 + 4 + 4 + 4  # box, score, class, anchor index


def estimate(spec, tmp_path, *args: str) -> tuple[list[dict], str]:
    out = tmp_path / "traffic.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "postprocess.py"), "--estimate-only", "--spec", str(spec),
                        "--json", str(out), *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())["traffic"], r.stdout


@pytest.fixture(scope="module")
def t4_rows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("estimate")
    body = (REPO / "pipelines" / "yolov8_t4.yaml").read_text()
    for old, new in YOLOV8N_T4.items():
        body = body.replace(old, new)
    (folder / "spec.yaml").write_text(body)
    return folder / "spec.yaml", estimate(folder / "spec.yaml", folder, "--batches", "1", "8")


def test_the_t4_specs_decode_reads_fp16_head_maps_beside_the_fp32_ones(t4_rows):
    _, (rows, text) = t4_rows
    decode = {(r["batch"], r["head_maps"]): r for r in rows if r["kernel"] == "decode/yolov8_decode"}
    assert sorted(decode) == [(1, "float16"), (1, "float32"), (8, "float16"), (8, "float32")]
    for (batch, dtype), r in decode.items():
        assert r["read"] == batch * HEAD_VALUES * (2 if dtype == "float16" else 4)
        assert r["written"] == batch * (4 + r["candidates_per_image"] * CANDIDATE_ROW)
    assert decode[8, "float32"]["us_at_bandwidth"] == pytest.approx(121.0, abs=0.3)
    assert decode[8, "float16"]["us_at_bandwidth"] == pytest.approx(60.5, abs=0.3)
    assert "µs at 320 GB/s" in text and "its profile allows batch <= 8" in text
    assert text.index("| 8 | float16 | decode/yolov8_decode |") < text.index("| 8 | float32 | decode/yolov8_decode |")


def test_the_nms_moves_the_candidates_the_data_gives_and_max_det_rows(t4_rows):
    _, (rows, _) = t4_rows
    for r in (r for r in rows if r["kernel"] == "nms/nms"):
        assert 0.01 * 8400 < r["candidates_per_image"] < 0.08 * 8400  # the benchmark's few percent of anchors
        assert r["read"] == r["batch"] * (4 + r["candidates_per_image"] * CANDIDATE_ROW)
        assert r["written"] == r["batch"] * (4 + 300 * (16 + 4 + 4))  # the T4 spec's max_det


def test_the_bandwidth_and_an_fp32_spec_change_the_estimate(t4_rows, tmp_path):
    spec, (rows, _) = t4_rows
    fp32 = tmp_path / "fp32.yaml"
    fp32.write_text(spec.read_text().replace("precision: fp16", "precision: fp32"))
    doubled, _ = estimate(fp32, tmp_path, "--batches", "8", "--bandwidth-gbs", "640")
    assert {r["head_maps"] for r in doubled} == {"float32"}  # an fp32 engine hands over fp32 only
    (before,) = [r for r in rows if r["batch"] == 8 and r["head_maps"] == "float32" and r["kernel"].startswith("decode")]
    (after,) = [r for r in doubled if r["kernel"].startswith("decode")]
    assert after["read"] == before["read"] and after["us_at_bandwidth"] == pytest.approx(before["us_at_bandwidth"] / 2)


def test_object_classes_draws_the_objects_from_the_first_classes():
    """--object-classes 1: a crowded frame, nearly every candidate of one class (the background
    logits of the other classes still pass the threshold now and then); the default spreads them."""
    sys.path.insert(0, str(REPO / "bench"))
    from postprocess import CONF, NC, head_maps

    def candidate_classes(maps):
        logits = np.concatenate([lv["cls"][0].reshape(NC, -1) for lv in maps], axis=1)
        keep = 1 / (1 + np.exp(-logits.max(axis=0))) > CONF
        return logits.argmax(axis=0)[keep]

    crowd = candidate_classes(head_maps(np.random.default_rng(1), 1, 1))
    spread = candidate_classes(head_maps(np.random.default_rng(1), 1))
    assert len(crowd) > 200 and np.mean(crowd == 0) > 0.9, np.bincount(crowd)
    assert len(np.unique(spread)) > 20 and np.bincount(spread).max() < 0.2 * len(spread)


def test_object_classes_outside_the_maps_classes_is_refused():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "postprocess.py"), "--estimate-only",
                        "--object-classes", "81"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--object-classes: '81'" in r.stderr and "1 to 80" in r.stderr, r.stderr


def test_the_fused_kernel_is_checked_bit_for_bit_against_the_two_kernels():
    """--fused prints whether its detections are the two kernels' exactly: counts, boxes, scores, classes."""
    sys.path.insert(0, str(REPO / "bench"))
    from postprocess import same_detections

    rng = np.random.default_rng(3)
    two = {"num_dets": np.array([5, 2], np.int32), "boxes": rng.uniform(0, 640, (2, 300, 4)).astype(np.float32),
           "scores": rng.uniform(0.25, 1, (2, 300)).astype(np.float32),
           "classes": rng.integers(0, 80, (2, 300)).astype(np.int32)}
    assert same_detections({k: v.copy() for k, v in two.items()}, two)
    for name, at in (("scores", (1, 0)), ("boxes", (0, 4, 2)), ("classes", (1, 1)), ("num_dets", (0,))):
        other = {k: v.copy() for k, v in two.items()}
        v = other[name]
        v[at] = np.nextafter(v[at], np.float32(np.inf)) if v.dtype == np.float32 else v[at] + 1
        assert not same_detections(other, two), name
