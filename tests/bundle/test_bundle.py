"""BundleView manifest, digests, reproducibility, verification and atomic writes (deepjit_compiler/bundle.py)."""
from __future__ import annotations

import errno
import gzip
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import REPO
from onnx import TensorProto, helper, numpy_helper

import deepjit_compiler.bundle.folder as bundle_mod
from deepjit_compiler.bundle.archive import pack
from deepjit_compiler.bundle.folder import (
    declared_size,
    read_bundle,
    unpack_bundle,
    update_bundle,
    write_bundle,
)
from deepjit_compiler.bundle.view import BundleView
from deepjit_compiler.errors import BundleError


def _tiny_onnx(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="/model.22/MatMul")], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _sample(seed: int) -> tuple[dict[str, bytes], dict]:
    rng = random.Random(seed)
    model = _tiny_onnx(seed)
    spec_text = f"name: tiny\nmodel: tiny.onnx\n# seed {rng.random()}\n"
    record = {"levels": {
        "graph": {"status": "passed", "reason": "", "max_abs_err": rng.random() * 1e-6},
        "precision": {"status": "passed", "reason": ""},
        "kernels": {"status": "failed", "reason": "decode: max abs err 0.3 > 1e-3"},
        "end_to_end": {"status": "passed", "reason": ""},
        "engine": {"status": "not_run", "reason": "TensorRT is not installed"},
    }}
    files = {
        "segments/backbone.onnx": model,
        "references/decode.onnx": _tiny_onnx(seed + 1),
        "kernels/decode/yolov8_decode.cu": b"extern \"C\" __global__ void decode() {}\n" + rng.randbytes(64),
        "kernels/decode/yolov8_decode.sm_75.cubin": rng.randbytes(5000),
        "kernels/decode/yolov8_decode.sm_75.ptx": rng.randbytes(700),
        "validation/record.json": json.dumps(record, sort_keys=True).encode(),
    }
    manifest = {
        "name": "tiny",
        "spec": {"text": spec_text, "sha256": hashlib.sha256(spec_text.encode()).hexdigest()},
        "model": {"sha256": hashlib.sha256(model).hexdigest(), "file": "tiny.onnx"},
        "toolchain": {"deepjit": "0.1.0", "onnx": onnx.__version__, "nvrtc": [12, 8]},
        "target": {"gpu": "Tesla T4", "sm": 75},
        "kernels": [{"name": "decode", "source": "kernels/decode/yolov8_decode.cu",
                     "cubin": "kernels/decode/yolov8_decode.sm_75.cubin", "params": {"block": 256},
                     "mangled_names": ["decode"], "cut_inputs": ["/model.22/Concat_output_0"]}],
        "engines": [{"name": "backbone", "kind": "onnxruntime", "segment": "segments/backbone.onnx"}],
        "validation": record,
    }
    return files, manifest


def _canonical_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture
def sample():
    return _sample(1)


