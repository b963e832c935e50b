"""What `deepjit run` and `deepjit bench` do with a bundle: load inputs, run, write detections; time.

Inputs for `run`: image files (.jpg, .png, ...; decoded with Pillow, which is optional), .npy
tensors and .npz files (one array per pipeline input), or folders of those. An image goes through
the pipeline's GPU letterbox when it has one (raw uint8 [B, H, W, 3] in), else it is letterboxed on
the host with the same semantics (`references.letterbox_numpy`); either way the boxes are mapped
back to the original image with ratio_pad (r, left, top): x = (x - left) / r, clipped to the image.
A .npy of uint8 [H, W, 3] (or [N, H, W, 3]) that is not the pipeline's input shape is an image in
OpenCV's BGR order. Any other .npy is fed as it is: [B, ...] rows, or one sample without the batch dim.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..bundle.folder import read_bundle
from ..bundle.view import BundleView, InputView
from ..choices import DEVICES
from ..errors import MissingDependency, RuntimeInputError
from ..files import atomic_write, read_regular
from ..images import IMAGE_SUFFIXES, read_image, read_npy, read_npz
from ..jit.contracts import image_channels
from ..surgery.references import letterbox_numpy
from .cpu import CpuPipeline
from .inputs import check_feeds
from .launch import letterbox_geometry
from .layout import Layout
from .pipeline import Pipeline

log = logging.getLogger("deepjit.run")

TENSOR_SUFFIXES = (".npy", ".npz")


@dataclass(frozen=True, slots=True)
class Sample:
    """One item to run: where it came from, its feed (batch 1), and how its boxes map back."""

    source: str
    feed: dict[str, np.ndarray]
    size: tuple[int, int] | None = None                         # the original image's (H, W)
    ratio_pad: tuple[float, float, float] | None = None         # host letterbox (r, left, top)


# ----------------------------------------------------------------------------- inputs
def expand_inputs(paths: Sequence[str | Path]) -> list[Path]:
    """Files in the order given; a folder contributes its images and tensors, sorted by name."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES + TENSOR_SUFFIXES)
            if not found:
                raise RuntimeInputError(f"{p}: no images ({', '.join(IMAGE_SUFFIXES)}) or .npy/.npz files in it")
            out += found
        elif p.is_file():
            if p.suffix.lower() not in IMAGE_SUFFIXES + TENSOR_SUFFIXES:
                raise RuntimeInputError(f"{p}: unsupported input; give images ({', '.join(IMAGE_SUFFIXES)}), "
                                        ".npy or .npz files, or folders of them")
            out.append(p)
        else:
            raise RuntimeInputError(f"{p}: no such file or folder")
    if not out:
        raise RuntimeInputError("no inputs given")
    return out


@dataclass(frozen=True, slots=True)
class ImageStage:
    """A kernel of the pipeline that takes decoded images (its contract's roles.image_input): the
    pipeline input it reads, the channel order it wants and its ratio_pad output, if any."""

    tensor: str
    channels: str
    ratio_pad: str | None


def image_stage(layout: Layout) -> ImageStage | None:
    """The pipeline's image stage (a letterbox on the GPU), or None."""
    for k in layout.kernels:
        role = k.contract.model.roles.image_input
        if role is not None:
            return ImageStage(k.plan_name(role.tensor), image_channels(k.contract, k.params),
                              k.plan_name(role.ratio_pad) if role.ratio_pad else None)
    return None


class _Images:
    """Turns a decoded image (BGR uint8 HWC) into a Sample for this pipeline."""

    def __init__(self, layout: Layout):
        if len(layout.inputs) != 1:
            names = ", ".join(i.name for i in layout.inputs)
            raise RuntimeInputError(f"images need a pipeline with one input; this one takes {names}: give .npz files")
        self.input: InputView = layout.inputs[0]
        self.gpu = image_stage(layout)
        if self.gpu is None or self.gpu.tensor != self.input.name:
            self.gpu = None
            shape = self.input.opt
            if len(shape) != 4 or shape[1] != 3 or shape[2] != shape[3]:
                raise RuntimeInputError(f"input '{self.input.name}' is {list(self.input.shape)}: host letterboxing "
                                        "needs a square [B, 3, S, S] input; give .npy tensors instead")
            self.size = int(shape[2])

    def sample(self, source: str, bgr: np.ndarray) -> Sample:
        h, w = bgr.shape[:2]
        if self.gpu is not None:
            raw = bgr if self.gpu.channels == "bgr" else bgr[..., ::-1]
            return Sample(source, {self.input.name: np.ascontiguousarray(raw[None])}, (h, w))
        _check_letterboxable(source, h, w, self.size)
        boxed = letterbox_numpy(bgr[None], size=self.size, dtype=self.input.dtype, swap_rb=True)
        r, left, top = (float(v) for v in boxed["ratio_pad"][0])
        return Sample(source, {self.input.name: boxed["images"]}, (h, w), (r, left, top))


