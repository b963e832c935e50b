"""`deepjit run`'s inputs (CPU): a file that is not a plain array or a decodable image is a clear
error naming it (exit code 2), never a traceback."""
from __future__ import annotations

import io
import re
import zipfile
from dataclasses import replace

import numpy as np
import pytest
from conftest import run_cli

from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.errors import RuntimeInputError
from deepjit_compiler.runtime import run as runbundle
from deepjit_compiler.runtime.layout import Layout
from deepjit_compiler.surgery.references import letterbox_numpy


@pytest.fixture(scope="module")
def t4_layout(t4_build) -> Layout:
    return Layout.from_bundle(read_bundle(t4_build.bundle.path))


def with_scale_input(layout: Layout) -> Layout:
    """The layout with a second input, 'scale' [batch, 2] float32, beside its images."""
    images_in = layout.inputs[0]
    scale = replace(images_in, name="scale", shape=("batch", 2), min=(1, 2), opt=(1, 2), max=(8, 2))
    return replace(layout, inputs=(images_in, scale))


def write_bad_inputs(folder, rng) -> dict[str, str]:
    """Seeded malformed inputs: {file name: what np.load or Pillow says about it}."""
    np.save(folder / "obj.npy", np.array([{"k": 1}, None], dtype=object), allow_pickle=True)
    (folder / "pickled.npy").write_bytes(b"\x80\x04" + rng.bytes(300))
    buf = io.BytesIO()
    np.save(buf, rng.random((1, 3, 640, 640), dtype=np.float32))
    (folder / "trunc.npy").write_bytes(buf.getvalue()[:1000])
    np.savez(folder / "obj.npz", images=np.array([object()], dtype=object))
    (folder / "garbage.npz").write_bytes(b"PK\x03\x04" + rng.bytes(400))
    with zipfile.ZipFile(folder / "member.npz", "w") as z:
        z.writestr("images.npy", b"\x93NUMPY" + rng.bytes(100))
    return {"obj.npy": "Object arrays", "pickled.npy": "pickled data", "trunc.npy": "reshape",
            "obj.npz": "Object arrays", "garbage.npz": "zip", "member.npz": ""}


def test_unreadable_tensor_files_name_the_file(tmp_path, t4_layout):
    for name, says in write_bad_inputs(tmp_path, np.random.default_rng(31)).items():
        kind = name.rsplit(".", 1)[1]
        with pytest.raises(RuntimeInputError, match=rf"{name}: cannot read it as a \.{kind} .*{says}.*allowed: numeric"):
            runbundle.load_samples([tmp_path / name], t4_layout)


def test_nan_is_refused_in_an_array_the_pipeline_is_fed_and_ignored_in_one_it_is_not(tmp_path, t4_layout):
    rng = np.random.default_rng(32)
    images = rng.random((1, 3, 640, 640), dtype=np.float32)
    np.savez(tmp_path / "extra.npz", images=images, meta=np.array([np.nan, 1.0]))
    (s,) = runbundle.load_samples([tmp_path / "extra.npz"], t4_layout)
    np.testing.assert_array_equal(s.feed["images"], images)
    images[0, 2, 100, 200] = np.inf
    np.savez(tmp_path / "bad.npz", images=images, meta=np.array([1.0]))
    with pytest.raises(RuntimeInputError, match=r"bad\.npz: array 'images': 1 of its 1228800 values are NaN or "
                                                r"infinite \(the first at index \[0, 2, 100, 200\]\)"):
        runbundle.load_samples([tmp_path / "bad.npz"], t4_layout)


def test_an_image_past_the_pixel_limit_is_a_clear_error(tmp_path, t4_layout, monkeypatch):
    image_mod = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    image_mod.fromarray(np.random.default_rng(32).integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(tmp_path / "b.png")
    monkeypatch.setattr(image_mod, "MAX_IMAGE_PIXELS", 500)
    with pytest.raises(RuntimeInputError, match=r"b\.png: the image is too large.*at most 1000 pixels"):
        runbundle.load_samples([tmp_path / "b.png"], t4_layout)


def test_run_exits_2_naming_a_pickled_input(tmp_path, t4_build):
    write_bad_inputs(tmp_path, np.random.default_rng(33))
    for name in ("obj.npy", "garbage.npz"):
        r = run_cli("run", str(t4_build.bundle.path), "-i", str(tmp_path / name), "--device", "cpu")
        assert r.returncode == 2, r.stderr
        assert f"{tmp_path / name}: cannot read it as" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("shape,says", [
    ((0, 50, 3), r"letterbox: a 50x0 image has no pixels; allowed: at least 1x1"),
    ((1, 1300, 3), r"letterbox: a 1300x1 image has no pixel left in the 640x640 frame \(it scales to 640x0\); "
                   r"allowed: a long side under 1280 times the short side"),
])
def test_an_image_the_host_letterbox_leaves_no_pixel_of_is_refused_naming_it(tmp_path, t4_build, shape, says):
    """Such an image divided by zero in the host letterbox's resize: exit 3, 'internal error'."""
    np.save(tmp_path / "thin.npy", np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8))
    r = run_cli("run", str(t4_build.bundle.path), "-i", str(tmp_path / "thin.npy"), "--device", "cpu")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert re.search(rf"error: thin\.npy: {says}", r.stderr), r.stderr


