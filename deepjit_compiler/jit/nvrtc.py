"""NVRTC: rendered kernels -> cubin for the target SM and PTX for newer GPUs, through the cache.

Raw `cuda.bindings.nvrtc` works without a GPU or driver (cuda.core's PTX path asks the driver), so
a CPU-only build machine compiles for any SM NVRTC supports. One compile with `-arch=sm_XX` yields
both the cubin and the PTX: that PTX targets sm_XX, i.e. it is compute_XX PTX (byte-identical to a
`-arch=compute_XX` compile), which the driver JIT-compiles on newer GPUs.
`cuda_fp16.h` comes from the headers bundled in NVRTC (13.x: `--use-bundled-headers`), else from
the CUDA headers cuda.pathfinder finds. A kernel includes only its contract's headers (in memory, in
the cache key) and CUDA's by <name>: check_includes refuses anything else before NVRTC reads it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import cuda.pathfinder as pathfinder
import platformdirs

from .. import __version__, config
from .._optional import lazy_import
from ..errors import KernelCompileError, KernelError, MissingDependency
from ..files import atomic_write
from .cache import KernelCache, key_of
from .includes import check_includes, check_options
from .render import KernelSource, render_kernel

log = logging.getLogger("deepjit.nvrtc")
nvrtc = lazy_import("cuda.bindings.nvrtc", "compiling kernels needs NVRTC: install cuda-bindings and nvidia-cuda-nvrtc")

FORMAT_VERSION = 2  # of the cache entries: 2 stores CompiledKernel.to_dict()
KERNEL_FORMAT = 1   # of CompiledKernel.to_dict(), the record bundles and the cache keep
_LOG_LINE = re.compile(r"^(?P<file>[^\s()]+)\((?P<line>\d+)\): (?P<rest>.*)$")


@dataclass
class CompileStats:
    """How many times NVRTC actually ran (a cache hit costs none): the tests' 'compiles once' hook."""

    compiles: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def bump(self) -> None:
        with self._lock:
            self.compiles += 1


stats = CompileStats()


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """What the spec's `compile:` block controls. -use_fast_math stays off unless asked for."""

    fast_math: bool = False
    debug: bool = False
    extra: tuple[str, ...] = ()

    def flags(self, sm: int) -> tuple[str, ...]:
        flags = ["--std=c++17", f"--gpu-architecture=sm_{sm}"]
        flags += ["-use_fast_math"] if self.fast_math else []
        flags += ["-lineinfo"] if self.debug else []
        return tuple(flags + list(self.extra))


