"""NVRTC on a machine without a GPU: cubin for sm_XX plus compute_XX PTX, mangled names kept,
versions recorded, options from the spec, and compile errors mapped back to the template."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from deepjit_compiler.errors import KernelCompileError, KernelError
from deepjit_compiler.jit import nvrtc
from deepjit_compiler.jit.nvrtc import CompileOptions, compile_site_kernel, compile_site_kernels, compile_source
from deepjit_compiler.jit.render import render_kernel

FACTS = {"reg_max": 16, "num_classes": 80, "strides": [8, 16, 32], "anchors": 8400,
         "levels": [[80, 80], [40, 40], [20, 20]], "input_dtype": "float32"}


@pytest.fixture(scope="module")
def t4_kernels(tmp_path_factory):
    """The T4 pipeline's two kernels (pipelines/yolov8_t4.yaml), compiled for sm_75."""
    cache = tmp_path_factory.mktemp("cache")
    return compile_site_kernels([("yolov8_decode", {"mode": "candidates", "conf_threshold": 0.25, "anchors_per_thread": 4}),
                                 ("nms", {"conf_threshold": 0.25, "iou_threshold": 0.45, "max_det": 300})],
                                FACTS, sm=75, cache_dir=cache)


def test_cubin_and_ptx_for_sm75_without_a_gpu(t4_kernels):
    decode, nms = t4_kernels
    for k in (decode, nms):
        assert k.cubin[:4] == b"\x7fELF"
        assert ".target sm_75" in k.ptx and (k.arch, k.ptx_arch) == ("sm_75", "compute_75")
        major, minor = nvrtc.nvrtc_version()
        assert k.nvrtc_version == f"{major}.{minor}"
        assert k.min_driver == major * 1000 and k.ptx_min_driver == major * 1000 + minor * 10
        assert k.ptx_isa and f".version {k.ptx_isa}" in k.ptx
        assert "-use_fast_math" not in k.options and "--std=c++17" in k.options
        assert len(k.key) == 64 and k.to_dict()["cubin_sha256"]
    mangled = decode.symbol("decode")
    assert mangled.startswith("_Z") and "deepjit_yolov8_decode_candidates" in mangled
    assert f".entry {mangled}(" in decode.ptx
    assert nms.symbol("deepjit_nms<300, false>") == nms.symbol("nms")


def test_sm90_build_and_fp16_inputs_find_cuda_fp16(tmp_path):
    k = compile_site_kernel("yolov8_decode", {"dtype": "float16", "mode": "output0"}, FACTS, sm=90, cache_dir=tmp_path)
    assert ".target sm_90" in k.ptx and k.source.symbols == (("decode", "deepjit_yolov8_decode_output0<__half, 1>"),)
    assert "6__half" in k.symbol("decode")  # the template argument survives in the mangled name


def test_lanes_per_anchor_is_for_the_candidates_and_nms_modes_only(tmp_path):
    for way in ({"anchors_per_thread": 1, "lanes_per_anchor": 4}, {"anchors_per_thread": 2, "lanes_per_anchor": 2},
                {"anchors_per_thread": 4, "large_batch_lanes": 2}):
        k = compile_site_kernel("yolov8_decode", way, FACTS, sm=75, cache_dir=tmp_path)
        assert "shfl.sync.bfly" in k.ptx  # the shared-anchor kernel's merge of the parts
    assert "shfl.sync.bfly" not in compile_site_kernel("yolov8_decode", {"anchors_per_thread": 4}, FACTS, sm=75,
                                                       cache_dir=tmp_path).ptx
    for way in ({"lanes_per_anchor": 2}, {"large_batch_lanes": 2}):
        with pytest.raises(KernelCompileError, match=r"yolov8_decode.cu.j2:\d+: error: static assertion failed with "
                                                     r"\"yolov8_decode: lanes_per_anchor \(or large_batch_lanes\) "
                                                     r"above 1 needs mode candidates or nms\""):
            compile_site_kernel("yolov8_decode", {"mode": "output0", "anchors_per_thread": 2, **way},
                                FACTS, sm=75, cache_dir=tmp_path)


