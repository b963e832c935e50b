"""Detections compared as sets, the way detector users judge accuracy: COCO-style average precision
of the pipeline's detections with the reference's as ground truth, recall and precision at IoU 0.5,
and a borderline band at the confidence threshold (docs/semantics.md, "Detection metrics").

The evaluation follows pycocotools' COCOeval (bbox) step by step. Per image and class, the produced
detections, in descending score order, each take the unmatched reference detection of best IoU at or
above the IoU threshold, preferring ones that are not ignored. Per class over all images, the
precision-recall curve is made monotone and read at 101 recall points; AP is their mean, mAP the
mean over the classes the reference detects, mAP50-95 the mean over IoU 0.50:0.05:0.95. Unlike
COCO there is no maxDets cap (the NMS's max_det caps the detections) and no area ranges.

The borderline band plays the part of COCO's ignored regions: a detection whose score lies within
`margin` of a score cut may be missing on the other side. The cuts of an image are the confidence
threshold and, on a side that kept `max_det` detections (its capacity), the score of the last one
kept. An unmatched borderline reference detection is not a miss, an unmatched borderline produced
one not a false positive, and a produced detection that matches only a borderline reference one
counts neither way.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)  # COCO's 0.50:0.05:0.95
RECALL_POINTS = np.linspace(0.0, 1.0, 101)   # COCO's 101-point interpolation
DETECTION_KEYS = ("num_dets", "boxes", "scores", "classes")  # a batch's arrays, EfficientNMS layout


@dataclass(frozen=True, slots=True)
class ImageDetections:
    """One image's detections: boxes [n, 4] as x1, y1, x2, y2, scores [n], classes [n]; `capacity`:
    the most there could be (max_det), None when unbounded."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray
    label: str = ""
    capacity: int | None = None


def images_from_batch(batch: Mapping[str, np.ndarray], labels: Sequence[str] = ()) -> list[ImageDetections]:
    """The rows of one batch in EfficientNMS's layout (DETECTION_KEYS) as per-image detections."""
    out = []
    for b, n in enumerate(np.asarray(batch["num_dets"]).reshape(-1)):
        n = int(n)
        out.append(ImageDetections(np.asarray(batch["boxes"][b, :n], np.float64),
                                   np.asarray(batch["scores"][b, :n], np.float64),
                                   np.asarray(batch["classes"][b, :n]).astype(np.int64),
                                   labels[b] if b < len(labels) else f"row {b}", int(batch["boxes"].shape[1])))
    return out


@dataclass(frozen=True, slots=True)
class ImageCounts:
    """One image at IoU 0.5: detections on each side, pairs matched, misses and false positives."""

    label: str
    reference: int
    produced: int
    matched: int
    missed: int      # reference detections unmatched, not borderline
    extra: int       # produced detections unmatched, not borderline
    borderline: int  # detections unmatched on either side but within the band: excused

    def describe(self) -> str:
        return (f"{self.matched}/{self.reference} matched ({self.produced} produced, {self.missed} missed, "
                f"{self.extra} extra, {self.borderline} borderline)")


