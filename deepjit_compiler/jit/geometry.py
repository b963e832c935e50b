"""A launch's geometry against CUDA's limits: grid, block and dynamic shared memory, for an SM.

A contract's `grid`, `block` and `shared_mem` are expressions of params and dims, so a user's contract
can ask for what no GPU launches (a block of 2048 threads, a grid y past 65535 at the largest batch,
no blocks at all) or for more shared memory than the target's SM gives a block. The driver would say
so only on the GPU, as cudaErrorInvalidConfiguration or CUDA_ERROR_INVALID_VALUE; `check_launch` says
it first, naming the entry point, the field, its value, the batch and what the SM allows. The build
checks every launch at every batch for the spec's target (build.check_launch_limits), the runtime
each launch for its GPU (runtime/launch.py). Static shared memory is known only once the code is
loaded on a GPU, which is where the runtime checks it too (runtime/gpu.Gpu.allow_shared).
"""
from __future__ import annotations

from ..errors import KernelError
from ..spec.targets import compute_capability
from .contracts import Launch

KIB = 1024

# CUDA Programming Guide (CUDA 13), 5.1.3 "Features and Technical Specifications"
# (docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html).
# Table 30: the same for every compute capability NVRTC 13 compiles for (7.5 and newer).
MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK = (1024, 1024, 64)                # x, y, z
MAX_GRID = (2**31 - 1, 65535, 65535)        # x, y, z
# Table 31, "Maximum amount of shared memory per thread block": what one block may opt in to
# (cudaFuncAttributeMaxDynamicSharedMemorySize), keyed as the table heads its columns. Table 32 puts
# 11.0 with 9.0 and 10.x (228 KB an SM, 1 KB of it kept by the system). templates/deepjit_common.cuh's
# kMaxSharedOptin is the same table for templates' static_asserts (tests/jit/test_geometry.py compiles both).
MAX_SHARED_PER_BLOCK: dict[str, int] = {
    "7.5": 64 * KIB, "8.0": 163 * KIB, "8.6": 99 * KIB, "8.7": 163 * KIB, "8.9": 99 * KIB,
    "9.0": 227 * KIB, "10.x": 227 * KIB, "11.0": 227 * KIB, "12.x": 99 * KIB,
}

BLOCK_ALLOWED = (f"x and y from 1 to {MAX_BLOCK[0]}, z from 1 to {MAX_BLOCK[2]}, "
                 f"at most {MAX_THREADS_PER_BLOCK} threads in all")
GRID_ALLOWED = f"x from 1 to {MAX_GRID[0]}, y and z from 1 to {MAX_GRID[1]}"


def max_shared_per_block(sm: int) -> int | None:
    """The most shared memory one block may have on `sm` (static and dynamic together), or None for an
    SM the table does not know (its GPU still checks at load)."""
    cc = compute_capability(sm)
    return MAX_SHARED_PER_BLOCK.get(cc, MAX_SHARED_PER_BLOCK.get(f"{sm // 10}.x"))


def check_launch(launch: Launch, sm: int, where: str, *, batch: int | None, target: str | None = None) -> None:
    """KernelError when `launch` is past CUDA's limits on `sm`, naming `where` (who launches it), its
    entry point, the batch, the field and its value, and what `target` (default sm_XX) allows."""
    problem = _block(launch.block) or _grid(launch.grid) or _shared(launch.shared_mem, sm)
    if problem is not None:
        what, allowed = problem
        at = f" at batch {batch}" if batch is not None else ""
        raise KernelError(f"{where}: entry point '{launch.entry}'{at}: {what}; {target or f'sm_{sm}'} allows {allowed}")


def _block(block: tuple[int, int, int]) -> tuple[str, str] | None:
    """(what is wrong, what is allowed) for a block past the limits, else None."""
    dims = list(block)
    threads = dims[0] * dims[1] * dims[2]
    wrong = _axis_outside(dims, MAX_BLOCK) or (f"{threads} threads" if threads > MAX_THREADS_PER_BLOCK else "")
    return (f"block is {dims} ({wrong})", BLOCK_ALLOWED) if wrong else None


def _grid(grid: tuple[int, int, int]) -> tuple[str, str] | None:
    wrong = _axis_outside(list(grid), MAX_GRID)
    return (f"grid is {list(grid)} ({wrong})", GRID_ALLOWED) if wrong else None


def _shared(nbytes: int, sm: int) -> tuple[str, str] | None:
    limit = max_shared_per_block(sm)
    if nbytes >= 0 and (limit is None or nbytes <= limit):
        return None
    # an SM the table does not know still refuses a negative size; its GPU checks the rest at load
    room = f"0 to {limit} bytes" if limit is not None else "0 bytes or more"
    return (f"shared_mem is {nbytes} bytes",
            f"{room} of dynamic shared memory a block (its static shared memory counts against that too)")


def _axis_outside(dims: list[int], most: tuple[int, int, int]) -> str:
    """'y is 80000' for the first axis outside 1..most, else ''."""
    for axis, value, top in zip("xyz", dims, most):
        if not 1 <= value <= top:
            return f"{axis} is {value}"
    return ""
