"""Compare NMS outputs as detection sets: matched by class, IoU and score, never by order."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..surgery.references import box_iou

DETECTION_KEYS = ("num_dets", "boxes", "scores", "classes")  # what match_detections reads


@dataclass(frozen=True, slots=True)
class DetectionMatch:
    """How well one batch of detections matches its reference."""

    ref_count: int
    test_count: int
    matched: int
    min_iou: float
    max_score_diff: float
    passed: bool

    def describe(self) -> str:
        return (f"{self.matched}/{self.ref_count} reference detections matched ({self.test_count} produced), "
                f"min IoU {self.min_iou:.4f}, max score diff {self.max_score_diff:.2e}")



def match_detections(ref: dict[str, np.ndarray], test: dict[str, np.ndarray], *, min_iou: float = 0.99,
                     score_atol: float = 1e-3, count_tolerance: int = 0,
                     unmatched_fraction: float = 0.0) -> DetectionMatch:
    """Greedy matching, reference detections in descending score order, over every image of the batch.

    Passes when, in every image, the counts differ by at most the allowance and all but that many
    reference detections find an unmatched test detection of the same class with IoU >= min_iou and
    a score within score_atol. The allowance is `count_tolerance`, or `unmatched_fraction` of the
    image's reference detections when that is larger (a lossy precision flips a few near-ties).
    """
    ref_total = test_total = matched = 0
    worst_iou, worst_score = 1.0, 0.0
    passed = True
    for b in range(len(ref["num_dets"])):
        n_ref, n_test = int(ref["num_dets"][b]), int(test["num_dets"][b])
        ref_total, test_total = ref_total + n_ref, test_total + n_test
        t_boxes, t_scores = test["boxes"][b, :n_test], test["scores"][b, :n_test]
        t_classes = test["classes"][b, :n_test]
        free = np.ones(n_test, dtype=bool)
        hits = 0
        for i in np.argsort(-ref["scores"][b, :n_ref], kind="stable"):
            ok = free & (t_classes == ref["classes"][b, i])
            if not ok.any():
                continue
            ious = np.where(ok, box_iou(ref["boxes"][b, i], t_boxes), -1.0)
            j = int(np.argmax(ious))
            score_diff = abs(float(t_scores[j]) - float(ref["scores"][b, i]))
            if ious[j] >= min_iou and score_diff <= score_atol:
                free[j] = False
                hits += 1
                worst_iou, worst_score = min(worst_iou, float(ious[j])), max(worst_score, score_diff)
        matched += hits
        allowed = max(count_tolerance, int(unmatched_fraction * n_ref))
        if abs(n_ref - n_test) > allowed or n_ref - hits > allowed:
            passed = False
    return DetectionMatch(ref_total, test_total, matched, worst_iou, worst_score, passed)
