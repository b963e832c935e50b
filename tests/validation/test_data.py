import numpy as np
import pytest
import skimage.data
from conftest import letterbox_variant
from PIL import Image

from deepjit_compiler.errors import RuntimeInputError, SpecError
from deepjit_compiler.graph.tensors import TensorSig
from deepjit_compiler.spec.load import load_spec
from deepjit_compiler.validation.data import (
    batch_sizes,
    concrete_shape,
    feeds_for,
    folder_feeds,
    random_feeds,
    row_labels,
)

IMAGES = TensorSig("images", "float32", ("batch", 3, 640, 640))


def test_random_feeds_are_seeded_and_in_range():
    inputs = {"images": ("float32", (2, 3, 8, 8)), "raw": ("uint8", (1, 5, 5, 3))}
    a = random_feeds(inputs, seed=7, samples=3, ranges={"images": (-2.0, 3.0)})
    b = random_feeds(inputs, seed=7, samples=3, ranges={"images": (-2.0, 3.0)})
    c = random_feeds(inputs, seed=8, samples=3, ranges={"images": (-2.0, 3.0)})
    assert len(a) == 3 and all(np.array_equal(x["images"], y["images"]) for x, y in zip(a, b))
    assert not np.array_equal(a[0]["images"], c[0]["images"])
    assert not np.array_equal(a[0]["images"], a[1]["images"])  # fresh data per sample
    imgs = np.stack([f["images"] for f in a])
    assert imgs.min() >= -2.0 and imgs.max() < 3.0 and imgs.std() > 1.0
    raw = a[0]["raw"]
    assert raw.dtype == np.uint8 and raw.max() > 200 and raw.min() < 50


def test_integer_ranges_include_both_ends():
    """A range [lo, hi] of an integer input is inclusive, as the uint8 default [0, 255] is."""
    (feed,) = random_feeds({"ids": ("int32", (512,)), "raw": ("uint8", (64, 64, 3))}, seed=3, samples=1,
                           ranges={"ids": (-1, 2)})
    assert sorted(np.unique(feed["ids"]).tolist()) == [-1, 0, 1, 2]
    assert (feed["raw"].min(), feed["raw"].max()) == (0, 255)


def test_concrete_shape_binds_batch_and_fallback_dims():
    assert concrete_shape(["batch", 3, 640, 640], 2) == (2, 3, 640, 640)
    assert concrete_shape(["b", 3, "h", "w"], 1, fallback=(4, 3, 320, 480)) == (1, 3, 320, 480)
    with pytest.raises(SpecError, match="dim 2"):
        concrete_shape(["b", 3, "h"], 1)


def test_folder_feeds_load_npy_samples_in_order_and_check_dtype(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(1, 3, 4, 4)).astype(np.float32) for _ in range(2)]
    for k, a in enumerate(arrays):
        np.save(tmp_path / f"images_{k}.npy", a)
    feeds = folder_feeds(tmp_path, {"images": ("float32", (1, 3, 4, 4))})
    assert [np.array_equal(f["images"], a) for f, a in zip(feeds, arrays)] == [True, True]
    np.save(tmp_path / "images_2.npy", arrays[0].astype(np.float64))
    with pytest.raises(SpecError, match="images_2.npy: expected float32"):
        folder_feeds(tmp_path, {"images": ("float32", (1, 3, 4, 4))})
    with pytest.raises(SpecError, match=r"holds no images \(.*\.png.*\) and not <input>_<k>.npy files with the same "
                                        r"k \(>= 1 of them\) for every input: found k \{'other': \[\]\}"):
        folder_feeds(tmp_path, {"other": ("float32", (1,))})
    (tmp_path / "images_2.npy").unlink()
    np.save(tmp_path / "mask_0.npy", arrays[0])  # a batch 1 without its mask
    with pytest.raises(SpecError, match=r"found k \{'images': \[0, 1\], 'mask': \[0\]\}"):
        folder_feeds(tmp_path, {"images": ("float32", (1, 3, 4, 4)), "mask": ("float32", (1, 3, 4, 4))})
    np.save(tmp_path / "images_1.npy", arrays[1][0])
    with pytest.raises(SpecError, match=r"images_1.npy: expected float32 with rank 4, got float32 \[3, 4, 4\]"):
        folder_feeds(tmp_path, {"images": ("float32", (1, 3, 4, 4))})


