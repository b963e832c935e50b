"""A yolov8_decode contract variant for a bench experiment: the shipped contract, its template and headers
copied to a folder, with the template's and the contract's texts changed (bench/anchor_major.py,
bench/fused_cluster.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def edited(text: str, edits: list[tuple[str, str]], name: str) -> str:
    """`text` with each (old, new) applied; each old must occur exactly once, so a shipped change is caught."""
    for old, new in edits:
        if text.count(old) != 1:
            raise SystemExit(f"{name}: the text to change occurs {text.count(old)} times, not once: {old[:60]!r}")
        text = text.replace(old, new)
    return text


def write_decode_variant(out: Path, template_edits: list[tuple[str, str]],
                         contract_edits: list[tuple[str, str]]) -> Path:
    """The variant's contract folder at `out`; returns its contract's path."""
    out.mkdir(parents=True, exist_ok=True)
    for header in ("deepjit_common.cuh", "deepjit_nms.cuh"):
        shutil.copyfile(REPO / "templates" / header, out / header)
    template = REPO / "templates" / "yolov8_decode.cu.j2"
    (out / template.name).write_text(edited(template.read_text(), template_edits, str(template)))
    contract = REPO / "kernels" / "yolov8_decode.yaml"
    (out / contract.name).write_text(edited(contract.read_text(), contract_edits, str(contract)))
    return out / contract.name
