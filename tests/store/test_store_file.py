"""References and the folder store (deepjit_compiler/store/__init__.py, store/file.py)."""
from __future__ import annotations

import gzip
import io
import json
import multiprocessing
import os
import random
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
from conftest import run_cli, within

from deepjit_compiler import store
from deepjit_compiler.bundle.folder import declared_size, read_bundle, write_bundle
from deepjit_compiler.errors import BundleError, StoreError
from deepjit_compiler.store import Ref, open_store, parse_ref
from deepjit_compiler.store.file import FileStore
from deepjit_compiler.store.refs import level_statuses

HEX = "ab" * 32


def make_bundle(dest: Path, seed: int, name: str = "tiny"):
    rng = random.Random(seed)
    files = {"segments/backbone.onnx": rng.randbytes(4000), "kernels/decode/decode.cu": rng.randbytes(300),
             "kernels/decode/decode.sm_75.cubin": rng.randbytes(2000)}
    manifest = {"name": name, "target": {"sm": 75}, "seed": seed,
                "validation": {"levels": {"graph": {"status": "passed", "reason": ""}}}}
    return write_bundle(dest, files, manifest)


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------- references
@pytest.mark.parametrize("text, expected", [
    ("file:///srv/store:v1", Ref("file:///srv/store", "v1")),
    ("file:///srv/store", Ref("file:///srv/store")),
    (f"file:///srv/store@sha256:{HEX}", Ref("file:///srv/store", None, f"sha256:{HEX}")),
    ("file:///srv/team@x/store:v1", Ref("file:///srv/team@x/store", "v1")),  # an '@' in a folder: no digest
    ("file:///srv/team:x/store:v1", Ref("file:///srv/team:x/store", "v1")),  # a ':' above the store folder
    (f"file:///srv/team@x/store@sha256:{HEX}", Ref("file:///srv/team@x/store", None, f"sha256:{HEX}")),
    ("oci://127.0.0.1:5000/team/yolo:v1.2-rc_3", Ref("oci://127.0.0.1:5000/team/yolo", "v1.2-rc_3")),
    ("oci://localhost/yolo", Ref("oci://localhost/yolo")),
    (f"oci://registry.example.com/a/b-c@sha256:{HEX}", Ref("oci://registry.example.com/a/b-c", None, f"sha256:{HEX}")),
    ("oci://[::1]:5000/yolo:t", Ref("oci://[::1]:5000/yolo", "t")),
    ("file:///srv/store:" + "v" * 128, Ref("file:///srv/store", "v" * 128)),  # the longest tag OCI allows
])
def test_parse_ref_and_str_round_trip(text, expected):
    assert parse_ref(text) == expected
    assert str(parse_ref(text)) == text


def test_level_statuses_are_in_run_order_with_other_levels_last():
    levels = {"zeta": {"status": "passed"}, "engine": {"status": "not_run"}, "graph": {"status": "failed"},
              "kernels": {}, "alpha": {"status": "passed"}, "precision": "passed"}
    assert list(level_statuses({"validation": {"levels": levels}}).items()) == [
        ("graph", "failed"), ("kernels", "unknown"), ("engine", "not_run"), ("alpha", "passed"), ("zeta", "passed")]
    for junk in (None, ["validation"], {"validation": []}, {"validation": {"levels": "graph"}}):
        assert level_statuses(junk) == {}


def test_relative_and_bare_refs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_ref("file://stores/main:v2") == Ref(f"file://{tmp_path}/stores/main", "v2")
    assert parse_ref("v3", default_store=f"file://{tmp_path}/d") == Ref(f"file://{tmp_path}/d", "v3")
    assert parse_ref(f"@sha256:{HEX}", default_store="oci://h:1/r") == Ref("oci://h:1/r", None, f"sha256:{HEX}")
    assert parse_ref("v3").store.startswith("file:///")


