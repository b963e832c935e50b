"""The compile cache: one test per key ingredient, ten builds compile once, a hit runs no NVRTC,
corrupt entries are rebuilt, concurrent builders agree, and where the cache lives."""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import shutil
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from deepjit_compiler.files import atomic_write
from deepjit_compiler.jit import cache as cache_mod
from deepjit_compiler.jit import nvrtc
from deepjit_compiler.jit.cache import KernelCache
from deepjit_compiler.jit.nvrtc import CompileOptions, cache_key, compile_cached, compile_site_kernel
from deepjit_compiler.jit.render import KernelSource, render_kernel

TEMPLATE = """\
#include "deepjit_common.cuh"
template <typename T>
__global__ void axpy(T* y, const T* x, float a, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) deepjit::store_f(y + i, {{ scale }}f * a * deepjit::to_f32(x[i]) + deepjit::to_f32(y[i]));
}
"""


@pytest.fixture
def tiny(tmp_path) -> Path:
    """A small user contract (compiles in tens of milliseconds)."""
    (tmp_path / "axpy.cu.j2").write_text(TEMPLATE)
    (tmp_path / "axpy.yaml").write_text(textwrap.dedent("""\
        name: axpy
        template: axpy.cu.j2
        headers: [deepjit_common.cuh]
        params: {scale: {type: float, default: 1.0}, dtype: {type: str, default: float32, allowed: [float32, float16]}}
        inputs: [{name: x, dtype: "{{ dtype }}", shape: [N]}]
        outputs: [{name: y, dtype: "{{ dtype }}", shape: [N]}]
        entry_points:
          - {name: axpy, symbol: "axpy<{{ ctype(dtype) }}>", block: [128], grid: ["ceil_div(N, 128)"],
             args: [{name: y, type: ptr}, {name: x, type: ptr}, {name: a, type: f32, value: "2.0"}, {name: N, type: i32}]}
        """))
    return tmp_path / "axpy.yaml"


def source(tiny: Path, **params) -> KernelSource:
    return render_kernel(str(tiny), params)[1]


def test_each_key_ingredient_changes_the_key(tiny, monkeypatch):
    base_src, opts = source(tiny), CompileOptions()
    base = cache_key(base_src, 75, opts)
    assert cache_key(source(tiny), 75, CompileOptions()) == base                        # deterministic
    assert cache_key(source(tiny, scale=3.0), 75, opts) != base                          # rendered source
    assert cache_key(base_src, 90, opts) != base                                         # arch
    assert cache_key(base_src, 75, CompileOptions(fast_math=True)) != base               # options
    assert cache_key(base_src, 75, CompileOptions(extra=("-DX=1",))) != base
    renamed = dataclasses.replace(base_src, symbols=(("axpy", "axpy<double>"),))
    assert cache_key(renamed, 75, opts) != base                                          # name expressions
    header = dataclasses.replace(base_src, headers=(("deepjit_common.cuh", base_src.headers[0][1] + "\n// edit"),))
    assert cache_key(header, 75, opts) != base                                           # header digest
    header = dataclasses.replace(base_src, headers=(("other.cuh", base_src.headers[0][1]),))
    assert cache_key(header, 75, opts) != base                                           # header name
    monkeypatch.setattr(nvrtc, "__version__", "99.0.0")
    assert cache_key(base_src, 75, opts) != base                                         # deepjit version
    monkeypatch.undo()
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (12, 9))
    assert cache_key(base_src, 75, opts) != base                                         # NVRTC version
    monkeypatch.undo()
    monkeypatch.setattr(nvrtc, "cuda_headers", lambda: (("-I/elsewhere",), "include-0123"))
    assert cache_key(base_src, 75, opts) != base                                         # CUDA headers used
    monkeypatch.undo()
    monkeypatch.setattr(nvrtc, "FORMAT_VERSION", nvrtc.FORMAT_VERSION + 1)
    assert cache_key(base_src, 75, opts) != base                                         # cache format