@dataclass(frozen=True, slots=True)
class DetectionMetrics:
    """The pipeline's detections against the reference's, over every image."""

    map50_95: float
    map50: float
    recall: float      # at IoU 0.5, borderline detections left out
    precision: float   # at IoU 0.5, borderline detections left out
    min_iou: float     # over the pairs matched at IoU 0.5 (1 when there are none)
    max_score_diff: float
    total: ImageCounts
    worst: ImageCounts | None  # the image with the most misses + false positives (the first of equals)
    images: int = 0

    def to_dict(self) -> dict[str, float | int]:
        """The numbers a gate record stores (deterministic: same detections, same values)."""
        t = self.total
        return {"map50_95": round(self.map50_95, 6), "map50": round(self.map50, 6), "recall": round(self.recall, 6),
                "precision": round(self.precision, 6), "min_iou": round(self.min_iou, 6),
                "max_score_diff": round(self.max_score_diff, 6), "images": self.images, "reference": t.reference,
                "produced": t.produced, "matched": t.matched, "missed": t.missed, "extra": t.extra,
                "borderline": t.borderline}

    def shortfalls(self, tolerance) -> list[str]:
        """What falls short of a spec.DetectionTolerance, judged on the recorded (rounded) values."""
        m = self.to_dict()
        short = [f"{what} {m[key]:.3f} < {field} {getattr(tolerance, field)}" for what, key, field in
                 (("mAP50-95", "map50_95", "min_map"), ("mAP50", "map50", "min_map50"),
                  ("recall", "recall", "min_recall"), ("precision", "precision", "min_precision"))
                 if m[key] < getattr(tolerance, field)]
        if m["min_iou"] < tolerance.min_iou:
            short.append(f"a matched pair's IoU {m['min_iou']:.4f} < min_iou {tolerance.min_iou}")
        if m["max_score_diff"] > tolerance.score_atol:
            short.append(f"a matched pair's scores differ by {m['max_score_diff']:.2e} > score_atol "
                         f"{tolerance.score_atol}")
        return short

    def describe(self) -> str:
        text = (f"mAP50-95 {self.map50_95:.3f}, mAP50 {self.map50:.3f}, recall {self.recall:.3f}, precision "
                f"{self.precision:.3f} (IoU 0.5); in total over {self.images} images: {self.total.describe()}")
        if self.worst is not None:
            text += f"; worst image {self.worst.label}: {self.worst.describe()}"
        if self.total.matched:
            text += f"; matched pairs: min IoU {self.min_iou:.4f}, max score diff {self.max_score_diff:.2e}"
        return text


