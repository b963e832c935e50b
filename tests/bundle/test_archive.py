"""Deterministic packing and safe extraction (deepjit_compiler/archive.py)."""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import random
import tarfile
from pathlib import Path

import pytest

from deepjit_compiler.bundle.archive import pack, pack_to, safe_extract
from deepjit_compiler.errors import BundleError
from deepjit_compiler.files import replace_dir

LONG = "kernels/" + "very_long_kernel_folder_name_" * 5 + "/decode.sm_90.cubin"  # > 100 chars: a PAX header


def _contents(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {
        "manifest.json": b'{"a": %d}\n' % rng.randrange(1 << 30),
        "segments/backbone.onnx": rng.randbytes(70_000),
        "kernels/decode/decode.cu": rng.randbytes(999),
        "kernels/decode/decode.sm_75.cubin": rng.randbytes(4096),
        "references/ünïcode.onnx": rng.randbytes(10),
        "empty.bin": b"",
        LONG: rng.randbytes(123),
    }


def _write_tree(root: Path, files: dict[str, bytes], *, reverse: bool, seed: int) -> Path:
    rng = random.Random(seed)
    for rel in sorted(files, reverse=reverse):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(files[rel])
        os.chmod(path, rng.choice([0o600, 0o640, 0o664, 0o644]))
        t = rng.randrange(1, 2_000_000_000)
        os.utime(path, (t, t))
    return root


def _read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_pack_ignores_mtime_mode_owner_and_creation_order(tmp_path):
    files = _contents(1)
    a = _write_tree(tmp_path / "a", files, reverse=False, seed=2)
    b = _write_tree(tmp_path / "some" / "other-name", files, reverse=True, seed=3)
    assert pack(a) == pack(b)


def test_pack_headers_are_normalised(tmp_path):
    files = _contents(4)
    root = _write_tree(tmp_path / "t", files, reverse=True, seed=5)
    os.chmod(root / "empty.bin", 0o700)
    data = pack(root)
    # gzip header: FLG has no FNAME bit, MTIME is zero.
    assert data[:2] == b"\x1f\x8b" and not data[3] & 0x08 and data[4:8] == b"\0\0\0\0"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(files, key=lambda n: n.encode())
        for m in members:
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
            assert m.isreg()
            assert m.mode == (0o755 if m.name == "empty.bin" else 0o644)
            assert tar.extractfile(m).read() == files[m.name]


def test_pack_to_writes_the_same_bytes_and_returns_their_digest(tmp_path):
    root = _write_tree(tmp_path / "t", _contents(6), reverse=False, seed=7)
    out = tmp_path / "out" / "t.tar.gz"
    digest = pack_to(root, out)
    assert out.read_bytes() == pack(root)
    assert digest == "sha256:" + hashlib.sha256(out.read_bytes()).hexdigest()
    assert [p.name for p in out.parent.iterdir()] == ["t.tar.gz"]


def test_pack_refuses_links(tmp_path):
    root = _write_tree(tmp_path / "t", _contents(8), reverse=False, seed=9)
    (root / "kernels" / "link.cu").symlink_to(root / "kernels" / "decode" / "decode.cu")
    with pytest.raises(BundleError, match="kernels/link.cu.*symbolic link"):
        pack(root)


def test_safe_extract_round_trip(tmp_path):
    files = _contents(10)
    data = pack(_write_tree(tmp_path / "t", files, reverse=False, seed=11))
    extracted = safe_extract(data, tmp_path / "x")
    assert extracted == sorted(files)
    assert _read_tree(tmp_path / "x") == files
    # and from a path, into an existing empty folder
    (tmp_path / "t.tar.gz").write_bytes(data)
    (tmp_path / "y").mkdir()
    safe_extract(tmp_path / "t.tar.gz", tmp_path / "y")
    assert _read_tree(tmp_path / "y") == files


def test_safe_extract_takes_an_archive_made_by_tar_of_the_folders_dot(tmp_path):
    """`tar czf b.tar.gz -C bundle .` names the folder itself '.'; it was refused as "an empty name"."""
    files = _contents(16)
    _write_tree(tmp_path / "t", files, reverse=False, seed=17)
    with tarfile.open(tmp_path / "t.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "t", arcname=".")
    assert safe_extract(tmp_path / "t.tar.gz", tmp_path / "x") == sorted(files)
    assert _read_tree(tmp_path / "x") == files


def _crafted(members: list[tuple[str, bytes, str]]) -> bytes:
    """A tar.gz with (name, type, linkname-or-data) members, as an attacker would make it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, kind, extra in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = extra
                tar.addfile(info)
            elif kind == tarfile.REGTYPE:
                data = extra.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


OK = ("ok.txt", tarfile.REGTYPE, "fine")


@pytest.mark.parametrize("members, message", [
    ([OK, ("../evil.txt", tarfile.REGTYPE, "x")], r"'\.\./evil.txt' contains '\.\.'"),
    ([OK, ("a/../../evil.txt", tarfile.REGTYPE, "x")], r"contains '\.\.'"),
    ([("{abs}", tarfile.REGTYPE, "x")], "is an absolute path"),
    ([OK, ("link", tarfile.SYMTYPE, "/etc/passwd")], "'link' is a link"),
    ([OK, ("link", tarfile.SYMTYPE, "../../outside")], "'link' is a link"),
    ([OK, ("hard", tarfile.LNKTYPE, "ok.txt")], "'hard' is a link"),
    ([OK, ("dev", tarfile.CHRTYPE, "")], "'dev' is a device"),
    ([OK, ("fifo", tarfile.FIFOTYPE, "")], "'fifo' is a device, fifo"),
    ([OK, ("ok.txt", tarfile.REGTYPE, "again")], "'ok.txt' appears twice"),
    ([OK, ("./ok.txt", tarfile.REGTYPE, "again")], "'ok.txt' appears twice"),
    ([OK, ("OK.txt", tarfile.REGTYPE, "case")], "differ only by case"),
    ([OK, ("ok.txt/inner", tarfile.REGTYPE, "x")], "under 'ok.txt', which is a file"),
])
def test_safe_extract_refuses_unsafe_members(tmp_path, members, message):
    outside = tmp_path / "abs-evil.txt"
    members = [(n.replace("{abs}", str(outside)), k, e) for n, k, e in members]
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(BundleError, match=message):
        safe_extract(_crafted(members), work / "dest")
    assert not (work / "dest").exists()
    assert list(work.iterdir()) == []  # no staging folder left behind
    assert not outside.exists() and not (tmp_path / "evil.txt").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_safe_extract_refuses_damaged_archives(tmp_path, damage):
    data = bytearray(pack(_write_tree(tmp_path / "t", _contents(12), reverse=False, seed=13)))
    if damage == "truncate":
        data = data[: len(data) * 2 // 3]
    else:
        data[len(data) // 2] ^= 0x5A
    (tmp_path / "work").mkdir()
    with pytest.raises(BundleError, match="truncated or corrupt"):
        safe_extract(bytes(data), tmp_path / "work" / "dest")
    assert list((tmp_path / "work").iterdir()) == []


def test_safe_extract_refuses_a_non_empty_destination(tmp_path):
    data = pack(_write_tree(tmp_path / "t", _contents(14), reverse=False, seed=15))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep me")
    with pytest.raises(BundleError, match="not an empty folder"):
        safe_extract(data, dest)
    assert _read_tree(dest) == {"mine.txt": b"keep me"}


def test_replace_dir_swaps_a_folder_and_leaves_nothing_behind(tmp_path):
    old, new = tmp_path / "dest", tmp_path / "new"
    _write_tree(old, {"a": b"old", "sub/b": b"old"}, reverse=False, seed=16)
    _write_tree(new, {"a": b"new"}, reverse=False, seed=17)
    replace_dir(new, old)
    assert _read_tree(old) == {"a": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]


def test_gzip_member_is_standard(tmp_path):
    """Other tools read the archive: plain gzip + tar, no DeepJIT-specific framing."""
    files = _contents(18)
    data = pack(_write_tree(tmp_path / "t", files, reverse=False, seed=19))
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data)), mode="r:") as tar:
        assert {m.name: tar.extractfile(m).read() for m in tar} == files
