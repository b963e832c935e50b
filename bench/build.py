"""Benchmark (not a test): `deepjit build` of a spec cold, warm and after one edit, in a fresh folder.

    python3 bench/build.py [pipelines/yolov8_t4.yaml] [--json out.json]

cold: empty stage and kernel caches (the synthetic model is written first, outside the timings:
that is a first build's one-time cost); warm: the same spec again; edited: one precision tolerance
changed, so only the precision stage reruns (not published). Each build is a `deepjit build --json` subprocess
(publishing to the spec's store inside the folder), timed whole, interpreter start included, with
the stages its result lists as cached and the seconds per stage from its build report.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deepjit_compiler.model.source import resolve_model  # noqa: E402
from deepjit_compiler.spec.load import load_spec  # noqa: E402

EDIT = ("  gate: true", "  precision_tolerances:\n    default: {atol: 0.06, rtol: 0.05, check_error_stat: median}\n"
        "    detections: {min_iou: 0.5, score_atol: 0.05, min_map: 0.8}\n  gate: true")


def timed_build(spec: Path, env: dict, *extra: str) -> dict:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "deepjit_compiler.cli", "-q", "build", str(spec), "--json", *extra],
                       capture_output=True, text=True, env=env, cwd=spec.parent)
    seconds = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"build of {spec} exited {r.returncode}:\n{r.stderr[-3000:]}")
    result = json.loads(r.stdout)
    return {"seconds": round(seconds, 2), "cached": result["cached"], "stages": result["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default=str(REPO / "pipelines/yolov8_t4.yaml"))
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="deepjit-bench-build-") as tmp:
        work = Path(tmp)
        (work / "pipelines").mkdir()
        spec = work / "pipelines" / Path(args.spec).name
        shutil.copy(args.spec, spec)
        resolve_model(load_spec(spec))  # the synthetic model, outside the timings
        env = {**os.environ, "DEEPJIT_CACHE_DIR": str(work / "cache"), "DEEPJIT_CACHE_KEY_FILE": str(work / "key")}
        env.pop("DEEPJIT_KEEP_RUN_RESULTS", None)
        runs = {"cold": timed_build(spec, env), "warm": timed_build(spec, env)}
        assert EDIT[0] in spec.read_text(), "the spec has no `gate: true` line to edit after"
        spec.write_text(spec.read_text().replace(EDIT[0], EDIT[1]))
        runs["edited"] = timed_build(spec, env, "--no-publish")  # another bundle: its tag holds the first
    report = {"spec": str(args.spec), "cpus": os.cpu_count(), "python": sys.version.split()[0], "runs": runs}
    for name, run in runs.items():
        stages = ", ".join(f"{k} {v:.2f}" for k, v in run["stages"].items())
        print(f"{name:7} {run['seconds']:6.2f} s  cached: {', '.join(run['cached']) or '-':28} stages: {stages}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
