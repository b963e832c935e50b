"""A device phase prepared for one set of shapes: its kernel launches with packed args (and any
engine enqueue), run plainly or captured once as a CUDA graph and replayed; views of the max-size
buffers at a bucket's shapes."""
from __future__ import annotations

from ..errors import KernelError
from .gpu import DeviceArray, Gpu
from .hostmem import capacity
from .launch import Prepared


def view(arr: DeviceArray, shape) -> DeviceArray:
    """The same allocation seen with a smaller shape (batch b as a prefix)."""
    out = DeviceArray(arr.buffer, shape, arr.dtype)
    if out.nbytes > capacity(arr):
        raise KernelError(f"{tuple(shape)} {arr.dtype} does not fit its buffer {arr} (sized for the profile max)")
    return out


class PreparedPhase:
    """One device phase at one set of shapes: its kernels' prepared launches (and engine enqueues,
    callables), the shapes of its tensors there, and its graph once captured."""

    def __init__(self, gpu: Gpu, items: list, shapes: dict[str, tuple[int, ...]], kernel_launches: int):
        self.gpu, self.items, self.shapes, self.kernel_launches = gpu, items, shapes, kernel_launches
        self.graph = None

    def launch(self) -> None:
        for item in self.items:
            if isinstance(item, Prepared):
                self.gpu.launch_with(item.config, item.function, *item.args)
            else:
                item()

    def capture(self) -> None:
        self.graph = self.gpu.capture(self.launch)

    def run(self, graphs: bool) -> None:
        self.graph.replay() if graphs and self.graph is not None else self.launch()

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None