@pytest.mark.parametrize("lanes, large, symbols", [(4, 0, (4,)), (4, 4, (4,)), (4, 2, (4, 2)), (1, 2, (1, 2))])
def test_large_batch_lanes_is_a_second_kernel_of_the_decode_entry(lanes, large, symbols, tmp_path):
    """large_batch_lanes other than lanes_per_anchor compiles the decode a second time, as its own kernel
    (the entry's from_batch), and neither kernel reads the grid's batch to choose its way."""
    k = compile_site_kernel("yolov8_decode", {"anchors_per_thread": 1, "lanes_per_anchor": lanes,
                                              "large_batch_lanes": large}, FACTS, sm=90, cache_dir=tmp_path)
    names = ("decode", "decode (batch 4+)")
    assert k.entries == tuple((name, f"deepjit_yolov8_decode_candidates<float, {p}>")
                              for name, p in zip(names, symbols))
    assert len({k.symbol(name) for name in names[:len(symbols)]}) == len(symbols)
    assert "%nctaid.y" not in k.ptx


def test_nms_chunk_must_fit_the_target_sms_shared_memory(tmp_path):
    """chunk * (chunk / 8 + 28) bytes of dynamic shared memory on top of ~35 KiB static: a T4
    (sm_75) allows 64 KiB per block, an H100/H200 (sm_90) 227 KiB."""
    nms = {"max_candidates": 8400}
    for sm, chunk in ((75, 256), (90, 1024)):
        k = compile_site_kernel("nms", {**nms, "chunk": chunk}, sm=sm, cache_dir=tmp_path)
        assert f"#define DJ_NMS_CHUNK {chunk}\n" in k.source.code
    # the check lives in the NMS body the nms kernel and the fused decode share
    with pytest.raises(KernelCompileError, match=r"deepjit_nms.cuh\(\d+\): error: static assertion failed with \"nms: chunk "
                                                 r"\* \(chunk / 8 \+ 28\) .* lower chunk\""):
        compile_site_kernel("nms", {**nms, "chunk": 512}, sm=75, cache_dir=tmp_path)


def test_nms_cluster_needs_sm90_and_the_slot_path(tmp_path):
    """cluster > 1 is a thread block cluster: sm_90 and newer, and only the slot path (chunk >= 512) splits
    its work; cluster 1 keeps the plain kernel, which needs neither."""
    nms = {"max_candidates": 8400}
    k = compile_site_kernel("nms", {**nms, "chunk": 512, "cluster": 4}, sm=90, cache_dir=tmp_path)
    assert k.entries == (("nms", "deepjit_nms_cluster<300, false, 4>"),)
    assert ".reqnctapercluster 4, 1, 1" in k.ptx and "st.async.shared::cluster" in k.ptx
    eight = compile_site_kernel("nms", {**nms, "block": 512, "chunk": 512, "cluster": 8}, sm=90, cache_dir=tmp_path)
    assert ".reqnctapercluster 8, 1, 1" in eight.ptx  # the most a portable cluster has
    with pytest.raises(KernelError, match=r"param .cluster. must be one of \[1, 2, 4, 8\], got 16"):
        compile_site_kernel("nms", {**nms, "chunk": 512, "cluster": 16}, sm=90, cache_dir=tmp_path)
    plain = compile_site_kernel("nms", {**nms, "chunk": 256}, sm=75, cache_dir=tmp_path)
    assert "deepjit_nms_cluster" not in plain.source.code and "cluster" not in plain.ptx
    with pytest.raises(KernelCompileError, match=r"static assertion failed with \"nms: cluster above 1 needs sm_90"):
        compile_site_kernel("nms", {**nms, "chunk": 256, "cluster": 2}, sm=75, cache_dir=tmp_path)
    with pytest.raises(KernelCompileError, match=r"static assertion failed with \"nms: cluster above 1 needs the slot "
                                                 r"path \(chunk >= 512\)\""):
        compile_site_kernel("nms", {**nms, "chunk": 256, "cluster": 2}, sm=90, cache_dir=tmp_path)


