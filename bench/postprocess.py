"""Benchmark (not a test): YOLOv8 post-processing on the GPU, DeepJIT against the usual ways.

    python3 bench/postprocess.py [--batches 1 8 32] [--iters 200] [--append bench/RESULTS.md] [--json out.json]
                                 [--head-dtypes float32 float16] [--decode-contract PATH] [--nms-contract PATH]
                                 [--spec pipelines/yolov8_t4.yaml] [--bandwidth-gbs 320] [--estimate-only]
                                 [--fused [--fused-block 1024] [--fused-chunk 256] [--fused-cluster 1 8]]
                                 [--object-classes 80]

--decode-contract / --nms-contract time your own contract (a kernels/*.yaml copy with its template)
in place of the built-in one, e.g. an earlier version as the same-run baseline.

Methods, all on the same seeded head maps (per-level box [B, 64, H, W] and class [B, 80, H, W] at
640x640, a few percent of anchors above 0.25); DeepJIT's once per --head-dtypes (the maps as an fp32
engine hands them over, and rounded to fp16 as an fp16 engine does, precision/boundaries.py):
  deepjit-plain   decode (candidates) + nms kernels, two plain launches per inference
  deepjit-graph   the same two kernels replayed from one CUDA graph
  deepjit-fused-* (--fused) yolov8_decode mode nms: decode and NMS in one launch (the last decode
                  block of each image runs its NMS), plain and from a CUDA graph; -cN, once per
                  --fused-cluster N above 1: the decode's blocks in clusters of N, the last cluster of
                  each image runs its NMS (a contract with that param: bench/fused_cluster.py writes one)
  torch-eager     the way ultralytics users run it: Detect-head decode in PyTorch eager, then
                  non_max_suppression with torchvision.ops.batched_nms, all on the GPU
  onnxrt-cpu      ONNX Runtime (CPU) on the references: the cut decode subgraph + nms_reference

Columns: GPU median / p95 per inference from device events (DeepJIT's inferences are queued
behind a sleep kernel, so they run back to back and the events time the GPU alone; torch syncs
inside NMS, so its events also hold the host's stalls), the host's wall time per inference with a
sync after each, and device kernel launches per inference (torch: counted by torch.profiler).

Then the bytes each kernel moves per batch (jit/traffic.py: its contract's tensors, read or written
once; the candidate buffers at the candidates the data gives) under --spec's settings (default the T4
example: its kernels' params, its engine precision's head-map dtype, and fp32 beside it), and the
time that is at --bandwidth-gbs (320: a T4's memory), next to each kernel measured alone on this GPU
and the bandwidth that measurement reaches. --estimate-only prints that table without a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deepjit_compiler.jit.contracts import load_contract, resolve_params  # noqa: E402
from deepjit_compiler.jit.nvrtc import compile_site_kernel, nvrtc_version  # noqa: E402
from deepjit_compiler.jit.traffic import kernel_traffic  # noqa: E402
from deepjit_compiler.model.source import resolve_model  # noqa: E402
from deepjit_compiler.precision.boundaries import plan_at_precision  # noqa: E402
from deepjit_compiler.runtime import gpu as gpu_mod  # noqa: E402
from deepjit_compiler.runtime.launch import KernelChain  # noqa: E402
from deepjit_compiler.runtime.layout import site_aliases  # noqa: E402
from deepjit_compiler.spec.load import load_spec  # noqa: E402
from deepjit_compiler.surgery.cut import plan_from_model  # noqa: E402
from deepjit_compiler.surgery.references import NMS_OUTPUTS  # noqa: E402

NC, REG, STRIDES, SIZE = 80, 16, (8, 16, 32), 640
CONF, IOU, MAX_DET = 0.25, 0.45, 300
ROTATE = 4  # input sets cycled through, so repeated runs do not just re-read L2


def head_maps(rng: np.random.Generator, batch: int, classes: int = NC) -> list[dict[str, np.ndarray]]:
    """Class logits low except 3x3 patches around ~33 objects per image, each of one of the first
    `classes` classes (1: a crowd of one class); DFL logits biased low."""
    levels = []
    for s in STRIDES:
        n = SIZE // s
        box = np.tile(-0.6 * np.arange(REG), 4)[None, :, None, None] + rng.normal(0, 1, (batch, 4 * REG, n, n))
        levels.append({"box": box.astype(np.float32), "cls": rng.normal(-6, 1.2, (batch, NC, n, n)).astype(np.float32)})
    for b in range(batch):
        for _ in range(8400 // 250):
            lv = levels[rng.choice(3, p=[0.7, 0.2, 0.1])]
            n = lv["cls"].shape[2]
            y, x, c = rng.integers(0, n), rng.integers(0, n), rng.integers(0, classes)
            patch = lv["cls"][b, c, max(0, y - 1):y + 2, max(0, x - 1):x + 2]
            patch[...] = rng.normal(0.8, 1.2, patch.shape)
    return levels


def decode_site(precision: str = "fp32"):
    """The decode kernel site (facts and reference subgraph) of a synthetic YOLOv8n, from surgery; as an
    engine of `precision` hands it the head maps (fp16: facts input_dtype float16, fp16 inputs)."""
    from deepjit_compiler.model.synth import synthesize_yolov8
    from deepjit_compiler.surgery.plan import CutRequest, KernelRequest

    plan = plan_from_model(synthesize_yolov8("yolov8n", seed=0),
                           [CutRequest("decode", preset="yolov8_decode", kernels=[KernelRequest("yolov8_decode")])])
    return plan_at_precision(plan, precision).sites[0]


PRECISION_OF = {"float32": "fp32", "float16": "fp16"}  # the engine precision that hands the decode that dtype
SPEC_DTYPES = {"fp16": "float16"}  # engine precisions whose engines hand the decode other than float32


def typed_maps(maps, dtype: str) -> list[dict[str, np.ndarray]]:
    return [{k: v.astype(dtype) for k, v in lv.items()} for lv in maps]


def candidates_per_image(maps, conf: float) -> int:
    """The decode's candidates (best class score > conf) per image of these maps, the mean rounded up:
    the rows of the candidate buffers the data fills."""
    best = np.concatenate([lv["cls"].astype(np.float32).max(axis=1).reshape(len(lv["cls"]), -1) for lv in maps], 1)
    scores = 1 / (1 + np.exp(-best, dtype=np.float32))
    return int(np.ceil((scores > np.float32(conf)).sum(axis=1).mean()))


def stats(us: list[float]) -> tuple[float, float]:
    return float(np.median(us)), float(np.percentile(us, 95))


# --- DeepJIT --------------------------------------------------------------------------------------


def queued_gpu_us(gpu, torch, step, iters: int) -> list[float]:
    """GPU time of each of `iters` steps run back to back: a sleep kernel holds the stream while the
    host queues them all, so host launch overhead does not show."""
    for k in range(20):  # warm-up
        step(k)
    gpu.sync()
    events = [gpu.event() for _ in range(iters + 1)]
    with torch.cuda.stream(torch.cuda.ExternalStream(int(gpu.cu_stream))):
        torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time
    for k in range(iters):
        gpu.record(events[k])
        step(k)
    gpu.record(events[iters])
    out = [1e3 * gpu.elapsed_ms(events[k], events[k + 1]) for k in range(iters)]
    for e in events:
        gpu.destroy_event(e)
    return out


def wall_us(gpu, step, iters: int) -> list[float]:
    """Host wall time per step with a sync after each (launch overhead included)."""
    out = []
    for k in range(iters):
        t0 = time.perf_counter()
        step(k)
        gpu.sync()
        out.append(1e6 * (time.perf_counter() - t0))
    return out


def site_feed(site, maps) -> dict[str, np.ndarray]:
    """The cut's head-map tensors, by the preset's record of which is which."""
    return {h["name"]: maps[h["level"]][h["role"]] for h in site.facts["head_inputs"]}


def chains(gpu, kernels, site, inputs_sets) -> list[KernelChain]:
    """One chain of `kernels` (the decode first, on the cut's head maps) per input set."""
    decode = kernels[0]
    aliases = site_aliases(load_contract(decode.contract_path), decode.params, site.inputs, "decode")
    return [KernelChain(gpu, [(decode, aliases), *kernels[1:]], {k: gpu.upload(v) for k, v in site_feed(site, maps).items()})
            for maps in inputs_sets]


def bench_chains(gpu, torch, posts, iters: int, prefix: str) -> dict[str, dict]:
    """The chains launched plainly and replayed from one CUDA graph each, cycled through."""
    launches = posts[0].launch()
    gpu.sync()
    graphs = [gpu.capture(p.launch) for p in posts]
    out = {}
    for mode, step in ((f"{prefix}-plain", lambda k: posts[k % ROTATE].launch()),
                       (f"{prefix}-graph", lambda k: graphs[k % ROTATE].replay())):
        out[mode] = {"gpu_us": stats(queued_gpu_us(gpu, torch, step, iters)),
                     "wall_us": stats(wall_us(gpu, step, min(iters, 100))),
                     "kernels": launches if mode.endswith("plain") else f"{launches} (1 graph)"}
    return out


def bench_deepjit(gpu, decode, nms, site, inputs_sets, iters: int, torch) -> dict[str, dict]:
    posts = chains(gpu, [decode, nms], site, inputs_sets)
    out = bench_chains(gpu, torch, posts, iters, "deepjit")
    first = posts[0].results()
    dets = first["num_dets"].tolist()

    # Breakdown: the decode alone (its counters zeroed by a memset node each replay), and the nms
    # alone on the candidates one decode left (their count restored by a copy node each replay).
    def decode_alone(p):
        gpu.fill(p.tensors["cand_count"], 0)
        p.gpu.launch_with(p.plan[0].config, p.plan[0].function, *p.plan[0].args)

    saved = []
    for p in posts:
        decode_alone(p)
        saved.append(gpu.empty(p.tensors["cand_count"].shape, np.int32))
        gpu.copy(saved[-1], p.tensors["cand_count"])
    gpu.sync()

    def nms_alone(p, s):
        gpu.copy(p.tensors["cand_count"], s)
        p.gpu.launch_with(p.plan[1].config, p.plan[1].function, *p.plan[1].args)

    dgraphs = [gpu.capture(lambda p=p: decode_alone(p)) for p in posts]
    ngraphs = [gpu.capture(lambda p=p, s=s: nms_alone(p, s)) for p, s in zip(posts, saved)]
    for mode, gs in (("deepjit decode alone (graph + memset)", dgraphs), ("deepjit nms alone (graph + copy)", ngraphs)):
        out[mode] = {"gpu_us": stats(queued_gpu_us(gpu, torch, lambda k, gs=gs: gs[k % ROTATE].replay(), iters)),
                     "wall_us": None, "kernels": 1}
    out["_dets"] = dets
    out["_out"] = first
    return out


def bench_fused(gpu, fused, site, inputs_sets, iters: int, torch, prefix: str = "deepjit-fused") -> dict[str, dict]:
    """yolov8_decode mode nms alone: one launch per inference, plain and replayed from a graph."""
    posts = chains(gpu, [fused], site, inputs_sets)
    out = bench_chains(gpu, torch, posts, iters, prefix)
    out["_out"] = posts[0].results(NMS_OUTPUTS)
    out["_dets"] = out["_out"]["num_dets"].tolist()
    return out


def same_detections(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """Bit-identical outputs: counts, and every row (zero past the count in both)."""
    return all(np.array_equal(a[k], b[k]) for k in NMS_OUTPUTS)


# --- PyTorch eager, as ultralytics runs it ----------------------------------------------------------


def torch_postprocess(torch, torchvision):
    import torch.nn.functional as F

    proj = torch.arange(REG, dtype=torch.float32, device="cuda").view(1, REG, 1, 1)
    cache = {}

    def make_anchors(feats):  # ultralytics.utils.tal.make_anchors, cached by shape like Detect does
        key = tuple(f.shape[2:] for f in feats)
        if key not in cache:
            pts, strides = [], []
            for f, s in zip(feats, STRIDES):
                h, w = f.shape[2:]
                sy, sx = torch.meshgrid(torch.arange(h, device="cuda") + 0.5, torch.arange(w, device="cuda") + 0.5,
                                        indexing="ij")
                pts.append(torch.stack((sx, sy), -1).view(-1, 2))
                strides.append(torch.full((h * w, 1), s, dtype=torch.float32, device="cuda"))
            cache[key] = (torch.cat(pts).transpose(0, 1), torch.cat(strides).transpose(0, 1))
        return cache[key]

    def decode(feats):  # Detect._inference + DFL + dist2bbox(xywh=True)
        b = feats[0].shape[0]
        x = torch.cat([f.view(b, 4 * REG + NC, -1) for f in feats], 2)
        anchors, strides = make_anchors(feats)
        box, cls = x.split((4 * REG, NC), 1)
        a = box.shape[-1]
        dist = F.conv2d(box.view(b, 4, REG, a).transpose(2, 1).softmax(1), proj).view(b, 4, a)
        lt, rb = dist.chunk(2, 1)
        x1y1, x2y2 = anchors.unsqueeze(0) - lt, anchors.unsqueeze(0) + rb
        dbox = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * strides
        return torch.cat((dbox, cls.sigmoid()), 1)

    def nms(pred):  # ultralytics.utils.ops.non_max_suppression, multi_label=False
        xc = pred[:, 4:].amax(1) > CONF
        pred = pred.transpose(-1, -2)
        xy, wh = pred[..., :2], pred[..., 2:4] / 2
        pred = torch.cat((xy - wh, xy + wh, pred[..., 4:]), -1)
        output = []
        for xi, x in enumerate(pred):
            x = x[xc[xi]]
            box, cls = x.split((4, NC), 1)
            conf, j = cls.max(1, keepdim=True)
            x = torch.cat((box, conf, j.float()), 1)[conf.view(-1) > CONF]
            keep = torchvision.ops.batched_nms(x[:, :4], x[:, 4], x[:, 5].long(), IOU)[:MAX_DET]
            output.append(x[keep])
        return output

    return lambda feats: nms(decode(feats))


def bench_torch(torch, torchvision, input_sets, iters: int) -> dict:
    run = torch_postprocess(torch, torchvision)
    feats = [[torch.cat([torch.from_numpy(lv["box"]), torch.from_numpy(lv["cls"])], 1).cuda() for lv in maps]
             for maps in input_sets]
    for k in range(10):
        run(feats[k % ROTATE])
    torch.cuda.synchronize()
    gpu_us, wall = [], []
    for k in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        run(feats[k % ROTATE])
        end.record()
        end.synchronize()
        wall.append(1e6 * (time.perf_counter() - t0))
        gpu_us.append(1e3 * start.elapsed_time(end))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(feats[0])
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if str(e.device_type).endswith("CUDA") and not e.name.startswith(("Memcpy", "Memset")))
    dets = [len(d) for d in run(feats[0])]
    return {"gpu_us": stats(gpu_us), "wall_us": stats(wall), "kernels": kernels, "_dets": dets}


# --- ONNX Runtime CPU on the references -------------------------------------------------------------


def bench_onnxrt(site, input_sets, iters: int) -> dict:
    import onnx
    import onnx.compose
    import onnxruntime as ort

    from deepjit_compiler.surgery.references import nms_reference

    a, b = onnx.ModelProto(), nms_reference(NC, conf_threshold=CONF, iou_threshold=IOU, max_det=MAX_DET)
    a.CopyFrom(site.reference)
    a.ir_version = b.ir_version = max(a.ir_version, b.ir_version)
    sess = ort.InferenceSession(onnx.compose.merge_models(a, b, io_map=[("output0", "output0")]).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    feeds = [site_feed(site, maps) for maps in input_sets]
    sess.run(None, feeds[0])
    wall = []
    for k in range(iters):
        t0 = time.perf_counter()
        sess.run(None, feeds[k % ROTATE])
        wall.append(1e6 * (time.perf_counter() - t0))
    return {"gpu_us": None, "wall_us": stats(wall), "kernels": "-", "_dets": sess.run(None, feeds[0])[0].tolist()}


# --- bytes moved, under a spec's settings ------------------------------------------------------------


def spec_kernels(spec_path: Path, head_dtypes) -> dict[str, list]:
    """{head-map dtype: [(step, contract, resolved params)]} of the spec's kernel steps, as a build of the
    spec with an engine handing the decode that dtype has them (its surgery and precision/boundaries.py)."""
    loaded = load_spec(spec_path)
    plan = plan_from_model(resolve_model(loaded).model, loaded.spec.cuts, spec_dir=loaded.folder)
    out = {}
    for dtype in head_dtypes:
        typed = plan_at_precision(plan, PRECISION_OF[dtype], loaded.folder)
        out[dtype] = []
        for step in (*typed.sites, *typed.added):
            for k in step.kernels:
                contract = load_contract(str(k.contract), spec_dir=loaded.folder)
                out[dtype].append((step.name, contract, resolve_params(contract, k.params, typed.kernel_facts(step))))
    return out


def traffic(contract, params, batch: int, candidates: int):
    """kernel_traffic at `batch`, the candidate buffers holding `candidates` rows per image."""
    if "max_candidates" in contract.model.params:
        params = {**params, "max_candidates": candidates}
    return kernel_traffic(contract, params, {"B": batch})


def traffic_rows(kernels: dict[str, list], batches, candidates: dict[int, int], bandwidth: float) -> list[dict]:
    rows = []
    for batch in batches:
        for dtype, steps in kernels.items():
            for step, contract, params in steps:
                t = traffic(contract, params, batch, candidates[batch])
                rows.append({"batch": batch, "head_maps": dtype, "kernel": f"{step}/{contract.name}",
                             "candidates_per_image": candidates[batch], "read": t.read, "written": t.written,
                             "us_at_bandwidth": 1e6 * t.seconds_at(bandwidth)})
    return rows


def spec_max_batch(spec_path: Path) -> int | None:
    """The largest batch the spec's profiles allow (None: a static shape without a profile)."""
    inputs = load_spec(spec_path).spec.inputs.values()
    maxima = [i.profile.max[0] for i in inputs if i.profile is not None]
    return min(maxima) if maxima else None


def traffic_table(rows: list[dict], bandwidth: float, spec: str, measured: dict | None = None,
                  max_batch: int | None = None) -> str:
    """`measured`: {(batch, dtype, kernel step): (median µs alone on this GPU, bytes that kernel moved)}."""
    gbs = f"{bandwidth / 1e9:,.0f} GB/s"
    beyond = f" (its profile allows batch <= {max_batch}: larger batches are for comparison)" if max_batch else ""
    lines = [f"Bytes each kernel moves per batch under `{spec}`'s settings{beyond} (read once, written once; "
             f"candidate buffers at the candidates the data gives), and that time at {gbs}:", "",
             f"| batch | head maps | kernel | candidates / image | MB read | MB written | µs at {gbs} |"
             + (" this GPU: µs alone | this GPU: GB/s |" if measured else ""),
             "|---:|---|---|---:|---:|---:|---:|" + ("---:|---:|" if measured else "")]
    for r in rows:
        line = (f"| {r['batch']} | {r['head_maps']} | {r['kernel']} | {r['candidates_per_image']} "
                f"| {r['read'] / 1e6:,.3f} | {r['written'] / 1e6:,.3f} | {r['us_at_bandwidth']:,.2f} |")
        if measured:
            us, moved = measured.get((r["batch"], r["head_maps"], r["kernel"].split("/")[0]), (None, None))
            line += " - | - |" if us is None else f" {us:,.1f} | {moved / us / 1e3:,.0f} |"
        lines.append(line)
    return "\n".join(lines)


# --- report -----------------------------------------------------------------------------------------


def table(rows: list[tuple]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
    lines = ["| method | batch | GPU median µs | GPU p95 µs | wall median µs | wall p95 µs | kernels / inference |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for method, batch, r in rows:
        g, w = r["gpu_us"] or (None, None), r["wall_us"] or (None, None)
        lines.append(f"| {method} | {batch} | {fmt(g[0])} | {fmt(g[1])} | {fmt(w[0])} | {fmt(w[1])} | {r['kernels']} |")
    return "\n".join(lines)


def object_classes(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= NC:
        raise argparse.ArgumentTypeError(f"{text!r}: the objects' classes are 1 to {NC} (the maps' classes)")
    return int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--ort-iters", type=int, default=10)
    ap.add_argument("--append", type=Path, help="append the tables to this markdown file")
    ap.add_argument("--json", type=Path, help="write all numbers here")
    ap.add_argument("--head-dtypes", nargs="+", default=["float32", "float16"], choices=list(PRECISION_OF),
                    help="dtypes of the head maps DeepJIT's kernels are timed on, in the same run")
    ap.add_argument("--anchors-per-thread", type=int, default=4)
    ap.add_argument("--lanes-per-anchor", type=int, default=1, help="yolov8_decode's lanes_per_anchor (1, 2 or 4)")
    ap.add_argument("--large-batch-lanes", type=int, default=0,
                    help="yolov8_decode's large_batch_lanes: its lanes from batch --large-batch on (0: none)")
    ap.add_argument("--large-batch", type=int, default=4, help="yolov8_decode's large_batch")
    ap.add_argument("--nms-block", type=int, default=512, help="threads of the nms kernel's one block per image")
    ap.add_argument("--nms-chunk", type=int, help="nms's chunk (default: the contract's)")
    ap.add_argument("--nms-cluster", type=int, default=1, help="nms's cluster: blocks an image (sm_90+)")
    ap.add_argument("--nms-large-batch-cluster", type=int, default=0,
                    help="nms's large_batch_cluster: its cluster from batch --nms-large-batch on (0: none)")
    ap.add_argument("--nms-large-batch", type=int, default=16, help="nms's large_batch")
    ap.add_argument("--decode-contract", default="yolov8_decode", help="contract name or YAML path")
    ap.add_argument("--nms-contract", default="nms", help="contract name or YAML path")
    ap.add_argument("--lineinfo", action="store_true", help="compile with -lineinfo (for ncu's source view)")
    ap.add_argument("--spec", type=Path, default=REPO / "pipelines" / "yolov8_t4.yaml",
                    help="the spec whose kernels' bytes are estimated (default: the T4 example)")
    ap.add_argument("--bandwidth-gbs", type=float, default=320.0, help="memory bandwidth of the estimate (T4: 320)")
    ap.add_argument("--estimate-only", action="store_true", help="print the bytes table only (no GPU needed)")
    ap.add_argument("--fused", action="store_true", help="also time yolov8_decode mode nms (one launch)")
    ap.add_argument("--fused-block", type=int, help="its block (decode and NMS; default: --nms-block)")
    ap.add_argument("--fused-chunk", type=int, default=256, help="its NMS chunk")
    ap.add_argument("--fused-cluster", type=int, nargs="+", default=[1],
                    help="one fused kernel per value: above 1, its blocks in clusters of that many, the last of an "
                         "image running its NMS (--decode-contract must have the param: bench/fused_cluster.py)")
    ap.add_argument("--object-classes", type=object_classes, default=NC, metavar=f"1..{NC}",
                    help="the objects' classes are drawn from the first this many (1: a crowded frame of one class)")
    args = ap.parse_args(argv)
    command = f"python3 bench/postprocess.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    bandwidth = args.bandwidth_gbs * 1e9
    spec_name = args.spec.resolve().relative_to(REPO) if args.spec.resolve().is_relative_to(REPO) else args.spec
    # the spec's engine precision's dtype first, fp32 beside it (what every engine handed over before)
    kernels = spec_kernels(args.spec, dict.fromkeys([SPEC_DTYPES.get(load_spec(args.spec).spec.engine.precision,
                                                                       "float32"), "float32"]))
    max_batch = spec_max_batch(args.spec)
    cands = {b: candidates_per_image(head_maps(np.random.default_rng(b), b, args.object_classes), CONF)
             for b in args.batches}
    if args.estimate_only:  # the first maps of each batch's seeded sets: the same as a measured run's
        rows = traffic_rows(kernels, args.batches, cands, bandwidth)
        text = f"Command: `{command}`\n\n" + traffic_table(rows, bandwidth, str(spec_name), max_batch=max_batch)
        text += "\n"
        print(text)
        if args.json:
            args.json.write_text(json.dumps({"traffic": rows}, indent=1))
        return 0

    import torch
    import torchvision

    gpu = gpu_mod.Gpu()
    sites = {dtype: decode_site(PRECISION_OF[dtype]) for dtype in args.head_dtypes}
    lanes = {"lanes_per_anchor": args.lanes_per_anchor} if args.lanes_per_anchor != 1 else {}  # older contracts lack it
    if args.large_batch_lanes:
        lanes.update(large_batch_lanes=args.large_batch_lanes, large_batch=args.large_batch)
    decode_params = {"mode": "candidates", "conf_threshold": CONF, "anchors_per_thread": args.anchors_per_thread,
                     **lanes}
    decoders = {dtype: compile_site_kernel(args.decode_contract, decode_params, site.facts, sm=gpu.sm,
                                           debug=args.lineinfo)
                for dtype, site in sites.items()}
    for dtype, decode in decoders.items():
        if decode.params.get("dtype", "float32") != dtype:
            raise SystemExit(f"{args.decode_contract} does not read {dtype} head maps (its dtype: "
                             f"{decode.params.get('dtype')}); pass --head-dtypes it reads")
    nms_way = {"chunk": args.nms_chunk} if args.nms_chunk else {}  # only what is asked: older contracts lack these
    if args.nms_cluster != 1:
        nms_way.update(cluster=args.nms_cluster)
    if args.nms_large_batch_cluster:
        nms_way.update(large_batch_cluster=args.nms_large_batch_cluster, large_batch=args.nms_large_batch)
    nms = compile_site_kernel(args.nms_contract, {"conf_threshold": CONF, "iou_threshold": IOU, "max_det": MAX_DET,
                                                  "block": args.nms_block, **nms_way}, sites[args.head_dtypes[0]].facts,
                              sm=gpu.sm, debug=args.lineinfo)
    fused = {dtype: {} for dtype in sites}  # dtype: {label: kernel}
    if args.fused:  # the decode's own way of reading (anchors, lanes) with the NMS block
        params = {**decode_params, "mode": "nms", "iou_threshold": IOU, "max_det": MAX_DET,
                  "block": args.fused_block or args.nms_block, "chunk": args.fused_chunk}
        for cluster in args.fused_cluster:
            label = "deepjit-fused" + (f"-c{cluster}" if cluster > 1 else "")
            way = {"cluster": cluster} if cluster > 1 else {}  # only what is asked: the shipped contract lacks it
            for dtype, site in sites.items():
                fused[dtype][label] = compile_site_kernel(args.decode_contract, {**params, **way}, site.facts,
                                                          sm=gpu.sm, debug=args.lineinfo)
    rows, record, measured = [], {}, {}
    for batch in args.batches:
        rng = np.random.default_rng(batch)
        sets = [head_maps(rng, batch, args.object_classes) for _ in range(ROTATE)]
        for dtype in args.head_dtypes:
            decode = decoders[dtype]
            typed = [typed_maps(m, dtype) for m in sets]
            ours = bench_deepjit(gpu, decode, nms, sites[dtype], typed, args.iters, torch)
            print(f"batch {batch}, {dtype} head maps: detections per image deepjit {ours.pop('_dets')[:4]}", flush=True)
            two = ours.pop("_out")
            for label, kernel in fused[dtype].items():
                one = bench_fused(gpu, kernel, sites[dtype], typed, args.iters, torch, label)
                print(f"batch {batch}, {dtype} head maps: detections per image {label} {one.pop('_dets')[:4]}, "
                      f"identical to the two kernels': {same_detections(one.pop('_out'), two)}", flush=True)
                ours = {**ours, **one}
            for name, r in ours.items():
                rows.append((f"{name} {dtype}", batch, r))
                record[f"{name} {dtype}/b{batch}"] = r
            for step, kernel, mode in (("decode", decode, "deepjit decode alone (graph + memset)"),
                                       ("nms", nms, "deepjit nms alone (graph + copy)")):
                moved = traffic(load_contract(kernel.contract_path), kernel.params, batch, cands[batch]).total
                measured[(batch, dtype, step)] = (ours[mode]["gpu_us"][0], moved)
        theirs = bench_torch(torch, torchvision, sets, max(20, args.iters // 4))
        cpu = bench_onnxrt(sites.get("float32") or decode_site(), sets, max(3, args.ort_iters // max(1, batch // 8)))
        print(f"batch {batch}: detections per image torch {theirs.pop('_dets')[:4]} onnxrt {cpu.pop('_dets')[:4]}",
              flush=True)
        for name, r in (("torch-eager", theirs), ("onnxrt-cpu", cpu)):
            rows.append((name, batch, r))
            record[f"{name}/b{batch}"] = r
        print(table([r for r in rows if r[1] == batch]), flush=True)
    moved_rows = traffic_rows(kernels, args.batches, cands, bandwidth)
    major, minor = nvrtc_version()
    header = (f"## {datetime.date.today().isoformat()}: {gpu.name} (sm_{gpu.sm}), driver CUDA "
              f"{gpu_mod.driver_version() // 1000}.{gpu_mod.driver_version() % 1000 // 10}, NVRTC {major}.{minor}, "
              f"torch {torch.__version__}, torchvision {torchvision.__version__}, {platform.python_implementation()} "
              f"{platform.python_version()}\n\nCommand: `{command}`\n\n")
    moved_table = traffic_table(moved_rows, bandwidth, str(spec_name), measured, max_batch)
    text = header + table(rows) + "\n\n" + moved_table + "\n"
    print("\n" + text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)
    if args.json:
        args.json.write_text(json.dumps({"header": header, "results": record, "traffic": moved_rows}, indent=1,
                                        default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
