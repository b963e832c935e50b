"""Deterministic packing and safe extraction (deepjit_compiler/archive.py)."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import stat
import tarfile
from pathlib import Path

import pytest
from conftest import within

import deepjit_compiler.bundle.archive as archive
from deepjit_compiler.bundle.archive import archived_manifest, pack, pack_to, safe_extract
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
    os.chmod(root / "manifest.json", 0o645)  # executable by others only: still executable
    data = pack(root)
    # gzip header: FLG has no FNAME bit, MTIME is zero, XFL says maximum compression (level 9).
    assert data[:2] == b"\x1f\x8b" and not data[3] & 0x08 and data[4:8] == b"\0\0\0\0" and data[8] == 2
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(files, key=lambda n: n.encode())
        for m in members:
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
            assert m.isreg()
            assert m.mode == (0o755 if m.name in ("empty.bin", "manifest.json") else 0o644)
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


def test_pack_refuses_special_files(tmp_path):
    root = _write_tree(tmp_path / "t", _contents(20), reverse=False, seed=21)
    os.mkfifo(root / "kernels" / "pipe")
    with pytest.raises(BundleError, match="'kernels/pipe' is not a regular file; bundles hold regular files only"):
        within(10, lambda: pack(root), root / "kernels" / "pipe")


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


def _crafted(members: list[tuple[str, bytes, str]], modes: dict[str, int] | None = None) -> bytes:
    """A tar.gz with (name, type, linkname-or-data) members, as an attacker would make it; `modes`
    sets some members' permission bits."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, kind, extra in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.mode = (modes or {}).get(name, info.mode)
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
    ([OK, ("d/x.txt", tarfile.REGTYPE, "x"), ("d", tarfile.REGTYPE, "y")], "'d' appears twice or clashes with a folder"),
    ([OK, ("d", tarfile.DIRTYPE, ""), ("d", tarfile.REGTYPE, "y")], "'d' appears twice or clashes with a folder"),
    ([OK, (".", tarfile.REGTYPE, "x")], "has an empty name"),
    ([OK, ("a\\b.txt", tarfile.REGTYPE, "x")], "has a NUL or backslash in its name"),
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
    (tmp_path / "a-file").write_text("keep me")
    with pytest.raises(BundleError, match="a-file: exists and is not an empty folder"):
        safe_extract(data, tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "keep me"
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep me")
    with pytest.raises(BundleError, match="not an empty folder"):
        safe_extract(data, dest)
    assert _read_tree(dest) == {"mine.txt": b"keep me"}


def test_safe_extract_keeps_only_the_executable_bit(tmp_path):
    """A member's setuid, world-writable or private mode does not travel: 0o755 if executable, else 0o644."""
    modes = {"run.sh": 0o4777, "private.bin": 0o600, "shared.bin": 0o666, "tool": 0o701}
    safe_extract(_crafted([(n, tarfile.REGTYPE, n) for n in modes], modes), tmp_path / "x")
    got = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "x").iterdir()}
    assert got == {"run.sh": 0o755, "private.bin": 0o644, "shared.bin": 0o644, "tool": 0o755}


def test_safe_extract_stops_past_exactly_max_bytes(tmp_path):
    files = _contents(22)
    data = pack(_write_tree(tmp_path / "t", files, reverse=False, seed=23))
    total = sum(len(v) for v in files.values())
    (tmp_path / "work").mkdir()
    with pytest.raises(BundleError, match=f"holds more than the {total - 1} bytes its bundle declares"):
        safe_extract(data, tmp_path / "work" / "x", max_bytes=total - 1)
    assert list((tmp_path / "work").iterdir()) == []
    assert safe_extract(data, tmp_path / "y", max_bytes=total) == sorted(files)