def test_ten_builds_compile_once(tiny, tmp_path):
    before = nvrtc.stats.compiles
    kernels = [compile_site_kernel(str(tiny), {"scale": 0.5}, sm=75, cache_dir=tmp_path / "c") for _ in range(10)]
    assert nvrtc.stats.compiles - before == 1
    assert [k.from_cache for k in kernels] == [False] + [True] * 9
    assert len({k.key for k in kernels}) == 1 and all(k.cubin == kernels[0].cubin for k in kernels)
    assert kernels[-1].symbol("axpy") == kernels[0].symbol("axpy")


def test_a_hit_runs_no_nvrtc(tiny, tmp_path, monkeypatch):
    first = compile_cached(source(tiny), 75, cache=KernelCache(tmp_path))

    def boom(*_a, **_k):
        raise AssertionError("NVRTC ran on a cache hit")

    monkeypatch.setattr(nvrtc.nvrtc, "nvrtcCompileProgram", boom)
    hit = compile_cached(source(tiny), 75, cache=KernelCache(tmp_path))
    assert hit.from_cache and hit.cubin == first.cubin and hit.ptx == first.ptx
    assert (hit.nvrtc_version, hit.min_driver, hit.lowered) == (first.nvrtc_version, first.min_driver, first.lowered)


def _entry(tmp_path, key) -> Path:
    return KernelCache(tmp_path).folder(key)


@pytest.mark.parametrize("damage", ["truncate cubin", "garble meta", "drop ptx", "meta of another key",
                                    "cubin and its digest edited together", "written by another user",
                                    "entry name edited", "field added"])
def test_corrupt_entries_are_misses_and_rebuilt(tiny, tmp_path, damage, monkeypatch):
    src = source(tiny)
    good = compile_cached(src, 75, cache=KernelCache(tmp_path))
    folder = _entry(tmp_path, good.key)
    if damage == "truncate cubin":
        (folder / "cubin").write_bytes(good.cubin[:100])
    elif damage == "garble meta":
        (folder / "meta.json").write_text("{not json")
    elif damage == "drop ptx":
        (folder / "ptx").unlink()
    elif damage == "cubin and its digest edited together":
        evil = good.cubin[:-4] + b"EVIL"
        (folder / "cubin").write_bytes(evil)
        meta = json.loads((folder / "meta.json").read_text())
        meta["blobs"]["cubin"] = hashlib.sha256(evil).hexdigest()
        (folder / "meta.json").write_text(json.dumps(meta))
    elif damage == "written by another user":  # a shared cache: their entry, signed with their secret
        with monkeypatch.context() as them:
            (tmp_path / "their.key").write_bytes(b"k" * 32)
            (tmp_path / "their.key").chmod(0o600)  # a key others could read is refused
            them.setenv("DEEPJIT_CACHE_KEY_FILE", str(tmp_path / "their.key"))
            compile_cached(src, 75, cache=KernelCache(tmp_path / "theirs"))
        shutil.rmtree(folder)
        shutil.copytree(KernelCache(tmp_path / "theirs").folder(good.key), folder)
    elif damage == "entry name edited":  # the binaries untouched: the launch would take another function
        meta = json.loads((folder / "meta.json").read_text())
        meta["lowered"] = {name: "_Z4evilPfPKffi" for name in meta["lowered"]}
        (folder / "meta.json").write_text(json.dumps(meta))
    elif damage == "field added":
        meta = json.loads((folder / "meta.json").read_text())
        meta["min_driver"], meta["note"] = "0.0", "trusted?"
        (folder / "meta.json").write_text(json.dumps(meta))
    else:
        meta = json.loads((folder / "meta.json").read_text())
        meta["key"] = "0" * 64
        (folder / "meta.json").write_text(json.dumps(meta))
    before_compiles, before_corrupt = nvrtc.stats.compiles, cache_mod.stats.corrupt
    again = compile_cached(src, 75, cache=KernelCache(tmp_path))
    assert not again.from_cache and again.cubin == good.cubin
    assert nvrtc.stats.compiles == before_compiles + 1
    assert cache_mod.stats.corrupt == before_corrupt + (damage != "drop ptx")  # a missing file is a plain miss
    assert compile_cached(src, 75, cache=KernelCache(tmp_path)).from_cache  # repaired


