"""PASCAL VOC2007 detection AP, as the official devkit (VOCevaldet.m, VOC2007) computes it.

Per class: detections of all images sorted by descending score; each is matched to the ground-truth
box of that class in its image with the largest IoU; if that IoU >= 0.5, the match is a true positive
when the box is not difficult and not yet taken, a false positive when it was already taken (a
duplicate), and ignored (neither) when the box is difficult; otherwise a false positive. Recall is over
the non-difficult boxes. AP is the VOC2007 11-point interpolation: the mean over t = 0, 0.1, ..., 1 of
the highest precision at recall >= t (0 when that recall is never reached). Boxes are continuous XYXY
(a VOC box (xmin, ymin, xmax, ymax) is (xmin - 1, ymin - 1, xmax, ymax)), so the plain IoU here is
the devkit's "+1" IoU.

rule="py-faster-rcnn" is the rule of py-faster-rcnn's Python `voc_eval` (lib/datasets/voc_eval.py), which
produced the paper's Faster R-CNN number: a match needs IoU > 0.5 (strictly), and the 11-point thresholds
are np.arange(0, 1.1, 0.1) compared exactly (`rec >= t`), so 0.3, 0.6 and 0.7 are 0.30000000000000004,
0.6000000000000001 and 0.7000000000000001 and a recall of exactly 3/10, 6/10 or 7/10 misses them. Both
differ from the devkit only on ties: an IoU of exactly 0.5, a recall of exactly k/10 (up to 6.4 AP points
on one class, tests/test_voc.py)."""
from __future__ import annotations

import numpy as np

RULES = ("devkit", "py-faster-rcnn")


def iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    ix = np.clip(np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0]), 0, None)
    iy = np.clip(np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1]), 0, None)
    inter = ix * iy
    union = (box[2] - box[0]) * (box[3] - box[1]) + (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) - inter
    return inter / np.maximum(union, 1e-12)


def ap_11point(recall: np.ndarray, precision: np.ndarray, rule: str = "devkit") -> float:
    # The devkit's t = 0:0.1:1 are k/10; np.arange's are not (0.30000000000000004): a tolerance for the
    # devkit, the exact comparison for py-faster-rcnn.
    tol = 1e-12 if rule == "devkit" else 0.0
    ap = 0.0
    for t in np.arange(0.0, 1.1, 0.1):
        p = precision[recall >= t - tol]
        ap += (p.max() if p.size else 0.0) / 11.0
    return float(ap)


def class_ap(dets: list[tuple[int, float, np.ndarray]], gts: dict[int, tuple[np.ndarray, np.ndarray]],
             min_iou: float = 0.5, rule: str = "devkit") -> float:
    """AP of one class. dets: (image, score, box); gts: image -> (boxes (n, 4), difficult (n,)) of this
    class. NaN when the class has no non-difficult box (the mean then leaves it out)."""
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}; choose one of: {', '.join(RULES)}")
    npos = sum(int((~d).sum()) for _, d in gts.values())
    if npos == 0:
        return float("nan")
    order = np.argsort(-np.array([s for _, s, _ in dets], dtype=np.float64), kind="stable")
    taken = {img: np.zeros(len(b), dtype=bool) for img, (b, _) in gts.items()}
    tp, fp = np.zeros(len(dets)), np.zeros(len(dets))
    for k, j in enumerate(order):
        img, _, box = dets[j]
        if img not in gts or len(gts[img][0]) == 0:
            fp[k] = 1
            continue
        boxes, difficult = gts[img]
        ov = iou(np.asarray(box, dtype=np.float64), boxes.astype(np.float64))
        m = int(np.argmax(ov))
        if (ov[m] >= min_iou) if rule == "devkit" else (ov[m] > min_iou):
            if difficult[m]:
                continue  # neither a true nor a false positive
            if not taken[img][m]:
                tp[k], taken[img][m] = 1, True
            else:
                fp[k] = 1  # a duplicate detection
        else:
            fp[k] = 1
    tp, fp = np.cumsum(tp), np.cumsum(fp)
    recall = tp / npos
    precision = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
    return ap_11point(recall, precision, rule)


def voc07_map(detections: list[dict], ground_truth: list[dict], num_classes: int,
              rule: str = "devkit") -> tuple[float, list[float]]:
    """mAP in percent and the per-class APs (percent, NaN for a class without boxes) over labels 1..C.

    detections: per image {"image", "boxes" (n, 4), "scores" (n,), "labels" (n,)};
    ground_truth: per image {"image", "boxes" (m, 4), "labels" (m,), "difficult" (m,)}."""
    aps = []
    for c in range(1, num_classes + 1):
        gts = {}
        for g in ground_truth:
            sel = np.asarray(g["labels"]) == c
            gts[g["image"]] = (np.asarray(g["boxes"], dtype=np.float64).reshape(-1, 4)[sel],
                               np.asarray(g["difficult"], dtype=bool)[sel])
        dets = []
        for d in detections:
            sel = np.nonzero(np.asarray(d["labels"]) == c)[0]
            boxes, scores = np.asarray(d["boxes"]).reshape(-1, 4), np.asarray(d["scores"])
            dets += [(d["image"], float(scores[i]), boxes[i]) for i in sel]
        aps.append(100.0 * class_ap(dets, gts, rule=rule))
    valid = [a for a in aps if not np.isnan(a)]
    return (float(np.mean(valid)) if valid else float("nan")), aps
