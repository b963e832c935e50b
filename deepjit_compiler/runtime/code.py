"""Which code of a bundle's kernel loads on this GPU: its cubin, or its PTX for the driver to JIT.
No GPU needed: the runtime asks before loading anything, so an incompatible bundle fails with one
clear error.
"""
from __future__ import annotations

from ..errors import BundleError, KernelError, closest
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