def test_an_older_formats_entry_is_a_plain_miss_and_rewritten(tiny, tmp_path):
    """Entries whose MAC covered only the key and digests (cache format 1) are rebuilt without a
    corrupt-entry warning, then hit."""
    good = compile_cached(source(tiny), 75, cache=KernelCache(tmp_path))
    meta_path = _entry(tmp_path, good.key) / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["cache_format"] == 2
    del meta["cache_format"]
    meta_path.write_text(json.dumps(meta))
    corrupt, compiles = cache_mod.stats.corrupt, nvrtc.stats.compiles
    again = compile_cached(source(tiny), 75, cache=KernelCache(tmp_path))
    assert not again.from_cache and nvrtc.stats.compiles == compiles + 1
    assert cache_mod.stats.corrupt == corrupt
    assert json.loads(meta_path.read_text())["cache_format"] == 2
    assert compile_cached(source(tiny), 75, cache=KernelCache(tmp_path)).from_cache


def test_entries_are_committed_by_meta_written_last(tiny, tmp_path, monkeypatch):
    written = []

    def recording(path, data):
        written.append(Path(path).name)
        return atomic_write(path, data)

    monkeypatch.setattr(cache_mod, "atomic_write", recording)
    k = compile_cached(source(tiny), 75, cache=KernelCache(tmp_path))
    assert sorted(written[:-1]) == ["cubin", "ptx"] and written[-1] == "meta.json"  # the commit, after the blobs
    folder = _entry(tmp_path, k.key)
    assert sorted(p.name for p in folder.iterdir()) == ["cubin", "meta.json", "ptx"]  # no temp files left
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["key"] == k.key and set(meta["blobs"]) == {"cubin", "ptx"}
    assert meta["nvrtc_version"] == k.nvrtc_version and meta["arch"] == "sm_75"
    assert meta["lowered"] == dict(k.lowered) and meta["format"] == 1  # CompiledKernel.to_dict()
    (folder / "meta.json").unlink()  # an entry without its commit marker does not exist
    assert KernelCache(tmp_path).get(k.key) is None


def test_concurrent_builders_of_one_kernel_agree(tiny, tmp_path):
    src = source(tiny, scale=7.0)
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda _: compile_cached(src, 75, cache=KernelCache(tmp_path)), range(12)))
    assert len({(r.key, r.cubin, r.ptx) for r in results}) == 1
    assert KernelCache(tmp_path).get(results[0].key) is not None


def test_cache_dir_comes_from_spec_then_env_then_user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPJIT_CACHE_DIR", str(tmp_path / "env"))
    assert KernelCache().root == tmp_path / "env"
    assert KernelCache(tmp_path / "spec").root == tmp_path / "spec"
    monkeypatch.delenv("DEEPJIT_CACHE_DIR")
    root = KernelCache().root
    assert root.name == "kernels" and "deepjit" in str(root)


