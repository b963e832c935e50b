"""COCO-style detection metrics (validation/detections.py), against cases worked out by hand.

The implementation was also checked against pycocotools' COCOeval on thousands of random cases while
it was written (docs/design.md); these tests pin the numbers a reader can recompute on paper.
"""
import numpy as np
import pytest

from deepjit_compiler.spec.models import DetectionTolerance
from deepjit_compiler.validation.detections import ImageDetections, evaluate_detections, images_from_batch, iou_matrix


def image(*dets, label="", capacity=None):
    """ImageDetections from (x1, y1, x2, y2, score, class) tuples."""
    a = np.array(dets, np.float64).reshape(-1, 6)
    return ImageDetections(a[:, :4], a[:, 4], a[:, 5].astype(np.int64), label, capacity)


def test_iou_matrix_by_hand():
    a = np.array([[0, 0, 10, 10], [0, 0, 10, 5]])
    b = np.array([[5, 0, 15, 10], [0, 0, 10, 10], [20, 20, 30, 30]])
    # [0,0,10,10] vs [5,0,15,10]: inter 50, union 150; vs itself 1; disjoint 0. [0,0,10,5] vs [5,0,15,10]: 25 / 125
    np.testing.assert_allclose(iou_matrix(a, b), [[1 / 3, 1, 0], [0.2, 0.5, 0]])


def test_identical_detections_score_one():
    ref = [image((0, 0, 10, 10, 0.9, 0), (20, 20, 40, 40, 0.6, 3)), image((5, 5, 9, 9, 0.7, 1))]
    m = evaluate_detections(ref, ref, threshold=0.25)
    got = (m.map50_95, m.map50, m.recall, m.precision, m.min_iou, m.max_score_diff)
    assert got == pytest.approx((1, 1, 1, 1, 1, 0))
    assert (m.total.reference, m.total.produced, m.total.matched, m.total.missed, m.total.extra) == (3, 3, 3, 0, 0)
    assert m.worst is None and m.images == 2


def test_average_precision_by_hand():
    """One class, two reference boxes; produced: a perfect box (0.9), a false one (0.8), and one of IoU
    0.62 with the second reference box (0.7).

    IoU 0.50, 0.55, 0.60: TP, FP, TP -> recall 0.5, 0.5, 1 and precision 1, 0.5, 2/3, made monotone
    1, 2/3, 2/3: the 51 recall points 0.00..0.50 read 1, the 50 points 0.51..1.00 read 2/3, so
    AP = (51 + 50 * 2/3) / 101. IoU 0.65 .. 0.95 (seven thresholds): TP, FP, FP -> recall stops at
    0.5: AP = 51 / 101. mAP50-95 = (3 * (51 + 100/3) + 7 * 51) / 1010 = 610 / 1010.
    """
    ref = [image((0, 0, 10, 10, 0.95, 0), (20, 0, 30, 10, 0.85, 0))]
    test = [image((0, 0, 10, 10, 0.9, 0), (50, 50, 60, 60, 0.8, 0), (20, 0, 30, 6.2, 0.7, 0))]
    m = evaluate_detections(ref, test, threshold=0.25)
    assert m.map50 == pytest.approx((51 + 50 * 2 / 3) / 101)
    assert m.map50_95 == pytest.approx(610 / 1010)
    assert m.recall == 1.0 and m.precision == pytest.approx(2 / 3)  # at IoU 0.5
    assert m.min_iou == pytest.approx(0.62) and m.max_score_diff == pytest.approx(0.15)
    assert (m.total.matched, m.total.missed, m.total.extra) == (2, 0, 1)


def test_the_precision_curve_is_made_monotone_before_it_is_read():
    """A false box first (0.9), then the two reference boxes (0.8, 0.7): precision 0, 1/2, 2/3 at recall
    0, 1/2, 1. Made monotone it is 2/3 at every recall point, so AP = 2/3 at every IoU (read as it
    is, the 101 points would give (0 + 50 * 1/2 + 50 * 2/3) / 101 = 0.578)."""
    ref = [image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.8, 0))]
    test = [image((50, 50, 60, 60, 0.9, 0), (0, 0, 10, 10, 0.8, 0), (20, 0, 30, 10, 0.7, 0))]
    m = evaluate_detections(ref, test, threshold=0.25)
    assert (m.map50, m.map50_95) == pytest.approx((2 / 3, 2 / 3))