def _check_letterboxable(source: str, h: int, w: int, size: int) -> None:
    """Refuse, naming the file, an image the letterbox cannot place (a side of 0 pixels, or one so thin
    that its short side scales to under half a pixel): its resize would divide by zero."""
    try:
        letterbox_geometry(h, w, size)
    except RuntimeInputError as e:
        raise RuntimeInputError(f"{source}: {e}") from None


def _is_image_array(arr: np.ndarray, inp: InputView, gpu_letterbox: bool) -> bool:
    """A uint8 [H, W, 3] / [N, H, W, 3] array is an image when the pipeline letterboxes on the GPU
    (its boxes then map back through ratio_pad), or when it is not the pipeline's input shape."""
    if not (arr.dtype == np.uint8 and arr.ndim in (3, 4) and arr.shape[-1] == 3):
        return False
    if gpu_letterbox:
        return True
    fits = arr.ndim in (len(inp.shape), len(inp.shape) - 1) and arr.dtype == np.dtype(inp.dtype) and \
        tuple(arr.shape[-(len(inp.shape) - 1):]) == tuple(inp.opt[1:])
    return not fits


def _rows(name: str, arr: np.ndarray, inp: InputView, source: str) -> np.ndarray:
    if arr.ndim == len(inp.shape) - 1:
        return arr[None]
    if arr.ndim == len(inp.shape) and len(arr) == 0:  # nothing to run: a mistake, not an empty result
        raise RuntimeInputError(f"{source}: array for input '{name}' has no rows (shape {arr.shape})")
    if arr.ndim == len(inp.shape):
        return arr
    raise RuntimeInputError(f"{source}: array for input '{name}' has shape {arr.shape}; expected "
                            f"{list(inp.shape)} or one sample without the batch dim")


def load_samples(paths: Sequence[str | Path], layout: Layout) -> list[Sample]:
    """Every input file as samples for this pipeline (one per image, one per row of a tensor)."""
    images = None
    samples: list[Sample] = []
    by_name = {i.name: i for i in layout.inputs}
    for path in expand_inputs(paths):
        suffix = path.suffix.lower()
        if suffix in IMAGE_SUFFIXES:
            images = images or _Images(layout)
            samples.append(images.sample(path.name, read_image(path)[..., ::-1]))
        elif suffix == ".npz":
            arrays = read_npz(path, by_name)
            missing = [n for n in by_name if n not in arrays]
            if missing:
                raise RuntimeInputError(f"{path}: no array for input(s) {', '.join(missing)}; it has "
                                        f"{', '.join(arrays) or 'none'}")
            rows = {n: _rows(n, arrays[n], by_name[n], path.name) for n in by_name}
            count = {len(v) for v in rows.values()}
            if len(count) != 1:
                raise RuntimeInputError(f"{path}: its arrays have different batch sizes {sorted(count)}")
            samples += [Sample(f"{path.name}[{i}]", {n: v[i:i + 1] for n, v in rows.items()})
                        for i in range(count.pop())]
        else:
            arr = read_npy(path)
            if len(layout.inputs) != 1:
                raise RuntimeInputError(f"{path}: this pipeline takes {len(layout.inputs)} inputs: give a .npz "
                                        f"with arrays named {', '.join(by_name)}")
            inp = layout.inputs[0]
            if _is_image_array(arr, inp, image_stage(layout) is not None):
                images = images or _Images(layout)
                batch = arr if arr.ndim == 4 else arr[None]
                if len(batch) == 0:  # nothing to run: a mistake, not an empty result (as in _rows)
                    raise RuntimeInputError(f"{path.name}: array of images [N, H, W, 3] has no images "
                                            f"(shape {arr.shape})")
                samples += [images.sample(f"{path.name}[{i}]" if arr.ndim == 4 else path.name, img)
                            for i, img in enumerate(batch)]
                continue
            rows = _rows(inp.name, arr, inp, path.name)
            samples += [Sample(f"{path.name}[{i}]" if arr.ndim == len(inp.shape) else path.name,
                               {inp.name: rows[i:i + 1]}) for i in range(len(rows))]
    _check_each(samples, layout)
    return samples


