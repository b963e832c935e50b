"""bench/batch_split.py's chunks: each level's maps cut along the batch into equal parts, and the chunks' nms
outputs put back together in chunk order (the graphs themselves need a GPU)."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from batch_split import chunk_maps, joined  # noqa: E402


def test_chunks_cut_every_level_along_the_batch_in_order():
    rng = np.random.default_rng(11)
    maps = [{"box": rng.normal(size=(8, 64, n, n)).astype(np.float16), "cls": rng.normal(size=(8, 80, n, n))}
            for n in (4, 2)]
    parts = chunk_maps(maps, 4)
    assert len(parts) == 4 and all(len(p) == 2 for p in parts)
    assert parts[2][1]["box"].shape == (2, 64, 2, 2) and parts[2][1]["box"].flags.c_contiguous
    assert np.array_equal(parts[2][1]["box"], maps[1]["box"][4:6]) and np.array_equal(parts[3][0]["cls"], maps[0]["cls"][6:])
    with pytest.raises(ValueError, match="a batch of 8 does not split into 3"):
        chunk_maps(maps, 3)


def test_joined_outputs_are_the_chunks_images_in_chunk_order():
    rng = np.random.default_rng(12)
    outs = [{"num_dets": rng.integers(0, 300, (2, 1)), "boxes": rng.normal(size=(2, 300, 4)),
             "scores": rng.normal(size=(2, 300)), "classes": rng.integers(0, 80, (2, 300))} for _ in range(3)]
    one = joined(outs)
    assert one["boxes"].shape == (6, 300, 4)
    assert np.array_equal(one["num_dets"][4:], outs[2]["num_dets"]) and np.array_equal(one["scores"][:2], outs[0]["scores"])