def test_manifest_lists_every_file_and_the_digest_covers_it(tmp_path, sample):
    files, manifest = sample
    info = write_bundle(tmp_path / "b", files, manifest)
    written = json.loads((tmp_path / "b" / "manifest.json").read_bytes())
    assert written["files"] == {rel: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                                for rel, data in files.items()}
    assert written["schema_version"] == 1
    assert written["digest"] == info.digest == _canonical_digest(written)
    on_disk = {p.relative_to(tmp_path / "b").as_posix() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    assert on_disk == set(files) | {"manifest.json"}
    for field in ("name", "spec", "model", "toolchain", "target", "kernels", "engines", "validation"):
        assert written[field] == manifest[field]


def test_manifest_json_is_canonical_text(tmp_path, sample):
    write_bundle(tmp_path / "b", *sample)
    raw = (tmp_path / "b" / "manifest.json").read_bytes()
    assert raw == (json.dumps(json.loads(raw), sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()


def test_two_builds_give_byte_identical_bundles(tmp_path, sample):
    files, manifest = sample
    # Build 2 reads its files from disk (other mtimes/modes) and got its fields in another order.
    scratch = tmp_path / "scratch"
    as_paths = {}
    for i, (rel, data) in enumerate(files.items()):
        p = scratch / f"f{i}"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.chmod(p, 0o600 + i % 2 * 0o100)
        os.utime(p, (1000 + i, 1000 + i))
        as_paths[rel] = p
    reordered = dict(reversed(list(manifest.items())))
    one = write_bundle(tmp_path / "first" / "yolo", files, manifest)
    two = write_bundle(tmp_path / "second" / "other-name", dict(reversed(list(as_paths.items()))), reordered)
    assert one.digest == two.digest
    assert one.archive.read_bytes() == two.archive.read_bytes()
    assert (one.path / "manifest.json").read_bytes() == (two.path / "manifest.json").read_bytes()
    raw_tar = gzip.decompress(one.archive.read_bytes())
    for leak in (str(tmp_path).encode(), str(Path.home()).encode() + b"/", b"/tmp/"):
        assert leak not in raw_tar
    with tarfile.open(one.archive, "r:gz") as tar:
        assert sorted(m.name for m in tar) == sorted(set(files) | {"manifest.json"})
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in tar} == {(0, 0, 0, "", "", 0o644)}


@pytest.mark.parametrize("bad, message", [
    ("/etc/passwd", "absolute"),
    ("../up.bin", r"'\.\.' component"),
    ("a/../../up.bin", r"'\.\.' component"),
    ("a//b.bin", "empty"),
    ("./a.bin", r"'\.'"),
    ("a\\b.bin", "backslash"),
    ("a\x00b.bin", "backslash or NUL"),
    ("manifest.json", "written by DeepJIT"),
])
def test_refuses_bad_file_paths(tmp_path, sample, bad, message):
    files, manifest = sample
    with pytest.raises(BundleError, match=message):
        write_bundle(tmp_path / "b", {**files, bad: b"x"}, manifest)
    assert list(tmp_path.iterdir()) == []


def test_refuses_files_that_clash(tmp_path, sample):
    files, manifest = sample
    with pytest.raises(BundleError, match="inside 'segments/backbone.onnx'"):
        write_bundle(tmp_path / "b", {**files, "segments/backbone.onnx/x": b"x"}, manifest)
    with pytest.raises(BundleError, match="differ only by case"):
        write_bundle(tmp_path / "b", {**files, "Segments/backbone.onnx": b"x"}, manifest)
    with pytest.raises(BundleError, match="'notes/a/b.txt' would be inside 'notes', which is a file"):
        write_bundle(tmp_path / "b", {**files, "notes": b"x", "notes/a/b.txt": b"y"}, manifest)
    assert list(tmp_path.iterdir()) == []


def test_refuses_absolute_paths_of_this_machine_in_the_manifest(tmp_path, sample):
    files, manifest = sample
    with pytest.raises(BundleError, match="'model.path'.*absolute path of this machine"):
        write_bundle(tmp_path / "b", files, {**manifest, "model": {"path": str(tmp_path / "tiny.onnx")}})
    with pytest.raises(BundleError, match=r"'toolchain.paths\[1\]'"):
        write_bundle(tmp_path / "b", files, {**manifest, "toolchain": {"paths": ["ok", str(Path.home() / "x")]}})
    assert not (tmp_path / "b").exists()
    # ONNX names look like paths but are not; the spec text may quote a path on one of its lines.
    ok = {**manifest, "spec": {**manifest["spec"], "text": f"model: {tmp_path}/tiny.onnx\nname: x\n"}}
    info = write_bundle(tmp_path / "b", files, ok)
    written = read_bundle(info.path).manifest
    assert written["spec"]["text"] == ok["spec"]["text"] and written["model"] == manifest["model"]
    assert written["kernels"][0]["cut_inputs"] == ["/model.22/Concat_output_0"]


@pytest.mark.parametrize("extra, message", [
    ({"digest": "sha256:" + "0" * 64}, "written by DeepJIT"),
    ({"files": {}}, "written by DeepJIT"),
    ({"schema_version": 2}, r"\['schema_version'\] are written by DeepJIT"),
    ({"err": float("nan")}, "'err'.*finite"),
    ({"x": {"y": [1, object()]}}, r"'x.y\[1\]'.*not JSON"),
    ({"x": {3: "a"}}, "key 3 is not a string"),
])
def test_refuses_manifest_fields_that_are_not_plain_json(tmp_path, sample, extra, message):
    files, manifest = sample
    with pytest.raises(BundleError, match=message):
        write_bundle(tmp_path / "b", files, {**manifest, **extra})


def test_read_bundle_verifies_folder_and_archive(tmp_path, sample):
    files, manifest = sample
    info = write_bundle(tmp_path / "b", files, manifest)
    for source in (info.path, info.archive):
        b = read_bundle(source)
        assert isinstance(b, BundleView) and b.digest == info.digest and b.name == "tiny"
        assert b.file("segments/backbone.onnx").read_bytes() == files["segments/backbone.onnx"]
        onnx.checker.check_model(onnx.load_from_string(b.file("segments/backbone.onnx").read_bytes()))
    with pytest.raises(BundleError, match="did you mean 'segments/backbone.onnx'"):
        b.file("segments/backbone.onx")


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("tamper, message", [
    (lambda root: _flip(root / "kernels/decode/yolov8_decode.sm_75.cubin"),
     "'kernels/decode/yolov8_decode.sm_75.cubin' does not match its sha256"),
    (lambda root: (root / "segments/backbone.onnx").write_bytes((root / "segments/backbone.onnx").read_bytes()[:-9]),
     "'segments/backbone.onnx' has .* bytes"),
    (lambda root: (root / "kernels/decode/extra.cu").write_bytes(b"// sneaked in"),
     "'kernels/decode/extra.cu' is not listed"),
    (lambda root: (root / "references/decode.onnx").unlink(),
     "'references/decode.onnx' is listed in manifest.json but missing"),
    (lambda root: (root / "manifest.json").write_text(
        (root / "manifest.json").read_text().replace('"block": 256', '"block": 512')),
     "'digest' .* does not match its content"),
])
def test_read_bundle_refuses_tampered_bundles(tmp_path, sample, tamper, message):
    info = write_bundle(tmp_path / "b", *sample)
    tamper(info.path)
    with pytest.raises(BundleError, match=message):
        read_bundle(info.path)


@pytest.mark.parametrize("edit, message", [
    (lambda m: [m], "manifest.json is not a JSON object"),
    (lambda m: {**m, "files": list(m["files"])}, "manifest.json has no 'files' object"),
    (lambda m: {**m, "files": {**m["files"], "../outside.bin": {"sha256": "ab" * 32, "size": 1}}},
     r"'\.\./outside.bin' has an empty, '\.' or '\.\.' component"),
    (lambda m: {**m, "files": {**m["files"], "kernels/k.ptx": {"sha256": "ab" * 32, "size": -1}}},
     r"files\['kernels/k.ptx'\] needs 'sha256' \(64 hex digits\) and 'size'"),
    (lambda m: {**m, "files": {**m["files"], "kernels/k.ptx": {"sha256": "ab", "size": 1}}},
     r"files\['kernels/k.ptx'\] needs 'sha256' \(64 hex digits\) and 'size'"),
])
def test_read_bundle_names_what_is_wrong_with_a_malformed_manifest(tmp_path, sample, edit, message):
    info = write_bundle(tmp_path / "b", *sample, archive=False)
    (info.path / "manifest.json").write_text(json.dumps(edit(info.manifest)))
    with pytest.raises(BundleError, match=message):
        read_bundle(info.path)


def test_read_bundle_verifies_every_file_of_an_archive(tmp_path, sample):
    """A well-formed archive (its gzip CRC intact) of a tampered bundle is refused as the folder is."""
    info = write_bundle(tmp_path / "b", *sample, archive=False)
    _flip(info.path / "kernels/decode/yolov8_decode.sm_75.cubin")
    (tmp_path / "tampered.tar.gz").write_bytes(pack(info.path))
    with pytest.raises(BundleError, match="'kernels/decode/yolov8_decode.sm_75.cubin' does not match its sha256"):
        read_bundle(tmp_path / "tampered.tar.gz")


def test_declared_size_is_the_files_and_the_manifest_json(tmp_path, sample):
    files, manifest = sample
    info = write_bundle(tmp_path / "b", files, manifest, archive=False)
    expected = sum(len(data) for data in files.values()) + (info.path / "manifest.json").stat().st_size
    assert declared_size(info.manifest) == expected


def test_read_bundle_refuses_a_manifest_whose_file_hash_was_also_forged(tmp_path, sample):
    files, manifest = sample
    info = write_bundle(tmp_path / "b", files, manifest)
    new = b"forged"
    (info.path / "references/decode.onnx").write_bytes(new)
    m = json.loads((info.path / "manifest.json").read_bytes())
    m["files"]["references/decode.onnx"] = {"sha256": hashlib.sha256(new).hexdigest(), "size": len(new)}
    (info.path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="does not match its content"):
        read_bundle(info.path)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_read_bundle_refuses_damaged_archives(tmp_path, sample, damage):
    info = write_bundle(tmp_path / "b", *sample)
    data = info.archive.read_bytes()
    info.archive.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(BundleError, match="truncated or corrupt"):
        read_bundle(info.archive)


def test_update_bundle_adds_files_and_changes_the_digest(tmp_path, sample):
    files, manifest = sample
    info = write_bundle(tmp_path / "b", files, manifest)
    plan = random.Random(7).randbytes(3000)
    record = {"levels": {lvl: {"status": "passed", "reason": ""} for lvl in manifest["validation"]["levels"]}}
    new = update_bundle(info.path, {"engines/backbone.plan": plan}, {"validation": record})
    b = read_bundle(new.path)
    assert new.digest != info.digest and new.digest == _canonical_digest(b.manifest)
    assert b.manifest["validation"] == record
    assert b.manifest["files"]["engines/backbone.plan"] == {"sha256": hashlib.sha256(plan).hexdigest(), "size": 3000}
    for rel, data in files.items():
        assert b.file(rel).read_bytes() == data
    assert read_bundle(new.archive).digest == new.digest
    assert b.manifest["kernels"] == manifest["kernels"]
    assert _leftovers(tmp_path) == []


def test_update_bundle_of_a_lone_archive(tmp_path, sample):
    info = write_bundle(tmp_path / "b", *sample)
    lone = tmp_path / "lone.tar.gz"
    lone.write_bytes(info.archive.read_bytes())
    new = update_bundle(lone, {"engines/backbone.plan": b"plan"}, {})
    assert new.path == lone and read_bundle(lone).digest == new.digest != info.digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "b.tar.gz", "lone.tar.gz"]


def test_update_bundle_refuses_a_tampered_bundle(tmp_path, sample):
    info = write_bundle(tmp_path / "b", *sample)
    _flip(info.path / "segments/backbone.onnx")
    with pytest.raises(BundleError, match="segments/backbone.onnx"):
        update_bundle(info.path, {"engines/x.plan": b"x"}, {})
    with pytest.raises(BundleError, match="written by DeepJIT"):
        update_bundle(info.archive, {}, {"digest": "sha256:" + "1" * 64})


def test_an_interrupted_write_leaves_the_previous_bundle(tmp_path, sample, monkeypatch):
    files, manifest = sample
    info = write_bundle(tmp_path / "b", files, manifest)
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    def crash(folder, dest):
        Path(dest).write_bytes(b"half an archive")
        raise KeyboardInterrupt

    monkeypatch.setattr(bundle_mod, "pack_to", crash)
    with pytest.raises(KeyboardInterrupt):
        write_bundle(info.path, {**files, "engines/new.plan": b"new"}, manifest)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    assert _leftovers(tmp_path) == []
    with pytest.raises(KeyboardInterrupt):
        write_bundle(tmp_path / "fresh", files, manifest)
    assert not (tmp_path / "fresh").exists() and not (tmp_path / "fresh.tar.gz").exists()
    assert _leftovers(tmp_path) == []


def test_a_missing_input_file_writes_nothing(tmp_path, sample):
    files, manifest = sample
    with pytest.raises(BundleError, match=r"files\['engines/x.plan'\]: .* not a readable regular file"):
        write_bundle(tmp_path / "b", {**files, "engines/x.plan": tmp_path / "nope.plan"}, manifest)
    assert list(tmp_path.iterdir()) == []


def test_write_bundle_replaces_a_bundle_but_not_other_folders(tmp_path, sample):
    files, manifest = sample
    write_bundle(tmp_path / "b", files, manifest)
    info = write_bundle(tmp_path / "b", {"only.bin": b"1"}, {"name": "second"})
    assert read_bundle(tmp_path / "b").manifest["name"] == "second"
    assert sorted(read_bundle(info.archive).files) == ["only.bin"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(BundleError, match="not a DeepJIT bundle; refusing to replace"):
        write_bundle(precious, files, manifest)
    assert (precious / "notes.txt").read_text() == "mine"


def test_write_bundle_fills_an_empty_folder_but_refuses_a_link_to_a_bundle(tmp_path, sample):
    files, manifest = sample
    (tmp_path / "empty").mkdir()
    assert read_bundle(write_bundle(tmp_path / "empty", files, manifest).path).name == "tiny"
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    with pytest.raises(BundleError, match="link: exists and is not a DeepJIT bundle; refusing to replace it"):
        write_bundle(tmp_path / "link", {"only.bin": b"1"}, manifest, archive=False)
    assert (tmp_path / "link").is_symlink() and read_bundle(tmp_path / "link").files.keys() == files.keys()


def test_bundle_files_are_readable_by_all_whatever_the_umask(tmp_path, sample):
    """A bundle is deployed by another user than the one who built it: 0o644 for every file."""
    files, manifest = sample
    previous = os.umask(0o077)
    try:
        info = write_bundle(tmp_path / "b", files, manifest, archive=False)
    finally:
        os.umask(previous)
    modes = {p.relative_to(info.path).as_posix(): p.stat().st_mode & 0o777 for p in info.path.rglob("*") if p.is_file()}
    assert modes == {rel: 0o644 for rel in [*files, "manifest.json"]}


def test_unpack_bundle_checks_the_expected_digest(tmp_path, sample):
    info = write_bundle(tmp_path / "b", *sample)
    with pytest.raises(BundleError, match="is not the expected sha256:1111"):
        unpack_bundle(info.archive.read_bytes(), tmp_path / "u", expected_digest="sha256:" + "1" * 64)
    assert not (tmp_path / "u").exists()
    b = unpack_bundle(info.archive, tmp_path / "u", expected_digest=info.digest)
    assert b.root == tmp_path / "u" and read_bundle(b.root).digest == info.digest
    assert pack(b.root) == info.archive.read_bytes()


def test_read_bundle_refuses_other_schema_versions_and_non_bundles(tmp_path, sample):
    info = write_bundle(tmp_path / "b", *sample)
    m = json.loads((info.path / "manifest.json").read_bytes())
    m["schema_version"] = 2
    (info.path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="schema_version 2 is not supported"):
        read_bundle(info.path)
    (tmp_path / "plain").mkdir()
    with pytest.raises(BundleError, match="plain: no manifest.json; not a DeepJIT bundle"):
        read_bundle(tmp_path / "plain")
    with pytest.raises(BundleError, match="no such bundle"):
        read_bundle(tmp_path / "absent")


def test_a_folder_that_merely_holds_a_manifest_is_never_replaced(tmp_path, sample):
    """A user's app/src/ with a manifest.json of its own, or a bundle someone edited, is not DeepJIT's."""
    files, manifest = sample
    app = tmp_path / "app" / "src"
    app.mkdir(parents=True)
    (app / "manifest.json").write_text('{"name": "my web app"}')
    (app / "main.py").write_text("print('mine')")
    with pytest.raises(BundleError, match="holds a manifest.json but is not a DeepJIT bundle as DeepJIT wrote it"):
        write_bundle(app, files, manifest)
    with pytest.raises(BundleError, match="is not a DeepJIT bundle as DeepJIT wrote it"):
        unpack_bundle(write_bundle(tmp_path / "b", files, manifest).archive, app)
    assert sorted(p.name for p in app.iterdir()) == ["main.py", "manifest.json"]
    edited = tmp_path / "b"
    (edited / "notes.txt").write_text("added by hand")
    with pytest.raises(BundleError, match="'notes.txt' is not listed"):
        write_bundle(edited, files, manifest)
    assert (edited / "notes.txt").read_text() == "added by hand"


def interrupted_writer(dest: Path) -> None:
    """What a writer of `dest` killed mid-way leaves beside it (a process that exits without cleaning up):
    its staging folders, with a half bundle and a half report, and a half-written archive."""
    code = ("import os, sys\nfrom pathlib import Path\nfrom deepjit_compiler.files import atomic_file, staging_dir\n"
            "dest = Path(sys.argv[1])\n"
            "with staging_dir(dest) as s, staging_dir(dest.with_name(dest.name + '.report')) as r:\n"
            "    (s / 'bundle').mkdir()\n    (s / 'bundle' / 'big.bin').write_bytes(b'x' * 1000)\n"
            "    (r / 'report').mkdir()\n"
            "    half = atomic_file(dest.with_name(dest.name + '.tar.gz'))\n"
            "    half.__enter__().write(b'half')\n"
            "    os._exit(9)\n")
    done = subprocess.run([sys.executable, "-c", code, str(dest)], timeout=120, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 9, done.stderr


def test_interrupted_writers_leftovers_are_removed_on_the_next_write(tmp_path, sample):
    files, manifest = sample
    interrupted_writer(tmp_path / "b")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert [n.split("-")[0] for n in left] == [".b.report.tmp", ".b.tar.gz.tmp", ".b.tmp"], left
    (tmp_path / ".other.tmp-1").mkdir()        # another output's: not touched
    write_bundle(tmp_path / "b", files, manifest)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-1", "b", "b.tar.gz"]


def test_only_what_deepjit_provably_made_is_removed(tmp_path, sample):
    """Names like its leftovers' are not enough: a user's folder or file keeps its place."""
    files, manifest = sample
    users = {".b.old-2023": "dir", ".b.tmp-mine": "dir", ".b.tmp-abcd1234": "dir",  # no DeepJIT mark inside
             ".b.tar.gz.tmp-abcd1234": "file", ".b.report.tmp-x": "file"}            # 0644: not mkstemp's
    for name, kind in users.items():
        if kind == "dir":
            (tmp_path / name).mkdir()
            (tmp_path / name / "notes.txt").write_text("a user's")
        else:
            (tmp_path / name).write_text("a user's")
            os.chmod(tmp_path / name, 0o644)
    write_bundle(tmp_path / "b", files, manifest)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, "b", "b.tar.gz"])
    assert all((tmp_path / n / "notes.txt").exists() for n, kind in users.items() if kind == "dir")


@pytest.mark.parametrize("name", ["*", "[.]b*", "?"])
def test_an_output_named_with_glob_characters_removes_only_its_own_leftovers(tmp_path, sample, name):
    files, manifest = sample
    users = [".bashrc.old-2019", ".x.old-1", ".notes.staging"]  # look like other outputs' leftovers
    for user in users:
        (tmp_path / user).write_text("a user's file")
    interrupted_writer(tmp_path / name)  # this output's own leftovers
    assert len(list(tmp_path.iterdir())) == len(users) + 3
    write_bundle(tmp_path / name, files, manifest, archive=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*users, name])


