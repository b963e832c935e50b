"""The `deepjit` command line. Exit codes: 0 ok, 1 accuracy gate failed, 2 bad input, 3 internal error."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import click

from . import __version__, store
from . import log as logsetup
from .build import build_pipeline
from .errors import DeepJITError
from .materialize import materialize_bundle
from .model.synth import write_synthetic
from .report import inspect_target, print_build
from .runtime.run import DEVICES, bench_bundle, format_bench, format_run, run_bundle
from .runtime.segments import ENGINE_CHOICES
from .serve.triton import KINDS, TritonOptions, export_triton
from .spec.load import json_schema
from .validation.gpu import validate_bundle

EXISTING = click.Path(exists=True, path_type=Path)
ENGINE = click.option("--engine", type=click.Choice(ENGINE_CHOICES), default="auto", show_default=True,
                      help="How segments run: auto (a plan where one runs here, else ONNX Runtime with a warning), "
                           "plan (a plan or exit 2 with why not), onnxruntime.")


def _emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="deepjit")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging on stderr.")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors on stderr.")
def cli(verbose: bool, quiet: bool) -> None:
    """DeepJIT: cut the small-kernel wall out of an ONNX model and replace it with JIT CUDA kernels."""
    logsetup.setup(verbose, quiet)


@cli.command()
@click.argument("spec", type=click.Path(path_type=Path))
@click.option("--dry-run", is_flag=True, help="Check the spec and model, print the plan, build nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option("--no-publish", is_flag=True, help="Skip the spec's `publish:` step.")
def build(spec: Path, dry_run: bool, as_json: bool, no_publish: bool) -> None:
    """Build the pipeline described by SPEC (a YAML file)."""
    result = build_pipeline(spec, dry_run=dry_run, publish=not no_publish)
    _emit_json(result.to_dict()) if as_json else print_build(result)
    if result.gate_failed:
        sys.exit(1)


@cli.command()
def schema() -> None:
    """Print the JSON Schema of the spec language (for editors)."""
    _emit_json(json_schema())


@cli.group()
def model() -> None:
    """Model utilities."""


@model.command("synth")
@click.argument("variant", type=click.Choice(["yolov8n", "yolov8s"]))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Where to write the ONNX file.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dynamic", is_flag=True, help="Symbolic batch/height/width, anchors computed in the graph.")
@click.option("--head-layout", type=click.Choice(["separate", "split"]), default="separate", show_default=True,
              help="split: box+class maps concatenated then Split (older ultralytics); separate: two Concats.")
@click.option("--batch", type=int, default=None, help="A fixed batch size (default: symbolic 'batch').")
def model_synth(variant: str, output: Path, seed: int, dynamic: bool, head_layout: str, batch: int | None) -> None:
    """Write a synthetic YOLOv8 detection ONNX whose graph matches an ultralytics export."""
    path = write_synthetic(variant, output, seed=seed, dynamic=dynamic, head_layout=head_layout, batch=batch)
    click.echo(f"wrote {path}")


@cli.command()
@click.argument("target", type=EXISTING)
@click.option("--suggest-cuts", is_flag=True, help="Find the small-kernel wall and propose `cuts:`.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON on stdout.")
def inspect(target: Path, suggest_cuts: bool, as_json: bool) -> None:
    """Describe an ONNX model or a DeepJIT bundle (a folder or .tar.gz)."""
    info = inspect_target(target, suggest_cuts=suggest_cuts)
    _emit_json(info.data) if as_json else click.echo(info.text)


@cli.command()
@click.argument("bundle", type=EXISTING)
@click.option("-i", "--input", "inputs", multiple=True, required=True, type=EXISTING,
              help="Image (.jpg/.png: needs Pillow), .npy/.npz, or a folder of them; repeat for more.")
@click.option("--out", type=click.Path(path_type=Path), help="Write the detections as JSON here.")
@click.option("--prefer", type=click.Choice(["auto", "cubin", "ptx"]), default="auto", show_default=True)
@click.option("--no-graph", is_flag=True, help="Plain kernel launches instead of CUDA graph replay.")
@click.option("--device", type=click.Choice(DEVICES), default="gpu", show_default=True,
              help="cpu: the bundle's ONNX segments and its kernels' ONNX references on ONNX Runtime's CPU provider.")
@ENGINE
@click.option("--json", "as_json", is_flag=True)
def run(bundle: Path, inputs, out, prefer, no_graph, device, engine, as_json) -> None:
    """Run BUNDLE on images or tensors on this GPU (or the CPU); boxes are mapped back to the original images."""
    result = run_bundle(bundle, list(inputs), out, prefer=prefer, graphs=not no_graph, device=device, engine=engine)
    _emit_json(result) if as_json else click.echo(format_run(result))


@cli.command()
@click.argument("bundle", type=EXISTING)
@click.option("--batch", "batches", default=None, help="Comma-separated batch sizes (default: the bundle's buckets).")
@click.option("--no-graph", is_flag=True, help="Plain kernel launches instead of CUDA graph replay.")
@click.option("--warmup", type=int, default=10, show_default=True)
@click.option("--iters", type=int, default=100, show_default=True)
@click.option("--prefer", type=click.Choice(["auto", "cubin", "ptx"]), default="auto", show_default=True)
@click.option("--device", type=click.Choice(DEVICES), default="gpu", show_default=True,
              help="cpu: the bundle's ONNX segments and its kernels' ONNX references on ONNX Runtime's CPU provider.")
@ENGINE
@click.option("--json", "as_json", is_flag=True)
def bench(bundle: Path, batches, no_graph, warmup, iters, prefer, device, engine, as_json) -> None:
    """Latency p50/p95/p99 (whole call and GPU part), throughput, launches and host<->device bytes per call."""
    try:
        sizes = [int(b) for b in batches.split(",")] if batches else None
    except ValueError:
        raise click.BadParameter(f"{batches!r}: give batch sizes like 1,8,32", param_hint="--batch") from None
    result = bench_bundle(bundle, sizes, graphs=not no_graph, warmup=warmup, iters=iters, prefer=prefer,
                          device=device, engine=engine)
    _emit_json(result) if as_json else click.echo(format_bench(result))


@cli.command()
@click.argument("bundle", type=EXISTING)
@ENGINE
@click.option("--json", "as_json", is_flag=True)
def validate(bundle: Path, engine: str, as_json: bool) -> None:
    """Re-run the validation levels this machine can run (kernels, end_to_end and the plans' engine level on
    a GPU) and record them."""
    updated, levels = validate_bundle(bundle, engine=engine)
    record = updated.manifest["validation"]
    if as_json:
        _emit_json(record)
    else:
        for name, level in record["levels"].items():
            click.echo(f"{name:11} {level['status']:8} {level.get('reason', '')}")
    if any(level.status == "failed" for level in levels):
        sys.exit(1)


@cli.group()
def export() -> None:
    """Export a bundle for a serving system."""


@export.command("triton")
@click.argument("bundle", type=EXISTING)
@click.argument("repo", type=click.Path(path_type=Path))
@click.option("--name", help="Model name (default: the bundle's name); REPO/NAME is written.")
@click.option("--version", "model_version", type=int, default=1, show_default=True, help="Model version folder.")
@click.option("--max-batch", type=int, help="max_batch_size (default: the profile's max batch).")
@click.option("--kind", type=click.Choice(KINDS), default="gpu", show_default=True,
              help="gpu: KIND_GPU instances run the bundle on their GPU; cpu: KIND_CPU instances on ONNX Runtime's "
                   "CPU provider (as run --device cpu).")
@click.option("--instances", type=int, default=1, show_default=True,
              help="Instances on each GPU (--kind gpu) or in all (--kind cpu).")
@click.option("--gpus", help="Comma-separated GPUs for the instances (default: every GPU the server sees).")
@click.option("--env", help="EXECUTION_ENV_PATH: absolute path of the serving Python environment (DeepJIT, numpy<2).")
@click.option("--no-dynamic-batching", is_flag=True, help="Leave Triton's dynamic batcher off.")
@click.option("--max-queue-delay-us", type=int, default=100, show_default=True,
              help="How long the dynamic batcher may hold a request to make a larger batch.")
@click.option("--json", "as_json", is_flag=True)
def export_triton_cmd(bundle: Path, repo: Path, name, model_version, max_batch, kind, instances, gpus, env,
                      no_dynamic_batching, max_queue_delay_us, as_json) -> None:
    """Write BUNDLE as a Triton Inference Server model in the model repository REPO (REPO/NAME/: config.pbtxt,
    VERSION/model.py and the bundle), for Triton's Python backend."""
    try:
        devices = tuple(int(g) for g in gpus.split(",")) if gpus else None
    except ValueError:
        raise click.BadParameter(f"{gpus!r}: give GPU numbers like 0,1", param_hint="--gpus") from None
    result = export_triton(bundle, repo, TritonOptions(name, model_version, max_batch, kind, instances, devices, env,
                                                       not no_dynamic_batching, max_queue_delay_us))
    if as_json:
        _emit_json({"model_dir": str(result.model_dir), "name": result.name, "version": result.version,
                    "bundle_digest": result.bundle_digest, "boxes_in": "image" if result.maps_boxes else "input"})
    else:
        click.echo(f"wrote {result.model_dir} (model {result.name}, version {result.version}, bundle "
                   f"{result.bundle_digest})")