def test_unwritable_cache_does_not_fail_the_build(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    k = compile_cached(source(tiny), 75, cache=KernelCache(blocker))
    assert k.cubin[:4] == b"\x7fELF" and not k.from_cache


def test_past_its_size_bound_a_compile_removes_the_least_recently_used_kernels(tiny, tmp_path, monkeypatch):
    """$DEEPJIT_KERNEL_CACHE_MB bounds the compile cache; the plans and stages that share its root stay."""
    import os
    import time

    from deepjit_compiler.stagecache import StageCache

    root = tmp_path / "c"
    stages = StageCache(root / "stages", enabled=True)
    stages.put("precision", {"seed": 1}, {"segment.onnx": b"\x08" * 50_000}, {"level": {}})
    kernels = [compile_cached(source(tiny, scale=s), 75, cache=KernelCache(root)) for s in (1.0, 2.0, 3.0)]
    folders = [KernelCache(root).folder(k.key) for k in kernels]
    for i, folder in enumerate(folders):  # written a second apart, oldest first
        os.utime(folder / "meta.json", (time.time(), time.time() - 100 + 10 * i))
    assert compile_cached(source(tiny, scale=1.0), 75, cache=KernelCache(root)).from_cache  # used now: the newest
    entry = sum(f.stat().st_size for f in folders[1].iterdir())
    monkeypatch.setenv("DEEPJIT_KERNEL_CACHE_MB", str(2.5 * entry / 1e6))  # room for two
    newest = compile_cached(source(tiny, scale=4.0), 75, cache=KernelCache(root))
    assert [f.exists() for f in folders] == [True, False, False]  # 2.0 and 3.0 were the least recently used
    assert compile_cached(source(tiny, scale=4.0), 75, cache=KernelCache(root)).from_cache
    assert newest.key not in {k.key for k in kernels}
    assert stages.get("precision", {"seed": 1}) is not None  # another cache's entry under the same root


def test_a_bad_kernel_cache_bound_is_a_named_error(tiny, tmp_path, monkeypatch):
    from deepjit_compiler.errors import DeepJITError

    monkeypatch.setenv("DEEPJIT_KERNEL_CACHE_MB", "-1")
    with pytest.raises(DeepJITError, match=r"\$DEEPJIT_KERNEL_CACHE_MB is '-1': a number of megabytes above 0"):
        compile_cached(source(tiny, scale=5.0), 75, cache=KernelCache(tmp_path))
    assert not list(tmp_path.glob("??/*/meta.json"))  # refused before it compiled or wrote anything


# ---------------------------------------------------------------------------- the key file and planted entries
KEY = "ab" * 32


@pytest.fixture
def key_file(tmp_path, monkeypatch) -> Path:
    """This test's own cache secret (32 bytes, mode 0600), so a record can be signed by hand."""
    path = tmp_path / "config" / "cache.key"
    path.parent.mkdir()
    path.write_bytes(b"s" * 32)
    path.chmod(0o600)
    monkeypatch.setenv("DEEPJIT_CACHE_KEY_FILE", str(path))
    return path


def _plant(root: Path, record: dict, secret: bytes | None = None, key: str = KEY) -> Path:
    """Write meta.json for `key` by hand, signed with `secret` (as DeepJIT signs) if given."""
    folder = KernelCache(root).folder(key)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"cache_format": cache_mod.FORMAT, "key": key, **record}
    if secret is not None:
        record["mac"] = hmac.new(secret, json.dumps(record, sort_keys=True).encode(), hashlib.sha256).hexdigest()
    (folder / "meta.json").write_text(json.dumps(record))
    return folder


def _get_within(cache: KernelCache, key: str, fifos: list[Path], seconds: float = 5.0):
    """cache.get(key) on a thread: (returned, still blocked). A get stuck opening a FIFO is then released
    by opening its write end, so the test ends either way."""
    out = []
    t = threading.Thread(target=lambda: out.append(cache.get(key)), daemon=True)
    t.start()
    t.join(seconds)
    blocked = t.is_alive()
    for fifo in fifos:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # EOF for a reader waiting on it
        except OSError:
            pass  # no reader: nothing waits
    t.join(seconds)
    return (out[0] if out else None), blocked