def test_npy_batches_pair_by_k_and_an_input_named_like_another_takes_only_its_own(tmp_path):
    """Inputs `x` and `x_mask`: x_mask_0.npy is not a batch of x. Batches go by k as a number (2 before 10)."""
    rng = np.random.default_rng(11)
    xs = {k: rng.normal(size=(1, 4)).astype(np.float32) for k in (2, 10)}
    masks = {k: rng.integers(0, 2, size=(1, 4)).astype(np.uint8) for k in (2, 10)}
    for k in xs:
        np.save(tmp_path / f"x_{k}.npy", xs[k])
        np.save(tmp_path / f"x_mask_{k}.npy", masks[k])
    feeds = folder_feeds(tmp_path, {"x": ("float32", (1, 4)), "x_mask": ("uint8", (1, 4))})
    assert [(f["x"].tolist(), f["x_mask"].tolist()) for f in feeds] == [(xs[k].tolist(), masks[k].tolist())
                                                                        for k in (2, 10)]
    assert row_labels(feeds) == [["x_2.npy row 0"], ["x_10.npy row 0"]]
    (tmp_path / "x_mask_10.npy").rename(tmp_path / "x_mask_3.npy")  # as many files, other ks
    with pytest.raises(SpecError, match=r"found k \{'x': \[2, 10\], 'x_mask': \[2, 3\]\}"):
        folder_feeds(tmp_path, {"x": ("float32", (1, 4)), "x_mask": ("uint8", (1, 4))})


@pytest.mark.parametrize("write, says", [
    (lambda p, rng: np.save(p, np.array([{"k": 1}] * 2, dtype=object), allow_pickle=True), "Object arrays"),
    (lambda p, rng: p.write_bytes(b"\x80\x04" + rng.bytes(200)), "pickled data"),
    (lambda p, rng: p.write_bytes(b"\x93NUMPY" + rng.bytes(50)), ""),
], ids=["object", "pickled", "garbage"])
def test_a_folder_npy_that_is_not_a_plain_array_names_the_file(tmp_path, write, says):
    rng = np.random.default_rng(41)
    np.save(tmp_path / "images_0.npy", rng.normal(size=(1, 3, 4, 4)).astype(np.float32))
    write(tmp_path / "images_1.npy", rng)
    with pytest.raises(RuntimeInputError, match=rf"images_1\.npy: cannot read it as a \.npy array .*{says}.*allowed"):
        folder_feeds(tmp_path, {"images": ("float32", (1, 3, 4, 4))})


def test_a_folder_image_past_the_pixel_limit_names_the_file(tmp_path, monkeypatch):
    image_mod = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    rgb = np.random.default_rng(42).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    image_mod.fromarray(rgb).save(tmp_path / "a.png")
    monkeypatch.setattr(image_mod, "MAX_IMAGE_PIXELS", 400)
    with pytest.raises(RuntimeInputError, match=r"a\.png: the image is too large.*at most 800 pixels"):
        folder_feeds(tmp_path, {"images": ("float32", (1, 3, 16, 16))})


def test_folder_of_images_is_read_as_bgr_and_letterboxed(tmp_path):
    from deepjit_compiler.graph.ort import ort_session
    from deepjit_compiler.surgery.references import letterbox_reference

    rng = np.random.default_rng(5)
    rgb = rng.integers(0, 256, size=(48, 80, 3), dtype=np.uint8)  # wide: padded above and below
    Image.fromarray(rgb).save(tmp_path / "a.png")
    (feed,) = folder_feeds(tmp_path, {"images": ("float32", (1, 3, 64, 64))})
    x = feed["images"]
    assert x.shape == (1, 3, 64, 64) and x.dtype == np.float32
    # By hand: r = min(64/48, 64/80) = 0.8, content 64 x 38 at top = round(13 - 0.1) = 13, rows 13..50.
    pad = np.float32(114) / np.float32(255)
    assert (x[0, :, :13] == pad).all() and (x[0, :, 51:] == pad).all()
    assert not (x[0, :, 13] == pad).all() and not (x[0, :, 50] == pad).all()
    # Against the ONNX letterbox reference run by ONNX Runtime (data.py letterboxes in numpy): the
    # file is read as OpenCV would (BGR) and the letterbox swaps it back to RGB.
    bgr = np.ascontiguousarray(rgb[None, :, :, ::-1])
    want = ort_session(letterbox_reference(size=64, swap_rb=True)).run(["images"], {"raw_images": bgr})[0]
    np.testing.assert_allclose(x, want, atol=2e-5, rtol=0)
    (raw,) = folder_feeds(tmp_path, {"raw_images": ("uint8", (1, 48, 80, 3))})
    assert np.array_equal(raw["raw_images"][0], rgb[:, :, ::-1])
    with pytest.raises(SpecError, match="takes no images"):
        folder_feeds(tmp_path, {"x": ("float32", (1, 10))})