@pytest.mark.parametrize("text, message", [
    ("", "empty reference"),
    ("oci://127.0.0.1:5000", "names no repository"),
    ("oci://host/Team/Yolo:v1", "must be lowercase"),
    ("oci://ho st/yolo", "not a registry HOST"),
    ("file:///srv/store:bad tag!", "tag 'bad tag!' is not valid"),
    ("file:///srv/store:.hidden", "is not valid"),
    ("http://host/repo:v1", "unknown scheme 'http://'"),
    ("team/yolo:v1", "has no scheme"),
    ("oci://h:1/r@sha256:xyz", "is not a digest"),
    (f"oci://h:1/r@sha256:{HEX.upper()}", "is not a digest"),
    ("file:///srv/store:" + "v" * 129, "is not valid: use letters, digits, '_', '.' and '-' \\(at most 128"),
    ("file://:v1", "names no folder"),
    ("localhost:5000", "has no scheme"),
    (f"oci://h:1/r:v1@sha256:{HEX}", "names a tag and a digest: give one"),
    (f"file:///srv/store:v1@sha256:{HEX}", "names a tag and a digest: give one"),
    (f"v1@sha256:{HEX}", "names a tag and a digest: give one"),  # the digest was ignored by push
])
def test_parse_ref_refuses(text, message):
    with pytest.raises(StoreError, match=message):
        parse_ref(text)


# ---------------------------------------------------------------------------- the folder store
def test_push_pull_round_trip(tmp_path):
    info = make_bundle(tmp_path / "b", 1)
    result = store.push(info.path, f"file://{tmp_path}/store:v1")
    assert result.digest == info.digest and result.ref == f"file://{tmp_path}/store:v1"
    assert (tmp_path / "store" / "blobs" / "sha256" / f"{info.digest[7:]}.tar.gz").read_bytes() == info.archive.read_bytes()
    assert (tmp_path / "store" / "tags" / "v1").read_text() == info.digest + "\n"
    out = store.pull(f"file://{tmp_path}/store:v1", tmp_path / "pulled")
    assert tree(out) == tree(info.path)
    by_digest = store.pull(result.pinned, tmp_path / "pinned")
    assert read_bundle(by_digest).digest == info.digest


def test_push_needs_a_tag_and_pull_a_tag_or_digest(tmp_path):
    info = make_bundle(tmp_path / "b", 2)
    with pytest.raises(StoreError, match=f"reference 'file://{tmp_path}/store' has no tag; push needs one"):
        store.push(info.path, f"file://{tmp_path}/store")
    with pytest.raises(StoreError, match="has neither tag nor digest"):
        store.pull(f"file://{tmp_path}/store", tmp_path / "p")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "b.tar.gz"]


def test_push_moves_a_tag_holding_other_content_only_with_force(tmp_path):
    a, b = make_bundle(tmp_path / "a", 3), make_bundle(tmp_path / "b", 4)
    store.push(a.path, f"file://{tmp_path}/store:v1")
    with pytest.raises(StoreError, match=f"tag 'v1' already holds {a.digest}, not this bundle"):
        store.push(b.path, f"file://{tmp_path}/store:v1")
    assert store.push(b.path, f"file://{tmp_path}/store:v1", force=True).digest == b.digest


def test_pull_from_a_tarball_push_and_default_destination(tmp_path, monkeypatch):
    info = make_bundle(tmp_path / "b", 2)
    store.push(info.archive, f"file://{tmp_path}/store:from-tar")
    monkeypatch.chdir(tmp_path)
    assert store.pull(f"file://{tmp_path}/store:from-tar") == Path("from-tar")
    assert tree(tmp_path / "from-tar") == tree(info.path)
    hex12 = info.digest.removeprefix("sha256:")[:12]
    assert store.pull(f"file://{tmp_path}/store@{info.digest}") == Path(f"bundle-{hex12}")
    assert tree(tmp_path / f"bundle-{hex12}") == tree(info.path)


def test_ls_lists_tags_in_order_with_name_digest_and_size(tmp_path):
    a, b = make_bundle(tmp_path / "a", 3, name="alpha"), make_bundle(tmp_path / "b", 4, name="beta")
    s = open_store(f"file://{tmp_path}/store")
    with pytest.raises(StoreError, match=f"no store there \\({tmp_path}/store does not exist"):
        s.ls()  # a typo in the path is not an empty store
    s.push(b.path, "z-last")
    s.push(a.path, "a-first")
    s.push(a.path, "also-a")
    entries = store.ls(f"file://{tmp_path}/store")
    size_a, size_b = a.archive.stat().st_size, b.archive.stat().st_size  # the .tar.gz write_bundle wrote
    assert [(e.tag, e.digest, e.name, e.size) for e in entries] == [
        ("a-first", a.digest, "alpha", size_a),
        ("also-a", a.digest, "alpha", size_a),
        ("z-last", b.digest, "beta", size_b),
    ]
    assert all(e.levels == {"graph": "passed"} for e in entries)
    with pytest.raises(StoreError, match="`ls` takes a store"):
        store.ls(f"file://{tmp_path}/store:v1")


