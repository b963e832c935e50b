"""GPU names and their SM (compute capability) numbers."""
from __future__ import annotations

from ..errors import closest

# Compute capability by product name (NVIDIA's CUDA GPUs table); NVRTC 13 targets sm_75 and newer.
GPU_SM: dict[str, int] = {
    "T4": 75, "RTX2080": 75, "RTX2080TI": 75, "QUADRORTX8000": 75,
    "A100": 80, "A30": 80,
    "A10": 86, "A10G": 86, "A40": 86, "A16": 86, "A2": 86, "RTX3090": 86, "RTX3080": 86, "RTXA6000": 86,
    "ORIN": 87, "JETSONORIN": 87,
    "L4": 89, "L40": 89, "L40S": 89, "RTX4090": 89, "RTX4080": 89, "RTX6000ADA": 89,
    "H100": 90, "H200": 90, "GH200": 90, "H20": 90, "H800": 90,
    "B200": 100, "GB200": 100, "B100": 100,
    "RTX5090": 120, "RTXPRO6000": 120,
}


# The compute capabilities TensorRT-RTX 1.7 (the `tensorrt-rtx` extra pins 1.7.x) builds plans for: the members
# SM75 .. SM121 of its ComputeCapability enum. It has no 9.0 (H100/H200) and no 10.x (B200); 7.5 is built only
# when asked for by name (its default set starts at 8.0). engines/flavours.py reads the installed library's enum
# at build time; this table is what a spec is checked against, where the library may not be installed.
TENSORRT_RTX_SM: tuple[int, ...] = (75, 80, 86, 89, 120, 121)


def compute_capability(sm: int) -> str:
    """'7.5' for 75, '12.0' for 120: how NVIDIA and TensorRT-RTX name a compute capability."""
    return f"{sm // 10}.{sm % 10}"

# Precisions a GPU runs only from some SM on: bf16 tensor cores (and TensorRT's bf16) start with Ampere.
PRECISION_MIN_SM: dict[str, int] = {"bf16": 80}


def _key(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


def sm_for_gpu(name: str) -> int:
    """The SM of a GPU by name ('T4' -> 75, 'H200' -> 90); ValueError naming the known ones."""
    try:
        return GPU_SM[_key(name)]
    except KeyError:
        raise ValueError(f"unknown GPU '{name}'{closest(_key(name), GPU_SM)}; known: "
                         f"{', '.join(sorted(GPU_SM))} (or give `sm` directly)") from None