@dataclass(frozen=True, slots=True)
class CompiledKernel:
    """A compiled contract: binaries, the rendered source they came from, and what they need."""

    contract: str
    contract_path: str
    source: KernelSource
    sm: int
    cubin: bytes
    ptx: str
    entries: tuple[tuple[str, str], ...]    # (entry point, C++ name expression)
    lowered: tuple[tuple[str, str], ...]    # (C++ name expression, mangled name)
    options: tuple[str, ...]
    nvrtc_version: str
    min_driver: int                         # cuDriverGetVersion() needed by the cubin (e.g. 13000)
    ptx_min_driver: int                     # ... and by the PTX: a driver JITs PTX up to its own version
    ptx_isa: str
    key: str
    log: str = ""
    from_cache: bool = False
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return f"sm_{self.sm}"

    @property
    def ptx_arch(self) -> str:
        return f"compute_{self.sm}"

    def symbol(self, entry: str) -> str:
        """The mangled name of an entry point (or of a C++ name expression)."""
        names = dict(self.entries)
        expr = names.get(entry, entry)
        for e, mangled in self.lowered:
            if e == expr:
                return mangled
        raise KernelError(f"kernel {self.contract}: no entry point '{entry}'; entry points: "
                          f"{', '.join(names)}")

    def digest(self) -> str:
        return self.key

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able record a bundle manifest and a cache entry keep (no binaries, no timings)."""
        return {"format": KERNEL_FORMAT, "contract": self.contract, "key": self.key, "arch": self.arch,
                "ptx_arch": self.ptx_arch, "entries": dict(self.entries), "lowered": dict(self.lowered),
                "options": list(self.options), "nvrtc_version": self.nvrtc_version, "min_driver": self.min_driver,
                "ptx_min_driver": self.ptx_min_driver, "ptx_isa": self.ptx_isa,
                "params": {k: v for k, v in self.params.items()},
                "cubin_sha256": hashlib.sha256(self.cubin).hexdigest(),
                "ptx_sha256": hashlib.sha256(self.ptx.encode()).hexdigest()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, cubin: bytes, ptx: str, source: KernelSource | None = None,
                  code: str = "", filename: str = "", contract_path: str = "", log: str = "",
                  from_cache: bool = False) -> CompiledKernel:
        """The inverse of to_dict, with the binaries. `source`: what it was rendered from, when at hand;
        otherwise a KernelSource of the rendered `code` (a bundle's copy) is made. KernelError (a
        BundleError's cause) for a record of another format or with a field missing."""
        if d.get("format") != KERNEL_FORMAT:
            raise KernelError(f"kernel record of format {d.get('format')!r}; this DeepJIT reads {KERNEL_FORMAT} "
                              "(rebuild the bundle, or clear the kernel cache)")
        try:
            name, params = str(d["contract"]), dict(d["params"])
            entries = tuple((str(k), str(v)) for k, v in d["entries"].items())
            arch = str(d["arch"])
            if not (arch.startswith("sm_") and arch[3:].isdigit()):
                raise ValueError(f"arch {arch!r} is not sm_XX")
            src = source or KernelSource(name, filename, code, entries, (), (), (), params)
            return cls(name, contract_path or name, src, int(arch[3:]), cubin, ptx, entries,
                       tuple((str(k), str(v)) for k, v in d["lowered"].items()), tuple(d.get("options", ())),
                       str(d["nvrtc_version"]), int(d["min_driver"]), int(d["ptx_min_driver"]),
                       str(d.get("ptx_isa", "")), str(d.get("key", "")), log, from_cache, params)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise KernelError(f"kernel {d.get('contract', '?')!r}: its record is malformed ({e!r})") from None


def _check(result, what: str):
    """Unwrap a cuda.bindings (err, *values) tuple, raising on an NVRTC error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise KernelError(f"NVRTC {what} failed: {msg.decode() if isinstance(msg, bytes) else msg}")
    return values[0] if len(values) == 1 else values


@lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    return tuple(_check(nvrtc.nvrtcVersion(), "nvrtcVersion"))  # type: ignore[return-value]


@lru_cache(maxsize=1)
def supported_sms() -> tuple[int, ...]:
    return tuple(_check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def check_target(sm: int) -> None:
    """KernelError unless the installed NVRTC compiles for sm_XX, naming the ones it does."""
    if sm not in supported_sms():
        major, minor = nvrtc_version()
        raise KernelError(f"NVRTC {major}.{minor} cannot target sm_{sm}; supported: "
                          f"{', '.join(f'sm_{s}' for s in supported_sms())}")


@lru_cache(maxsize=1)
def cuda_headers() -> tuple[tuple[str, ...], str]:
    """(NVRTC options that make cuda_fp16.h includable, an identity of those headers for the key)."""
    major, minor = nvrtc_version()
    info = getattr(nvrtc, "nvrtcGetBundledHeadersInfo", None)
    if info is not None:
        try:  # new bindings over an older NVRTC library (13.0) raise instead of returning an error
            result = info()  # (err, info, None)
            available = result[1].available if result[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS else 0
        except Exception as e:
            log.debug("NVRTC %d.%d has no bundled headers (%s): using cuda.pathfinder", major, minor, e)
            available = 0
        if available:
            where = Path(platformdirs.user_cache_dir("deepjit")) / f"nvrtc-headers-{major}.{minor}"
            return (f"--use-bundled-headers={where}",), f"bundled-{major}.{minor}"
    try:
        folder = pathfinder.find_nvidia_header_directory("cudart")
    except Exception as e:  # pathfinder raises several types for "not found"
        raise MissingDependency(f"NVRTC {major}.{minor} has no bundled headers and cuda_fp16.h was not found: "
                                f"install nvidia-cuda-runtime (pip) or the CUDA toolkit ({e})") from None
    if folder is None or not (Path(folder) / "cuda_fp16.h").is_file():
        raise MissingDependency(f"cuda_fp16.h not found (cuda.pathfinder gave {folder}): install nvidia-cuda-runtime")
    h = hashlib.sha256()
    for name in ("cuda_fp16.h", "cuda_fp16.hpp"):
        if (Path(folder) / name).is_file():
            h.update((Path(folder) / name).read_bytes())
    return (f"-I{folder}",), f"include-{h.hexdigest()[:16]}"


def _mapped_log(source: KernelSource, text: str) -> str:
    """The NVRTC log with rendered-source locations mapped back to the template, plus excerpts."""
    out = []
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if m and m.group("file") == source.filename:
            n = int(m.group("line"))
            origin = source.origin(n)
            where = f"{origin[0]}:{origin[1]}" if origin else f"{source.filename}:{n}"
            out.append(f"{where}: {m.group('rest')}  (rendered {source.filename}:{n})")
            if "error" in m.group("rest"):
                out.append(source.excerpt(n))
        else:
            out.append(line)
    return "\n".join(out)


def _check_reads(source: KernelSource, options: CompileOptions, contract_path: str) -> None:
    """What NVRTC would read besides the source: only declared headers, CUDA's own, no file options."""
    check_includes(source, contract_path)
    check_options(options.extra, source, contract_path)


def compile_source(source: KernelSource, sm: int, options: CompileOptions = CompileOptions(), *,
                   contract_path: str = "") -> CompiledKernel:
    """Run NVRTC (no cache): cubin for sm_XX and its compute_XX PTX, mangled names kept."""
    _check_reads(source, options, contract_path)
    return _nvrtc(source, sm, options, contract_path)


def _nvrtc(source: KernelSource, sm: int, options: CompileOptions, contract_path: str) -> CompiledKernel:
    """compile_source's NVRTC run, on a source and options already checked (_check_reads)."""
    check_target(sm)
    include, _ = cuda_headers()
    flags = options.flags(sm) + include
    prog = _check(nvrtc.nvrtcCreateProgram(source.code.encode(), source.filename.encode(), len(source.headers),
                                           [t.encode() for _, t in source.headers],
                                           [n.encode() for n, _ in source.headers]), "nvrtcCreateProgram")
    try:
        for _, expr in source.symbols:
            _check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        stats.bump()
        result = nvrtc.nvrtcCompileProgram(prog, len(flags), [f.encode() for f in flags])
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = bytearray(size)  # never `b" " * size`: for size 1 that is CPython's shared b" ", overwritten
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        text = bytes(buf).rstrip(b"\0").decode(errors="replace").strip()
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            major, minor = nvrtc_version()
            raise KernelCompileError(f"NVRTC {major}.{minor} could not compile kernel '{source.contract}' "
                                     f"({contract_path or source.filename}) for sm_{sm} with "
                                     f"{' '.join(flags)}:\n{_mapped_log(source, text)}")
        cubin = _read(prog, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
        ptx = _read(prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX).rstrip(b"\0").decode()
        lowered = tuple((expr, _check(nvrtc.nvrtcGetLoweredName(prog, expr.encode()), "nvrtcGetLoweredName").decode())
                        for _, expr in source.symbols)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    if text:
        log.warning("NVRTC warnings for %s:\n%s", source.contract, _mapped_log(source, text))
    major, minor = nvrtc_version()
    isa = re.search(r"^\.version\s+(\S+)", ptx, re.M)
    return CompiledKernel(source.contract, contract_path, source, sm, cubin, ptx, source.symbols, lowered, flags,
                          f"{major}.{minor}", major * 1000, major * 1000 + minor * 10, isa.group(1) if isa else "",
                          key="", log=text, params=source.params)


def _read(prog, size_fn, get_fn) -> bytes:
    size = _check(size_fn(prog), size_fn.__name__)
    buf = bytearray(size)
    _check(get_fn(prog, buf), get_fn.__name__)
    return bytes(buf)


def cache_key(source: KernelSource, sm: int, options: CompileOptions) -> str:
    """sha256 over everything that changes the binaries (CuPy/Triton style)."""
    major, minor = nvrtc_version()
    return key_of({"format": FORMAT_VERSION, "deepjit": __version__, "nvrtc": f"{major}.{minor}",
                   "arch": f"sm_{sm}", "code": "cubin+ptx", "options": sorted(options.flags(sm)),
                   "source": source.code, "names": [s for _, s in source.symbols],
                   "headers": source.header_digest(), "cuda_headers": cuda_headers()[1]})


def compile_cached(source: KernelSource, sm: int, options: CompileOptions = CompileOptions(), *,
                   cache: KernelCache | None = None, contract_path: str = "") -> CompiledKernel:
    """compile_source through the on-disk cache: a hit runs no NVRTC."""
    _check_reads(source, options, contract_path)  # before the lookup: a hit must not serve what a compile refuses
    cache = cache or KernelCache()
    key = cache_key(source, sm, options)
    entry = cache.get(key)
    if entry is not None:
        meta, blobs = entry
        log.debug("cache hit for %s (%s)", source.contract, key[:12])
        # The params are not in the key (two param sets may render the same code): this request's.
        kernel = CompiledKernel.from_dict({**meta, "params": dict(source.params)}, cubin=blobs["cubin"],
                                          ptx=blobs["ptx"].decode(), source=source, contract_path=contract_path,
                                          log=meta.get("log", ""), from_cache=True)
    else:
        bound = config.kernel_cache_max_bytes()  # a bad setting fails before NVRTC runs
        built = dataclasses.replace(_nvrtc(source, sm, options, contract_path), key=key)
        cache.put(key, {"cubin": built.cubin, "ptx": built.ptx.encode()},
                  {**built.to_dict(), "log": built.log, "deepjit": __version__})
        cache.prune(bound, keep=key)  # only after a compile: a hit adds nothing
        kernel = built
    _dump(kernel)
    return kernel


def _dump(kernel: CompiledKernel) -> None:
    """DEEPJIT_DUMP_DIR: also write the rendered source and PTX there, for debugging."""
    folder = config.dump_dir()
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{kernel.contract}-{kernel.arch}-{kernel.key[:12]}"
    atomic_write(folder / f"{stem}.cu", kernel.source.code.encode())
    atomic_write(folder / f"{stem}.ptx", kernel.ptx.encode())


def compile_site_kernel(contract_ref: str, params: Mapping[str, Any], facts: Mapping[str, Any] | None = None, *,
                        sm: int, options: Sequence[str] = (), fast_math: bool = False, debug: bool = False,
                        cache_dir: str | Path | None = None, spec_dir: str | Path | None = None) -> CompiledKernel:
    """Resolve a contract (name in kernels/ or a path relative to spec_dir), render it with the
    spec's params and the kernel site's facts, and compile it for sm (cubin + PTX) through the cache."""
    contract, source = render_kernel(contract_ref, params, facts, spec_dir=Path(spec_dir) if spec_dir else None)
    opts = CompileOptions(fast_math=fast_math, debug=debug, extra=tuple(options))
    cache = KernelCache(Path(cache_dir) if cache_dir else None)
    return compile_cached(source, sm, opts, cache=cache, contract_path=str(contract.path))


def compile_site_kernels(kernels: Sequence[tuple[str, Mapping[str, Any]]], facts: Mapping[str, Any] | None = None,
                         **kw) -> list[CompiledKernel]:
    """compile_site_kernel for each (contract, params) of a cut's `kernels:` list, in order."""
    return [compile_site_kernel(ref, params, facts, **kw) for ref, params in kernels]