@pytest.mark.parametrize("pipeline", ["yolov8_t4", "yolov8_h200"])
def test_decode_output0_twin_of_each_example_pipeline_compiles(pipeline, tmp_path):
    """The kernels level recompiles the pipeline's decode as the twin its contract declares
    (roles.twin: mode output0): whatever the spec sets for the candidates kernel must leave a
    compilable twin."""
    from deepjit_compiler.jit.contracts import load_contract
    from deepjit_compiler.spec.load import load_spec

    cuts = load_spec(Path(__file__).parents[2] / "pipelines" / f"{pipeline}.yaml").spec.cuts
    (ref,) = [k for cut in cuts for k in cut.kernels if k.contract == "yolov8_decode"]
    twin = load_contract("yolov8_decode").model.roles.twin
    assert twin == {"mode": "output0", "lanes_per_anchor": 1, "large_batch_lanes": 0}
    k = compile_site_kernel("yolov8_decode", {**ref.params, **twin}, FACTS, sm=90, cache_dir=tmp_path)
    assert k.source.symbols == (("decode", "deepjit_yolov8_decode_output0<float, 1>"),)


@pytest.mark.parametrize("pipeline, sm", [("yolov8_t4", 75), ("yolov8_h200", 90)])
def test_each_example_pipelines_decode_reads_fp16_head_maps_from_an_fp16_site(pipeline, sm, tmp_path):
    """An fp16 build hands the decode fp16 head maps (facts input_dtype, precision/boundaries.py): the
    spec's decode and its twin, the dtype inferred, compile for the target with 16-bit loads only."""
    from deepjit_compiler.jit.contracts import load_contract
    from deepjit_compiler.spec.load import load_spec

    cuts = load_spec(Path(__file__).parents[2] / "pipelines" / f"{pipeline}.yaml").spec.cuts
    (ref,) = [k for cut in cuts for k in cut.kernels if k.contract == "yolov8_decode"]
    fp16 = {**FACTS, "input_dtype": "float16"}
    twin = load_contract("yolov8_decode").model.roles.twin
    for params in (ref.params, {**ref.params, **twin}):
        k = compile_site_kernel("yolov8_decode", params, fp16, sm=sm, cache_dir=tmp_path)
        assert k.params["dtype"] == "float16" and "6__half" in k.symbol("decode") and f".target sm_{sm}" in k.ptx
        loads = re.findall(r"ld\.global[.\w]*", k.ptx)
        assert loads and not [x for x in loads if x.endswith("f32")], loads  # the head maps are read as halves
        assert "cvt.f32.f16" in k.ptx
        k32 = compile_site_kernel("yolov8_decode", params, FACTS, sm=sm, cache_dir=tmp_path)
        assert [x for x in re.findall(r"ld\.global[.\w]*", k32.ptx) if x.endswith("f32")]  # and as floats from fp32


def test_compiled_kernel_record_round_trips(t4_kernels):
    from deepjit_compiler.jit.nvrtc import CompiledKernel

    for k in t4_kernels:
        record = k.to_dict()
        back = CompiledKernel.from_dict(record, cubin=k.cubin, ptx=k.ptx, source=k.source, contract_path=k.contract_path,
                                        log=k.log, from_cache=k.from_cache)
        assert back == k and back.to_dict() == record
    with pytest.raises(KernelError, match="kernel record of format 0; this DeepJIT reads 1"):
        CompiledKernel.from_dict({**record, "format": 0}, cubin=b"", ptx="")
    with pytest.raises(KernelError, match="'nms': its record is malformed.*arch"):
        CompiledKernel.from_dict({k_: v for k_, v in record.items() if k_ != "arch"}, cubin=b"", ptx="")


