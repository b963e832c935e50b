"""Benchmark (not a test): the whole pipeline, decoded uint8 photos in (480 x 640, not the model's
size), detections in original-image pixels out, against what a user would run instead, in the same
run on the same GPU:

  (a) onnx     host letterbox with OpenCV as ultralytics' LetterBox does, ONNX Runtime's CUDA provider
               on the whole exported model (numpy in and out, as ultralytics' AutoBackend runs it),
               torchvision batched_nms on the GPU (as ultralytics' non_max_suppression), boxes scaled
               back on the host (scale_boxes). fp16: the same model through DeepJIT's fp16 rewrite.
  (b) pytorch  the same model in PyTorch eager: skipped, no ONNX -> PyTorch converter is at hand and
               the ultralytics weights are not here (printed as a note).
  (c) deepjit  the bundle: letterbox kernel on the GPU + engine + decode + NMS kernels on one stream.

Columns per batch and precision: call p50/p95 (µs, wall clock), GPU time p50 (µs, CUDA events
around the device work: (a) the ONNX Runtime run and the NMS part, (c) the pipeline's device
phase), img/s, CUDA kernels per call (CUPTI via torch.profiler, graph nodes included), graph
launches, host<->device bytes per call. Detections of (a) and (c) are matched per image (same
class, IoU >= 0.5): matched / total and the largest box coordinate difference in pixels. At batch 1
(c)'s GPU part is compared with the engine alone (the same ONNX Runtime call on the bundle's
segment, on its own) plus the DeepJIT kernels' own time: the glue.

    python3 bench/pipeline.py WORK [--models nudenet yolov8s] [--batches 1 8 32] [--precisions fp16 fp32]
        [--iters 50] [--json out.json]

nudenet: nudenet 3.4.2's 320n.onnx (a trained YOLOv8n, 18 classes, 320 input; `pip install
nudenet==3.4.2 --no-deps`); yolov8s: the H200 example's synthetic YOLOv8s (640, seeded weights).
Needs a GPU, onnxruntime-gpu, torch, torchvision, OpenCV and scikit-image (photos).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import cv2  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402
import yaml  # noqa: E402

from deepjit_compiler import build as build_module  # noqa: E402
from deepjit_compiler.build import build_pipeline  # noqa: E402
from deepjit_compiler.engines.onnxrt import OnnxrtEngineRunner  # noqa: E402
from deepjit_compiler.precision.rewrite import apply_precision  # noqa: E402
from deepjit_compiler.runtime import gpu as gpu_mod  # noqa: E402
from deepjit_compiler.runtime.pipeline import Pipeline  # noqa: E402
from deepjit_compiler.runtime.run import map_boxes  # noqa: E402
from deepjit_compiler.validation.detections import box_iou  # noqa: E402
from deepjit_compiler.validation.gate import not_run  # noqa: E402

CONF, IOU, MAX_DET = 0.25, 0.45, 300
PHOTO_HW = (480, 640)
NOTE_B = "(b) PyTorch eager: skipped: no ONNX -> PyTorch converter is at hand and the ultralytics weights are not here"


# ----------------------------------------------------------------------------- inputs
def photos(n: int) -> np.ndarray:
    """n decoded BGR uint8 photos of one size (scikit-image's, resized to 480 x 640), cycled."""
    from skimage import data

    rgb = [getattr(data, name)() for name in ("astronaut", "coffee", "chelsea", "rocket", "cat")]
    bgr = [cv2.resize(np.ascontiguousarray(p[..., :3][..., ::-1]), PHOTO_HW[::-1], interpolation=cv2.INTER_AREA)
           for p in rgb]
    return np.stack([bgr[i % len(bgr)] for i in range(n)])


def model_file(name: str, work: Path) -> tuple[dict, int]:
    """The spec's model entry and the model's input size."""
    if name == "nudenet":
        found = importlib.util.find_spec("nudenet")
        if found is None:
            raise SystemExit("nudenet is not installed: pip install nudenet==3.4.2 --no-deps")
        return {"path": str(Path(found.submodule_search_locations[0]) / "320n.onnx")}, 320
    return {"path": str(work / "models" / f"{name}.onnx"), "synthesize": name, "seed": 0, "dynamic": False}, 640


def spec_for(name: str, model: dict, size: int, precision: str, batches: list[int], work: Path) -> Path:
    """A pipeline: letterbox kernel before the model, decode cut, NMS after, for this GPU."""
    top = max(batches)
    inp = onnx.load(model["path"], load_external_data=False).graph.input[0] if Path(model["path"]).exists() else None
    shape = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim] if inp else ["batch", 3, size, size]
    spec = {
        "name": name,
        "model": model,
        "target": {"sm": gpu_mod.Gpu().sm if gpu_mod.available() else 90},
        "inputs": {
            "raw_images": {"shape": ["batch", "height", "width", 3], "dtype": "uint8", "buckets": batches,
                           "profile": {"min": [1, 32, 32, 3], "opt": [top, *PHOTO_HW, 3], "max": [top, 1080, 1920, 3]}},
            "images": {"shape": shape, "dtype": "float32", "buckets": batches,
                       "profile": {"min": [1, 3, size, size], "opt": [top, 3, size, size], "max": [top, 3, size, size]}},
        },
        "engine": {"precision": precision, "keep_fp32": ["Softmax"]},
        "cuts": [
            {"name": "letterbox", "add": "before", "at": "images",
             "kernels": [{"contract": "letterbox", "params": {"size": size}}]},
            {"name": "decode", "preset": "yolov8_decode",
             "kernels": [{"contract": "yolov8_decode", "params": {"mode": "candidates", "conf_threshold": CONF}}]},
            {"name": "nms", "add": "after", "at": "output0",
             "kernels": [{"contract": "nms", "params": {"conf_threshold": CONF, "iou_threshold": IOU,
                                                        "max_det": MAX_DET}}]},
        ],
        "validation": {"samples": 1, "gate": False,
                       "data": {"random": {"ranges": {"images": [0.0, 1.0], "raw_images": [0, 255]}}}},
        "bundle": {"path": str(work / "out" / name)},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def build(spec: Path) -> Path:
    """The bundle, its GPU levels left to `deepjit validate` (this is a benchmark, not the gate)."""
    why = "skipped by bench/pipeline.py: run `deepjit validate`"
    build_module.gpu_levels = lambda path, spec, report_dir=None: [not_run("kernels", why), not_run("end_to_end", why)]
    return build_pipeline(spec, publish=False).bundle.path


# ----------------------------------------------------------------------------- (a) the usual ONNX deployment
def letterbox_cv2(img: np.ndarray, size: int) -> tuple[np.ndarray, tuple[float, float, float]]:
    """ultralytics' LetterBox(auto=False, scaleup=True, center=True): resize, pad with 114."""
    h, w = img.shape[:2]
    r = min(size / h, size / w)
    new_w, new_h = round(w * r), round(h * r)
    dw, dh = (size - new_w) / 2, (size - new_h) / 2
    if (w, h) != (new_w, new_h):
        img = cv2.resize(img, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    top, bottom = round(dh - 0.1), round(dh + 0.1)
    left, right = round(dw - 0.1), round(dw + 0.1)
    img = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(114, 114, 114))
    return img, (r, left, top)


class OnnxBaseline:
    """(a): host letterbox, ONNX Runtime CUDA on the whole model (numpy in/out), torchvision NMS."""

    def __init__(self, model_path: str, size: int, precision: str):
        model = onnx.load(model_path)
        if precision != "fp32":
            model = apply_precision(model, precision, keep_fp32=["Softmax"])
        self.size, self.stream = size, torch.cuda.Stream()
        options = {"device_id": "0", "use_tf32": "0", "has_user_compute_stream": "1",
                   "user_compute_stream": str(self.stream.cuda_stream)}
        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.sess = ort.InferenceSession(model.SerializeToString(), so,
                                         providers=[("CUDAExecutionProvider", options), "CPUExecutionProvider"])
        self.input = self.sess.get_inputs()[0].name
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        self.copied = {"h2d": 0, "d2h": 0}

    def __call__(self, images: np.ndarray) -> list[dict]:
        boxed = [letterbox_cv2(img, self.size) for img in images]
        x = np.stack([b for b, _ in boxed])[..., ::-1].transpose(0, 3, 1, 2)  # BGR -> RGB, HWC -> CHW
        x = np.ascontiguousarray(x, dtype=np.float32) / 255.0
        e0, e1, e2, e3 = self.events
        e0.record(self.stream)
        pred = self.sess.run(None, {self.input: x})[0]
        e1.record(self.stream)
        with torch.cuda.stream(self.stream):
            e2.record(self.stream)
            dets = [d.cpu().numpy() for d in nms(torch.from_numpy(pred).to("cuda"))]
            e3.record(self.stream)
        self.copied = {"h2d": x.nbytes + pred.nbytes, "d2h": pred.nbytes + sum(d.nbytes for d in dets)}
        return [record(d[:, :4], d[:, 4], d[:, 5], pad, img.shape[:2])
                for d, (_, pad), img in zip(dets, boxed, images)]

    def gpu_us(self) -> float:
        e0, e1, e2, e3 = self.events
        e3.synchronize()
        return (e0.elapsed_time(e1) + e2.elapsed_time(e3)) * 1e3


def nms(pred: torch.Tensor) -> list[torch.Tensor]:
    """ultralytics' non_max_suppression (multi_label=False, agnostic=False): per image
    [n, 6] (x1, y1, x2, y2, score, class)."""
    out = []
    for x in pred.transpose(-1, -2):
        scores, classes = x[:, 4:].max(1)
        keep = scores > CONF
        xywh, scores, classes = x[keep, :4], scores[keep], classes[keep]
        boxes = torch.cat([xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2], 1)
        i = torchvision.ops.batched_nms(boxes, scores, classes, IOU)[:MAX_DET]
        out.append(torch.cat([boxes[i], scores[i, None], classes[i, None].float()], 1))
    return out


def record(boxes, scores, classes, ratio_pad, size) -> dict:
    return {"boxes": map_boxes(boxes, ratio_pad, size), "scores": np.asarray(scores, np.float64),
            "classes": np.asarray(classes).astype(np.int64)}


# ----------------------------------------------------------------------------- (c) the bundle
class Bundle:
    def __init__(self, path: Path, **load):
        self.pipe = Pipeline.load(path, **load)

    def __call__(self, images: np.ndarray) -> list[dict]:
        out = self.pipe({"raw_images": images})
        return [record(out["boxes"][i, :n], out["scores"][i, :n], out["classes"][i, :n], out["ratio_pad"][i],
                       images.shape[1:3]) for i, n in enumerate(out["num_dets"].astype(int))]

    def gpu_us(self) -> float:
        return self.pipe.last_timing()["gpu_ms"] * 1e3

    @property
    def copied(self) -> dict[str, int]:
        return self.pipe.last_copies()


# ----------------------------------------------------------------------------- measuring
def profile(fn) -> dict[str, float]:
    """CUDA kernels one call runs (CUPTI), and the GPU time of DeepJIT's own kernels in it (µs)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    try:
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as e:  # no CUPTI: the columns say so rather than the run stopping
        print(f"  profiler failed: {e}", flush=True)
        return {"kernels": -1, "deepjit_kernels_us": float("nan")}
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))]
    ours = sum(e.time_range.elapsed_us() for e in kernels if "deepjit" in e.name)
    return {"kernels": len(kernels), "deepjit_kernels_us": float(ours)}


def timed(fn, images, warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        fn(images)
    call, gpu = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(images)
        call.append((time.perf_counter() - t0) * 1e6)
        gpu.append(fn.gpu_us())
    return {"call_p50": float(np.percentile(call, 50)), "call_p95": float(np.percentile(call, 95)),
            "gpu_p50": float(np.percentile(gpu, 50)), "img_s": len(images) * 1e6 / float(np.mean(call)),
            "copied": dict(fn.copied), **profile(lambda: fn(images))}


def agreement(a: list[dict], c: list[dict]) -> dict:
    """(a)'s detections matched to (c)'s per image: same class, IoU >= 0.5, greedy by (a)'s score."""
    matched = total = produced = 0
    worst = 0.0
    for ra, rc in zip(a, c):
        total, produced = total + len(ra["scores"]), produced + len(rc["scores"])
        free = np.ones(len(rc["scores"]), bool)
        for i in np.argsort(-ra["scores"], kind="stable"):
            ok = free & (rc["classes"] == ra["classes"][i])
            if not ok.any():
                continue
            ious = np.where(ok, box_iou(ra["boxes"][i], rc["boxes"]), -1.0)
            j = int(np.argmax(ious))
            if ious[j] >= 0.5:
                free[j] = False
                matched += 1
                worst = max(worst, float(np.abs(ra["boxes"][i] - rc["boxes"][j]).max()))
    return {"matched": matched, "reference": total, "produced": produced, "max_box_diff_px": worst}


def engine_alone_us(bundle: Path, size: int, iters: int) -> float:
    """The bundle's engine segment on its own at batch 1: the same ONNX Runtime call the pipeline makes
    (IO binding on device buffers, our stream), timed with CUDA events."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    step = next(s for s in manifest["plan"]["steps"] if s["kind"] == "segment")
    path = bundle / step["file"]
    cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((1, 3, size, size), dtype=np.float32)
    feed = {cpu.get_inputs()[0].name: x}
    outs = dict(zip([o.name for o in cpu.get_outputs()], cpu.run(None, feed)))
    tensors = {k: torch.from_numpy(v).cuda() for k, v in {**feed, **outs}.items()}
    runner = OnnxrtEngineRunner(path.read_bytes(), device="cuda", name="engine-alone")
    stream = torch.cuda.Stream()
    runner.activate()
    bindings = {k: t.data_ptr() for k, t in tensors.items()}
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(iters + 10):
        start.record(stream)
        runner.enqueue(stream.cuda_stream, bindings, shapes)
        end.record(stream)
        end.synchronize()
        if i >= 10:
            times.append(start.elapsed_time(end) * 1e3)
    runner.deactivate()
    return float(np.median(times))


def arrangements(bundle: Path, batches: list[int], warmup: int, iters: int) -> list[dict]:
    """The ways engine and kernels can share the stream: one graph with the engine in it (whole), the
    kernels' graphs around the engine run through its own CUDA graph (split) or plainly (split_plain),
    no graphs at all (off)."""
    out = []
    for how, graphs in (("whole", True), ("split", True), ("split_plain", True), ("off", False)):
        try:
            ours = Bundle(bundle, capture="auto" if how == "off" else how, graphs=graphs)
        except Exception as e:  # what ONNX Runtime does under a capture from outside
            out.append({"capture": how, "error": str(e).splitlines()[0][:200]})
            continue
        for b in batches:
            r = timed(ours, photos(b), warmup, iters)
            out.append({"capture": ours.pipe.capture_modes() if graphs else "off", "batch": b,
                        **{k: r[k] for k in ("call_p50", "gpu_p50", "kernels")},
                        "graphs": ours.pipe.graph_launches_per_inference(b)})
        ours.pipe.close()
    return out


# ----------------------------------------------------------------------------- report
def table(rows: list[dict]) -> str:
    head = ("model", "prec", "batch", "pipeline", "call p50", "p95", "GPU p50", "img/s", "kernels", "graphs",
            "h2d B", "d2h B")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in (
            r["model"], r["precision"], r["batch"], r["pipeline"], f"{r['call_p50']:.0f}", f"{r['call_p95']:.0f}",
            f"{r['gpu_p50']:.0f}", f"{r['img_s']:.0f}", r["kernels"], r.get("graphs", 0), r["copied"]["h2d"],
            r["copied"]["d2h"])) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--models", nargs="+", default=["nudenet", "yolov8s"], choices=["nudenet", "yolov8s"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--precisions", nargs="+", default=["fp16", "fp32"], choices=["fp16", "fp32"])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"{torch.cuda.get_device_name()}, ONNX Runtime {ort.__version__} ({', '.join(ort.get_available_providers())}), "
          f"torch {torch.__version__}, torchvision {torchvision.__version__}, OpenCV {cv2.__version__}\n{NOTE_B}",
          flush=True)
    rows, checks = [], []
    for name in args.models:
        model, size = model_file(name, args.work)
        for precision in args.precisions:
            t0 = time.perf_counter()
            bundle = build(spec_for(f"{name}_{precision}", model, size, precision, args.batches, args.work))
            print(f"built {bundle} in {time.perf_counter() - t0:.0f} s", flush=True)
            baseline, ours = OnnxBaseline(model["path"], size, precision), Bundle(bundle)
            print(f"  (c) engine {ours.pipe.describe()['engine']}, graphs {ours.pipe.capture_modes()}", flush=True)
            for b in args.batches:
                images = photos(b)
                common = {"model": name, "precision": precision, "batch": b}
                a = {**common, "pipeline": "(a) onnx", **timed(baseline, images, args.warmup, args.iters)}
                c = {**common, "pipeline": "(c) deepjit", **timed(ours, images, args.warmup, args.iters),
                     "graphs": ours.pipe.graph_launches_per_inference(b)}
                agree = agreement(baseline(images), ours(images))
                rows += [a, c]
                checks.append({**common, "agreement": agree, "c_faster": c["call_p50"] < a["call_p50"]})
                print(table([a, c]).split("\n", 2)[2], f"\n  agreement {agree}", flush=True)
            glue = {"engine_alone_us": engine_alone_us(bundle, size, args.iters)}
            c1 = next(r for r in rows if r["pipeline"] == "(c) deepjit" and r["model"] == name
                      and r["precision"] == precision and r["batch"] == min(args.batches))
            glue.update(deepjit_kernels_us=c1["deepjit_kernels_us"], gpu_p50=c1["gpu_p50"])
            glue["ratio"] = glue["gpu_p50"] / (glue["engine_alone_us"] + glue["deepjit_kernels_us"])
            checks.append({"model": name, "precision": precision, "glue_batch1": glue})
            print(f"  glue at batch {min(args.batches)}: {glue}", flush=True)
            ours.pipe.close()
            if precision == args.precisions[0]:
                ways = arrangements(bundle, sorted(args.batches)[:2], args.warmup, args.iters)
                checks.append({"model": name, "precision": precision, "arrangements": ways})
                for w in ways:
                    print(f"  arrangement {w}", flush=True)
    print("\n" + table(rows) + "\n\n" + NOTE_B)
    for c in checks:
        print(json.dumps(c))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "checks": checks}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