def _check_each(samples: Sequence[Sample], layout: Layout) -> None:
    """Every sample's dtype and dims against the pipeline's inputs, before anything runs: the pipeline's
    own check sees a batch of several files' rows and cannot say which file is wrong."""
    for s in samples:
        try:
            check_feeds(layout.inputs, s.feed, 1, layout.max_batch, layout.buckets)  # batch 1: batched later
        except RuntimeInputError as e:
            raise RuntimeInputError(f"{s.source}: {e}") from None


def batches(samples: Sequence[Sample], max_batch: int) -> list[list[Sample]]:
    """Consecutive samples of equal shapes and dtypes, at most max_batch to a batch."""
    out: list[list[Sample]] = []

    def sig(s: Sample):
        return tuple((k, v.shape, v.dtype.str) for k, v in sorted(s.feed.items()))

    for s in samples:
        if out and len(out[-1]) < max_batch and sig(out[-1][0]) == sig(s):
            out[-1].append(s)
        else:
            out.append([s])
    return out


def stack(group: Sequence[Sample]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([s.feed[k] for s in group]) for k in group[0].feed}


# ----------------------------------------------------------------------------- outputs
def map_boxes(boxes: np.ndarray, ratio_pad: Sequence[float], size: tuple[int, int] | None) -> np.ndarray:
    """x1, y1, x2, y2 in the letterboxed input -> the original image: (x - left) / r, (y - top) / r,
    clipped to the image when its size is known (as ultralytics' scale_boxes does)."""
    r, left, top = (float(v) for v in ratio_pad)
    out = np.asarray(boxes, np.float64).copy()
    out[..., [0, 2]] = (out[..., [0, 2]] - left) / r
    out[..., [1, 3]] = (out[..., [1, 3]] - top) / r
    if size is not None:
        h, w = size
        out[..., [0, 2]] = out[..., [0, 2]].clip(0, w)
        out[..., [1, 3]] = out[..., [1, 3]].clip(0, h)
    return out


def result_of(outputs: dict[str, np.ndarray], i: int, sample: Sample, layout: Layout) -> dict[str, Any]:
    """The JSON record of row i: detections (boxes in the original image when known), or the raw outputs."""
    record: dict[str, Any] = {"source": sample.source, "size": list(sample.size) if sample.size else None}
    det = next((d for d in layout.detections if all(n in outputs for n in d.names)), None)
    if det is None:
        record["outputs"] = {k: {"shape": list(v.shape[1:]), "dtype": str(v.dtype), "values": v[i].tolist()}
                             for k, v in outputs.items()}
        return record
    n = int(outputs[det.count][i])
    boxes = outputs[det.boxes][i, :n]
    stage = image_stage(layout)
    device_pad = stage.ratio_pad if stage is not None and stage.ratio_pad in outputs else None
    ratio_pad = sample.ratio_pad or (tuple(outputs[device_pad][i]) if device_pad else None)
    if ratio_pad is not None and sample.size is not None:
        boxes, frame = map_boxes(boxes, ratio_pad, sample.size), "image"
    else:
        frame = "input"
    record.update(num_dets=n, boxes_in=frame, detections=[
        {"class": int(c), "score": round(float(s), 6), "box": [round(float(x), 3) for x in b]}
        for b, s, c in zip(boxes, outputs[det.scores][i, :n], outputs[det.classes][i, :n])])
    return record


