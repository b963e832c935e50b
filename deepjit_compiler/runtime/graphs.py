"""A device phase prepared for one set of shapes: its kernel launches with packed args and its engine
enqueues, run plainly or captured as CUDA graphs and replayed; views of the max-size buffers at a
bucket's shapes.

Capture tries the whole phase first, engine included: one graph per phase (TensorRT's enqueue is
capturable). An engine that cannot be captured from outside (its call fails under capture) gets
`split`: the kernels around it are captured as graphs of their own and the engine runs between them
on the same stream, through its own CUDA graph where it has one (ONNX Runtime's enable_cuda_graph)."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import KernelError
from .gpu import DeviceArray, Gpu
from .hostmem import capacity
from .launch import Prepared

log = logging.getLogger("deepjit.runtime")

CAPTURE = ("auto", "whole", "split", "split_plain")


def view(arr: DeviceArray, shape) -> DeviceArray:
    """The same allocation seen with a smaller shape (batch b as a prefix)."""
    out = DeviceArray(arr.buffer, shape, arr.dtype)
    if out.nbytes > capacity(arr):
        raise KernelError(f"{tuple(shape)} {arr.dtype} does not fit its buffer {arr} (sized for the profile max)")
    return out


@dataclass(frozen=True)
class EngineCall:
    """One engine run over fixed device buffers on the runtime's stream: an item of a phase."""

    runner: Any
    stream: int
    bindings: Mapping[str, int]
    shapes: Mapping[str, tuple[int, ...]]

    def __call__(self) -> None:
        self.runner.enqueue(self.stream, self.bindings, self.shapes)

    def alone(self) -> None:
        """The run outside the runtime's graphs: through the engine's own CUDA graph where it has one."""
        if getattr(self.runner, "own_graphs", False):
            self.runner.enqueue(self.stream, self.bindings, self.shapes, own_graph=True)
        else:
            self()


class PreparedPhase:
    """One device phase at one set of shapes: its kernels' prepared launches and engine calls, the
    shapes of its tensors there, and once captured its graph(s) and how they were captured (`mode`:
    'whole', 'split', 'split_plain', or 'off' before capture)."""

    def __init__(self, gpu: Gpu, items: list, shapes: dict[str, tuple[int, ...]], kernel_launches: int):
        self.gpu, self.items, self.shapes, self.kernel_launches = gpu, items, shapes, kernel_launches
        self.graph = None
        self.parts: list = []  # split: graphs of kernels and engine calls, in order
        self.mode = "off"
        self._own = True  # split: engines through their own CUDA graphs

    def launch(self, items: list | None = None) -> None:
        for item in self.items if items is None else items:
            if isinstance(item, Prepared):
                self.gpu.launch_with(item.config, item.function, *item.args)
            else:
                item()

    def capture(self, how: str = "auto") -> None:
        """Capture the phase: `auto` tries it whole and falls back to split when an engine refuses;
        `whole` or `split` force one (split_plain: split, the engines run without their own graphs)."""
        if how not in CAPTURE:
            raise KernelError(f"capture must be one of {', '.join(CAPTURE)}, got '{how}'")
        engines = any(isinstance(i, EngineCall) for i in self.items)
        if how in ("auto", "whole") or not engines:
            try:
                self.graph = self.gpu.capture(self.launch)
                self.mode = "whole"
                return
            except Exception as e:  # ONNX Runtime raises its own classes; CUDA reports an invalidated capture
                if how == "whole" or not engines:
                    raise
                log.info("the engine cannot be captured in the kernels' graph (%s): capturing around it",
                         str(e).splitlines()[0][:200])
        self.gpu.sync()
        self._own = how != "split_plain"
        run: list = []
        for item in [*self.items, None]:
            if isinstance(item, Prepared):
                run.append(item)
                continue
            if run:
                self.parts.append(self.gpu.capture(lambda r=tuple(run): self.launch(list(r))))
                run = []
            if item is not None:
                # ONNX Runtime captures its own graph on the run after its first (which sizes its memory):
                # two runs now, so that no call after load captures or allocates
                self._engine(item)
                self._engine(item)
                self.parts.append(item)
        self.mode = "split" if self._own else "split_plain"  # _engine may have given up the engine's own graph

    def _engine(self, call: EngineCall) -> None:
        if not self._own:
            return call()
        try:
            call.alone()
        except Exception as e:  # its own capture failed too (cuDNN's fp32 convolutions refuse capture)
            self.gpu.abandon_capture()
            log.info("the engine cannot run as its own CUDA graph either (%s): running it plainly",
                     str(e).splitlines()[0][:200])
            self._own, self.mode = False, "split_plain"
            call()

    @property
    def graph_launches(self) -> int:
        if self.mode == "off":
            return 0
        return 1 if self.mode == "whole" else sum(not isinstance(p, EngineCall) for p in self.parts)

    def run(self, graphs: bool) -> None:
        if not graphs or self.mode == "off":
            self.launch()
        elif self.mode == "whole":
            self.graph.replay()
        else:
            for part in self.parts:
                self._engine(part) if isinstance(part, EngineCall) else part.replay()

    def close(self) -> None:
        for g in [self.graph, *(p for p in self.parts if not isinstance(p, EngineCall))]:
            if g is not None:
                g.close()
        self.graph, self.parts = None, []