def test_map50_is_read_at_iou_0_5_and_a_pair_at_exactly_0_5_matches():
    """[0, 0, 10, 5] on [0, 0, 10, 10]: inter 50, union 100, IoU exactly 0.5 (COCO: at or above the
    threshold). Matched at IoU 0.50 only: AP 1 there and 0 at 0.55 .. 0.95, so mAP50 1 and mAP50-95 1/10;
    each tolerance met exactly is no shortfall."""
    m = evaluate_detections([image((0, 0, 10, 10, 0.9, 0))], [image((0, 0, 10, 5, 0.9, 0))], threshold=0.25)
    assert (m.map50, m.map50_95, m.recall, m.min_iou, m.max_score_diff) == pytest.approx((1, 0.1, 1, 0.5, 0))
    exact = DetectionTolerance(min_map=0.1, min_map50=1, min_recall=1, min_precision=1, min_iou=0.5, score_atol=0)
    assert m.shortfalls(exact) == []


def test_map_is_the_mean_over_the_classes_the_reference_detects():
    """Class 0 perfect (AP 1); class 1 half found (AP 51/101 at every IoU); class 2 only produced: as in
    COCO it has no AP of its own, but it is a false positive in the precision."""
    ref = [image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.9, 1), (40, 0, 50, 10, 0.8, 1))]
    test = [image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.9, 1), (60, 0, 70, 10, 0.9, 2))]
    m = evaluate_detections(ref, test, threshold=0.25)
    assert m.map50_95 == pytest.approx((1 + 51 / 101) / 2) and m.map50 == pytest.approx((1 + 51 / 101) / 2)
    assert m.recall == pytest.approx(2 / 3) and m.precision == pytest.approx(2 / 3)


def test_greedy_matching_follows_coco():
    """The higher-scored detection takes its best reference box; the next one takes the box left."""
    ref = [image((0, 0, 10, 10, 0.9, 0), (2, 0, 12, 10, 0.9, 0))]
    # d1 overlaps both boxes at IoU 90/110 = 0.82 and takes the later of equals (COCO's `<`), the second;
    # d2 overlaps the second best (1.0) but it is taken: d2 gets the first (IoU 80/120 = 0.67 >= 0.5)
    test = [image((1, 0, 11, 10, 0.8, 0), (2, 0, 12, 10, 0.7, 0))]
    m = evaluate_detections(ref, test, threshold=0.25)
    assert m.recall == 1.0 and m.precision == 1.0 and m.total.matched == 2
    assert m.min_iou == pytest.approx(iou_matrix([[2, 0, 12, 10]], [[0, 0, 10, 10]])[0, 0])


def test_borderline_detections_near_the_threshold_are_excused_and_others_are_not():
    ref = [image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.26, 0))]   # the second is 0.01 above 0.25
    test = [image((0, 0, 10, 10, 0.9, 0), (40, 0, 50, 10, 0.255, 0))]  # and an extra one 0.005 above it
    strict = evaluate_detections(ref, test, threshold=0.25, margin=0.0)
    assert (strict.total.missed, strict.total.extra, strict.total.borderline) == (1, 1, 0)
    assert strict.recall == 0.5 and strict.precision == 0.5 and strict.map50 < 1
    banded = evaluate_detections(ref, test, threshold=0.25, margin=0.02)
    assert (banded.total.missed, banded.total.extra, banded.total.borderline) == (0, 0, 2)
    assert (banded.map50_95, banded.recall, banded.precision) == pytest.approx((1, 1, 1))
    # a detection 0.05 above the threshold is no borderline case: missing, it is a miss
    far = [image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.30, 0))]
    m = evaluate_detections(far, [image((0, 0, 10, 10, 0.9, 0))], threshold=0.25, margin=0.02)
    assert m.total.missed == 1 and m.recall == 0.5
    # without a known threshold there is no band
    assert evaluate_detections(ref, test, threshold=None, margin=0.02).total.borderline == 0
    # the band is closed: 0.375 is exactly 0.125 above 0.25 (all three exact in binary)
    edge = evaluate_detections([image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.375, 0))],
                               [image((0, 0, 10, 10, 0.9, 0))], threshold=0.25, margin=0.125)
    assert (edge.total.missed, edge.total.borderline, edge.recall) == (0, 1, 1.0)