@pytest.mark.parametrize("inputs, says", [
    ({"images": ("float32", (1, 3, 32, 48))}, r"a\.png: input 'images' \[1, 3, 32, 48\] takes no images"),
    ({"images": ("float32", (1, 3, 32, 32)), "scale": ("float32", (1, 1))},
     r"images need a pipeline with one input, not images, scale"),
], ids=["not-square", "two-inputs"])
def test_images_for_an_input_that_cannot_take_them_are_refused(tmp_path, inputs, says):
    rgb = np.random.default_rng(6).integers(0, 256, size=(24, 40, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    with pytest.raises(SpecError, match=says):
        folder_feeds(tmp_path, inputs)


def test_batch_sizes_cycle_through_the_buckets_and_cover_every_row():
    assert batch_sizes(17, [1, 2, 4]) == [1, 2, 4, 1, 2, 4, 1, 2]
    assert batch_sizes(5, [4, 2, 1]) == [1, 2, 2]      # the rest takes the largest bucket that fits
    assert batch_sizes(3, [4]) == [4]                   # smaller than every bucket: one batch, filled up
    assert batch_sizes(8, [8]) == [8] and batch_sizes(0, [1, 2]) == []
    assert batch_sizes(1, [4, 2]) == [2] and batch_sizes(5, [2, 4]) == [2, 2, 2]  # a rest of 1: the smallest


def test_every_image_of_a_folder_is_used_batched_by_the_buckets_and_labelled(tmp_path):
    rng = np.random.default_rng(9)
    for k in range(6):
        Image.fromarray(rng.integers(0, 256, size=(20 + k, 30, 3), dtype=np.uint8)).save(tmp_path / f"im{k}.png")
    feeds = folder_feeds(tmp_path, {"images": ("float32", (2, 3, 32, 32))}, buckets=(1, 4))
    assert [f["images"].shape[0] for f in feeds] == [1, 4, 1]  # 6 images: 1 + 4 + 1, whatever the batch asked
    assert row_labels(feeds) == [["im0.png"], ["im1.png", "im2.png", "im3.png", "im4.png"], ["im5.png"]]
    alone = folder_feeds(tmp_path, {"images": ("float32", (1, 3, 32, 32))})  # every image, one per batch
    np.testing.assert_array_equal(np.concatenate([f["images"] for f in alone]),
                                  np.concatenate([f["images"] for f in feeds]))
    # raw images (a letterbox stage on the GPU) differ in size: one per batch, repeated to the smallest bucket
    raw = folder_feeds(tmp_path, {"raw_images": ("uint8", (1, 20, 30, 3))}, buckets=(2, 4))
    assert [f["raw_images"].shape for f in raw][:2] == [(2, 20, 30, 3), (2, 21, 30, 3)]
    assert row_labels(raw)[1] == ["im1.png", "im1.png"]


def test_a_folder_takes_photos_of_every_common_format_whatever_the_suffix_case(tmp_path):
    photo = skimage.data.chelsea()[::10, ::10]
    names = ["a.jpg", "b.JPEG", "c.png", "d.bmp", "e.webp", "f.tif", "g.TIFF"]
    for name in names:
        Image.fromarray(photo).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not an image")
    feeds = folder_feeds(tmp_path, {"raw_images": ("uint8", (1, *photo.shape))})
    assert [row for rows in row_labels(feeds) for row in rows] == names
    np.testing.assert_array_equal(feeds[2]["raw_images"][0], photo[..., ::-1])  # the PNG, lossless, as BGR


def test_random_feeds_and_plain_lists_are_labelled_by_sample_and_row():
    feeds = random_feeds({"x": ("float32", (2, 4))}, seed=0, samples=2)
    assert row_labels(feeds) == [["sample 0 row 0", "sample 0 row 1"], ["sample 1 row 0", "sample 1 row 1"]]
    assert row_labels([{"x": np.zeros((3, 1))}]) == [["batch 0 row 0", "batch 0 row 1", "batch 0 row 2"]]


def test_feeds_for_batch_a_folder_by_the_spec_inputs_buckets(write_spec, tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(2)
    for k in range(9):
        Image.fromarray(rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)).save(photos / f"p{k}.png")
    spec = load_spec(write_spec({"    random:\n      ranges: {images: [0.0, 1.0]}": "    folder: photos"})).spec
    feeds = feeds_for(spec, [TensorSig("images", "float32", ("batch", 3, 640, 640))])
    # the T4 spec's buckets 1, 2, 4, 8: after 1 + 2 + 4, the 2 images left take bucket 2
    assert [f["images"].shape[0] for f in feeds] == [1, 2, 4, 2]
    assert all(f["images"].shape[1:] == (3, 640, 640) for f in feeds)
    assert sum(len(rows) for rows in row_labels(feeds)) == 9


@pytest.mark.parametrize("shape", [(2, 3, 320, 320), (1, 3, 640, 648)], ids=["below-min", "above-max"])
def test_a_folder_array_outside_the_profile_names_the_file_and_the_profile(write_spec, tmp_path, shape):
    """A 320 x 320 batch for the fixed 640 model failed inside ONNX Runtime (exit 3)."""
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "images_0.npy", np.random.default_rng(4).random(shape, dtype=np.float32))
    spec = load_spec(write_spec({"    random:\n      ranges: {images: [0.0, 1.0]}": "    folder: data"})).spec
    dims = ", ".join(map(str, shape))
    with pytest.raises(SpecError, match=rf"validation.data.folder: images_0.npy gives input 'images' shape \[{dims}\]; "
                                        r"its profile allows \[1, 3, 640, 640\] to \[8, 3, 640, 640\]"):
        feeds_for(spec, [IMAGES])


def test_random_feeds_follow_the_specs_seed(write_spec):
    def feeds(seed: int):
        path = write_spec({"  seed: 0": f"  seed: {seed}", "  samples: 2": "  samples: 1",
                           "  gate: true": "  batch: 1\n  gate: true"}, name=f"seed{seed}.yaml")
        return feeds_for(load_spec(path).spec, [IMAGES])[0]["images"]

    first = feeds(5)
    assert np.array_equal(first, feeds(5)) and not np.array_equal(first, feeds(6))


@pytest.mark.parametrize("edits, rows", [
    ({"  gate: true": "  batch: 16\n  gate: true"}, 8),
    ({"  gate: true": "  batch: 1\n  gate: true", "min: [1, 3, 640, 640]": "min: [4, 3, 640, 640]",
      "buckets: [1, 2, 4, 8]": "buckets: [4, 8]"}, 4),
], ids=["above-max", "below-min"])
def test_the_random_batch_is_clamped_to_the_profile(write_spec, edits, rows):
    spec = load_spec(write_spec({"  samples: 2": "  samples: 1", **edits})).spec
    (feed,) = feeds_for(spec, [IMAGES])
    assert feed["images"].shape == (rows, 3, 640, 640)


def test_symbolic_dims_past_the_batch_take_the_profiles_opt(write_spec):
    """raw_images [batch, height, width, 3]: opt [2, 96, 128, 3], max [4, 1080, 1920, 3]."""
    spec = load_spec(write_spec(letterbox_variant(opt_hw=(96, 128)))).spec
    feeds = feeds_for(spec, [TensorSig("raw_images", "uint8", ("batch", "height", "width", 3))])
    assert [f["raw_images"].shape for f in feeds] == [(2, 96, 128, 3)] * 2
