"""Write a yolov8_decode variant that reads anchor-major head maps (a bench experiment, not a test).

    python3 bench/anchor_major.py OUT_DIR
    python3 bench/decode_variants.py l2=yolov8_decode:lanes_per_anchor=2 \\
        b2=OUT_DIR/yolov8_decode.yaml:lanes_per_anchor=2 c2=OUT_DIR/yolov8_decode.yaml:lanes_per_anchor=2,class_nhwc=1 \\
        --anchor-major b2 c2 --anchor-major-classes c2 --batches 8 32

The shipped contract, its template and headers copied to OUT_DIR, with the template changed so that each
level's box map is read as [B, H, W, 4 reg_max] (a candidate's 64 box logits in 4 sectors, not one sector
each as in [B, 64, H, W]) and, with its param class_nhwc=1, each class map as [B, H, W, nc]. Those are
the memory of TensorRT's HWC8 output format for fp16 maps whose channels are a multiple of 8 (64 and
80): what an engine could hand the decode instead of reformatting its convs' output to NCHW. Candidates
mode with anchors_per_thread 1 only (the static_asserts say so).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_edits import write_decode_variant  # noqa: E402

# (shipped text, its replacement): each shipped text must occur exactly once
TEMPLATE_EDITS = [
    ("""{% macro fold_classes(first, count, unroll='') %}
""", """{% macro fold_classes(first, count, unroll='') %}
{% if class_nhwc %}
    // Anchor-major class maps ([B, H, W, NC]): an anchor's classes contiguous, four in one load.
    static_assert(VV == 1 && NC % 4 == 0 && ({{ count }}) % 4 == 0, "class_nhwc: one anchor, classes by 4");
#pragma unroll
    for (int k = 0; k < {{ count }}; k += 4) {
        const int c = {{ first }} + k;
        if (c < NC) {
            float v4[4];
            deepjit::load_vec<4>(L.cls + (size_t)p * NC + c, v4);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (v4[i] > best[0]) { prev[0] = best[0]; best[0] = v4[i]; arg[0] = c + i; }
            }
        }
    }
{% else %}
"""),
    ("""                if (v[j] > best[j]) { prev[j] = best[j]; best[j] = v[j]; arg[j] = c; }
            }
        }
    }
{%- endmacro %}""", """                if (v[j] > best[j]) { prev[j] = best[j]; best[j] = v[j]; arg[j] = c; }
            }
        }
    }
{% endif %}
{%- endmacro %}"""),
    ("L.cls[(size_t)c * L.cs + p]", "L.cls[{{ '(size_t)p * NC + c' if class_nhwc else '(size_t)c * L.cs + p' }}]"),
    ("""    float x[REG][VV];
#pragma unroll
    for (int r = 0; r < REG; ++r) deepjit::load_vec<VV>(box + (size_t)(k * REG + r) * cs + p, x[r]);
""", """    // Anchor-major box maps ([B, H, W, 4 REG]): the anchor's side is REG contiguous logits.
    static_assert(VV == 1 && REG % 8 == 0, "anchor-major box maps: one anchor a call, REG a multiple of 8");
    float x[REG][VV], row[REG];
#pragma unroll
    for (int r = 0; r < REG; r += 8) deepjit::load_vec<8>(box + (size_t)p * (4 * REG) + k * REG + r, row + r);
#pragma unroll
    for (int r = 0; r < REG; ++r) x[r][0] = row[r];
"""),
]
CONTRACT_EDIT = ("  block: {type: int, default: 128",
                 '  class_nhwc: {type: int, default: 0, allowed: [0, 1], doc: "class maps anchor-major too"}\n'
                 "  block: {type: int, default: 128")


def write_variant(out: Path) -> Path:
    """The variant's contract folder at `out`; returns its contract's path."""
    return write_decode_variant(out, TEMPLATE_EDITS, [CONTRACT_EDIT])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(write_variant(Path(sys.argv[1])))