def test_an_empty_key_file_left_by_an_interrupted_first_run_signs_nothing(tmp_path, key_file):
    """An older DeepJIT killed between creating the key file and writing it left b"": an entry signed
    with the empty key must not be trusted, and the key is replaced by a whole one."""
    key_file.write_bytes(b"")
    folder = _plant(tmp_path, {"blobs": {"cubin": hashlib.sha256(b"evil").hexdigest()}}, secret=b"")
    (folder / "cubin").write_bytes(b"evil")
    assert KernelCache(tmp_path).get(KEY) is None
    assert len(key_file.read_bytes()) == 32 and key_file.stat().st_mode & 0o777 == 0o600


def test_the_key_file_is_never_seen_half_written(tmp_path, monkeypatch):
    """A second process reading the key while the first writes it finds none (and makes its own, which
    both then use), never an empty one; a first run killed mid-write leaves no key file."""
    path = tmp_path / "config" / "cache.key"
    monkeypatch.setenv("DEEPJIT_CACHE_KEY_FILE", str(path))
    real_urandom, seen = os.urandom, []

    def urandom_with_a_reader_meanwhile(n):
        if not seen:
            seen.append(None)
            seen[0] = cache_mod._secret()  # the other process, between creating and writing
        return real_urandom(n)

    monkeypatch.setattr(os, "urandom", urandom_with_a_reader_meanwhile)
    first = cache_mod._secret()
    assert len(seen[0]) == 32 and first == seen[0] == path.read_bytes()

    path.unlink()

    def killed(n):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "urandom", killed)
    with pytest.raises(KeyboardInterrupt):
        cache_mod._secret()
    assert not path.exists() and not list(path.parent.iterdir())  # nor its temp file


@pytest.mark.parametrize("problem", ["group and others can read it", "group can write it", "another user owns it",
                                     "it is short and others can read it"])
def test_a_key_file_others_could_know_or_set_turns_signing_off(tmp_path, key_file, monkeypatch, caplog, problem):
    """Every get is a miss (even of an entry signed with that key), put writes nothing, one warning."""
    if problem == "another user owns it":
        monkeypatch.setattr(os, "getuid", lambda: os.stat(key_file).st_uid + 1)
    if problem == "it is short and others can read it":  # not ours alone: refused, not replaced
        key_file.write_bytes(b"s" * 8)
    key_file.chmod({"group can write it": 0o620, "another user owns it": 0o600}.get(problem, 0o644))
    secret = key_file.read_bytes()
    folder = _plant(tmp_path, {"blobs": {"cubin": hashlib.sha256(b"x").hexdigest()}}, secret=secret)
    (folder / "cubin").write_bytes(b"x")
    caplog.set_level(logging.WARNING, "deepjit.cache")
    cache = KernelCache(tmp_path / "c", cache_mod.CacheStats())
    assert KernelCache(tmp_path).get(KEY) is None
    cache.put(KEY, {"cubin": b"x"}, {})
    assert cache.get(KEY) is None and not (tmp_path / "c").exists()
    assert cache.counters.writes == 0 and cache.counters.misses == 1 and cache.counters.hits == 0
    assert key_file.read_bytes() == secret  # left for the user to fix
    assert caplog.text.count(f"not using the cache key file {key_file}") == 1


@pytest.mark.parametrize("plant", ["meta.json is a FIFO", "an unsigned record names a FIFO outside",
                                   "a signed record's blob is a symlink to a FIFO", "an unsigned record's MAC is not ASCII"])
