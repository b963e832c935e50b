"""Requests to pipeline calls and back: what a serving instance does with the requests it is handed.

Triton's dynamic batcher hands an instance several requests at once, each a batch of its own (a client
may send several images in one request). `RequestRunner.run` checks each request against the
pipeline's profile (a refusal is that request's alone), runs consecutive requests whose inputs have the
same shapes and dtypes as one call of at most the max batch (the pipeline pads it to its bucket), and
splits the outputs back by request. When the pipeline takes raw images (a letterbox stage: its
contract's roles.image_input) and makes its ratio_pad, the boxes come back in each image's own pixels,
mapped as `deepjit run` maps them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DeepJITError
from ..jit.contract_models import Detections
from ..runtime.layout import Layout
from ..runtime.run import image_stage, map_boxes

Feeds = Mapping[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class BoxMapping:
    """Boxes of `detections` map back to the images of input `images` through output `ratio_pad`."""

    images: str
    ratio_pad: str
    detections: Detections


def box_mapping(layout: Layout) -> BoxMapping | None:
    """How boxes map back to the images sent, when the pipeline takes raw images and says how it fit them."""
    stage = image_stage(layout)
    det = next(iter(layout.detections), None)
    outputs = {o.name for o in layout.outputs}
    if stage is None or det is None or stage.ratio_pad not in outputs or not set(det.names) <= outputs \
            or stage.tensor not in {i.name for i in layout.inputs}:
        return None
    return BoxMapping(stage.tensor, stage.ratio_pad, det)


class RequestRunner:
    """Runs requests (feeds of any batch each) through a loaded Pipeline or CpuPipeline."""

    def __init__(self, pipe: Any):
        self.pipe, self.layout = pipe, pipe.layout
        self.mapping = box_mapping(self.layout)

    def run(self, requests: Sequence[Feeds]) -> list[dict[str, np.ndarray] | DeepJITError]:
        """Per request, its outputs (rows of its batch) or the DeepJITError that refused it."""
        results: list[dict[str, np.ndarray] | DeepJITError | None] = [None] * len(requests)
        accepted: list[tuple[int, int]] = []   # (request, its batch)
        for i, feeds in enumerate(requests):
            try:
                accepted.append((i, self.layout.check_feeds(feeds)))
            except DeepJITError as e:
                results[i] = e
        for group in self._groups(requests, accepted):
            batch = {k: np.concatenate([requests[i][k] for i, _ in group]) for k in requests[group[0][0]]}
            try:
                outputs = self._call(batch)
            except DeepJITError as e:
                for i, _ in group:
                    results[i] = e
                continue
            start = 0
            for i, n in group:
                results[i] = {k: v[start:start + n] for k, v in outputs.items()}
                start += n
        return results  # type: ignore[return-value]

    def _groups(self, requests: Sequence[Feeds], accepted: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """Consecutive requests of the same input shapes and dtypes, at most the max batch to a call."""
        def sig(i: int):
            return tuple((k, v.shape[1:], v.dtype.str) for k, v in sorted(requests[i].items()))

        groups: list[list[tuple[int, int]]] = []
        for i, n in accepted:
            last = groups[-1] if groups else None
            if last and sig(last[0][0]) == sig(i) and sum(m for _, m in last) + n <= self.layout.max_batch:
                last.append((i, n))
            else:
                groups.append([(i, n)])
        return groups

    def _call(self, batch: Feeds) -> dict[str, np.ndarray]:
        outputs = self.pipe(batch)
        m = self.mapping
        if m is None:
            return outputs
        det, size = m.detections, tuple(batch[m.images].shape[1:3])
        boxes = outputs[det.boxes].copy()
        for row in range(len(boxes)):
            n = int(np.asarray(outputs[det.count][row]).reshape(-1)[0])
            boxes[row, :n] = map_boxes(boxes[row, :n], outputs[m.ratio_pad][row], size).astype(boxes.dtype)
        return {**outputs, det.boxes: boxes}