@dataclass
class _ClassRecord:
    """One class over all images: what accumulating its precision-recall curve needs."""

    scores: list[np.ndarray] = field(default_factory=list)
    matched: list[np.ndarray] = field(default_factory=list)   # [T, n] per image
    ignored: list[np.ndarray] = field(default_factory=list)   # [T, n] per image
    ground_truth: int = 0                                      # reference detections not borderline


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every x1, y1, x2, y2 box of `a` [n, 4] with every one of `b` [m, 4], as [n, m] (float64)."""
    a, b = np.asarray(a, np.float64).reshape(-1, 4), np.asarray(b, np.float64).reshape(-1, 4)
    lo, hi = np.maximum(a[:, None, :2], b[None, :, :2]), np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=2)
    area = lambda x: np.clip(x[:, 2] - x[:, 0], 0, None) * np.clip(x[:, 3] - x[:, 1], 0, None)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def _match(ious: np.ndarray, gt_ignored: np.ndarray, threshold: float) -> np.ndarray:
    """COCO's greedy matching for one IoU threshold: for each detection (rows, in descending score
    order) the index of its reference detection (columns, not-ignored first) or -1."""
    taken = np.zeros(ious.shape[1], dtype=bool)
    out = np.full(ious.shape[0], -1)
    for d in range(ious.shape[0]):
        best, m = min(threshold, 1 - 1e-10), -1
        for g in range(ious.shape[1]):
            if taken[g]:
                continue
            if m > -1 and not gt_ignored[m] and gt_ignored[g]:
                break  # matched a real one; only ignored ones are left
            if ious[d, g] < best:
                continue
            best, m = ious[d, g], g
        if m > -1:
            taken[m], out[d] = True, m
    return out


def _ap(record: _ClassRecord) -> np.ndarray:
    """AP at each IoU threshold of one class (pycocotools' accumulate): [T]."""
    scores = np.concatenate(record.scores)
    order = np.argsort(-scores, kind="mergesort")
    matched = np.concatenate(record.matched, axis=1)[:, order]
    ignored = np.concatenate(record.ignored, axis=1)[:, order]
    tp = np.cumsum(matched & ~ignored, axis=1).astype(np.float64)
    fp = np.cumsum(~matched & ~ignored, axis=1).astype(np.float64)
    out = np.zeros(len(IOU_THRESHOLDS))
    for t in range(len(IOU_THRESHOLDS)):
        if not tp.shape[1]:
            continue
        recall = tp[t] / record.ground_truth
        precision = tp[t] / (tp[t] + fp[t] + np.spacing(1))
        precision = np.maximum.accumulate(precision[::-1])[::-1]  # monotone: the best precision to the right
        at = np.searchsorted(recall, RECALL_POINTS, side="left")
        out[t] = np.where(at < len(precision), precision[np.minimum(at, len(precision) - 1)], 0.0).mean()
    return out


def evaluate_detections(reference: Sequence[ImageDetections], produced: Sequence[ImageDetections], *,
                        threshold: float | None = None, margin: float = 0.0) -> DetectionMetrics:
    """mAP50-95, mAP50, recall and precision of `produced` with `reference` as ground truth, image by
    image (the two sequences pair up). `threshold`: the confidence threshold both sides were cut at
    (None: unknown); a detection whose score is within `margin` of a cut is borderline."""
    if len(reference) != len(produced):
        raise ValueError(f"{len(reference)} reference images but {len(produced)} produced")
    classes: dict[int, _ClassRecord] = {}
    images, pairs, true_pos = [], [], 0
    for ref, test in zip(reference, produced):
        cuts = np.array([threshold] * (threshold is not None) + [side.scores.min() for side in (ref, test) if
                                                                 side.capacity and len(side.scores) >= side.capacity])

        def borderline(scores: np.ndarray, cuts=cuts) -> np.ndarray:
            return (np.abs(scores[:, None] - cuts[None, :]) <= margin).any(axis=1)

        counts = np.zeros(5, dtype=int)  # matched, missed, extra, borderline reference, borderline produced
        for c in sorted(set(ref.classes.tolist()) | set(test.classes.tolist())):
            g = np.flatnonzero(ref.classes == c)
            g = g[np.argsort(borderline(ref.scores[g]), kind="mergesort")]  # not-ignored first, as COCO
            d = np.flatnonzero(test.classes == c)
            d = d[np.argsort(-test.scores[d], kind="mergesort")]
            g_ignored, d_border = borderline(ref.scores[g]), borderline(test.scores[d])
            ious = iou_matrix(test.boxes[d], ref.boxes[g])
            match = np.stack([_match(ious, g_ignored, t) for t in IOU_THRESHOLDS]).reshape(len(IOU_THRESHOLDS), -1)
            matched = match > -1
            # COCO: a detection matched to an ignored reference one, or unmatched and itself ignored
            # (here: borderline), is neither a true nor a false positive.
            ignored = np.where(matched, np.append(g_ignored, False)[match], d_border[None, :])
            rec = classes.setdefault(c, _ClassRecord())
            rec.scores.append(test.scores[d])
            rec.matched.append(matched)
            rec.ignored.append(ignored)
            rec.ground_truth += int((~g_ignored).sum())
            hit = match[0]  # IOU_THRESHOLDS[0] is 0.5
            got = np.zeros(len(g), dtype=bool)
            got[hit[hit > -1]] = True
            counts += [int(matched[0].sum()), int((~got & ~g_ignored).sum()), int((~matched[0] & ~d_border).sum()),
                       int((~got & g_ignored).sum()), int((~matched[0] & d_border).sum())]
            true_pos += int((matched[0] & ~ignored[0]).sum())
            pairs += [(ious[i, hit[i]], abs(test.scores[d[i]] - ref.scores[g[hit[i]]]))
                      for i in np.flatnonzero(hit > -1)]
        images.append(ImageCounts(ref.label, len(ref.scores), len(test.scores), int(counts[0]), int(counts[1]),
                                  int(counts[2]), int(counts[3] + counts[4])))

    total = ImageCounts("total", *(sum(getattr(i, k) for i in images) for k in
                                   ("reference", "produced", "matched", "missed", "extra", "borderline")))
    judged = [r for r in classes.values() if r.ground_truth > 0]
    if judged:
        aps = np.stack([_ap(r) for r in judged])  # [classes, T]
        map50_95, map50 = float(aps.mean()), float(aps[:, 0].mean())
    else:  # the reference detects nothing outside the band: perfect unless something else was produced
        map50_95 = map50 = 0.0 if total.extra else 1.0
    ground_truth = sum(r.ground_truth for r in classes.values())
    worst = max(images, key=lambda i: (i.missed + i.extra, -images.index(i)), default=None)
    return DetectionMetrics(
        map50_95, map50, true_pos / ground_truth if ground_truth else 1.0,
        true_pos / (true_pos + total.extra) if true_pos + total.extra else 1.0,
        float(min((p[0] for p in pairs), default=1.0)), float(max((p[1] for p in pairs), default=0.0)),
        total, worst if worst is not None and worst.missed + worst.extra else None, len(images))