def test_a_real_reference_detection_is_matched_before_a_borderline_one():
    """As COCO's ignored regions: P (0.9) overlaps the real R at IoU 80/120 = 2/3 and the borderline B
    (0.26, listed first) at IoU 1. At IoU 0.50 .. 0.65 P takes R (a true positive, AP 1); at 0.70 .. 0.95
    R is out of reach, P takes B and counts neither way while R is missed (AP 0): mAP50-95 4/10."""
    ref = [image((0, 0, 10, 10, 0.26, 0), (2, 0, 12, 10, 0.9, 0))]
    m = evaluate_detections(ref, [image((0, 0, 10, 10, 0.9, 0))], threshold=0.25, margin=0.02)
    assert (m.map50, m.map50_95, m.recall, m.precision, m.min_iou) == pytest.approx((1, 0.4, 1, 1, 2 / 3))
    assert (m.total.matched, m.total.missed, m.total.extra, m.total.borderline) == (1, 0, 0, 1)


def test_a_match_to_a_borderline_reference_detection_counts_neither_way():
    """P (0.26) matches only the borderline B; R is missed and Q is false. Recall 0/1 and precision
    0/(0 + 1): the P-B pair is no true positive, and B and P, matched, are not borderline leftovers.
    AP: Q a false positive, P ignored, no true one: 0."""
    ref = [image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.26, 0))]
    test = [image((20, 0, 30, 10, 0.26, 0), (50, 50, 60, 60, 0.8, 0))]
    m = evaluate_detections(ref, test, threshold=0.25, margin=0.02)
    assert (m.map50_95, m.map50, m.recall, m.precision) == (0.0, 0.0, 0.0, 0.0)
    assert (m.total.matched, m.total.missed, m.total.extra, m.total.borderline) == (1, 1, 1, 0)


def test_an_unmatched_borderline_detection_is_no_false_positive_in_the_ap():
    """P1 (0.9) and P2 (0.255, matched to R2 of 0.30: a true positive though in the band) around Pb
    (0.26, unmatched, borderline): Pb is ignored, so precision stays 1 up to recall 1 and AP is 1
    (counted as a false positive it would be (51 + 50 * 2/3) / 101)."""
    ref = [image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.30, 0))]
    test = [image((0, 0, 10, 10, 0.9, 0), (40, 0, 50, 10, 0.26, 0), (20, 0, 30, 10, 0.255, 0))]
    m = evaluate_detections(ref, test, threshold=0.25, margin=0.02)
    assert (m.map50_95, m.map50, m.recall, m.precision) == pytest.approx((1, 1, 1, 1))
    assert (m.total.matched, m.total.extra, m.total.borderline) == (2, 0, 1)


def test_a_full_image_cuts_at_its_last_score_too():
    """An image that kept max_det detections was cut at its lowest score: the band is around that cut."""
    ref = [image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.50, 0), capacity=2)]
    test = [image((0, 0, 10, 10, 0.9, 0), (40, 0, 50, 10, 0.51, 0), capacity=2)]  # another box won the slot
    m = evaluate_detections(ref, test, threshold=0.25, margin=0.02)
    assert (m.total.missed, m.total.extra, m.total.borderline) == (0, 0, 2) and m.map50_95 == pytest.approx(1)
    # with room for more, 0.50 and 0.51 were cut by nothing but the 0.25 threshold: a miss and an extra
    roomy = evaluate_detections([image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.50, 0), capacity=10)],
                                [image((0, 0, 10, 10, 0.9, 0), (40, 0, 50, 10, 0.51, 0), capacity=10)],
                                threshold=0.25, margin=0.02)
    assert (roomy.total.missed, roomy.total.extra, roomy.total.borderline) == (1, 1, 0)


