"""Input files (images, .npy, .npz) that cannot be read are clear errors naming the file, never a bug."""
from __future__ import annotations

import io
import os
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import skimage.data
from conftest import within

from deepjit_compiler.errors import RuntimeInputError
from deepjit_compiler.images import read_image, read_npy, read_npz


def npy_bytes(arr: np.ndarray, *, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def huge_npy_header() -> bytes:
    """A valid .npy header claiming 10**12 float32s (4 TiB), then a few bytes."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)})
    return buf.getvalue() + bytes(64)


def test_an_image_past_the_pixel_limit_is_refused_naming_the_file_and_the_limit(tmp_path, monkeypatch):
    image_mod = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    rgb = np.random.default_rng(21).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    image_mod.fromarray(rgb).save(tmp_path / "big.png")
    np.testing.assert_array_equal(read_image(tmp_path / "big.png"), rgb)
    monkeypatch.setattr(image_mod, "MAX_IMAGE_PIXELS", 1000)  # 4096 pixels is past twice that
    with pytest.raises(RuntimeInputError, match=r"big\.png: the image is too large.*at most 2000 pixels"):
        read_image(tmp_path / "big.png")


def test_undecodable_images_name_the_file(tmp_path):
    pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    (tmp_path / "junk.png").write_bytes(np.random.default_rng(22).bytes(300))
    with pytest.raises(RuntimeInputError, match=r"junk\.png: cannot decode the image.*\.jpg"):
        read_image(tmp_path / "junk.png")
    (tmp_path / "folder.png").mkdir()
    with pytest.raises(RuntimeInputError, match=r"folder\.png: cannot decode the image \(.*not a regular file"):
        read_image(tmp_path / "folder.png")


@pytest.mark.parametrize("reader, name", [(read_image, "fifo.png"), (read_npy, "fifo.npy"), (read_npz, "fifo.npz")])
def test_a_fifo_is_refused_at_once(tmp_path, reader, name):
    pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    os.mkfifo(tmp_path / name)
    with pytest.raises(RuntimeInputError, match=f"{name}: .*not a regular file"):
        within(10, lambda: reader(tmp_path / name), tmp_path / name)


@pytest.mark.parametrize("content, message", [
    (lambda rng: npy_bytes(np.array([{"a": 1}, None], dtype=object), allow_pickle=True), "Object arrays"),
    (lambda rng: b"\x80\x04" + rng.bytes(200), "pickled data"),
    (lambda rng: npy_bytes(rng.random((2, 3, 8, 8), dtype=np.float32))[:300], "cannot reshape|size"),
    (lambda rng: huge_npy_header(), "allocate"),
    (lambda rng: b"", "No data|EOF|empty"),
], ids=["object", "pickled", "truncated", "huge", "empty"])
def test_npy_files_that_are_not_plain_arrays_name_the_file(tmp_path, content, message):
    path = tmp_path / "bad.npy"
    path.write_bytes(content(np.random.default_rng(23)))
    with pytest.raises(RuntimeInputError, match=rf"bad\.npy: cannot read it as a \.npy array \(.*({message}).*\); "
                                                r"allowed: numeric arrays"):
        read_npy(path)


def corrupt_member(data: bytes) -> bytes:
    """The .npz with a byte of its (stored) member flipped: its CRC no longer matches."""
    at = len(data) // 2
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def test_npz_files_that_are_not_plain_arrays_name_the_file(tmp_path):
    rng = np.random.default_rng(24)
    good = rng.random((2, 5), dtype=np.float32)
    np.savez(tmp_path / "good.npz", images=good)
    np.testing.assert_array_equal(read_npz(tmp_path / "good.npz")["images"], good)
    np.savez(tmp_path / "obj.npz", images=np.array([object()] * 2, dtype=object))
    (tmp_path / "garbage.npz").write_bytes(b"PK\x03\x04" + rng.bytes(500))
    (tmp_path / "crc.npz").write_bytes(corrupt_member((tmp_path / "good.npz").read_bytes()))
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as z:
        z.writestr("images.npy", huge_npy_header())
    for name in ("obj.npz", "garbage.npz", "crc.npz", "huge.npz"):
        with pytest.raises(RuntimeInputError, match=rf"{name}: cannot read it as a \.npz of arrays \(.*\); allowed"):
            read_npz(tmp_path / name)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_arrays_with_nan_or_inf_are_refused_naming_the_file_array_and_first_index(tmp_path, bad):
    rng = np.random.default_rng(25)
    images = rng.random((2, 3, 8, 8), dtype=np.float32)
    np.save(tmp_path / "fine.npy", images)
    np.testing.assert_array_equal(read_npy(tmp_path / "fine.npy"), images)
    images[1, 2, 3, 4] = images[1, 2, 5, 6] = bad
    np.save(tmp_path / "bad.npy", images)
    np.savez(tmp_path / "bad.npz", counts=rng.integers(0, 9, (2,)), images=images)
    with pytest.raises(RuntimeInputError, match=r"bad\.npy: 2 of its 384 values are NaN or infinite \(the first at "
                                                r"index \[1, 2, 3, 4\]\); allowed: finite"):
        read_npy(tmp_path / "bad.npy")
    with pytest.raises(RuntimeInputError, match=r"bad\.npz: array 'images': 2 of its 384 values are NaN"):
        read_npz(tmp_path / "bad.npz")
    with pytest.raises(RuntimeInputError, match=r"bad\.npz: array 'images': 2 of its 384 values are NaN"):
        read_npz(tmp_path / "bad.npz", {"images"})
    # a member the caller does not feed may hold anything
    np.testing.assert_array_equal(read_npz(tmp_path / "bad.npz", {"counts"})["images"], images)


def test_a_16_bit_grey_image_keeps_its_high_byte_instead_of_saturating(tmp_path):
    image_mod = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    grey = np.random.default_rng(26).integers(0, 65536, (32, 48), dtype=np.uint16)
    want = np.repeat((grey // 256).astype(np.uint8)[..., None], 3, axis=-1)  # OpenCV's imread: 65535 -> 255
    for name, pixels in (("grey16.png", grey), ("grey16.tif", grey), ("grey16be.tif", grey.astype(">u2"))):
        image_mod.fromarray(pixels).save(tmp_path / name)  # the big-endian TIFF opens as mode I;16B
        got = read_image(tmp_path / name)
        assert got.dtype == np.uint8 and got.shape == (32, 48, 3)
        np.testing.assert_array_equal(got, want)


def test_a_32_bit_or_float_image_is_refused_naming_its_mode(tmp_path):
    image_mod = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    rng = np.random.default_rng(27)
    image_mod.fromarray(rng.integers(0, 2**20, (16, 16), dtype=np.int32)).save(tmp_path / "deep.tif")
    image_mod.fromarray(rng.random((16, 16), dtype=np.float32)).save(tmp_path / "float.tif")
    with pytest.raises(RuntimeInputError, match=r"deep\.tif: a 32-bit integer image \(Pillow mode I\).*8- or 16-bit"):
        read_image(tmp_path / "deep.tif")
    with pytest.raises(RuntimeInputError, match=r"float\.tif: a floating-point image \(Pillow mode F\)"):
        read_image(tmp_path / "float.tif")


def test_an_all_nan_array_is_refused_without_an_index_per_value():
    """np.argwhere of an all-NaN array made ndim int64s per value (9.7 GB for a 600 MB batch): the first
    index comes from argmin instead; the peak stays near the array's bool mask."""
    import tracemalloc

    from deepjit_compiler.images import _finite

    images = np.full((4, 3, 256, 256), np.nan, dtype=np.float32)
    tracemalloc.start()
    try:
        with pytest.raises(RuntimeInputError, match=r"x: 786432 of its 786432 values are NaN or infinite \(the first "
                                                    r"at index \[0, 0, 0, 0\]\)"):
            _finite(images, "x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < images.nbytes, peak


def test_a_16_bit_grey_png_that_pillow_opens_as_mode_i_keeps_its_high_byte():
    """Pillow before 13 opens a 16-bit grey PNG as mode I (32-bit ints holding 0..65535), not I;16."""
    image_mod = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    from deepjit_compiler.images import _rgb8

    img = image_mod.fromarray(np.array([[0, 130 * 256 + 7, 65535]], dtype=np.int32))
    img.format = "PNG"
    assert img.mode == "I"
    np.testing.assert_array_equal(_rgb8(img, Path("grey16.png")), [[[0] * 3, [130] * 3, [255] * 3]])


def test_a_complex_array_with_nan_is_refused_like_a_float_one(tmp_path):
    values = np.random.default_rng(26).random((2, 4)) + 1j * np.random.default_rng(27).random((2, 4))
    values[1, 3] = complex(1.0, np.nan)
    np.save(tmp_path / "c.npy", values.astype(np.complex64))
    with pytest.raises(RuntimeInputError, match=r"c\.npy: 1 of its 8 values are NaN or infinite \(the first at "
                                                r"index \[1, 3\]\)"):
        read_npy(tmp_path / "c.npy")


def test_grey_and_transparent_photos_become_three_channel_rgb(tmp_path):
    image_mod = pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    grey, rgb = skimage.data.camera()[::8, ::8], skimage.data.chelsea()[::6, ::6]
    alpha = np.random.default_rng(29).integers(0, 256, rgb.shape[:2], dtype=np.uint8)
    image_mod.fromarray(grey).save(tmp_path / "grey.png")
    image_mod.fromarray(np.dstack([rgb, alpha])).save(tmp_path / "rgba.png")
    np.testing.assert_array_equal(read_image(tmp_path / "grey.png"), np.repeat(grey[..., None], 3, axis=-1))
    np.testing.assert_array_equal(read_image(tmp_path / "rgba.png"), rgb)  # the alpha channel is dropped


def test_a_tiff_whose_width_is_not_a_whole_number_names_the_file(tmp_path):
    pytest.importorskip("PIL.Image", reason="decoding images needs Pillow")
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(skimage.data.chelsea()[::6, ::6]).save(buf, "TIFF")
    data = bytearray(buf.getvalue())  # little-endian: "II", then the first directory's offset
    ifd = struct.unpack_from("<I", data, 4)[0]
    for at in range(ifd + 2, ifd + 2 + 12 * struct.unpack_from("<H", data, ifd)[0], 12):
        if struct.unpack_from("<H", data, at)[0] == 256:  # ImageWidth: made a FLOAT, 75.5
            struct.pack_into("<HIf", data, at + 2, 11, 1, 75.5)
    (tmp_path / "width.tif").write_bytes(bytes(data))
    with pytest.raises(RuntimeInputError, match=r"width\.tif: cannot decode the image \(Invalid dimensions\)"):
        read_image(tmp_path / "width.tif")


def test_a_npz_with_a_broken_deflate_stream_names_the_file(tmp_path):
    rng = np.random.default_rng(28)
    np.savez_compressed(tmp_path / "z.npz", images=rng.random((4, 64), dtype=np.float32))
    data = bytearray((tmp_path / "z.npz").read_bytes())
    body = 30 + int.from_bytes(data[26:28], "little") + int.from_bytes(data[28:30], "little")  # past the local header
    data[body:body + 16] = rng.bytes(16)
    (tmp_path / "z.npz").write_bytes(bytes(data))
    with pytest.raises(RuntimeInputError, match=r"z\.npz: cannot read it as a \.npz of arrays \(Error -3 .*\); allowed"):
        read_npz(tmp_path / "z.npz")
