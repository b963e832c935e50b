"""A bundle on the CPU: `CpuPipeline.load(bundle)`, for `deepjit run/bench --device cpu`.

Every step runs on ONNX Runtime's CPU provider: each engine segment's ONNX, and in place of each
kernel its contract's ONNX reference (what the kernels level checks the kernel against), so a bundle
can be tried on any machine and compared with a GPU run. The segments keep their precision (an fp16
segment runs its fp16 graph); no CUDA graphs, no kernels, no copies. Same calling convention and
facts as `Pipeline`, so `run` and `bench` treat both alike."""
from __future__ import annotations

import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ..bundle.folder import read_bundle
from ..bundle.view import BundleView
from ..graph.steps import StepRunner
from .layout import Layout, LayoutFacts


class CpuPipeline(LayoutFacts):
    """A bundle's steps on ONNX Runtime's CPU provider, in plan order."""

    graphs = False

    def __init__(self, bundle: BundleView, layout: Layout):
        self.bundle, self.layout = bundle, layout
        self._steps = StepRunner((s.name, bundle.onnx(s.file)) for s in bundle.steps)
        self.code = {k.name: "onnx reference" for k in layout.kernels}

    @classmethod
    def load(cls, bundle: Path | str | BundleView, **_: Any) -> CpuPipeline:
        """Load a bundle (folder, .tar.gz or read BundleView); GPU options (prefer, graphs) do not apply."""
        bundle = read_bundle(bundle)
        layout = Layout.from_bundle(bundle)
        layout.schedule(False)  # the plan's wiring, checked as the GPU pipeline checks it (not a KeyError mid-run)
        return cls(bundle, layout)

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on `feeds` (checked against the profile like the GPU pipeline's): outputs in plan order."""
        self.layout.check_feeds(feeds)
        env = self._steps.tensors({k: np.ascontiguousarray(v) for k, v in feeds.items()})
        return {o.name: env[o.name] for o in self.layout.outputs}

    def last_timing(self) -> dict[str, float]:
        return {}  # nothing runs on a GPU

    def last_copies(self) -> dict[str, int]:
        return {"h2d": 0, "d2h": 0}

    def describe(self) -> dict[str, Any]:
        return {"bundle": self.layout.name, "digest": self.layout.digest, "device": f"CPU ({platform.machine()})",
                "sm": None, "kernels": dict(self.code), "graphs": False, "capture": "off",
                "engine": f"cpu (ONNX Runtime {ort.__version__})"}

    def launches_per_inference(self, batch: int) -> int:
        return 0

    def graph_launches_per_inference(self, batch: int | None = None) -> int:
        return 0

    def close(self) -> None:
        self._steps = None

    def __enter__(self) -> CpuPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
