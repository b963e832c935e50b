"""The `deepjit` command line. Exit codes: 0 ok, 1 accuracy gate failed, 2 bad input, 3 internal error.

stdout carries only a command's result (its table, or with `--json` one JSON document, on every exit
code); everything logged, by DeepJIT or by the libraries it drives, goes to stderr.
"""
from __future__ import annotations

import contextlib
import errno
import json
import re
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import click

from . import __version__
from . import log as logsetup
from .choices import DEVICES, ENGINE_CHOICES, KINDS
from .errors import DeepJITError, GateFailed, OutputError

# Each command imports the stages it drives when it runs: importing them all here (onnx, GraphSurgeon,
# Polygraphy, ONNX Runtime, oras) took `deepjit --help` and every command ~1.5 s before any work.

EXISTING = click.Path(exists=True, path_type=Path)
ENGINE = click.option("--engine", type=click.Choice(ENGINE_CHOICES), default="auto", show_default=True,
                      help="How segments run: auto (a plan where one runs here, else ONNX Runtime with a warning), "
                           "plan (a plan or exit 2 with why not), onnxruntime.")
# What a terminal acts on rather than shows: C0 controls but tab and newline (ESC starts a sequence that
# can retitle the window or rewrite the screen), DEL, C1 controls (0x9b is CSI), and the bidi overrides.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every character a terminal would act on shown as an escape: what a command prints on a
    terminal can come from a pulled bundle's manifest (names, tensors) or a store, which are untrusted."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def _emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def json_option(what: str):
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print {what} as one JSON document on stdout (an error too: {{\"error\": ...}}).")


def _error_document(e: BaseException) -> dict:
    code = e.exit_code if isinstance(e, DeepJITError) else 3
    message = str(e) if isinstance(e, DeepJITError) else f"internal error in DeepJIT (a bug): {type(e).__name__}: {e}"
    error = {"error": {"type": type(e).__name__, "message": message, "exit_code": code}}
    result = getattr(e, "result", None)  # a GateFailed carries the build that the gate rejected
    return {**result.to_dict(), **error} if result is not None else error


@contextlib.contextmanager
def working(as_json: bool = False) -> Iterator[None]:
    """Around a command's work: whatever a library prints (Polygraphy and GraphSurgeon print their
    logs) goes to stderr, so stdout holds only the result; with `--json`, a failure still prints one
    JSON document on stdout before main() reports it on stderr and exits with its code."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except (click.exceptions.Exit, click.exceptions.Abort):
        raise
    except Exception as e:
        error = _user_error(e) or e
        if as_json:
            _emit_json(_error_document(error))
        if error is e:
            raise
        raise error from None


def _user_error(e: Exception) -> DeepJITError | None:
    """An OSError that is bad input or a full disk rather than a bug: a name in a path the user gave is
    too long, or the disk (stdout's too: `> /dev/full`) has no room for what is written."""
    if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG:
        return OutputError(f"{e.filename or 'a path'}: a name in this path is longer than the file system "
                           "allows (255 bytes a name on most)")
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"{e.filename or 'writing the output'}: {e.strerror}; free some space (or quota) "
                           "and run it again")
    return None


def _set_verbosity(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        logsetup.set_level(param.name)


def verbosity(f):
    """-v/-q, accepted before the subcommand (`deepjit -q build`), after it (`deepjit build -q`) and
    between a group and its command (`deepjit model -q synth`)."""
    f = click.option("-q", "--quiet", is_flag=True, expose_value=False, callback=_set_verbosity,
                     help="Only warnings and errors on stderr.")(f)
    return click.option("-v", "--verbose", is_flag=True, expose_value=False, callback=_set_verbosity,
                        help="Debug logging on stderr.")(f)


class _Group(click.Group):
    """Every subcommand and subgroup takes -v/-q too."""

    group_class = type  # `@cli.group()` makes one of these as well

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        verbosity(cmd)
        super().add_command(cmd, name)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="deepjit")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging on stderr.")
@click.option("-q", "--quiet", is_flag=True, help="Only warnings and errors on stderr.")
def cli(verbose: bool, quiet: bool) -> None:
    """DeepJIT: cut the small-kernel wall out of an ONNX model and replace it with JIT CUDA kernels."""
    logsetup.setup(verbose, quiet)


@cli.command()
@click.argument("spec", type=click.Path(path_type=Path))
@click.option("--dry-run", is_flag=True, help="Check the spec and model, print the plan, build and write nothing.")
@json_option("the build's result")
@click.option("--no-publish", is_flag=True, help="Skip the spec's `publish:` step.")
def build(spec: Path, dry_run: bool, as_json: bool, no_publish: bool) -> None:
    """Build the pipeline described by SPEC (a YAML file)."""
    from .build import build_pipeline
    from .report import print_build

    try:
        with working(as_json):
            result = build_pipeline(spec, dry_run=dry_run, publish=not no_publish)
    except GateFailed as e:
        if not as_json and e.result is not None:
            print_build(e.result)  # the tables say what failed; main() prints the failures on stderr
        raise
    _emit_json(result.to_dict()) if as_json else print_build(result)


@cli.command()
def schema() -> None:
    """Print the JSON Schema of the spec language (for editors)."""
    from .spec.load import json_schema

    with working(True):
        schema = json_schema()
    _emit_json(schema)


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
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
def model_synth(variant: str, output: Path, seed: int, dynamic: bool, head_layout: str, batch: int | None,
                force: bool) -> None:
    """Write a synthetic YOLOv8 detection ONNX whose graph matches an ultralytics export."""
    if (output.exists() or output.is_symlink()) and not force:
        raise OutputError(f"{output}: exists; refusing to overwrite it (use --force to replace it)")
    from .model.synth import write_synthetic

    with working():
        path = write_synthetic(variant, output, seed=seed, dynamic=dynamic, head_layout=head_layout, batch=batch)
    click.echo(f"wrote {path}")


@cli.command()
@click.argument("target", type=EXISTING)
@click.option("--suggest-cuts", is_flag=True, help="Find the small-kernel wall and propose `cuts:`.")
@json_option("the description")
def inspect(target: Path, suggest_cuts: bool, as_json: bool) -> None:
    """Describe an ONNX model or a DeepJIT bundle (a folder or .tar.gz)."""
    from .report import inspect_target

    with working(as_json):
        info = inspect_target(target, suggest_cuts=suggest_cuts)
    _emit_json(info.data) if as_json else click.echo(printable(info.text))


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
@json_option("the detections per input")
def run(bundle: Path, inputs, out, prefer, no_graph, device, engine, as_json) -> None:
    """Run BUNDLE on images or tensors on this GPU (or the CPU); boxes are mapped back to the original images."""
    from .runtime.run import format_run, run_bundle

    with working(as_json):
        result = run_bundle(bundle, list(inputs), out, prefer=prefer, graphs=not no_graph, device=device,
                            engine=engine)
    _emit_json(result) if as_json else click.echo(printable(format_run(result)))


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
@json_option("the latencies per batch size")
def bench(bundle: Path, batches, no_graph, warmup, iters, prefer, device, engine, as_json) -> None:
    """Latency p50/p95/p99 (whole call and GPU part), throughput, launches and host<->device bytes per call."""
    try:
        sizes = [int(b) for b in batches.split(",")] if batches is not None else None  # "" is a mistake too
    except ValueError:
        raise click.BadParameter(f"{batches!r}: give batch sizes like 1,8,32", param_hint="--batch") from None
    if sizes is not None and len(set(sizes)) != len(sizes):  # a size twice printed two rows of one bench
        raise click.BadParameter(f"{batches!r}: a batch size is given twice; give each once, like 1,8,32",
                                 param_hint="--batch")
    from .runtime.run import bench_bundle, format_bench

    with working(as_json):
        result = bench_bundle(bundle, sizes, graphs=not no_graph, warmup=warmup, iters=iters, prefer=prefer,
                              device=device, engine=engine)
    _emit_json(result) if as_json else click.echo(printable(format_bench(result)))


DATA = click.option("--data", type=click.Path(exists=True, file_okay=False, path_type=Path),
                    help="Validate on this folder (images, or <input>_<k>.npy batches) instead of the data the "
                         "bundle's spec names (random, or a folder inside the bundle).")


@cli.command()
@click.argument("bundle", type=EXISTING)
@ENGINE
@DATA
@json_option("the bundle's validation record")
def validate(bundle: Path, engine: str, data: Path | None, as_json: bool) -> None:
    """Re-run the validation levels this machine can run (kernels, end_to_end and the plans' engine level on
    a GPU) and record them."""
    from .validation.gpu import validate_bundle

    with working(as_json):
        updated, levels = validate_bundle(bundle, engine=engine, data=data)
    record = updated.manifest["validation"]
    if as_json:
        _emit_json(record)
    else:
        for name, level in record["levels"].items():
            click.echo(printable(f"{name:11} {level['status']:8} {level.get('reason', '')}"))
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
@json_option("the model folder, name, version and bundle digest")
def export_triton_cmd(bundle: Path, repo: Path, name, model_version, max_batch, kind, instances, gpus, env,
                      no_dynamic_batching, max_queue_delay_us, as_json) -> None:
    """Write BUNDLE as a Triton Inference Server model in the model repository REPO (REPO/NAME/: config.pbtxt,
    VERSION/model.py and the bundle), for Triton's Python backend."""
    try:
        devices = tuple(int(g) for g in gpus.split(",")) if gpus is not None else None
    except ValueError:
        raise click.BadParameter(f"{gpus!r}: give GPU numbers like 0,1", param_hint="--gpus") from None
    from .serve.triton import TritonOptions, export_triton

    options = TritonOptions(name, model_version, max_batch, kind, instances, devices, env, not no_dynamic_batching,
                            max_queue_delay_us)
    with working(as_json):
        result = export_triton(bundle, repo, options)
    if as_json:
        _emit_json({"model_dir": str(result.model_dir), "name": result.name, "version": result.version,
                    "bundle_digest": result.bundle_digest, "boxes_in": "image" if result.maps_boxes else "input"})
    else:
        click.echo(f"wrote {result.model_dir} (model {result.name}, version {result.version}, bundle "
                   f"{result.bundle_digest})")


@cli.command()
@click.argument("bundle", type=EXISTING)
@click.option("--timing-cache", type=click.Path(path_type=Path), help="TensorRT timing cache to load and save.")
@DATA
def materialize(bundle: Path, timing_cache: Path | None, data: Path | None) -> None:
    """Build TensorRT plans of BUNDLE's segments on this (target) GPU (deferred ones, or beside its
    TensorRT-RTX plans), check and record them."""
    from .materialize import materialize_bundle

    with working():
        info, report = materialize_bundle(bundle, timing_cache=timing_cache, data=data)
    click.echo(f"materialized {info.path} ({info.digest})")
    if not report.passed:
        click.echo("\n".join(report.failures()), err=True)
        sys.exit(1)


@cli.command()
@click.argument("bundle", type=EXISTING)
@click.argument("ref")
@click.option("--force", is_flag=True, help="Move an existing tag that points at different content.")
@json_option("the pushed reference and digest")
def push(bundle: Path, ref: str, force: bool, as_json: bool) -> None:
    """Push BUNDLE (folder or .tar.gz) to REF: file://PATH:TAG, oci://HOST[:PORT]/REPO:TAG, or a bare TAG."""
    from . import store

    with working(as_json):
        result = store.push(bundle, ref, force=force)
    data = {"ref": result.ref, "digest": result.digest, "pinned": result.pinned}
    _emit_json(data) if as_json else click.echo(f"pushed {result.ref}\ndigest {result.digest}\npinned {result.pinned}")


@cli.command()
@click.argument("ref")
@click.argument("dest", required=False, type=click.Path(path_type=Path))
def pull(ref: str, dest: Path | None) -> None:
    """Pull REF into DEST (default ./TAG), verifying every digest."""
    from . import store

    with working():
        where = store.pull(ref, dest)
    click.echo(f"pulled {ref} into {where}")


@cli.command("ls")
@click.argument("store_url", metavar="STORE")
@json_option("the tags")
def ls_(store_url: str, as_json: bool) -> None:
    """List the tags in STORE (file://PATH or oci://HOST[:PORT]/REPO): bundle, validation, size, digest."""
    from . import store
    from .report import format_store

    with working(as_json):
        entries = store.ls(store_url)
    if as_json:
        _emit_json([{"tag": e.tag, "digest": e.digest, "name": e.name, "size": e.size, "validation": dict(e.levels)}
                    for e in entries])
    else:
        click.echo(printable(format_store(store_url, entries)), nl=False)


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors print one message (exit 2, or 1 for the gate); bugs show a traceback (3)."""
    try:
        cli.main(args=argv, prog_name="deepjit", standalone_mode=False)
        return 0
    except DeepJITError as e:
        click.echo(printable(f"error: {e}"), err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 2
    except click.ClickException as e:  # bad usage, before a command ran (an option, a missing path)
        if "--json" in (sys.argv[1:] if argv is None else argv):
            _emit_json({"error": {"type": "UsageError", "message": e.format_message(), "exit_code": 2}})
        e.show()
        return 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    except Exception as e:
        if (error := _user_error(e)) is not None:  # one that came outside `working` (printing the result)
            click.echo(printable(f"error: {error}"), err=True)
            return error.exit_code
        traceback.print_exc()
        click.echo("error: internal error in DeepJIT (a bug): please report the traceback above", err=True)
        return 3


if __name__ == "__main__":
    sys.exit(main())
