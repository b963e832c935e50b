"""Benchmark (not a test): whole bundles on this GPU through the runtime, graph replay on and off.

    python3 bench/pipeline.py specs WORK [--build]        # yolov8n variant specs: native SM, T4, letterbox
    deepjit build WORK/yolov8n_native.yaml --no-publish   # (each of them; or --build above, GPU levels skipped)
    python3 bench/pipeline.py run WORK/out/yolov8n_native [WORK/out/yolov8n_t4 ...] [--batches 1 2 4 8]
        [--iters 50] [--json out.json]

`run` does what `deepjit run` and `deepjit bench` do: detections for a seeded image (PNG when Pillow
is there, else a uint8 .npy), then per batch p50/p95/p99 latency of the whole call and of its GPU part,
throughput and launches per inference, graphs on and off.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deepjit_compiler.runtime import gpu as gpu_mod  # noqa: E402
from deepjit_compiler.runtime.run import bench_bundle, format_bench, format_run, run_bundle  # noqa: E402


def write_specs(work: Path) -> dict[str, Path]:
    """The GPU tests' yolov8n variants (one place defines them: tests/runtime/test_runtime_gpu.py)."""
    spec = importlib.util.spec_from_file_location("runtime_gpu_tests", REPO / "tests/runtime/test_runtime_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    work.mkdir(parents=True, exist_ok=True)
    return module.write_specs(work, gpu_mod.Gpu().sm if gpu_mod.available() else 90)


def build(specs: dict[str, Path]) -> None:
    """Build each spec without the kernels/end_to_end levels (those are `deepjit validate`'s)."""
    from deepjit_compiler import build as build_module
    from deepjit_compiler.build import build_pipeline
    from deepjit_compiler.validation.gate import not_run

    why = "skipped by bench/pipeline.py: run `deepjit validate`"
    build_module.gpu_levels = lambda path, spec, report_dir=None: [not_run("kernels", why), not_run("end_to_end", why)]
    for name, spec in specs.items():
        print(f"built {name}: {build_pipeline(spec, publish=False).bundle.path}", flush=True)


def sample_inputs(folder: Path) -> list[Path]:
    rgb = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    try:
        from PIL import Image

        Image.fromarray(rgb).save(folder / "random.png")
        return [folder / "random.png"]
    except ImportError:
        np.save(folder / "random.npy", rgb[..., ::-1].copy())
        return [folder / "random.npy"]


def run(bundles: list[Path], batches: list[int] | None, iters: int, warmup: int) -> dict:
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        inputs = sample_inputs(Path(tmp))
        for bundle in bundles:
            result = run_bundle(bundle, inputs)
            print(format_run(result), flush=True)
            entry = {"run": result}
            for graphs in (True, False):
                bench = bench_bundle(bundle, batches, graphs=graphs, warmup=warmup, iters=iters)
                print(format_bench(bench) + "\n", flush=True)
                entry["bench_graphs" if graphs else "bench_plain"] = bench
            report[bundle.name] = entry
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    specs = sub.add_parser("specs", help="write the yolov8n variant specs into WORK")
    specs.add_argument("work", type=Path)
    specs.add_argument("--build", action="store_true", help="also build them (GPU levels skipped)")
    runp = sub.add_parser("run", help="run and bench bundles")
    runp.add_argument("bundles", type=Path, nargs="+")
    runp.add_argument("--batches", type=int, nargs="+", default=None, help="default: the bundle's buckets")
    runp.add_argument("--iters", type=int, default=50)
    runp.add_argument("--warmup", type=int, default=5)
    runp.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.cmd == "specs":
        written = write_specs(args.work)
        for name, path in written.items():
            print(f"{name} {path}")
        if args.build:
            build(written)
        return 0
    report = run(args.bundles, args.batches, args.iters, args.warmup)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