def _write_json(path: Path, data: Any) -> None:
    atomic_write(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


_RUN_KEYS = {"bundle", "results", "out"}  # what every `deepjit run` output holds at its top level


def check_out(out: Path, bundle: BundleView) -> None:
    """`--out` may be a new file, or an earlier `deepjit run` output to replace; never a file of the
    user's (a README, the bundle's own manifest) nor a path inside the bundle. Checked before the run."""
    if out.resolve().is_relative_to(bundle.root.resolve()):
        raise RuntimeInputError(f"--out {out}: inside the bundle {bundle.source}, which would no longer verify; "
                                "write it elsewhere")
    if not out.exists() and not out.is_symlink():
        return
    try:
        doc = json.loads(read_regular(out, limit=1 << 30, follow=False))
    except (OSError, ValueError, RecursionError):
        doc = None
    if not (isinstance(doc, dict) and _RUN_KEYS <= doc.keys()):
        raise RuntimeInputError(f"--out {out}: exists and is not a `deepjit run` output; refusing to replace it "
                                "(choose another file or remove it)")


def load_pipeline(bundle, device: str = "gpu", *, prefer: str = "auto", graphs: bool = True,
                  engine: str = "auto", gpu: int = 0) -> Pipeline | CpuPipeline:
    """The bundle loaded on GPU number `gpu` (device `gpu`), or on ONNX Runtime's CPU provider (`cpu`:
    its segments and its kernels' ONNX references; `engine` must then be auto or onnxruntime). Without
    a GPU, the error says how to run on the CPU instead."""
    if device not in DEVICES:
        raise RuntimeInputError(f"--device must be one of {', '.join(DEVICES)}, got '{device}'")
    if device == "cpu":
        if engine == "plan":
            raise RuntimeInputError("--engine plan runs a TensorRT plan, which needs a GPU: not with --device cpu")
        return CpuPipeline.load(bundle)
    try:
        return Pipeline.load(bundle, prefer=prefer, graphs=graphs, engine=engine, gpu=gpu)
    except MissingDependency as e:
        raise MissingDependency(f"{e}: run the bundle on the CPU instead with --device cpu (its ONNX segments and "
                                "its kernels' ONNX references on ONNX Runtime)") from None


def _where(result: dict[str, Any]) -> str:
    sm = f" (sm_{result['sm']})" if result.get("sm") else ""
    graphs = f"graphs {result['capture']}" if result["graphs"] else "graphs off"
    return f"{result['bundle']} on {result['device']}{sm}, engine {result['engine']}, {graphs}"


# ----------------------------------------------------------------------------- run
def run_bundle(bundle, inputs: Sequence[str | Path], out: Path | None = None, *, prefer: str = "auto",
               graphs: bool = True, device: str = "gpu",
               engine: str = "auto") -> dict[str, Any]:
    """`deepjit run`: every input through the pipeline (batched up to its max batch) on `device`;
    detections per image, written to `out` as JSON when given."""
    bundle = read_bundle(bundle)
    if out is not None:
        check_out(Path(out), bundle)
    samples = load_samples(inputs, Layout.from_bundle(bundle))
    records = []
    with load_pipeline(bundle, device, prefer=prefer, graphs=graphs, engine=engine) as pipe:
        for group in batches(samples, pipe.max_batch):
            outputs = pipe(stack(group))
            records += [result_of(outputs, i, s, pipe.layout) for i, s in enumerate(group)]
        result = {**pipe.describe(), "results": records, "out": str(out) if out else None}
    if out is not None:
        _write_json(Path(out), result)
    return result


def format_run(result: dict[str, Any]) -> str:
    lines = [_where(result)]
    for r in result["results"]:
        if "detections" not in r:
            lines.append(f"  {r['source']}: " + ", ".join(f"{k} {v['shape']}" for k, v in r["outputs"].items()))
            continue
        top = ", ".join(f"{d['class']}:{d['score']:.2f}" for d in r["detections"][:5])
        lines.append(f"  {r['source']}: {r['num_dets']} detections (boxes in {r['boxes_in']} pixels)"
                     + (f"; top: {top}" if top else ""))
    if result.get("out"):
        lines.append(f"wrote {result['out']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- bench
def random_feeds(layout: Layout, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Seeded inputs at the profile's opt shape: floats in [0, 1), integers in [0, 255]."""
    feeds = {}
    for inp in layout.inputs:
        shape, dtype = (batch, *inp.opt[1:]), np.dtype(inp.dtype)
        feeds[inp.name] = rng.random(shape).astype(dtype) if dtype.kind == "f" else \
            rng.integers(0, 256, shape).astype(dtype)
    return feeds


def percentiles(values_us: Sequence[float]) -> dict[str, float]:
    v = np.asarray(values_us, np.float64)
    return {"p50": float(np.percentile(v, 50)), "p95": float(np.percentile(v, 95)),
            "p99": float(np.percentile(v, 99)), "mean": float(v.mean())}


def check_batches(batches_: Sequence[int], layout: Layout) -> list[int]:
    bad = [b for b in batches_ if not 1 <= b <= layout.max_batch]
    if bad:
        raise RuntimeInputError(f"--batch {', '.join(map(str, bad))}: this bundle takes batches 1..{layout.max_batch} "
                                f"(buckets {', '.join(map(str, layout.buckets))})")
    return list(batches_)


def bench_bundle(bundle, batches: Sequence[int] | None = None, graphs: bool = True, warmup: int = 10,
                 iters: int = 100, *, prefer: str = "auto", seed: int = 0, device: str = "gpu",
                 engine: str = "auto") -> dict[str, Any]:
    """`deepjit bench`: per batch, `warmup` calls then `iters` timed ones on seeded inputs: latency
    percentiles (µs) of the whole call and of its GPU part (CUDA events; none on the CPU),
    throughput, launches, bytes copied between host and device per call."""
    if warmup < 0 or iters < 1:
        raise RuntimeInputError(f"bench needs warmup >= 0 and iters >= 1, got {warmup} and {iters}")
    bundle = read_bundle(bundle)
    layout = Layout.from_bundle(bundle)
    todo = check_batches(batches or layout.buckets, layout)
    rng = np.random.default_rng(seed)
    rows = []
    with load_pipeline(bundle, device, prefer=prefer, graphs=graphs, engine=engine) as pipe:
        for b in todo:
            feeds = random_feeds(layout, b, rng)
            for _ in range(warmup):
                pipe(feeds)
            call, gpu, kernels = [], [], []
            for _ in range(iters):
                t0 = time.perf_counter()
                pipe(feeds)
                call.append((time.perf_counter() - t0) * 1e6)
                timing = pipe.last_timing()
                if timing:
                    gpu.append(timing["gpu_ms"] * 1e3)
                    kernels.append(timing["kernels_ms"] * 1e3)
            rows.append({"batch": b, "bucket": layout.bucket_for(b), "call_us": percentiles(call),
                         "gpu_us": percentiles(gpu) if gpu else None,
                         "kernels_us": percentiles(kernels) if kernels else None,
                         "throughput_img_s": b * 1e6 / float(np.mean(call)),
                         "kernel_launches": pipe.launches_per_inference(b),
                         "graph_launches": pipe.graph_launches_per_inference(b), "copied_bytes": pipe.last_copies()})
            log.info("batch %d: p50 %.0f µs per call, %.0f img/s", b, rows[-1]["call_us"]["p50"],
                     rows[-1]["throughput_img_s"])
        return {**pipe.describe(), "warmup": warmup, "iters": iters, "seed": seed, "results": rows}


def format_bench(result: dict[str, Any]) -> str:
    head = f"{_where(result)}, {result['iters']} iterations after {result['warmup']} warm-up\n"
    cols = ("batch", "bucket", "call p50", "p95", "p99", "gpu p50", "p95", "p99", "kernels p50", "img/s",
            "launches", "graphs", "h2d B", "d2h B")
    rows = [cols]
    for r in result["results"]:
        c, g, k, copied = r["call_us"], r["gpu_us"], r["kernels_us"], r["copied_bytes"]
        gpu = [f"{g[p]:.0f}" for p in ("p50", "p95", "p99")] if g else ["-"] * 3
        rows.append((str(r["batch"]), str(r["bucket"]), *(f"{c[p]:.0f}" for p in ("p50", "p95", "p99")), *gpu,
                     f"{k['p50']:.1f}" if k else "-", f"{r['throughput_img_s']:.1f}", str(r["kernel_launches"]),
                     str(r["graph_launches"]), str(copied["h2d"]), str(copied["d2h"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return head + "\n".join(lines) + "\n(latencies in µs; gpu = copies + kernels from CUDA events; launches = " \
                                     "kernels per inference, graphs = graph launches per inference; h2d/d2h = " \
                                     "bytes copied between host and device per call)"