def test_existing_tag_with_other_content_needs_force(tmp_path):
    a, b = make_bundle(tmp_path / "a", 5), make_bundle(tmp_path / "b", 6)
    s = FileStore(tmp_path / "store")
    s.push(a.path, "v1")
    assert s.push(a.path, "v1").digest == a.digest  # the same content again: fine
    with pytest.raises(StoreError, match=f"tag 'v1' already holds {a.digest}, not this bundle .*--force"):
        s.push(b.path, "v1")
    assert [e.digest for e in s.ls()] == [a.digest]
    s.push(b.path, "v1", force=True)
    assert [e.digest for e in s.ls()] == [b.digest]
    assert tree(s.pull("v1", tmp_path / "p")) == tree(b.path)
    assert read_bundle(s.pull(a.digest, tmp_path / "old")).digest == a.digest  # still there by digest


def test_unknown_tag_and_digest(tmp_path):
    s = FileStore(tmp_path / "store")
    s.push(make_bundle(tmp_path / "a", 7).path, "release-1")
    with pytest.raises(StoreError, match="no tag 'release-2' .*did you mean 'release-1'"):
        s.pull("release-2", tmp_path / "p")
    with pytest.raises(StoreError, match="no bundle sha256:abab"):
        s.pull(f"sha256:{HEX}", tmp_path / "p")
    assert not (tmp_path / "p").exists()


