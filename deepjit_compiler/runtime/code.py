"""Which code of a bundle's kernel loads on this GPU (its cubin, or its PTX for the driver to JIT),
and the CompiledKernel rebuilt from a manifest entry and its files. No GPU needed: the runtime asks
before loading anything, so an incompatible bundle fails with one clear error.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..bundle.view import sm_of
from ..errors import BundleError, KernelError, closest
from ..jit.nvrtc import CompiledKernel
from ..jit.render import KernelSource
from .layout import KernelInfo


def _cuda(version: int) -> str:
    return f"CUDA {version // 1000}.{version % 1000 // 10}"


def choose_code(kernel: KernelInfo, device_sm: int, driver: int, prefer: str = "auto", *,
                device_name: str = "this GPU", bundle_name: str = "bundle") -> str:
    """'cubin' when the bundle was built for this GPU's SM, else 'ptx' (the driver JIT-compiles it
    for a newer GPU). BundleError naming the kernel, the bundle's target, this GPU and this driver
    when neither can load here."""
    if prefer not in ("auto", "cubin", "ptx"):
        choices = ("auto", "cubin", "ptx")
        raise KernelError(f"prefer must be auto, cubin or ptx, got {prefer!r}{closest(prefer, choices)}")
    e, sm = kernel.entry, kernel.sm
    nvrtc = e.get("nvrtc_version", "?")
    here = f"{device_name} (sm_{device_sm}, driver for {_cuda(driver)})"
    if sm > device_sm:
        raise BundleError(f"{bundle_name}: kernel {kernel.name} was built for sm_{sm}; {here} is older: neither its "
                          f"cubin nor its compute_{sm} PTX can run here: rebuild with target.gpu set to this GPU")
    code = prefer if prefer != "auto" else ("cubin" if sm == device_sm else "ptx")
    if code == "cubin" and sm != device_sm:
        raise BundleError(f"{bundle_name}: kernel {kernel.name} has a cubin for sm_{sm}, which cannot load on "
                          f"{here}: load its PTX instead (--prefer ptx, or auto)")
    need = int(e.get("min_driver" if code == "cubin" else "ptx_min_driver", 0))
    if driver < need:
        what = "cubin" if code == "cubin" else f"PTX (ISA {e.get('ptx_isa', '?')})"
        raise BundleError(f"{bundle_name}: kernel {kernel.name}: its {what}, made by NVRTC {nvrtc}, needs a driver "
                          f"for {_cuda(need)} or newer; {here} is older: update the driver, or rebuild the bundle "
                          f"with an NVRTC no newer than {_cuda(driver)} (pin nvidia-cuda-nvrtc on the build machine)")
    return code


def compiled_kernel(entry: Mapping[str, Any], cubin: bytes, ptx: str, source: str = "", contract_path: str = ""):
    """A CompiledKernel (what Gpu.load and ContractKernel take) from a bundle manifest's kernel entry
    and its files. Its contract is the bundle's copy (`contract_path`), else found by name."""
    try:
        name, params = str(entry["contract"]), dict(entry["params"])
        entries = tuple((str(k), str(v)) for k, v in entry["entries"].items())
        lowered = tuple((str(k), str(v)) for k, v in entry["lowered"].items())
        src = KernelSource(name, entry["files"]["source"].rsplit("/", 1)[-1], source, entries, (), (), (), params)
        return CompiledKernel(name, contract_path or name, src, sm_of(entry.get("arch", ""), name), cubin, ptx, entries, lowered,
                              tuple(entry.get("options", ())), str(entry["nvrtc_version"]), int(entry["min_driver"]),
                              int(entry["ptx_min_driver"]), str(entry.get("ptx_isa", "")), str(entry.get("key", "")),
                              params=params)
    except (KeyError, TypeError, AttributeError) as err:
        raise BundleError(f"manifest: kernel entry {entry.get('contract', '?')!r} is malformed ({err!r})") from None