def test_options_from_the_spec(tmp_path):
    _, src = render_kernel("letterbox", {}, {})
    assert "-use_fast_math" not in CompileOptions().flags(75)
    fast = compile_source(src, 75, CompileOptions(fast_math=True, debug=True, extra=("-DDEEPJIT_TEST=1",)))
    assert {"-use_fast_math", "-lineinfo", "-DDEEPJIT_TEST=1", "--gpu-architecture=sm_75"} <= set(fast.options)
    assert ".loc" in fast.ptx  # -lineinfo puts source lines in the PTX


def test_unsupported_sm_lists_the_supported_ones():
    _, src = render_kernel("letterbox", {}, {})
    with pytest.raises(KernelError, match=r"cannot target sm_70; supported: sm_75, "):
        compile_source(src, 70)


def test_compile_error_is_reported_at_the_template_line(tmp_path):
    (tmp_path / "broken.cu.j2").write_text(textwrap.dedent("""\
        // a user's kernel
        {% for i in range(n) %}
        __device__ float f{{ i }}(float x) { return x * {{ i }}; }
        {% endfor %}
        extern "C" __global__ void broken(float* x) {
            x[0] = f0(x[0]) + undefined_thing;
        }
        """))
    (tmp_path / "broken.yaml").write_text(textwrap.dedent("""\
        name: broken
        template: broken.cu.j2
        params: {n: {type: int, default: 4}}
        entry_points: [{name: broken, symbol: broken, block: [1], grid: [1], args: []}]
        """))
    with pytest.raises(KernelCompileError) as info:
        compile_site_kernel(str(tmp_path / "broken.yaml"), {}, sm=75, cache_dir=tmp_path / "cache")
    msg = str(info.value)
    assert f"{tmp_path / 'broken.cu.j2'}:6: error" in msg                   # template line, not rendered line
    assert "(rendered broken.cu:7)" in msg                                  # 4 loop copies of 1 line for 3 template lines
    assert '>    7 |     x[0] = f0(x[0]) + undefined_thing;' in msg          # the rendered source around it
    assert "undefined_thing" in msg and "sm_75" in msg


def test_name_expressions_of_templates_are_kept(t4_kernels):
    decode, _ = t4_kernels
    assert decode.lowered[0][0] == "deepjit_yolov8_decode_candidates<float, 1>"
    with pytest.raises(KernelError, match="no entry point 'nope'"):
        decode.symbol("nope")


def test_cuda_headers_fall_back_to_pathfinder_without_bundled_headers(monkeypatch, tmp_path):
    """NVRTC 13.0 under newer cuda-bindings: nvrtcGetBundledHeadersInfo raises; cuda_fp16.h must
    then come from the CUDA headers cuda.pathfinder finds."""
    def broken():
        raise TypeError("__cinit__() takes exactly 1 positional argument (0 given)")

    monkeypatch.setattr(nvrtc.nvrtc, "nvrtcGetBundledHeadersInfo", broken, raising=False)
    nvrtc.cuda_headers.cache_clear()
    try:
        options, identity = nvrtc.cuda_headers()
        assert options[0].startswith("-I") and identity.startswith("include-")
        k = compile_site_kernel("letterbox", {"dtype": "float16"}, {}, sm=75, cache_dir=tmp_path)
        assert options[0] in k.options and k.cubin[:4] == b"\x7fELF"
    finally:
        nvrtc.cuda_headers.cache_clear()


def test_binaries_are_the_same_bytes_in_another_process(tmp_path):
    """Reproducible bundles: no per-compile unique names (anonymous namespaces, constexpr globals)."""
    import subprocess
    import sys

    code = ("import hashlib, sys; from deepjit_compiler.jit.nvrtc import compile_site_kernel as c; "
            "k = c('nms', {}, {}, sm=75, cache_dir=sys.argv[1]); "
            "print(hashlib.sha256(k.cubin).hexdigest(), hashlib.sha256(k.ptx.encode()).hexdigest())")
    runs = [subprocess.run([sys.executable, "-c", code, str(tmp_path / f"c{i}")], capture_output=True, text=True,
                           check=True).stdout for i in range(2)]
    assert runs[0] == runs[1] and len(runs[0].split()) == 2