def test_an_array_of_no_images_is_refused(tmp_path, t4_layout):
    """A uint8 [0, H, W, 3] array ran nothing: exit 0 with no results."""
    np.save(tmp_path / "none.npy", np.zeros((0, 48, 64, 3), np.uint8))
    with pytest.raises(RuntimeInputError, match=r"none\.npy: array of images \[N, H, W, 3\] has no images "
                                                r"\(shape \(0, 48, 64, 3\)\)"):
        runbundle.load_samples([tmp_path / "none.npy"], t4_layout)


def test_an_input_file_of_the_wrong_dtype_or_size_is_named_before_anything_runs(tmp_path, t4_build):
    """The pipeline's check of a batch named only the input: which file of a folder was wrong went unsaid."""
    rng = np.random.default_rng(34)
    np.save(tmp_path / "a.npy", rng.random((1, 3, 640, 640), dtype=np.float32))
    np.save(tmp_path / "b.npy", rng.random((3, 640, 640)))  # float64
    np.save(tmp_path / "c.npy", rng.random((2, 3, 320, 640), dtype=np.float32))
    r = run_cli("run", str(t4_build.bundle.path), "-i", str(tmp_path), "--device", "cpu")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert ("error: b.npy: input 'images' is float64, expected float32 (shape [batch, 3, 640, 640]); convert it "
            "with .astype(np.float32)") in r.stderr
    (tmp_path / "b.npy").unlink()
    r = run_cli("run", str(t4_build.bundle.path), "-i", str(tmp_path), "--device", "cpu")
    assert r.returncode == 2 and ("error: c.npy[0]: input 'images' dim 2 is 320, allowed 640 (shape [batch, 3, 640, "
                                  "640], got (1, 3, 320, 640))") in r.stderr, r.stderr