def test_a_write_the_file_system_refuses_is_an_output_error(tmp_path, sample, monkeypatch):
    from deepjit_compiler.errors import OutputError

    files, manifest = sample
    (tmp_path / "afile").write_text("")
    with pytest.raises(OutputError, match=r"afile/b: cannot write \(.*/afile is a file, not a folder\)"):
        write_bundle(tmp_path / "afile" / "b", files, manifest)
    real = os.replace

    def disk_full(src, dst):
        if str(dst).endswith(".tar.gz"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OutputError, match=r"/b: cannot write the bundle \(.*No space left on device"):
        write_bundle(tmp_path / "b", files, manifest)
    assert not (tmp_path / "b.tar.gz").exists() and _leftovers(tmp_path) == []


def test_a_gzip_bomb_stops_at_the_size_its_manifest_declares(tmp_path, sample):
    files, manifest = sample
    info = write_bundle(tmp_path / "b", files, manifest)
    declared = declared_size(info.manifest)
    bomb = io.BytesIO()
    with tarfile.open(fileobj=bomb, mode="w:gz", compresslevel=1) as tar:
        member = tarfile.TarInfo("zeros.bin")
        member.size = 256 << 20        # 256 MiB of zeros: about 1 MB compressed
        tar.addfile(member, _Zeros(member.size))
    start = time.perf_counter()
    with pytest.raises(BundleError, match=f"holds more than the {declared} bytes its bundle declares"):
        unpack_bundle(bomb.getvalue(), tmp_path / "out", max_bytes=declared)
    assert time.perf_counter() - start < 5 and not (tmp_path / "out").exists()