@cli.command()
@click.argument("bundle", type=EXISTING)
@click.option("--timing-cache", type=click.Path(path_type=Path), help="TensorRT timing cache to load and save.")
def materialize(bundle: Path, timing_cache: Path | None) -> None:
    """Build TensorRT plans of BUNDLE's segments on this (target) GPU (deferred ones, or beside its
    TensorRT-RTX plans), check and record them."""
    info, report = materialize_bundle(bundle, timing_cache=timing_cache)
    click.echo(f"materialized {info.path} ({info.digest})")
    if not report.passed:
        click.echo("\n".join(report.failures()), err=True)
        sys.exit(1)


@cli.command()
@click.argument("bundle", type=EXISTING)
@click.argument("ref")
@click.option("--force", is_flag=True, help="Move an existing tag that points at different content.")
@click.option("--json", "as_json", is_flag=True)
def push(bundle: Path, ref: str, force: bool, as_json: bool) -> None:
    """Push BUNDLE (folder or .tar.gz) to REF: file://PATH:TAG, oci://HOST[:PORT]/REPO:TAG, or a bare TAG."""
    result = store.push(bundle, ref, force=force)
    data = {"ref": result.ref, "digest": result.digest, "pinned": result.pinned}
    _emit_json(data) if as_json else click.echo(f"pushed {result.ref}\ndigest {result.digest}\npinned {result.pinned}")