def test_safe_extract_refuses_a_gzip_stream_that_goes_on_past_its_members(tmp_path, monkeypatch):
    """Zeros after the tar's end are inflated too (to check the gzip CRC), but only so far."""
    monkeypatch.setattr(archive, "_TRAILER_SLACK", 1 << 16)
    tar = gzip.decompress(pack(_write_tree(tmp_path / "t", _contents(24), reverse=False, seed=25)))
    padded = gzip.compress(tar + bytes(1 << 20), mtime=0)
    (tmp_path / "work").mkdir()
    with pytest.raises(BundleError, match="the archive goes on past its members"):
        safe_extract(padded, tmp_path / "work" / "x", max_bytes=len(tar))
    assert list((tmp_path / "work").iterdir()) == []


def test_safe_extract_bounds_an_archive_of_undeclared_size_by_its_own_size(tmp_path, monkeypatch):
    """Without a declared size (a .tar.gz given to read_bundle), a hundred times the archive's size is the bound."""
    monkeypatch.setattr(archive, "_TRAILER_SLACK", 1 << 16)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("zeros.bin")
        info.size = 8 << 20  # about 8 kB compressed: 1000 : 1
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    data = buf.getvalue()
    (tmp_path / "work").mkdir()
    with pytest.raises(BundleError, match=f"holds more than the {100 * len(data) + (1 << 16)} bytes"):
        safe_extract(data, tmp_path / "work" / "x")
    assert list((tmp_path / "work").iterdir()) == []


def test_safe_extract_bounds_a_declared_size_by_the_archives_own_size_too(tmp_path, monkeypatch):
    """A declared size past a hundred times the archive's size (a forged manifest's) does not lift the bound;
    one under it is the bound."""
    monkeypatch.setattr(archive, "_TRAILER_SLACK", 1 << 16)
    data = gzip.compress(_zeros_member(8 << 20), mtime=0)
    ratio_bound = 100 * len(data) + (1 << 16)
    (tmp_path / "work").mkdir()
    with pytest.raises(BundleError, match=f"holds more than the {ratio_bound} bytes 100 times its own {len(data)} "
                                          "bytes allow"):
        safe_extract(data, tmp_path / "work" / "x", max_bytes=1 << 40)
    with pytest.raises(BundleError, match=f"holds more than the {ratio_bound - 1} bytes its bundle declares"):
        safe_extract(data, tmp_path / "work" / "x", max_bytes=ratio_bound - 1)
    assert list((tmp_path / "work").iterdir()) == []


def _zeros_member(size: int) -> bytes:
    """An uncompressed tar of one member of `size` zero bytes (about 1000 : 1 once gzipped)."""
    info = tarfile.TarInfo("zeros.bin")
    info.size = size
    return info.tobuf(format=tarfile.PAX_FORMAT) + bytes(size)


@pytest.mark.parametrize("manifest", [{"name": "my web app"}, ["digest", "files"], {"digest": "sha256:0"}])
def test_archived_manifest_is_none_for_a_manifest_no_bundle_has(tmp_path, manifest):
    root = _write_tree(tmp_path / "t", {"manifest.json": json.dumps(manifest).encode(), "a.bin": b"a"},
                       reverse=False, seed=26)
    (tmp_path / "t.tar.gz").write_bytes(pack(root))
    assert archived_manifest(tmp_path / "t.tar.gz") is None


def test_archived_manifest_reads_a_bundles_manifest_up_to_max_bytes(tmp_path):
    manifest = {"digest": "sha256:" + "ab" * 32, "files": {"a.bin": {"sha256": "cd" * 32, "size": 1}}}
    text = json.dumps(manifest).encode()
    root = _write_tree(tmp_path / "t", {"manifest.json": text, "a.bin": b"a"}, reverse=False, seed=27)
    (tmp_path / "t.tar.gz").write_bytes(pack(root))
    assert archived_manifest(tmp_path / "t.tar.gz") == manifest
    assert archived_manifest(tmp_path / "t.tar.gz", max_bytes=len(text)) == manifest
    assert archived_manifest(tmp_path / "t.tar.gz", max_bytes=len(text) - 1) is None


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