class _Zeros(io.RawIOBase):
    """`n` zero bytes, read in pieces (no gigabyte in memory)."""

    def __init__(self, n: int):
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), self.left)
        buf[:n] = bytes(n)
        self.left -= n
        return n


def test_a_manifest_nested_absurdly_deep_is_a_bundle_error(tmp_path, sample):
    files, manifest = sample
    info = write_bundle(tmp_path / "b", files, manifest)
    (info.path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BundleError, match="nested absurdly deep"):
        read_bundle(info.path)


def test_without_an_archive_a_stale_one_is_removed_but_a_foreign_file_stays(tmp_path, sample):
    files, manifest = sample
    first = write_bundle(tmp_path / "b", files, manifest)  # with its archive
    again = write_bundle(tmp_path / "b", files, {**manifest, "name": "other"}, archive=False)
    assert again.archive is None and not (tmp_path / "b.tar.gz").exists() and first.archive == tmp_path / "b.tar.gz"
    (tmp_path / "b.tar.gz").write_bytes(b"my own tarball, not a bundle")
    write_bundle(tmp_path / "b", files, manifest, archive=False)
    assert (tmp_path / "b.tar.gz").read_bytes() == b"my own tarball, not a bundle"


@pytest.mark.parametrize("kind", ["file", "symlink", "symlink to a bundle archive"])
def test_an_archive_never_replaces_a_users_file_or_symlink(tmp_path, sample, kind):
    files, manifest = sample
    target = tmp_path / "keep.txt"
    target.write_bytes(b"a user's file")
    if kind == "symlink to a bundle archive":
        target.write_bytes(write_bundle(tmp_path / "other", files, manifest).archive.read_bytes())
    before = target.read_bytes()
    tar = tmp_path / "b.tar.gz"
    tar.write_bytes(before) if kind == "file" else tar.symlink_to(target)
    with pytest.raises(BundleError, match=r"b\.tar\.gz: (is a symlink|exists and is not a DeepJIT bundle archive); "
                                          "refusing to replace it"):
        write_bundle(tmp_path / "b", files, manifest)
    assert not (tmp_path / "b").exists() and tar.is_symlink() == (kind != "file") and tar.read_bytes() == before


