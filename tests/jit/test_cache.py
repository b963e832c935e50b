"""The compile cache: one test per key ingredient, ten builds compile once, a hit runs no NVRTC,
corrupt entries are rebuilt, concurrent builders agree, and where the cache lives."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

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


def test_entries_are_committed_by_meta_written_last(tiny, tmp_path):
    k = compile_cached(source(tiny), 75, cache=KernelCache(tmp_path))
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