def test_totals_and_the_worst_image_are_labelled():
    ref = [image((0, 0, 10, 10, 0.9, 0), label="a.png"), image((0, 0, 10, 10, 0.9, 0), (20, 0, 30, 10, 0.8, 1),
                                                              label="b.png")]
    test = [image((0, 0, 10, 10, 0.9, 0), label="a.png"), image(label="b.png")]
    m = evaluate_detections(ref, test, threshold=0.25)
    assert (m.total.reference, m.total.produced, m.total.matched, m.total.missed) == (3, 1, 1, 2)
    assert m.worst.label == "b.png" and (m.worst.reference, m.worst.matched, m.worst.missed) == (2, 0, 2)
    text = m.describe()
    assert "in total over 2 images: 1/3 matched (1 produced, 2 missed" in text
    assert "worst image b.png: 0/2 matched (0 produced, 2 missed" in text


def test_empty_sides():
    nothing = [image(), image()]
    m = evaluate_detections(nothing, nothing, threshold=0.25)
    assert (m.map50_95, m.recall, m.precision) == (1.0, 1.0, 1.0)  # nothing to find, nothing found
    spurious = evaluate_detections(nothing, [image((0, 0, 5, 5, 0.9, 0)), image()], threshold=0.25)
    assert (spurious.map50_95, spurious.precision, spurious.total.extra) == (0.0, 0.0, 1)
    lost = evaluate_detections([image((0, 0, 5, 5, 0.9, 0))], [image()], threshold=0.25)
    assert (lost.map50_95, lost.recall, lost.total.missed) == (0.0, 0.0, 1)
    # no matched pair: no IoU or score difference to fall short of
    assert m.shortfalls(DetectionTolerance()) == []
    assert not any("IoU" in s or "score" in s for s in lost.shortfalls(DetectionTolerance()))


def test_the_two_sides_must_have_as_many_images():
    with pytest.raises(ValueError, match="2 reference images but 1 produced"):
        evaluate_detections([image(), image()], [image()], threshold=0.25)


def test_images_from_an_efficientnms_batch():
    batch = {"num_dets": np.array([2, 0], np.int32), "boxes": np.zeros((2, 5, 4), np.float32),
             "scores": np.zeros((2, 5), np.float32), "classes": np.zeros((2, 5), np.int32)}
    batch["boxes"][0, :2] = [[0, 0, 4, 4], [1, 1, 3, 3]]
    batch["scores"][0, :3] = [0.9, 0.8, 0.7]  # the row past num_dets is not a detection
    batch["classes"][0, :2] = [3, 1]
    a, b = images_from_batch(batch, ["x.png"])
    assert (a.label, a.capacity, a.classes.tolist()) == ("x.png", 5, [3, 1])
    assert a.scores.tolist() == pytest.approx([0.9, 0.8])
    assert (b.label, len(b.scores)) == ("row 1", 0)


def test_shortfalls_name_the_metric_and_the_field():
    ref = [image((0, 0, 10, 10, 0.95, 0), (20, 0, 30, 10, 0.85, 0))]
    test = [image((0, 0, 10, 10, 0.9, 0), (50, 50, 60, 60, 0.8, 0), (20, 0, 30, 6.2, 0.7, 0))]
    m = evaluate_detections(ref, test, threshold=0.25)
    short = m.shortfalls(DetectionTolerance())
    assert "mAP50-95 0.604 < min_map 0.99" in short and "mAP50 0.835 < min_map50 0.99" in short
    assert "precision 0.667 < min_precision 0.99" in short
    assert any("IoU 0.6200 < min_iou 0.99" in s for s in short) and any("score_atol" in s for s in short)
    assert not any("recall" in s for s in short)
    perfect = evaluate_detections(ref, ref, threshold=0.25)  # COCO's eps makes it 0.9999999999999998
    assert perfect.shortfalls(DetectionTolerance(min_map=1, min_map50=1, min_recall=1, min_precision=1)) == []
