"""Benchmark (not a test): a bundle served by a real Triton Inference Server on loopback, under load.

    python3 bench/triton_load.py BUNDLE [--kind cpu|gpu] [--clients 8] [--requests 400] [--batch 1]
                                 [--queue-delay-us 2000] [--env PATH] [--append bench/RESULTS.md] [--json out.json]

It exports BUNDLE twice into one temporary model repository (`deepjit export triton`): `batched`, with
Triton's dynamic batcher (the bundle's buckets preferred, --queue-delay-us), and `unbatched`, without
it; starts nvidia-pytriton's tritonserver on 127.0.0.1 (deepjit_compiler.serve.local) and, for each
model, after a warm-up, has --clients threads (each its own gRPC client) send --requests requests in
all, each of --batch seeded random inputs at the profile's opt shape, one at a time per client. It
reports throughput (inferences per second over the whole run), request latency p50/p99 as each
client saw it, and the mean batch Triton executed (its inference statistics). Loopback only: nothing
leaves the machine. The models run in --env (default: this Python environment, which needs numpy < 2).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpc

from deepjit_compiler.bundle.folder import read_bundle
from deepjit_compiler.runtime.layout import Layout
from deepjit_compiler.serve.local import LocalTritonServer, statistics_after
from deepjit_compiler.serve.triton import TritonOptions, export_triton

TRITON_TYPES = {"uint8": "UINT8", "float32": "FP32", "float16": "FP16", "int32": "INT32", "int64": "INT64"}


def inputs_for(layout: Layout, batch: int, seed: int = 0) -> list[tuple[str, np.ndarray, str]]:
    """(name, array, Triton dtype) per input: the profile's opt shape at `batch`, seeded random values."""
    rng = np.random.default_rng(seed)
    out = []
    for i in layout.inputs:
        shape = (batch, *i.opt[1:])
        array = rng.integers(0, 256, shape, dtype=np.uint8) if i.dtype == "uint8" else \
            rng.uniform(0, 1, shape).astype(i.dtype)
        out.append((i.name, array, TRITON_TYPES[i.dtype]))
    return out


def request(client, model: str, inputs) -> None:
    infer_inputs = []
    for name, array, dtype in inputs:
        inp = grpc.InferInput(name, list(array.shape), dtype)
        inp.set_data_from_numpy(array)
        infer_inputs.append(inp)
    client.infer(model, infer_inputs)


def load(url: str, model: str, inputs, clients: int, requests: int) -> dict:
    """`requests` requests from `clients` threads; latencies in ms, throughput in inferences/s."""
    left, lock, latencies, errors = [requests], threading.Lock(), [], []

    def worker():
        with grpc.InferenceServerClient(url) as client:  # closed: an open connection holds the server's stop
            while True:
                with lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                t0 = time.perf_counter()
                try:
                    request(client, model, inputs)
                except Exception as e:  # noqa: BLE001  (counted and reported: the run must say it was not clean)
                    errors.append(str(e))
                    continue
                latencies.append((time.perf_counter() - t0) * 1e3)

    with grpc.InferenceServerClient(url) as stats:
        before = stats.get_inference_statistics(model, as_json=True)["model_stats"][0]
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        batch = inputs[0][1].shape[0]
        after = statistics_after(lambda: stats.get_inference_statistics(model, as_json=True)["model_stats"][0],
                                 before, {"inference_count": len(latencies) * batch})
    executions = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
    inferences = int(after.get("inference_count", 0)) - int(before.get("inference_count", 0))
    return {"model": model, "requests": len(latencies), "errors": len(errors), "first_error": errors[:1],
            "wall_s": wall, "throughput": len(latencies) * batch / wall,
            "p50_ms": float(np.percentile(latencies, 50)), "p99_ms": float(np.percentile(latencies, 99)),
            "mean_ms": float(np.mean(latencies)), "inferences": inferences, "executions": executions,
            "mean_batch": inferences / executions if executions else 0.0}


def machine(kind: str) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    text = f"{cpu}, {os.cpu_count()} CPUs, CPython {platform.python_version()}, numpy {np.__version__}"
    if kind == "gpu":
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        name, _, driver = (smi.stdout.strip().splitlines() or ["GPU ?"])[0].partition(", ")
        text = f"{name} (driver {driver or '?'}); {text}"
    return text


def table(rows: list[dict], args, layout: Layout) -> str:
    lines = ["| model | dynamic batching | clients | requests x batch | throughput (inf/s) | p50 ms | p99 ms | "
             "mean executed batch | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        batching = f"on ({args.queue_delay_us} us, preferred {[b for b in layout.buckets if b > 1]})" \
            if r["model"] == "batched" else "off"
        lines.append(f"| {r['model']} | {batching} | {args.clients} | {r['requests']} x {args.batch} | "
                     f"{r['throughput']:.1f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['mean_batch']:.2f} | "
                     f"{r['errors']} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--kind", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--instances", type=int, default=1, help="instances (per GPU with --kind gpu)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--warmup", type=int, default=8, help="requests per model before the timed run")
    p.add_argument("--batch", type=int, default=1, help="inputs per request")
    p.add_argument("--queue-delay-us", type=int, default=2000)
    p.add_argument("--env", default=sys.prefix, help="EXECUTION_ENV_PATH (default: this environment)")
    p.add_argument("--append", type=Path, help="append the results as a section of this Markdown file")
    p.add_argument("--json", type=Path)
    p.add_argument("--log", type=Path, help="keep tritonserver's log here")
    args = p.parse_args()

    bundle = read_bundle(args.bundle)
    layout = Layout.from_bundle(bundle)
    inputs = inputs_for(layout, args.batch)
    with tempfile.TemporaryDirectory(prefix="deepjit-triton-load-") as tmp:
        repo = Path(tmp) / "repo"
        for name, batching in (("batched", True), ("unbatched", False)):
            export_triton(bundle, repo, TritonOptions(name=name, kind=args.kind, instances=args.instances,
                                                      env=args.env, dynamic_batching=batching,
                                                      max_queue_delay_us=args.queue_delay_us))
        with LocalTritonServer(repo, log_file=args.log) as server, grpc.InferenceServerClient(server.grpc_url) as warm:
            rows = []
            for model in ("unbatched", "batched"):
                for _ in range(args.warmup):
                    request(warm, model, inputs)
                rows.append(load(server.grpc_url, model, inputs, args.clients, args.requests))
    text = table(rows, args, layout)
    print(text)
    command = "python3 bench/triton_load.py " + " ".join(sys.argv[1:])
    if args.append:
        when = datetime.date.today().isoformat()
        section = (f"\n## {when}: {machine(args.kind)} — Triton Inference Server (nvidia-pytriton's tritonserver, "
                   f"Python backend), KIND_{args.kind.upper()}, gRPC on loopback\n\n"
                   f"Bundle {bundle.name} ({bundle.digest[:19]}…), inputs "
                   f"{', '.join(f'{n} {list(a.shape)} {a.dtype}' for n, a, _ in inputs)}.\n"
                   f"Command: `{command}`\n\n{text}\n")
        with args.append.open("a") as f:
            f.write(section)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": machine(args.kind), "bundle": bundle.digest,
                                         "rows": rows}, indent=2) + "\n")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