def test_decode_mode_nms_compiles_with_the_shared_nms_body(tmp_path):
    """Mode nms includes the nms contract's body (deepjit_nms.cuh) and so has its shared-memory limit:
    on a T4 (sm_75) chunk 256 fits beside the decode, 512 does not."""
    fused = {"mode": "nms", "block": 512, "max_det": 100}
    for sm in (75, 90):
        k = compile_site_kernel("yolov8_decode", {**fused, "chunk": 256}, FACTS, sm=sm, cache_dir=tmp_path)
        assert k.entries == (("decode", "deepjit_yolov8_decode_nms<float, 1, 100, false>"),)
        assert "#include \"deepjit_nms.cuh\"" in k.source.code and "#define DJ_NMS_BLOCK 512" in k.source.code
        assert any(name == "deepjit_nms.cuh" for name, _ in k.source.headers)
    with pytest.raises(KernelCompileError, match=r"deepjit_nms.cuh\(\d+\): error: static assertion failed with \"nms: chunk"):
        compile_site_kernel("yolov8_decode", {**fused, "chunk": 512}, FACTS, sm=75, cache_dir=tmp_path)
    with pytest.raises(KernelCompileError, match=r"nms: block must be a multiple of 64, at least 128"):
        compile_site_kernel("yolov8_decode", {**fused, "block": 64}, FACTS, sm=90, cache_dir=tmp_path)


def test_the_twin_of_a_fused_decode_compiles(tmp_path):
    """The kernels level checks a mode-nms decode's twin (roles.twin: mode output0, one lane) against the
    cut: its NMS params and the NMS block must leave a compilable output0 kernel."""
    from deepjit_compiler.jit.contracts import load_contract

    twin = load_contract("yolov8_decode").model.roles.twin
    fused = {"mode": "nms", "block": 1024, "chunk": 512, "anchors_per_thread": 1, "lanes_per_anchor": 4}
    k = compile_site_kernel("yolov8_decode", {**fused, **twin}, FACTS, sm=90, cache_dir=tmp_path)
    assert k.entries == (("decode", "deepjit_yolov8_decode_output0<float, 1>"),)


def _including(folder: Path, include: str) -> str:
    """A user's contract whose kernel reads LEAK from what `include` names; its own header mine.cuh (whose
    last line has no newline)."""
    (folder / "secret.h").write_text('#define LEAK "TOP-SECRET"\n')
    (folder / "mine.cuh").write_text("#include <cuda_fp16.h>")
    (folder / "k.cu.j2").write_text(f'#include "mine.cuh"\n{include}\n__device__ const char leaked[] = LEAK;\n'
                                    'extern "C" __global__ void k(char* o) { o[0] = leaked[threadIdx.x]; }\n')
    (folder / "k.yaml").write_text("name: k\ntemplate: k.cu.j2\nheaders: [mine.cuh]\n"
                                   "entry_points: [{name: k, symbol: k, block: [1], grid: [1], args: []}]\n")
    return str(folder / "k.yaml")