def test_an_empty_folder_is_refused_naming_it_even_beside_other_inputs(tmp_path):
    """A folder of no inputs is a mistake (a wrong path), never silently skipped."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not an input")
    np.save(tmp_path / "x.npy", np.random.default_rng(35).random((3, 640, 640), dtype=np.float32))
    with pytest.raises(RuntimeInputError, match=r"empty: no images \(\.jpg, .*\) or \.npy/\.npz files in it"):
        runbundle.expand_inputs([tmp_path / "x.npy", tmp_path / "empty"])


def test_images_need_one_square_input(tmp_path, t4_layout):
    """Host letterboxing makes one [B, 3, S, S] tensor: a pipeline of two inputs, or of a non-square one,
    is told to take tensors instead."""
    image_mod = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    rgb = np.random.default_rng(36).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    image_mod.fromarray(rgb).save(tmp_path / "img.png")
    with pytest.raises(RuntimeInputError, match="images need a pipeline with one input; this one takes images, scale"):
        runbundle.load_samples([tmp_path / "img.png"], with_scale_input(t4_layout))
    wide = replace(t4_layout.inputs[0], min=(1, 3, 320, 640), opt=(1, 3, 320, 640), max=(8, 3, 320, 640))
    with pytest.raises(RuntimeInputError, match=r"host letterboxing needs a square \[B, 3, S, S\] input"):
        runbundle.load_samples([tmp_path / "img.png"], replace(t4_layout, inputs=(wide,)))


def test_a_uint8_array_that_is_not_three_channels_is_a_tensor_of_the_wrong_dtype(tmp_path, t4_layout):
    """Only [H, W, 3] / [N, H, W, 3] uint8 arrays are images: an RGBA one is fed as a tensor and refused."""
    np.save(tmp_path / "rgba.npy", np.random.default_rng(37).integers(0, 256, (2, 40, 50, 4), dtype=np.uint8))
    with pytest.raises(RuntimeInputError, match=r"rgba\.npy\[0\]: input 'images' is uint8, expected float32"):
        runbundle.load_samples([tmp_path / "rgba.npy"], t4_layout)


def test_an_npz_whose_arrays_disagree_on_the_batch_is_refused(tmp_path, t4_layout):
    """Each sample takes row i of every array: arrays of 2 and 3 rows have no common rows to pair."""
    rng = np.random.default_rng(38)
    np.savez(tmp_path / "pair.npz", images=rng.random((2, 3, 640, 640), dtype=np.float32),
             scale=rng.random((3, 2), dtype=np.float32))
    with pytest.raises(RuntimeInputError, match=r"pair\.npz: its arrays have different batch sizes \[2, 3\]"):
        runbundle.load_samples([tmp_path / "pair.npz"], with_scale_input(t4_layout))


def test_an_npy_for_a_pipeline_of_two_inputs_is_told_to_be_an_npz(tmp_path, t4_layout):
    np.save(tmp_path / "x.npy", np.random.default_rng(39).random((1, 3, 640, 640), dtype=np.float32))
    with pytest.raises(RuntimeInputError, match=r"x\.npy: this pipeline takes 2 inputs: give a \.npz with arrays "
                                                r"named images, scale"):
        runbundle.load_samples([tmp_path / "x.npy"], with_scale_input(t4_layout))


def test_each_image_of_an_array_of_images_is_its_own_sample(tmp_path, t4_layout):
    """A uint8 [N, H, W, 3] array is N images, named file[i], each letterboxed from its own pixels."""
    bgr = np.random.default_rng(40).integers(0, 256, (2, 32, 64, 3), dtype=np.uint8)
    np.save(tmp_path / "imgs.npy", bgr)
    samples = runbundle.load_samples([tmp_path / "imgs.npy"], t4_layout)
    assert [s.source for s in samples] == ["imgs.npy[0]", "imgs.npy[1]"]
    for sample, image in zip(samples, bgr):
        want = letterbox_numpy(image[None], size=640, dtype="float32", swap_rb=True)["images"]
        np.testing.assert_array_equal(sample.feed["images"], want)


def test_bench_batches_must_lie_in_1_to_the_max_batch(t4_layout):
    assert runbundle.check_batches([1, 8], t4_layout) == [1, 8]
    with pytest.raises(RuntimeInputError, match=r"--batch 0, 9: this bundle takes batches 1\.\.8 \(buckets 1, 2, 4, 8\)"):
        runbundle.check_batches([0, 4, 9], t4_layout)


def test_bench_needs_at_least_one_timed_call_and_no_negative_warmup(t4_build):
    for warmup, iters in ((10, 0), (-1, 5)):
        with pytest.raises(RuntimeInputError, match=rf"bench needs warmup >= 0 and iters >= 1, got {warmup} and {iters}"):
            runbundle.bench_bundle(t4_build.bundle.path, [1], warmup=warmup, iters=iters, device="cpu")


def test_bench_feeds_span_their_dtypes_range_at_the_opt_shape(t4_layout):
    """Floats in [0, 1), uint8 over all of 0..255 (an [H, W, 3] raw image input), seeded."""
    raw = replace(t4_layout.inputs[0], name="raw", dtype="uint8", shape=("batch", 64, 64, 3), min=(1, 64, 64, 3),
                  opt=(1, 64, 64, 3), max=(8, 64, 64, 3))
    layout = replace(t4_layout, inputs=(t4_layout.inputs[0], raw))
    feeds = runbundle.random_feeds(layout, 3, np.random.default_rng(41))
    assert feeds["images"].shape == (3, 3, 640, 640) and feeds["images"].dtype == np.float32
    assert 0.0 <= feeds["images"].min() and feeds["images"].max() < 1.0
    assert feeds["raw"].shape == (3, 64, 64, 3) and feeds["raw"].dtype == np.uint8
    assert (feeds["raw"].min(), feeds["raw"].max()) == (0, 255)
    again = runbundle.random_feeds(layout, 3, np.random.default_rng(41))
    np.testing.assert_array_equal(again["raw"], feeds["raw"])


def test_only_samples_of_one_shape_and_dtype_share_a_batch():
    rng = np.random.default_rng(42)

    def sample(name: str, shape: tuple[int, ...], dtype) -> runbundle.Sample:
        return runbundle.Sample(name, {"images": rng.random(shape).astype(dtype)})

    big, small, half = (1, 3, 64, 64), (1, 3, 32, 32), (1, 3, 64, 64)
    samples = [sample("a", big, np.float32), sample("b", big, np.float32), sample("c", small, np.float32),
               sample("d", half, np.float16), sample("e", big, np.float32)]
    assert [[s.source for s in g] for g in runbundle.batches(samples, 8)] == [["a", "b"], ["c"], ["d"], ["e"]]
    np.testing.assert_array_equal(runbundle.stack(samples[:2])["images"],
                                  np.concatenate([samples[0].feed["images"], samples[1].feed["images"]]))


def test_a_plan_engine_on_the_cpu_is_refused_before_loading(t4_build):
    with pytest.raises(RuntimeInputError, match="--engine plan runs a TensorRT plan, which needs a GPU: not with "
                                                "--device cpu"):
        runbundle.load_pipeline(t4_build.bundle.path, "cpu", engine="plan")


def test_out_refuses_a_json_file_of_the_users_and_accepts_an_earlier_run_output(tmp_path, t4_build):
    bundle = read_bundle(t4_build.bundle.path)
    (tmp_path / "config.json").write_text('{"bundle": "mine", "results": []}\n')
    with pytest.raises(RuntimeInputError, match=r"config\.json: exists and is not a `deepjit run` output"):
        runbundle.check_out(tmp_path / "config.json", bundle)
    (tmp_path / "dets.json").write_text('{"bundle": "yolov8n", "results": [], "out": "dets.json"}\n')
    runbundle.check_out(tmp_path / "dets.json", bundle)
    runbundle.check_out(tmp_path / "new.json", bundle)