def test_get_opens_nothing_an_unchecked_record_names(tmp_path, key_file, plant):
    """The record's MAC is checked before any file it names is opened, and only regular files are read:
    a planted entry in a shared cache cannot make get read outside it, hang on a FIFO or fail."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = KernelCache(tmp_path / "c").folder(KEY)
    if plant == "meta.json is a FIFO":
        folder.mkdir(parents=True)
        os.mkfifo(folder / "meta.json")
    elif plant == "an unsigned record names a FIFO outside":
        _plant(tmp_path / "c", {"blobs": {"../../../fifo": "0" * 64}, "mac": "0" * 64})
    elif plant == "a signed record's blob is a symlink to a FIFO":
        folder = _plant(tmp_path / "c", {"blobs": {"cubin": "0" * 64}}, secret=key_file.read_bytes())
        (folder / "cubin").symlink_to(fifo)
    else:
        _plant(tmp_path / "c", {"blobs": {}, "mac": "\u00e9" * 64})
    cache = KernelCache(tmp_path / "c", cache_mod.CacheStats())
    found, blocked = _get_within(cache, KEY, [fifo, folder / "meta.json"])
    assert not blocked and found is None and cache.counters.misses == 1


@pytest.mark.parametrize("name", ["../../../outside", "ABSOLUTE", "meta.json", "..", "sub/cubin", "sub\\cubin"])
def test_a_signed_record_names_only_plain_files_in_its_entry(tmp_path, key_file, name):
    """Even a record this user's key signed (a bug, or a key that leaked) reads and prunes nothing outside
    its entry folder."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret data")
    name = str(outside) if name == "ABSOLUTE" else name
    _plant(tmp_path / "c", {"blobs": {name: hashlib.sha256(b"secret data").hexdigest()}}, secret=key_file.read_bytes())
    cache = KernelCache(tmp_path / "c", cache_mod.CacheStats())
    assert cache.get(KEY) is None and cache.counters.corrupt == 1
    cache.prune(0)
    assert outside.read_bytes() == b"secret data"


def test_a_signed_record_whose_blob_is_a_symlink_is_not_followed(tmp_path, key_file):
    outside = tmp_path / "outside"
    outside.write_bytes(b"cubin bytes")
    folder = _plant(tmp_path / "c", {"blobs": {"cubin": hashlib.sha256(b"cubin bytes").hexdigest()}},
                    secret=key_file.read_bytes())
    (folder / "cubin").symlink_to(outside)
    cache = KernelCache(tmp_path / "c", cache_mod.CacheStats())
    assert cache.get(KEY) is None and cache.counters.corrupt == 1
    cache.put(KEY, {"cubin": b"cubin bytes"}, {})  # a rebuild replaces the link with the file
    assert cache.get(KEY)[1] == {"cubin": b"cubin bytes"} and not (folder / "cubin").is_symlink()


OTHER = "cd" * 32


@pytest.fixture
def blobs() -> dict[str, bytes]:
    rng = np.random.default_rng(7)
    return {"cubin": rng.bytes(256), "ptx": rng.bytes(128)}


def test_put_then_get_returns_the_blobs_and_the_record_as_json_and_counts(tmp_path, key_file, blobs):
    cache = KernelCache(tmp_path / "c", cache_mod.CacheStats())
    cache.put(KEY, blobs, {"sms": {75}, "names": ("a", "b")})
    meta, got = cache.get(KEY)
    assert got == blobs and meta["sms"] == [75] and meta["names"] == ["a", "b"] and meta["key"] == KEY
    assert cache.get(OTHER) is None
    c = cache.counters
    assert (c.writes, c.hits, c.misses, c.corrupt) == (1, 1, 1, 0)


def test_the_key_is_the_sha256_of_the_materials_sorted_json():
    expected = hashlib.sha256(b'{"a":[1,2],"b":"x"}').hexdigest()
    assert cache_mod.key_of({"b": "x", "a": [1, 2]}) == cache_mod.key_of({"a": [1, 2], "b": "x"}) == expected


@pytest.mark.parametrize("name", ["../outside", "meta.json", ".", "", "sub/cubin"])
def test_put_writes_nothing_for_a_blob_name_that_is_not_a_plain_file(tmp_path, key_file, name):
    cache = KernelCache(tmp_path / "c", cache_mod.CacheStats())
    cache.put(KEY, {name: b"x"}, {})
    assert not (tmp_path / "c").exists() and cache.counters.writes == 0