@pytest.mark.parametrize("include, why", [
    ('#include "{secret}"', "not one of the contract's `headers:`"),             # an absolute path
    ('#include "../k/secret.h"', "not one of the contract's `headers:`"),        # out of the folder
    ('#include "secret.h"', "not one of the contract's `headers:`"),             # NVRTC looks in the working dir
    ("#include <{secret}>", "no absolute path, no '..'"),
    ("#include <../../../../../../../..{secret}>", "no absolute path, no '..'"),
    ('#define H "{secret}"\n#include H', "only a plain #include"),              # a computed include
    ('#/* a comment */include "{secret}"', "only a plain #include"),
    ('#inc\\\nlude "{secret}"', "not one of the contract's `headers:`"),          # a line splice
    ('%:include "{secret}"', "not one of the contract's `headers:`"),             # the digraph of '#'
    ('??=include "{secret}"', "not one of the contract's `headers:`"),            # the trigraph of '#'
    ('#inc??/\nlude "{secret}"', "not one of the contract's `headers:`"),          # a splice by trigraph
    ('#import "{secret}"', "only a plain #include"),
    ('#\\u0069nclude "{secret}"', "only a plain #include"),                     # a UCN for 'i'
    ("#include <>", "no absolute path, no '..'"),
    ("#include <..\\secret.h>", "no absolute path, no '..'"),
    ("#include <C:{secret}>", "no absolute path, no '..'"),
    ('#if __has_include("{secret}")\n#endif\n#define LEAK "x"', "only a plain #include"),
])
def test_kernel_code_includes_only_its_headers_and_cudas(tmp_path, monkeypatch, include, why):
    """NVRTC would read any other file into the PTX (not in the cache key): refused before it runs. Trigraphs
    too: NVRTC takes them under `--std=c++11` (a spec may pass it)."""
    folder = tmp_path / "k"
    folder.mkdir()
    monkeypatch.chdir(folder)
    path = _including(folder, include.format(secret=folder / "secret.h"))
    before = nvrtc.stats.compiles
    where = re.escape(str(folder / "k.cu.j2"))
    with pytest.raises(KernelError, match=rf"k\.yaml: kernel 'k' includes .* at {where}:[23]: .*{re.escape(why)}") as e:
        compile_site_kernel(path, {}, sm=75, cache_dir=tmp_path / "cache")
    assert nvrtc.stats.compiles == before and "TOP-SECRET" not in str(e.value)
    assert type(e.value) is KernelError and e.value.exit_code == 2


@pytest.mark.parametrize("include, line", [
    ('// a comment \\\n   continued\n#include "{secret}"', 4),   # a splice on an earlier line
    ('#define A 1 \\\n#include "{secret}"', 3),                 # spliced onto the line before
])
def test_a_refused_include_is_located_at_its_own_template_line(tmp_path, include, line):
    """Lines joined by a splice still count: the error names the line the directive is written on."""
    path = _including(tmp_path, include.format(secret=tmp_path / "secret.h"))
    with pytest.raises(KernelError, match=rf"includes .* at {re.escape(str(tmp_path / 'k.cu.j2'))}:{line}: "):
        compile_site_kernel(path, {}, sm=75, cache_dir=tmp_path / "cache")


def test_a_declared_header_may_include_only_declared_and_cuda_headers(tmp_path, monkeypatch):
    path = _including(tmp_path, "#define LEAK \"ok\"")
    assert compile_site_kernel(path, {}, sm=75, cache_dir=tmp_path / "cache").cubin  # <cuda_fp16.h> and mine.cuh
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.cuh").write_text('#include "secret.h"\n')
    with pytest.raises(KernelError, match=r"k\.yaml: kernel 'k' includes \"secret\.h\" at mine\.cuh:1: "):
        compile_site_kernel(path, {}, sm=75, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("option", ["-I/etc", " -I/etc", "--include-path=/etc", "--pre-include=/etc/passwd", "-include x.h",
                                    "--use-pch=x", "-MD", "--dependency-output={tmp}/x.d", "--time={tmp}/t.csv",
                                    "--fdevice-time-trace={tmp}/trace.json", "-time={tmp}/t.csv",
                                    "-fdevice-time-trace={tmp}/trace", "-create-pch={tmp}/k.pch",
                                    "-use-pch={tmp}/k.pch"])
def test_options_cannot_add_files_to_what_nvrtc_reads(option, tmp_path):
    """NVRTC takes each long option with one dash too (`-time=f` writes f as `--time=f` does)."""
    option = option.format(tmp=tmp_path)
    _, src = render_kernel("letterbox", {}, {})
    with pytest.raises(KernelError, match=rf"compile option '{re.escape(option)}' is not allowed"):
        compile_source(src, 75, CompileOptions(extra=(option,)))
    assert not list(tmp_path.iterdir())
