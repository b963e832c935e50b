"""Where the nms block's time goes (not a test): clock64() cycles per step of image 0's block.

    python3 bench/nms_profile.py [--batches 1 8] [--block 1024] [--chunk 512] [--cluster 1]
                                 [--contract kernels/nms.yaml] [--object-classes 80]

Compiles a copy of the nms contract's template with DJ_NMS_PROFILE defined (templates/deepjit_nms.cuh:
a mark after each block barrier, a step ending when its last warp gets there) and runs it on
bench/postprocess.py's data sets; the kernel prints one line per 64 launches ("nms slot profile" where
the image took the slot path: its counting pass, rows, settle, the cluster's exchange with --cluster
above 1, and output; a cluster's first block prints). Marks cost a few cycles each, so totals are a little
above the plain kernel's.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_variants import DECODE_PARAMS  # noqa: E402
from nms_variants import NMS_PARAMS  # noqa: E402
from postprocess import NC, REPO, bench_deepjit, decode_site, head_maps, object_classes  # noqa: E402

from deepjit_compiler.jit.contracts import load_contract  # noqa: E402
from deepjit_compiler.jit.nvrtc import compile_site_kernel  # noqa: E402
from deepjit_compiler.runtime import gpu as gpu_mod  # noqa: E402


def defined_copy(contract: Path, folder: Path, define: str = "DJ_NMS_PROFILE") -> Path:
    """The contract with its template and headers in `folder`, the template starting with `#define {define}`
    (bench/nms_floors.py's copies define DJ_NMS_STOP)."""
    c = load_contract(str(contract))
    for f in [c.template_path, *c.header_paths]:
        shutil.copy(f, folder / f.name)
    tpl = folder / c.template_path.name
    head, _, rest = tpl.read_text().partition("\n")  # after its first line, a {#- -#} comment that eats whitespace
    tpl.write_text(f"{head}\n#define {define}\n{rest}")
    shutil.copy(contract, folder / contract.name)
    return folder / contract.name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--cluster", type=int, default=1, help="nms's cluster: blocks an image (sm_90+)")
    ap.add_argument("--contract", type=Path, default=REPO / "kernels" / "nms.yaml")
    ap.add_argument("--object-classes", type=object_classes, default=NC,
                    help="as bench/postprocess.py's (1: a crowded frame of one class)")
    args = ap.parse_args(argv)
    import torch  # bench_deepjit holds the stream with torch's sleep kernel while it queues

    gpu = gpu_mod.Gpu()
    site = decode_site()
    decode = compile_site_kernel("yolov8_decode", {**DECODE_PARAMS, "lanes_per_anchor": 4}, site.facts, sm=gpu.sm)
    with tempfile.TemporaryDirectory() as tmp:
        ref = defined_copy(args.contract, Path(tmp))
        cluster = {"cluster": args.cluster} if args.cluster != 1 else {}  # older contracts lack it
        nms = compile_site_kernel(str(ref), {**NMS_PARAMS, "block": args.block, "chunk": args.chunk, **cluster},
                                  site.facts, sm=gpu.sm, spec_dir=".")
        for batch in args.batches:  # inside: the runtime reads the contract again
            print(f"== batch {batch} (plain, graph, then nms alone)", flush=True)
            sets = [head_maps(np.random.default_rng(batch), batch, args.object_classes)] * 4
            bench_deepjit(gpu, decode, nms, site, sets, 128, torch)
            gpu.sync()
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