def test_an_entry_copied_into_another_keys_folder_is_not_served_nor_pruned(tmp_path, key_file, blobs):
    """Each record is signed for its own key: a valid entry of ours copied to another key's folder (a shared
    cache) would hand that key's build these binaries."""
    cache = KernelCache(tmp_path / "c", cache_mod.CacheStats())
    cache.put(KEY, blobs, {})
    shutil.copytree(cache.folder(KEY), cache.folder(OTHER))
    assert cache.get(OTHER) is None and cache.counters.corrupt == 1
    assert cache.get(KEY)[1] == blobs
    cache.prune(0)
    assert not cache.folder(KEY).exists() and (cache.folder(OTHER) / "cubin").read_bytes() == blobs["cubin"]


@pytest.mark.parametrize("meta", ["[1]", "meta symlinked", '"blobs as a list"'])
def test_a_meta_json_that_is_no_record_of_this_entry_is_corrupt(tmp_path, key_file, blobs, meta):
    cache = KernelCache(tmp_path / "c", cache_mod.CacheStats())
    cache.put(KEY, blobs, {})
    path = cache.folder(KEY) / "meta.json"
    if meta == "meta symlinked":  # the very record, but planted as a link: only regular files are read
        path.rename(tmp_path / "record.json")
        path.symlink_to(tmp_path / "record.json")
    elif meta == '"blobs as a list"':  # signed, so a bug of ours: still a miss, not a TypeError
        _plant(tmp_path / "c", {"blobs": list(blobs)}, secret=key_file.read_bytes())
    else:
        path.write_text(meta)
    assert cache.get(KEY) is None and cache.counters.corrupt == 1


def test_prune_removes_only_this_users_entries_least_recently_used_first(tmp_path, key_file, blobs):
    """Another user's entry, one of an older format and files it did not write in an entry's folder stay;
    `keep` stays whatever its size; a cache already within the bound loses nothing."""
    root = tmp_path / "c"
    cache = KernelCache(root, cache_mod.CacheStats())
    theirs = _plant(root, {"blobs": {}}, secret=b"t" * 32, key="ef" * 32)
    older = _plant(root, {"blobs": {}, "cache_format": 1}, secret=key_file.read_bytes(), key="01" * 32)
    for i, key in enumerate((KEY, OTHER, "23" * 32)):
        cache.put(key, blobs, {})
        os.utime(cache.folder(key) / "meta.json", (1000 + i, 1000 + i))
    (cache.folder(OTHER) / "notes.txt").write_text("mine")
    ours = sum(f.stat().st_size for k in (KEY, OTHER, "23" * 32) for f in cache.folder(k).iterdir()
               if f.name != "notes.txt")
    assert cache.prune(ours) == 0 and cache.folder(KEY).exists()
    cache.prune(0, keep=KEY)
    assert sorted(p.name for p in cache.folder(KEY).iterdir()) == ["cubin", "meta.json", "ptx"]
    assert [p.name for p in cache.folder(OTHER).iterdir()] == ["notes.txt"]
    assert not cache.folder("23" * 32).exists()
    assert (theirs / "meta.json").exists() and (older / "meta.json").exists()


def test_a_key_file_another_process_leaves_short_meanwhile_signs_nothing(tmp_path, monkeypatch, caplog):
    """An older DeepJIT that created the key file (empty) just before this one linked its own: its
    content, not yet written, must not become the secret."""
    path = tmp_path / "config" / "cache.key"
    monkeypatch.setenv("DEEPJIT_CACHE_KEY_FILE", str(path))

    def theirs_first(p: Path) -> None:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
        p.chmod(0o600)

    monkeypatch.setattr(cache_mod, "_make_key_file", theirs_first)
    caplog.set_level(logging.WARNING, "deepjit.cache")
    assert cache_mod._secret() is None
    assert f"not using the cache key file {path} (it is shorter than 32 bytes)" in caplog.text