def _repack_with_edit(archive: bytes) -> bytes:
    """The same bundle archive with one file's bytes changed: a well-formed, tampered tarball."""
    src = tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz")
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as dst:
        for m in src:
            data = src.extractfile(m).read()
            if m.name == "kernels/decode/decode.sm_75.cubin":
                data = bytes([data[0] ^ 1]) + data[1:]
            dst.addfile(m, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("damage, message", [
    ("tamper", "'kernels/decode/decode.sm_75.cubin' does not match its sha256"),
    ("truncate", "truncated or corrupt"),
    ("swap", "is not the expected"),
])
def test_pull_refuses_damaged_blobs(tmp_path, damage, message):
    a, b = make_bundle(tmp_path / "a", 8), make_bundle(tmp_path / "b", 9)
    s = FileStore(tmp_path / "store")
    s.push(a.path, "v1")
    s.push(b.path, "v2")
    blob = tmp_path / "store" / "blobs" / "sha256" / f"{a.digest[7:]}.tar.gz"
    data = blob.read_bytes()
    blob.write_bytes({"tamper": lambda: _repack_with_edit(data),
                      "truncate": lambda: data[: len(data) // 2],
                      "swap": lambda: b.archive.read_bytes()}[damage]())
    with pytest.raises(StoreError, match=f"(?s)refusing v1: .*{message}"):
        s.pull("v1", tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_pull_does_not_overwrite_a_foreign_folder(tmp_path):
    s = FileStore(tmp_path / "store")
    s.push(make_bundle(tmp_path / "a", 10).path, "v1")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(BundleError, match="mine: exists and is not a DeepJIT bundle; refusing to replace"):
        s.pull("v1", tmp_path / "mine")
    assert tree(tmp_path / "mine") == {"notes.txt": b"keep"}


def _push_worker(root: str, bundle: str, tag: str, barrier, results) -> None:
    barrier.wait()
    try:
        results.put(("ok", FileStore(Path(root)).push(Path(bundle), tag).digest))
    except StoreError as e:
        results.put(("refused", str(e)))


def _race(root: Path, bundles: list[Path], tag: str) -> list[tuple[str, str]]:
    ctx = multiprocessing.get_context("spawn")  # fork is unsafe once other tests started threads
    barrier, results = ctx.Barrier(len(bundles)), ctx.Queue()
    procs = [ctx.Process(target=_push_worker, args=(str(root), str(b), tag, barrier, results)) for b in bundles]
    for p in procs:
        p.start()
    out = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def test_concurrent_pushes_of_the_same_content_all_succeed(tmp_path):
    a = make_bundle(tmp_path / "a", 11)
    results = _race(tmp_path / "store", [a.path] * 6, "v1")
    assert results == [("ok", a.digest)] * 6
    assert [(e.tag, e.digest) for e in FileStore(tmp_path / "store").ls()] == [("v1", a.digest)]
    assert sorted(p.name for p in (tmp_path / "store" / "blobs" / "sha256").iterdir()) == [
        f"{a.digest[7:]}.manifest.json", f"{a.digest[7:]}.tar.gz"]


def test_concurrent_pushes_of_different_content_one_wins(tmp_path):
    a, b = make_bundle(tmp_path / "a", 12), make_bundle(tmp_path / "b", 13)
    results = _race(tmp_path / "store", [a.path, b.path] * 4, "v1")
    winner = FileStore(tmp_path / "store").ls()[0].digest
    loser = b.digest if winner == a.digest else a.digest
    assert sorted(r for r in results if r[0] == "ok") == [("ok", winner)] * 4
    refused = [msg for kind, msg in results if kind == "refused"]
    assert len(refused) == 4 and all(f"already holds {winner}, not this bundle ({loser})" in m for m in refused)
    assert read_bundle(FileStore(tmp_path / "store").pull("v1", tmp_path / "p")).digest == winner
    assert json.loads((tmp_path / "p" / "manifest.json").read_bytes())["digest"] == winner


# ---------------------------------------------------------------------------- hostile or careless inputs
def test_a_refused_push_writes_no_blob(tmp_path):
    a, b = make_bundle(tmp_path / "a", 31), make_bundle(tmp_path / "b", 32)
    s = FileStore(tmp_path / "store")
    s.push(a.path, "v1")
    before = sorted(p.name for p in (tmp_path / "store/blobs/sha256").iterdir())
    with pytest.raises(StoreError, match="already holds"):
        s.push(b.path, "v1")
    assert sorted(p.name for p in (tmp_path / "store/blobs/sha256").iterdir()) == before


def test_a_bundle_its_gate_rejected_is_pushed_only_with_force(tmp_path):
    files = {"x.bin": b"1"}
    rejected = write_bundle(tmp_path / "r", files, {"name": "r", "validation": {"levels": {
        "graph": {"status": "passed"}, "precision": {"status": "failed", "reason": "too far"},
        "engine": {"status": "not_run", "reason": "no TensorRT"}}}})
    url = f"file://{tmp_path / 'store'}"
    with pytest.raises(StoreError, match=r"its accuracy gate rejected this bundle \(precision failed\).*--force"):
        store.push(rejected.path, f"{url}:v1")
    assert not (tmp_path / "store").exists()
    assert store.push(rejected.path, f"{url}:v1", force=True).digest == rejected.digest
    unchecked = write_bundle(tmp_path / "u", files, {"name": "u", "validation": {"levels": {
        "engine": {"status": "not_run", "reason": "no TensorRT"}}}})
    assert store.push(unchecked.path, f"{url}:v2").digest == unchecked.digest  # a level that did not run: no gate


def test_ls_lists_only_tag_names_not_leftovers_beside_them(tmp_path):
    s = FileStore(tmp_path / "store")
    digest = s.push(make_bundle(tmp_path / "a", 38).path, "v1").digest
    (tmp_path / "store/tags/.v2.tmp-k3j4").write_text(f"{digest}\n")  # what an interrupted tag write leaves
    assert [e.tag for e in s.ls()] == ["v1"]


def test_a_tag_that_is_a_path_is_refused_before_it_is_read(tmp_path):
    s = FileStore(tmp_path / "store")
    digest = s.push(make_bundle(tmp_path / "a", 39).path, "v1").digest
    (tmp_path / "store/outside").write_text(f"{digest}\n")
    with pytest.raises(StoreError, match=r"tag '\.\./outside' is not valid"):
        s.pull("../outside", tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_a_store_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("a user's")
    with pytest.raises(StoreError, match=f"{tmp_path}/notes.txt exists and is not a folder"):
        FileStore(tmp_path / "notes.txt")


def test_one_corrupt_tag_file_does_not_break_ls(tmp_path, caplog):
    s = FileStore(tmp_path / "store")
    s.push(make_bundle(tmp_path / "a", 33).path, "good")
    (tmp_path / "store/tags/bad").write_text("garbage\n")
    assert [e.tag for e in s.ls()] == ["good"]
    assert "tag file" in caplog.text and "bad" in caplog.text
    with pytest.raises(StoreError, match="tag file .*bad is corrupt"):
        s.pull("bad", tmp_path / "p")


def test_stale_temporaries_of_interrupted_pushes_are_removed(tmp_path):
    s = FileStore(tmp_path / "store")
    s.push(make_bundle(tmp_path / "a", 34).path, "v1")
    blobs = tmp_path / "store/blobs/sha256"
    old, fresh = (Path(tempfile.mkstemp(dir=blobs, prefix=f".{HEX}.tar.gz.tmp-")[1]) for _ in range(2))  # as pushes do
    user = blobs / f".{HEX}.tar.gz.tmp-mine"                   # a name like theirs, not made by DeepJIT
    user.write_bytes(b"z")
    for stale in (old, user):
        os.utime(stale, (time.time() - 3600, time.time() - 3600))   # an hour untouched: its writer is gone
    s.push(make_bundle(tmp_path / "b", 35).path, "v2")
    assert not old.exists() and fresh.exists() and user.exists()


def test_a_junk_side_manifest_is_listed_without_a_name_and_the_blob_still_pulls(tmp_path):
    """The side manifest only feeds `ls`: a deeply nested (hostile) one neither crashes it nor the pull."""
    s = FileStore(tmp_path / "store")
    digest = s.push(make_bundle(tmp_path / "a", 36).path, "v1").digest
    meta = tmp_path / f"store/blobs/sha256/{digest.split(':')[1]}.manifest.json"
    meta.write_text("[" * 100_000 + "]" * 100_000)
    assert [e.name for e in s.ls()] == [""]                      # listed, without a name
    assert read_bundle(s.pull("v1", tmp_path / "p")).digest == digest   # the blob itself still verifies


def test_ls_prints_a_table_with_sizes_and_validation(tmp_path):
    a = make_bundle(tmp_path / "a", 7, name="alpha")
    rejected = write_bundle(tmp_path / "r", {"k.cubin": b"\x7fELF" + bytes(3000)}, {"name": "rej", "validation": {
        "levels": {"graph": {"status": "passed"}, "precision": {"status": "failed"}, "kernels": {"status": "not_run"}}}})
    s = FileStore(tmp_path / "store")
    s.push(a.path, "v1")
    s.push(rejected.path, "bad")
    r = run_cli("ls", f"file://{tmp_path}/store")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(line for line in lines if "tag" in line)
    assert all(col in header for col in ("bundle", "validation", "size", "digest"))
    v1 = next(line for line in lines if "v1" in line)
    size = a.archive.stat().st_size
    assert "alpha" in v1 and "graph passed" in v1 and a.digest in v1
    assert f"{size / 1000:.1f} kB" in v1 and f" {size} " not in v1  # for humans, not raw bytes
    assert "precision FAILED; graph passed; kernels not run" in next(line for line in lines if "bad" in line)
    r = run_cli("ls", f"file://{tmp_path}/nowhere")
    assert r.returncode == 2 and "no store there" in r.stderr and r.stdout == ""
    r = run_cli("ls", f"file://{tmp_path}/store", "--json")
    assert {e["tag"]: e["validation"] for e in json.loads(r.stdout)}["bad"]["precision"] == "failed"


def test_a_bare_tag_push_says_it_creates_the_default_store(tmp_path):
    a = make_bundle(tmp_path / "a", 8)
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    default = tmp_path / "data/deepjit/store"
    r = run_cli("push", str(a.path), "v1", env=env)
    assert r.returncode == 0, r.stderr
    assert f"creating the default store {default}" in r.stderr and default.is_dir()
    r = run_cli("push", str(a.path), "v2", env=env)
    assert r.returncode == 0 and "creating the default store" not in r.stderr  # only the first time


# ---------------------------------------------------------------------------- a store's own files are input
@pytest.mark.parametrize("plant, problem", [
    (lambda p, rng: p.mkdir(), "not a regular file"),
    (lambda p, rng: p.write_bytes(b"\xff\xfe" + rng.randbytes(64)), "it holds no digest"),
    (lambda p, rng: os.mkfifo(p), "not a regular file"),
    (lambda p, rng: p.write_text(f"sha256:{rng.randbytes(32).hex()}" + " " * 8000), "over 4096 bytes"),
], ids=["folder", "binary", "fifo", "oversized"])
def test_a_tag_that_is_not_a_small_file_holding_a_digest_is_a_clear_error(tmp_path, caplog, plant, problem):
    s = FileStore(tmp_path / "store")
    a = make_bundle(tmp_path / "a", 40)
    s.push(a.path, "good")
    bad = tmp_path / "store/tags/bad"
    plant(bad, random.Random(41))
    message = f"tag file {bad} is corrupt \\({problem}; expected a regular file holding 'sha256:"
    with pytest.raises(StoreError, match=message):
        within(10, lambda: s.pull("bad", tmp_path / "p"), bad)
    with pytest.raises(StoreError, match=message):
        within(10, lambda: s.push(a.path, "bad"), bad)
    assert [e.tag for e in within(10, s.ls, bad)] == ["good"]     # listed without the bad one, which is named
    assert f"tag file {bad} is corrupt" in caplog.text
    assert not (tmp_path / "p").exists()


def _bomb_blob(size: int) -> bytes:
    """A tar.gz whose one member's header claims `size` bytes (the data is cut short): only the
    bound taken before inflating tells a bomb from a truncated archive."""
    info = tarfile.TarInfo("segments/backbone.onnx")
    info.size = size
    return gzip.compress(info.tobuf(format=tarfile.PAX_FORMAT) + bytes(4096), mtime=0)


def test_pull_trusts_a_stored_manifest_json_only_when_its_digest_is_the_bundles(tmp_path, monkeypatch, caplog):
    import deepjit_compiler.store.file as file_store

    s = FileStore(tmp_path / "store")
    a = make_bundle(tmp_path / "a", 42)
    s.push(a.path, "v1")
    bounds = []
    real_unpack = file_store.unpack_bundle
    monkeypatch.setattr(file_store, "unpack_bundle", lambda *args, **kw: bounds.append(kw["max_bytes"]) or real_unpack(*args, **kw))
    s.pull("v1", tmp_path / "p1")                                   # the sealed manifest bounds unpacking
    assert bounds == [declared_size(a.manifest)]

    meta = tmp_path / f"store/blobs/sha256/{a.digest[7:]}.manifest.json"
    forged = json.loads(meta.read_bytes())                          # keeps its 'digest', lifts every size
    forged["files"] = {rel: {**e, "size": 1 << 40} for rel, e in forged["files"].items()}
    meta.write_text(json.dumps(forged))
    s.pull("v1", tmp_path / "p2")                                   # ignored: the archive's size bounds it
    assert bounds[-1] is None and f"{meta.name} does not match {a.digest}" in caplog.text

    (tmp_path / f"store/blobs/sha256/{a.digest[7:]}.tar.gz").write_bytes(_bomb_blob(1 << 32))
    with pytest.raises(StoreError, match=r"refusing v1: .*holds more than the \d{8,9} bytes"):
        s.pull("v1", tmp_path / "p3")                               # a bomb stops at that bound, not at 1 TiB
    assert not (tmp_path / "p3").exists()


def test_a_folder_that_is_not_a_store_is_named(tmp_path):
    """ls and pull of a folder holding other things say so (exit 2), not 'no tags' or 'no tag v1'."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's")
    for args in (["ls", f"file://{tmp_path}/mine"], ["pull", f"file://{tmp_path}/mine:v1", str(tmp_path / "p")]):
        r = run_cli(*args)
        assert r.returncode == 2 and f"{tmp_path}/mine is not a DeepJIT store (no tags/ or blobs/ in it)" in r.stderr
    r = run_cli("pull", f"file://{tmp_path}/nothing:v1", str(tmp_path / "p"))
    assert r.returncode == 2 and "no store there" in r.stderr
    (tmp_path / "empty").mkdir()  # an empty folder is an empty store
    assert run_cli("ls", f"file://{tmp_path}/empty").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine"]  # nothing written anywhere
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("dest", [".", "", ".."])
def test_pulling_into_the_current_folder_is_refused_naming_it(tmp_path, monkeypatch, dest):
    """Replacing the folder a shell stands in (or one holding it) would pull it from under it."""
    FileStore(tmp_path / "store").push(make_bundle(tmp_path / "a", 37).path, "v1")
    (here := tmp_path / "here" / "in").mkdir(parents=True)
    monkeypatch.chdir(here)
    r = run_cli("pull", f"file://{tmp_path}/store:v1", dest)
    assert r.returncode == 2 and f"{dest or '.'}: is the current folder or holds it; refusing" in r.stderr, r.stderr
    assert list(here.iterdir()) == [] and [p.name for p in here.parent.iterdir()] == ["in"]


def test_a_store_folder_whose_name_holds_a_colon_is_refused(tmp_path):
    """`file://DIR/run:3:v1` read as the store `run:3`, tag v1, but was pushed to the store `run`, tag v1
    (opening the store read ':3' as a tag again): a folder that no reference names."""
    info = make_bundle(tmp_path / "b", 41)
    r = run_cli("push", str(info.path), f"file://{tmp_path}/run:3:v1")
    assert r.returncode == 2, r.stderr
    assert (f"error: reference 'file://{tmp_path}/run:3:v1': the store folder 'run:3' holds ':', which a reference "
            "reads as the start of a tag; allowed: a store folder name without ':'") in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "b.tar.gz"]  # no store written