def test_an_archive_never_replaces_a_dangling_symlink_or_a_folder(tmp_path, sample):
    files, manifest = sample
    tar = tmp_path / "b.tar.gz"
    tar.symlink_to(tmp_path / "nowhere")
    with pytest.raises(BundleError, match=r"b\.tar\.gz: is a symlink; refusing to replace it"):
        write_bundle(tmp_path / "b", files, manifest)
    assert tar.is_symlink() and not (tmp_path / "b").exists()
    tar.unlink()
    (tar / "mine").mkdir(parents=True)
    with pytest.raises(BundleError, match=r"b\.tar\.gz: is a folder; the bundle archive needs that name"):
        write_bundle(tmp_path / "b", files, manifest, archive=False)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["b.tar.gz", "mine"]


def test_an_archive_replaces_a_bundle_archive_and_update_keeps_a_users_file(tmp_path, sample):
    files, manifest = sample
    write_bundle(tmp_path / "b", files, {**manifest, "name": "other"})
    info = write_bundle(tmp_path / "b", files, manifest)  # an earlier bundle archive there is replaced
    assert read_bundle(info.archive).digest == info.digest
    info.archive.write_bytes(b"my own tarball, not a bundle")
    updated = update_bundle(info.path, {"extra.bin": b"x"}, {})  # the folder only; the user's file stays
    assert updated.archive is None and info.archive.read_bytes() == b"my own tarball, not a bundle"