@cli.command()
@click.argument("ref")
@click.argument("dest", required=False, type=click.Path(path_type=Path))
def pull(ref: str, dest: Path | None) -> None:
    """Pull REF into DEST (default ./TAG), verifying every digest."""
    click.echo(f"pulled {ref} into {store.pull(ref, dest)}")


@cli.command("ls")
@click.argument("store_url", metavar="STORE")
@click.option("--json", "as_json", is_flag=True)
def ls_(store_url: str, as_json: bool) -> None:
    """List the tags in STORE (file://PATH or oci://HOST[:PORT]/REPO)."""
    entries = store.ls(store_url)
    if as_json:
        _emit_json([{"tag": e.tag, "digest": e.digest, "name": e.name, "size": e.size} for e in entries])
    else:
        for e in entries:
            click.echo(f"{e.tag:30} {e.digest}  {e.name or ''} {e.size or ''}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors print one message (exit 2, or 1 for the gate); bugs show a traceback (3)."""
    try:
        cli.main(args=argv, prog_name="deepjit", standalone_mode=False)
        return 0
    except DeepJITError as e:
        click.echo(f"error: {e}", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 2
    except click.ClickException as e:
        e.show()
        return 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    except Exception:
        traceback.print_exc()
        click.echo("error: internal error in DeepJIT (a bug): please report the traceback above", err=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