def test_nothing_is_written_inside_a_bundle(tmp_path, sample):
    """`deepjit pull REF bundle/sub` (or a build's bundle.path there) put files the outer bundle's manifest does
    not list, so it no longer verified; a user's folder holding some other manifest.json is no bundle."""
    files, manifest = sample
    outer = write_bundle(tmp_path / "b", files, manifest, archive=False)
    inner = write_bundle(tmp_path / "other", files, manifest)
    for dest in (outer.path / "sub", outer.path / "engines" / "new"):
        with pytest.raises(BundleError, match=f"{dest}: inside the bundle {outer.path}, which would no longer verify"):
            unpack_bundle(inner.archive, dest)
        with pytest.raises(BundleError, match="inside the bundle"):
            write_bundle(dest, files, manifest)
    assert read_bundle(outer.path).digest == outer.digest  # still verifies
    app = tmp_path / "app"
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "my web app"}')
    assert read_bundle(unpack_bundle(inner.archive, app / "models" / "yolo").root).digest == inner.digest


def test_nothing_is_written_inside_a_bundle_given_relatively_or_below_a_manifest_of_its_own(tmp_path, monkeypatch,
                                                                                            sample):
    """A relative destination is judged from the working folder up (`cd bundle/engines; deepjit pull REF new`),
    and a bundle file named manifest.json (no bundle's) on the way up hides no bundle above it."""
    files, manifest = sample
    outer = write_bundle(tmp_path / "b", {**files, "docs/manifest.json": b'{"name": "my web app"}'}, manifest,
                         archive=False)
    inner = write_bundle(tmp_path / "other", files, manifest)
    dest = outer.path / "docs" / "yolo"
    with pytest.raises(BundleError, match=f"{dest}: inside the bundle {outer.path}, which would no longer verify"):
        unpack_bundle(inner.archive, dest)
    monkeypatch.chdir(outer.path / "docs")
    with pytest.raises(BundleError, match=f"new: inside the bundle {outer.path}, which would no longer verify"):
        unpack_bundle(inner.archive, Path("new"))
    assert read_bundle(outer.path).digest == outer.digest  # still verifies


def test_a_file_that_is_no_archive_says_what_a_bundle_is(tmp_path):
    (tmp_path / "README.md").write_text("# not a bundle\n")
    with pytest.raises(BundleError, match=r"README.md: archive is truncated or corrupt \(.*\); a bundle is a folder "
                                          r"or the .tar.gz DeepJIT made of one"):
        read_bundle(tmp_path / "README.md")


def test_replaceable_is_judged_even_when_the_working_folder_is_gone(tmp_path, monkeypatch, sample):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()  # os.getcwd() raises from here on
    files, manifest = sample
    info = write_bundle(tmp_path / "b", files, manifest, archive=False)
    bundle_mod.check_replaceable(info.path)  # a bundle as DeepJIT wrote it: replaceable
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's")
    with pytest.raises(BundleError, match="mine: exists and is not a DeepJIT bundle"):
        bundle_mod.check_replaceable(tmp_path / "mine")
