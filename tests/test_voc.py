"""Table 2 (VOC detection): the devkit's VOC2007 AP on hand-worked cases, VOC prep of the tiny archives
and its bad inputs, tiny SSD and Faster R-CNN runs in fp32/fp16/mixed, real learning (trained SSD
beats untrained), parameter counts of the paper-size detectors, and Table 2 regenerated."""
import json
import re
import shutil
import tarfile
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from bad_input import assert_command_fails_in_one_line, rewrite_tar
from conftest import tiny_overrides
from data_prep.voc import prepare as prep
from data_prep.voc.tiny import generate
from experiments.voc_detection.voc_eval import ap_11point, voc07_map
from mpt.errors import UserError


# The small networks here run far faster on one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- VOC2007 AP


def gt(image, boxes, labels, difficult=None):
    return {"image": image, "boxes": np.array(boxes, float).reshape(-1, 4), "labels": np.array(labels),
            "difficult": np.array(difficult if difficult is not None else [False] * len(labels))}


def det(image, boxes, scores, labels):
    return {"image": image, "boxes": np.array(boxes, float).reshape(-1, 4), "scores": np.array(scores, float),
            "labels": np.array(labels)}


A, B, C = [0, 0, 10, 10], [20, 20, 40, 40], [50, 0, 70, 30]


def test_perfect_detector_is_100():
    gts = [gt(0, [A, B], [1, 2]), gt(1, [C], [1])]
    dets = [det(0, [A, B], [0.9, 0.8], [1, 2]), det(1, [C], [0.7], [1])]
    m, aps = voc07_map(dets, gts, 2)
    assert m == pytest.approx(100.0) and aps == [pytest.approx(100.0)] * 2


def test_duplicates_are_false_positives():
    # A (0.9, TP), A again (0.8, duplicate: FP), B (0.7, TP): precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1.
    # 11-point: t = 0 .. 0.5 -> 1 (6 points), t = 0.6 .. 1 -> 2/3 (5 points): (6 + 10/3) / 11.
    gts = [gt(0, [A, B], [1, 1])]
    dets = [det(0, [A, [0, 0, 10, 11], B], [0.9, 0.8, 0.7], [1, 1, 1])]
    m, _ = voc07_map(dets, gts, 1)
    assert m == pytest.approx(100 * (6 + 10 / 3) / 11)
    assert m < 100


def test_difficult_neither_helps_nor_hurts():
    gts = [gt(0, [A, B], [1, 1], [False, True])]
    hit_difficult = voc07_map([det(0, [B, A], [0.9, 0.8], [1, 1])], gts, 1)[0]  # the top detection is on it
    ignore_it = voc07_map([det(0, [A], [0.8], [1])], gts, 1)[0]  # missing it costs no recall
    assert hit_difficult == ignore_it == pytest.approx(100.0)
    # the same box not difficult: missing it halves the recall
    assert voc07_map([det(0, [A], [0.8], [1])], [gt(0, [A, B], [1, 1])], 1)[0] == pytest.approx(100 * 6 / 11)


def test_11point_interpolation_worked_example():
    # 3 boxes; ranked detections TP, FP, TP, FP (the third box is never found):
    # recall 1/3, 1/3, 2/3, 2/3; precision 1, 1/2, 2/3, 1/2.
    # t = 0, .1, .2, .3 -> 1; t = .4, .5, .6 -> 2/3; t = .7 .. 1 -> 0: AP = (4 + 3 * 2/3) / 11 = 6/11.
    far = [200, 200, 210, 210]
    gts = [gt(0, [A, B, C], [1, 1, 1])]
    dets = [det(0, [A, far, B, far], [0.9, 0.8, 0.7, 0.6], [1, 1, 1, 1])]
    assert voc07_map(dets, gts, 1)[0] == pytest.approx(100 * 6 / 11)
    assert ap_11point(np.array([1 / 3, 1 / 3, 2 / 3, 2 / 3]), np.array([1, 0.5, 2 / 3, 0.5])) == pytest.approx(6 / 11)


def test_iou_half_is_a_hit_and_wrong_class_is_a_miss():
    # IoU exactly 0.5 counts (the devkit's ovmax >= 0.5): [0,0,10,10] vs [0,0,10,20] has IoU 100/200.
    assert voc07_map([det(0, [[0, 0, 10, 20]], [1.0], [1])], [gt(0, [A], [1])], 1)[0] == pytest.approx(100)
    assert voc07_map([det(0, [[0, 0, 10, 21]], [1.0], [1])], [gt(0, [A], [1])], 1)[0] == 0
    m, aps = voc07_map([det(0, [A], [1.0], [2])], [gt(0, [A], [1])], 2)
    assert aps[0] == 0 and np.isnan(aps[1]) and m == 0  # class 2 has no box: left out of the mean


def pyfrcnn_class_ap(dets, gts):
    """py-faster-rcnn's voc_eval rule (lib/datasets/voc_eval.py), written out here from its description,
    independently of voc_eval.py: boxes in VOC pixel coordinates with the +1 width, detections sorted by
    score, a match at IoU > 0.5 (strict) to a box not yet taken and not difficult, the 11-point AP over
    t in np.arange(0, 1.1, 0.1) taken as is (rec >= t: 0.3 is 0.30000000000000004).
    dets: (image, score, continuous box); gts: image -> (continuous boxes, difficult)."""
    def pixels(b):  # continuous (x0, y0, x1, y1) -> the VOC pixel box (x0 + 1, y0 + 1, x1, y1)
        return [b[0] + 1, b[1] + 1, b[2], b[3]]

    npos = sum(int(np.sum(~np.asarray(d))) for _, d in gts.values())
    records = {img: {"bbox": [pixels(b) for b in boxes], "difficult": list(diff), "det": [False] * len(boxes)}
               for img, (boxes, diff) in gts.items()}
    order = sorted(range(len(dets)), key=lambda j: -dets[j][1])
    tp, fp = [], []
    for j in order:
        img, _, box = dets[j]
        R, bb = records.get(img, {"bbox": [], "difficult": [], "det": []}), pixels(box)
        best, jmax = -np.inf, -1
        for k, g in enumerate(R["bbox"]):
            iw = max(min(bb[2], g[2]) - max(bb[0], g[0]) + 1.0, 0.0)
            ih = max(min(bb[3], g[3]) - max(bb[1], g[1]) + 1.0, 0.0)
            inter = iw * ih
            union = (bb[2] - bb[0] + 1.0) * (bb[3] - bb[1] + 1.0) + (g[2] - g[0] + 1.0) * (g[3] - g[1] + 1.0) - inter
            if inter / union > best:
                best, jmax = inter / union, k
        hit = best > 0.5
        if hit and R["difficult"][jmax]:
            tp.append(0), fp.append(0)
        elif hit and not R["det"][jmax]:
            R["det"][jmax] = True
            tp.append(1), fp.append(0)
        else:
            tp.append(0), fp.append(1)
    tp, fp = np.cumsum(tp), np.cumsum(fp)
    rec = tp / float(npos)
    prec = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
    return sum((prec[rec >= t].max() if np.any(rec >= t) else 0.0) for t in np.arange(0.0, 1.1, 0.1)) / 11.0


def random_class(rng):
    """One class on a few images: integer boxes on a coarse grid (so IoUs of exactly 0.5 occur), a
    multiple of 10 boxes for some classes (so recalls land on k/10), some difficult, detections near
    them or anywhere, distinct scores."""
    gts, dets = {}, []
    n_img = int(rng.integers(1, 5))
    npos_target = 10 * int(rng.integers(1, 3)) if rng.random() < 0.5 else int(rng.integers(1, 12))
    for img in range(n_img):
        m = int(rng.integers(0, 2 * npos_target // n_img + 2))
        xy = rng.integers(0, 8, size=(m, 2)) * 5
        wh = rng.integers(1, 5, size=(m, 2)) * 5
        gts[img] = (np.concatenate([xy, xy + wh], 1).astype(float), rng.random(m) < 0.15)
        for b in gts[img][0]:
            for _ in range(int(rng.integers(0, 3))):
                d = b + rng.integers(-2, 3, size=4) * 5 * (rng.random() < 0.6)
                dets.append((img, None, np.concatenate([d[:2], np.maximum(d[2:], d[:2] + 5)])))
        for _ in range(int(rng.integers(0, 4))):
            x, y = rng.integers(0, 8, size=2) * 5
            dets.append((img, None, np.array([x, y, x + 10, y + 10], float)))
    scores = rng.permutation(len(dets)) / max(len(dets), 1) + 0.01
    return [(img, float(sc), b) for (img, _, b), sc in zip(dets, scores)], gts


def test_py_faster_rcnn_rule_equals_an_independent_implementation_on_random_classes():
    """ap_rule=py-faster-rcnn (the evaluator of the paper's Faster R-CNN number) against the rule written
    out independently above, on random classes; and the devkit rule differs from it only on ties."""
    from experiments.voc_detection.voc_eval import class_ap

    rng = np.random.default_rng(0)
    checked = differ = 0
    for _ in range(600):
        dets, gts = random_class(rng)
        if sum(int((~d).sum()) for _, d in gts.values()) == 0:
            continue
        ours = class_ap(dets, gts, rule="py-faster-rcnn")
        assert ours == pytest.approx(pyfrcnn_class_ap(dets, gts), abs=1e-12), (dets, gts)
        checked += 1
        differ += abs(class_ap(dets, gts, rule="devkit") - ours) > 1e-9
    assert checked > 400 and differ > 10  # the random set does reach the ties that tell the rules apart


def test_py_faster_rcnn_rule_on_the_two_ties():
    from experiments.voc_detection.voc_eval import class_ap

    # IoU exactly 0.5 ([0,0,10,10] vs [0,0,10,20]): a hit for the devkit (>=), a miss for py-faster-rcnn (>)
    one = ([(0, 1.0, np.array([0, 0, 10, 20.0]))], {0: (np.array([A], float), np.array([False]))})
    assert class_ap(*one) == pytest.approx(1.0) and class_ap(*one, rule="py-faster-rcnn") == 0.0
    # 10 boxes, 3 found first, then only false positives: recall reaches exactly 3/10, which the devkit's
    # t = 0.3 counts and np.arange's 0.30000000000000004 does not: 4/11 against 3/11.
    boxes = np.array([[20 * k, 0, 20 * k + 10, 10] for k in range(10)], float)
    dets = [(0, 1.0 - k / 10, boxes[k]) for k in range(3)] + [(0, 0.5, np.array([0, 50, 10, 60.0]))]
    gts = {0: (boxes, np.zeros(10, bool))}
    assert class_ap(dets, gts) == pytest.approx(4 / 11)
    assert class_ap(dets, gts, rule="py-faster-rcnn") == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match="rule="):
        class_ap(dets, gts, rule="coco")


# ----------------------------------------------------------------------------- prep


SETS = {"VOCtrainval_06-Nov-2007.tar": "2007_trainval", "VOCtest_06-Nov-2007.tar": "2007_test",
        "VOCtrainval_11-May-2012.tar": "2012_trainval"}


def annotations(root, set_name: str) -> list[tuple[str, list[dict]]]:
    """(image id, objects) of a prepared VOC set in its ImageSets order, read straight from the
    annotation XML: an object is {name, box (the devkit's continuous box: xmin - 1, ymin - 1, xmax, ymax),
    difficult}."""
    year, split = set_name.split("_", 1)
    base = root / "VOCdevkit" / f"VOC{year}"
    out = []
    for i in (base / "ImageSets" / "Main" / f"{split}.txt").read_text().split():
        objs = []
        for o in ET.parse(base / "Annotations" / f"{i}.xml").getroot().iter("object"):
            b = o.find("bndbox")
            x0, y0, x1, y1 = (float(b.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax"))
            objs.append({"name": o.findtext("name"), "box": [x0 - 1, y0 - 1, x1, y1],
                         "difficult": o.findtext("difficult") == "1"})
        out.append((i, objs))
    return out


def ground_truth(root, set_name: str, classes: list[str], n: int | None = None) -> list[dict]:
    """voc07_map's ground truth for the first n images of a set (class k is label k + 1)."""
    return [gt(k, [o["box"] for o in objs], [classes.index(o["name"]) + 1 for o in objs],
               [o["difficult"] for o in objs]) for k, (_, objs) in enumerate(annotations(root, set_name)[:n])]


@pytest.fixture(scope="module")
def voc_archives(tmp_path_factory):
    out = tmp_path_factory.mktemp("voc_archives")
    generate(out, size=64, trainval=16, test=8, trainval12=6)
    return out


@pytest.fixture(scope="module")
def tiny_voc(voc_archives, tmp_path_factory):
    out = tmp_path_factory.mktemp("voc_prepared")
    prep.prepare(voc_archives, out, log=lambda *a: None)
    return out


def test_prep_layout_counts_and_resume(voc_archives, tiny_voc, tmp_path):
    import torchvision

    info = json.loads((tiny_voc / "prepared.json").read_text())
    assert {k: v["images"] for k, v in info["sets"].items()} == {"2007_trainval": 16, "2007_test": 8,
                                                                 "2012_trainval": 6}
    assert info["classes"] == ["circle", "square", "triangle"] and not info["official"]
    # objects and difficult objects per set as the archives' own annotation XML has them (the generator
    # marks objects under 15 px difficult, about one in ten: this small release has some)
    in_archives = {}
    for tar_name, set_name in SETS.items():
        with tarfile.open(voc_archives / tar_name) as tf:
            objs = [o for m in tf if m.name.endswith(".xml")
                    for o in ET.fromstring(tf.extractfile(m).read()).iter("object")]
        in_archives[set_name] = (len(objs), sum(o.findtext("difficult") == "1" for o in objs))
    assert {k: (v["objects"], v["difficult"]) for k, v in info["sets"].items()} == in_archives
    assert sum(d for _, d in in_archives.values()) > 0
    ds = torchvision.datasets.VOCDetection(str(tiny_voc), year="2007", image_set="test")  # torchvision reads it
    img, target = ds[0]
    assert img.size == (64, 64) and {"difficult", "truncated", "bndbox"} <= set(target["annotation"]["object"][0])
    assert not (tiny_voc / "VOCdevkit" / "VOC2007" / "ImageSets" / "Main" / "test.txt").read_text() == ""
    # resumable: an interrupted run (no marker, one image missing) keeps what it had
    out = tmp_path / "p"
    shutil.copytree(tiny_voc, out)
    (out / "prepared.json").unlink()
    (out / "VOCdevkit" / "VOC2007" / "JPEGImages" / "000003.jpg").unlink()
    again = prep.prepare(voc_archives, out, log=lambda *a: None)
    assert (out / "VOCdevkit" / "VOC2007" / "JPEGImages" / "000003.jpg").is_file()
    assert again["skipped"] == info["skipped"] + sum(1 for _ in (tiny_voc / "VOCdevkit").rglob("*") if _.is_file()) - 1
    assert prep.prepare(voc_archives, out, log=lambda *a: None)["sets"] == info["sets"]


@pytest.mark.parametrize("damage,msg", [
    ("missing", "no VOCtest_06-Nov-2007.tar"),
    ("truncated", "is truncated or not a tar"),
    ("xml", "is malformed XML"),
    ("box", "expected xmin <= xmax"),
    ("no_jpeg", "has no JPEG"),
    ("traversal", "unsafe member path"),
    # data that used to pass the prep and then train on nothing or fail in training
    ("outside", r"100002.xml: object 0 \(\w+\) has box \(100, 100, 120, 120\), entirely outside the 64x64 image"),
    ("sub_pixel", r"100002.xml: object 0 \(\w+\) has box \(64.5, 1, 65, 9\), less than a pixel inside the 64x64"),
    ("garbage_jpeg", r"100002.jpg does not decode as a JPEG"),
    ("cut_jpeg", r"100002.jpg does not decode as a JPEG \(image file is truncated"),
    ("no_objects", r"VOCtest_06-Nov-2007.tar: the 8 images of test.txt hold no object"),
])
def test_prep_bad_inputs_are_one_line_errors(voc_archives, tmp_path, damage, msg):
    a = tmp_path / "a"
    shutil.copytree(voc_archives, a)
    test_tar = a / "VOCtest_06-Nov-2007.tar"
    if damage == "missing":
        test_tar.unlink()
    elif damage == "truncated":
        test_tar.write_bytes(test_tar.read_bytes()[: test_tar.stat().st_size // 2 + 100])
    elif damage == "xml":
        rewrite_tar(test_tar, lambda n, d: (n, d[:-30]) if n.endswith("100002.xml") else (n, d))
    elif damage == "box":
        rewrite_tar(test_tar, lambda n, d: (n, d.replace(b"<xmin>", b"<xmin>9")) if n.endswith("100002.xml")
                     else (n, d))
    elif damage in ("outside", "sub_pixel"):
        box = b"<xmin>100</xmin><ymin>100</ymin><xmax>120</xmax><ymax>120</ymax>" if damage == "outside" else \
            b"<xmin>64.5</xmin><ymin>1</ymin><xmax>65</xmax><ymax>9</ymax>"
        rewrite_tar(test_tar, lambda n, d: (n, re.sub(rb"<bndbox>.*?</bndbox>", b"<bndbox>" + box + b"</bndbox>", d,
                                                      count=1, flags=re.S)) if n.endswith("100002.xml") else (n, d))
    elif damage == "garbage_jpeg":  # the first two bytes still say JPEG
        rewrite_tar(test_tar, lambda n, d: (n, d[:2] + bytes(len(d) - 2)) if n.endswith("100002.jpg") else (n, d))
    elif damage == "cut_jpeg":
        rewrite_tar(test_tar, lambda n, d: (n, d[: len(d) // 2]) if n.endswith("100002.jpg") else (n, d))
    elif damage == "no_objects":
        rewrite_tar(test_tar, lambda n, d: (n, re.sub(rb"<object>.*?</object>", b"", d, flags=re.S))
                    if n.endswith(".xml") else (n, d))
    elif damage == "no_jpeg":
        rewrite_tar(test_tar, lambda n, d: None if n.endswith("100002.jpg") else (n, d))
    else:
        rewrite_tar(test_tar, lambda n, d: ("../evil.txt", d) if n.endswith("100002.jpg") else (n, d))
    with pytest.raises(UserError, match=msg):
        prep.prepare(a, tmp_path / "out", log=lambda *x: None)
    assert not (tmp_path / "evil.txt").exists()
    if damage == "truncated":  # and from the command line: one line, exit code 2
        assert_command_fails_in_one_line("data_prep.voc", a, tmp_path / "out2", msg)


def test_box_partly_outside_is_clipped_and_trains(voc_archives, tmp_path):
    """VOC's 1-based coordinates put some boxes at 0 or one past the edge: the prep accepts them and
    the loader clips them to the image, so that training keeps them (SanitizeBoundingBoxes dropped a
    box with a coordinate outside the image, and an image of only such boxes trained on nothing)."""
    from data_prep.voc.dataset import VOCDetectionSet
    from experiments.voc_detection.task import train_transform

    a = shutil.copytree(voc_archives, tmp_path / "a")
    box = b"<bndbox><xmin>0</xmin><ymin>3</ymin><xmax>65</xmax><ymax>70</ymax></bndbox>"
    rewrite_tar(a / "VOCtest_06-Nov-2007.tar", lambda n, d: (n, re.sub(rb"<bndbox>.*?</bndbox>", box, d, count=1,
                                                                   flags=re.S)) if n.endswith("100002.xml") else (n, d))
    out = tmp_path / "out"
    info = prep.prepare(a, out, log=lambda *x: None)
    ds = VOCDetectionSet(out, ["2007_test"], info["classes"], train_transform("none"))
    k = ds.items.index(next(it for it in ds.items if it[0].endswith("100002.jpg")))
    n_objects = len(ds.items[k][1])
    _, target = ds[k]
    assert len(target["boxes"]) == n_objects  # none dropped
    assert target["boxes"][0].tolist() == [0.0, 2.0, 64.0, 64.0]  # (-1, 2, 65, 70) clipped to the 64x64 image


# ----------------------------------------------------------------------------- models


def test_paper_size_parameter_counts_and_backbone_weights(tmp_path):
    import models

    # SSD300 (Liu et al. 2016, VOC, 21 classes): 26.3M; Faster R-CNN VGG-16 (py-faster-rcnn): 137M
    # (VGG-16's 138M less fc8's 4.1M, plus the RPN and the 21-class heads).
    with torch.device("meta"):  # shapes only: no memory, no initialisation time
        ssd = models.build("ssd300_vgg16")
        frcnn = models.build("faster_rcnn_vgg16")
    assert sum(p.numel() for p in ssd.parameters()) == pytest.approx(26.3e6, rel=0.005)
    assert sum(p.numel() for p in frcnn.parameters()) == pytest.approx(137.1e6, rel=0.005)
    # ImageNet init: a VGG-16 state dict (torchvision's layout: our Table 1 vgg16 has the same names)
    vgg = models.build("vgg16", width=1 / 16)
    torch.save(vgg.state_dict(), tmp_path / "vgg.pt")
    s = models.build("ssd300_vgg16", width=1 / 16, size=64, backbone=str(tmp_path / "vgg.pt"))
    assert torch.equal(s.backbone.vgg[0].weight, vgg.features[0].weight)
    f = models.build("faster_rcnn_vgg16", width=1 / 16, size=64, backbone=str(tmp_path / "vgg.pt"))
    assert torch.equal(f.roi_heads.box_head[1].weight, vgg.classifier[0].weight)
    with pytest.raises(UserError, match="not found"):
        models.build("ssd300_vgg16", width=1 / 16, size=64, backbone=str(tmp_path / "none.pt"))
    with pytest.raises(UserError, match="this model \\(width\\) needs"):
        models.build("ssd300_vgg16", width=1 / 8, size=64, backbone=str(tmp_path / "vgg.pt"))


def test_recipe_details_against_the_caffe_references(tmp_path):
    """SSD (weiliu89/caffe ssd_pascal.py): default boxes not clipped, extra layers and heads from Caffe's
    xavier (uniform +-sqrt(3 / fan_in), bias 0) when the recipe starts from ImageNet weights, biases not
    decayed. Faster R-CNN (py-faster-rcnn train.prototxt): biases decayed, RoI box loss smooth L1 with
    sigma 1 (beta 1). Both: biases at twice the learning rate."""
    import models
    from experiments.voc_detection.task import Task
    from mpt import config as C

    vgg = models.build("vgg16", width=1 / 16)
    torch.save(vgg.state_dict(), tmp_path / "vgg.pt")
    torch.manual_seed(0)
    ssd = models.build("ssd300_vgg16", width=1 / 16, backbone=str(tmp_path / "vgg.pt"))
    assert ssd.anchor_generator.clip is False
    for conv in [m for m in list(ssd.backbone.extras.modules()) + list(ssd.head.modules()) if isinstance(m, torch.nn.Conv2d)]:
        bound = (3 / (conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1])) ** 0.5
        w = conv.weight.abs()
        assert w.max() <= bound and w.max() > 0.8 * bound and conv.bias.abs().max() == 0
    for model, decayed in (("ssd300_vgg16", False), ("faster_rcnn_vgg16", True)):
        cfg = C.resolve("voc_detection", [f"model={model}"])
        assert cfg.task.bias_decay is decayed
        groups = Task(cfg, Task.Facts(classes=())).param_groups(models.build(model, width=1 / 16, size=64))
        assert groups[1]["lr"] == 2 * cfg.optim.lr and groups[1]["weight_decay"] == (0.0005 if decayed else 0.0)
    # the RoI head's box loss, recomputed from its own sampled RoIs with beta 1 (torchvision's is 1/9)
    torch.manual_seed(0)
    frcnn = models.build("faster_rcnn_vgg16", width=1 / 16, size=64)
    heads = frcnn.roi_heads
    feats = {"0": torch.randn(1, 32, 4, 4)}
    target = [{"boxes": torch.tensor([[4.0, 4.0, 40.0, 40.0]]), "labels": torch.tensor([1])}]
    props = [torch.tensor([[4.0, 4.0, 40.0, 40.0], [6.0, 2.0, 30.0, 44.0], [0.0, 0.0, 63.0, 63.0]])]
    heads.train()
    heads.box_head.eval()  # no dropout: the two passes must see the same features
    torch.manual_seed(1)
    _, losses = heads(feats, props, [(64, 64)], target)
    torch.manual_seed(1)  # the same RoI sample
    props2, _, labels, reg = heads.select_training_samples(props, target)
    _, box = heads.box_predictor(heads.box_head(heads.box_roi_pool(feats, props2, [(64, 64)])))
    labels, reg = torch.cat(labels), torch.cat(reg)
    fg = labels > 0
    pred = box.reshape(len(labels), -1, 4)[fg, labels[fg]]
    want = torch.nn.functional.smooth_l1_loss(pred, reg[fg], beta=1.0, reduction="sum") / len(labels)
    assert fg.any() and (pred - reg[fg]).abs().max() > 1 / 9  # inside the range where the two betas differ
    assert torch.allclose(losses["loss_box_reg"], want)


@pytest.mark.parametrize("model, images, drops", [("ssd300_vgg16", 16551, [80000, 100000]),
                                                   ("faster_rcnn_vgg16", 5011, [50000])])
def test_paper_learning_rate_drops_land_on_the_solvers_iterations(model, images, drops):
    """The Caffe solvers drop the rate at whole iterations; our milestones are epochs, so they must be
    written to land on exactly those updates with the loader's full batches per epoch (images // batch:
    SSD's 16,551 / 32 is 517, not 517.2 -- which put the drops 35 and 43 updates early)."""
    from mpt import config as C
    from mpt.optim import update_factor

    cfg = C.resolve("voc_detection", ["profile=paper", f"model={model}"])
    per_epoch = images // cfg.train.batch_size
    factor = update_factor(cfg.sched, per_epoch, cfg.train.max_steps / per_epoch)
    got = [u for u in range(1, cfg.train.max_steps) if factor(u) < factor(u - 1)]
    assert got == drops


def test_ssd_photometric_distortion_never_permutes_channels():
    """SSD's random_order_prob is 0; torchvision's RandomPhotometricDistort permutes channels with p = 0.5.
    A pure red image stays reddest in its red channel through brightness, contrast, saturation and a hue
    shift of at most 36 degrees."""
    from torchvision import tv_tensors

    from experiments.voc_detection.task import SSDPhotometricDistort

    red = tv_tensors.Image(torch.tensor([255, 0, 0], dtype=torch.uint8).view(3, 1, 1).expand(3, 8, 8).clone())
    boxes = tv_tensors.BoundingBoxes([[1, 1, 5, 5]], format="XYXY", canvas_size=(8, 8))
    t = SSDPhotometricDistort()
    torch.manual_seed(0)
    changed = 0
    for _ in range(200):
        img, b = t(red, boxes)
        assert img.dtype == torch.uint8 and torch.equal(b, boxes)
        assert (img[0] > img[1]).all() and (img[0] > img[2]).all()
        changed += not torch.equal(img, red)
    assert changed > 150  # each of the four distortions with probability 0.5
    # brightness is a shift, contrast a plain scaling (Caffe's convertTo), not torchvision's blends
    grey = tv_tensors.Image(torch.full((3, 2, 2), 100, dtype=torch.uint8))
    none = {"brightness": None, "contrast": None, "saturation": None, "hue": None, "contrast_first": True}
    assert (t.transform(grey, {**none, "brightness": 20.0}) == 120).all()
    assert (t.transform(grey, {**none, "contrast": 1.5}) == 150).all()


def test_fast_iou_crop_draws_torchvisions_crops():
    """FastIoUCrop evaluates RandomIoUCrop's trials in blocks: the same crop (or none), the same
    boxes inside it, and the generator left where torchvision's loop leaves it, on random scenes."""
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    from experiments.voc_detection.task import FastIoUCrop

    g = torch.Generator().manual_seed(1)
    fast, ref = FastIoUCrop(), v2.RandomIoUCrop()
    crops = 0
    for k in range(200):
        h, w = (int(torch.randint(20, 1500, (1,), generator=g)) for _ in range(2))
        n = int(torch.randint(1, 6, (1,), generator=g))
        xy = torch.rand(n, 2, generator=g) * torch.tensor([w, h]) * 0.9
        wh = torch.rand(n, 2, generator=g) * torch.tensor([w, h]) * 0.5 + 1
        boxes = tv_tensors.BoundingBoxes(torch.cat([xy, (xy + wh).clamp(max=torch.tensor([w, h]))], 1),
                                         format="XYXY", canvas_size=(h, w))
        image = tv_tensors.Image(torch.zeros(3, 1, 1, dtype=torch.uint8).expand(3, h, w))
        torch.manual_seed(k)
        got, after = fast.make_params([boxes]), torch.rand(1)
        torch.manual_seed(k)
        want, after_want = ref.make_params([image, boxes]), torch.rand(1)
        assert got.keys() == want.keys() and torch.equal(after, after_want), k
        for key in want:
            assert (torch.equal(got[key], want[key]) if torch.is_tensor(want[key]) else got[key] == want[key]), (k, key)
        crops += bool(want)
    assert 100 < crops < 200  # both branches: a crop, and "leave the image as it is" (1 option in 7)


def test_fast_hue_and_lookup_distortion_match_torchvision():
    """SSDPhotometricDistort's brightness and contrast (one table lookup) equal Caffe's convertTo on
    every uint8 value; its hue shift equals torchvision's adjust_hue up to float rounding: at most 1
    level, in under 1e-4 of the values (measured: 6e-6)."""
    from torchvision.transforms.v2 import functional as F

    from experiments.voc_detection.task import SSDPhotometricDistort, adjust_hue

    every = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(3, 16, 16).clone()
    t = SSDPhotometricDistort()
    none = {"brightness": None, "contrast": None, "saturation": None, "hue": None, "contrast_first": True}
    for b, c, first in [(20.5, None, True), (-31.0, 1.4, True), (7.0, 0.6, False), (None, 1.5, False)]:
        want = every.float()
        if b is not None:
            want = (want + b).round().clamp(0, 255)
        if c is not None and first:
            want = (want * c).round().clamp(0, 255)
        if c is not None and not first:
            want = (want * c).round().clamp(0, 255)
        got = t.transform(every, {**none, "brightness": b, "contrast": c, "contrast_first": first})
        assert torch.equal(got, want.to(torch.uint8)), (b, c, first)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 64, 64), dtype=torch.uint8, generator=g)
    images[0, :, :8] = 77  # greys: no hue
    images[1, 1:] = images[1, :1]
    off = total = 0
    for img in images:
        for factor in (-0.5, -0.1, 0.0, 0.03, 0.1, 0.5):
            d = (adjust_hue(img, factor).int() - F.adjust_hue(img, factor).int()).abs()
            assert d.max() <= 1, factor
            off, total = off + int((d > 0).sum()), total + d.numel()
    assert off < 1e-4 * total, off


def reference_ssd_train(size: int):
    """SSD300's training augmentation as the plain torchvision v2 pipeline, followed by the detector's
    resize to size x size: Compose([distortion (torchvision's own kernels, float arithmetic), zoom out,
    RandomIoUCrop, flip, sanitize, to float]) on the whole photograph. SSDTrain must keep its law."""
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    from experiments.voc_detection.task import SSDPhotometricDistort, SSDTrain, _difficult_too

    class Distort(SSDPhotometricDistort):
        def transform(self, x, params):
            linear = lambda img, a, b: tv_tensors.wrap((img.float() * a + b).round().clamp(0, 255).to(img.dtype),  # noqa: E731
                                                       like=img)
            if params["brightness"] is not None:
                x = linear(x, 1.0, params["brightness"])
            if params["contrast"] is not None and params["contrast_first"]:
                x = linear(x, params["contrast"], 0.0)
            if params["saturation"] is not None:
                x = v2.functional.adjust_saturation(x, params["saturation"])
            if params["hue"] is not None:
                x = v2.functional.adjust_hue(x, params["hue"] / 180.0)
            if params["contrast"] is not None and not params["contrast_first"]:
                x = linear(x, params["contrast"], 0.0)
            return x

    compose = v2.Compose([Distort(), v2.RandomZoomOut(fill={tv_tensors.Image: SSDTrain.FILL, "others": 0},
                                                      side_range=(1.0, 4.0), p=0.5),
                          v2.RandomIoUCrop(), v2.RandomHorizontalFlip(0.5),
                          v2.SanitizeBoundingBoxes(labels_getter=_difficult_too), v2.ToDtype(torch.float32, scale=True)])

    def transform(img, target):
        img, target = compose(img, target)
        h, w = img.shape[-2:]  # the detector's resize (GeneralizedRCNNTransform): float, bilinear, no antialias
        img = torch.nn.functional.interpolate(img[None], size=(size, size), mode="bilinear", align_corners=False)[0]
        ratio = torch.tensor([size] * 4, dtype=torch.float32) / torch.tensor([w, h, w, h], dtype=torch.float32)
        return img, {**target, "boxes": target["boxes"] * ratio}

    return transform


def ssd_train_against_reference(root, classes, images: int, draws: int):
    """Per (image, seed): SSDTrain's sample against the reference pipeline's from the same random
    draws. Boxes, labels and difficult flags must be equal and the generator left in the same state;
    returns per sample (mean |pixel difference| in levels of 255, fraction of values off by > 8)."""
    from data_prep.voc.dataset import VOCDetectionSet
    from experiments.voc_detection.task import train_transform

    size = 300
    ds = VOCDetectionSet(root, ["2007_trainval"], classes)
    new, ref = train_transform("ssd", size), reference_ssd_train(size)
    stats = []
    for i in range(min(images, len(ds))):
        img, target = ds[i]
        for k in range(draws):
            torch.manual_seed(1000 * i + k)
            got, t_got = new(img, dict(target))
            after = torch.rand(1)
            torch.manual_seed(1000 * i + k)
            want, t_want = ref(img, dict(target))
            assert torch.equal(after, torch.rand(1)), (i, k)
            assert got.dtype == torch.uint8 and got.shape == (3, size, size)
            assert torch.equal(t_got["boxes"], t_want["boxes"]), (i, k, t_got["boxes"], t_want["boxes"])
            assert t_got["boxes"].canvas_size == (size, size)
            for key in ("labels", "difficult"):
                assert torch.equal(t_got[key], t_want[key]), (i, k, key)
            d = (got.float() - want * 255).abs()
            stats.append((float(d.mean()), float((d > 8).float().mean())))
    return stats


def test_ssd_train_keeps_the_augmentation_law(tiny_voc):
    """SSDTrain (geometry on the boxes, only the crop window built, uint8 resize, distortion after it)
    gives the boxes of the plain pipeline exactly, and pixels close to its: the distortion is pointwise,
    so only rounding differs, and the pixels where the image meets the zoom-out fill (distorted there
    after blending instead of before). On the tiny 64-px scenes, upscaled up to 15x, that border is wide:
    bounds 1 level mean |difference| overall, and under 10% of a sample's values off by more than 8
    (measured: 0.41 and at most 5.3%)."""
    stats = ssd_train_against_reference(tiny_voc, ["circle", "square", "triangle"], images=16, draws=3)
    assert np.mean([s[0] for s in stats]) < 1.0, stats
    assert max(s[1] for s in stats) < 0.10, stats


@pytest.mark.skipif(bool(__import__("data_prep.imagenet.real_photos", fromlist=["missing"]).missing()),
                    reason="Debian's mate-backgrounds photographs not installed (apt-get install mate-backgrounds)")
def test_ssd_train_keeps_the_law_on_real_photographs(tmp_path):
    """The same on real photographs at VOC's size (data_prep.voc.real_photos: 500 x 375 or 333, JPEG
    quality 90), which SSD300 mostly downscales: bounds 0.5 level mean |difference| overall, under 3% of a
    sample's values off by more than 8 (measured on 100 images x 3 draws: 0.20, at most 1.0%)."""
    from data_prep.voc import real_photos

    real_photos.generate(tmp_path / "a", trainval=12, test=2)
    prep.prepare(tmp_path / "a", tmp_path / "voc", log=lambda *a: None)
    with __import__("PIL").Image.open(next((tmp_path / "voc").glob("VOCdevkit/VOC2007/JPEGImages/*.jpg"))) as im:
        assert max(im.size) == 500 and min(im.size) in (333, 375)
    stats = ssd_train_against_reference(tmp_path / "voc", list(real_photos.CLASSES), images=12, draws=3)
    assert np.mean([s[0] for s in stats]) < 0.5, stats
    assert max(s[1] for s in stats) < 0.03, stats


def test_loader_images_are_uint8_and_the_model_gets_float_in_0_1(tiny_voc):
    """Images stay uint8 through the loader (a quarter of the bytes to copy to the device) and become
    what the detectors' transforms expect -- float32 in 0..1, as v2.ToDtype(float32, scale=True) -- in
    the task's loss and evaluate (model_input). SSD's training images arrive at its input size."""
    from torchvision.transforms import v2

    from experiments.voc_detection.task import Task, model_input
    from mpt import config as C

    for model, augment, square in [("ssd300_vgg16", "ssd", True), ("ssd300_vgg16", "flip", True),
                                   ("faster_rcnn_vgg16", "flip", False)]:
        cfg = C.resolve("voc_detection", ["profile=tiny", f"model={model}", f"task.data_root={tiny_voc}",
                                          "task.image_size=96", f"task.augment={augment}"])
        train, val = Task(cfg).datasets()
        torch.manual_seed(0)
        for img, _ in [train[0], train[1], val[0]]:
            assert img.dtype == torch.uint8
            x = model_input([img])[0]
            assert x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
            assert torch.equal(x, v2.ToDtype(torch.float32, scale=True)(img))
        assert (train[0][0].shape[-2:] == (96, 96)) == square and val[0][0].shape[-2:] == (64, 64)


# ----------------------------------------------------------------------------- runs




CELLS = [(m, p) for m in ("ssd300_vgg16", "faster_rcnn_vgg16") for p in ("fp32", "fp16", "mixed")]


@pytest.fixture(scope="module")
def tiny_runs(tiny_voc, tmp_path_factory):
    """Every Table 2 cell once, minimal: FP16 on a CPU is slow, so 64-px images, 1/16 width, one step,
    4 test images."""
    from experiments.voc_detection import main

    out = tmp_path_factory.mktemp("voc_runs")
    summaries, args = {}, {}
    for model, prec in CELLS:
        extra = ["loss_scale=8"] if prec == "mixed" else []
        args[(model, prec)] = tiny_overrides(
            tiny_voc, out, f"model={model}", f"precision={prec}", *extra, "train.batch_size=2", "train.max_steps=1",
            "task.eval_max_images=4", "train.log_every=1", "numerics.every=1")
        summaries[(model, prec)] = main(args[(model, prec)])
    return out, summaries, args


def reference_map(args: list[str], root, n: int) -> tuple[float, int]:
    """mAP and detection count of a finished run's saved model on the first n test images, computed
    outside the engine: its checkpoint loaded into the model, the JPEGs read here, the ground truth
    from the annotation XML (ground_truth), the devkit AP (voc07_map, checked by hand above)."""
    from PIL import Image

    from experiments.voc_detection.task import Task
    from mpt import config as C
    from mpt import identity

    cfg = C.resolve("voc_detection", args)
    checkpoint = identity.run_dir(cfg) / "checkpoint.pt"
    task = Task(cfg)  # the class count from the prepared data
    model = task.build_model()
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    model.eval()
    classes = json.loads((root / "prepared.json").read_text())["classes"]
    ids = [i for i, _ in annotations(root, cfg.task.test_set)[:n]]
    images = []
    for i in ids:
        with Image.open(root / "VOCdevkit" / "VOC2007" / "JPEGImages" / f"{i}.jpg") as im:
            images.append(torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1).float() / 255)
    with torch.no_grad():
        out = model(images)
    dets = [det(k, o["boxes"].numpy(), o["scores"].numpy(), o["labels"].numpy()) for k, o in enumerate(out)]
    m, _ = voc07_map(dets, ground_truth(root, cfg.task.test_set, classes, n), len(classes))
    return m, sum(len(d["scores"]) for d in dets)


@pytest.mark.heavy
def test_tiny_runs_finish_with_map(tiny_runs, tiny_voc):
    out, summaries, args = tiny_runs
    for (model, prec), s in summaries.items():
        assert s["status"] == "completed", (model, prec, s["error"])
        assert s["final_loss_scale"] == (8 if prec == "mixed" else 1)
    # The reported mAP is the devkit's on what the run's model detects: recomputed from each FP32 run's
    # checkpoint on the same 4 test images (FP16 cells evaluate under autocast: not recomputed here).
    for model in ("ssd300_vgg16", "faster_rcnn_vgg16"):
        s = summaries[(model, "fp32")]
        m, n = reference_map(args[(model, "fp32")], tiny_voc, 4)
        assert (s["metrics"]["mAP"], s["metrics"]["detections"]) == (pytest.approx(m, abs=1e-3), n), \
            (model, s["metrics"])
    # Figure 3's input: activation-gradient histograms sampled from SSD's FP32 run
    d = out / "voc_detection" / summaries[("ssd300_vgg16", "fp32")]["run_name"]
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert any(k.startswith("numerics/") and "act" in k for x in lines if x["kind"] == "numerics" for k in x)


@pytest.mark.heavy
def test_table2_and_figure3_tiny_regenerated(tiny_runs, tmp_path):
    out, _, _ = tiny_runs
    from paper_tables import __main__ as tables_cli

    assert tables_cli.main(["--runs", str(out), "--out", str(tmp_path / "t")]) == 0
    md = (tmp_path / "t" / "table2_tiny.md").read_text()
    assert "TINY" in md.upper()
    for row in ("Faster R-CNN", "SSD"):
        line = next(ln for ln in md.splitlines() if row in ln)
        assert "missing" not in line and line.count("(n=1)") == 3, line
    assert (tmp_path / "t" / "figure3_tiny.png").read_bytes().startswith(b"\x89PNG")  # the tiny profile's name
    assert not (tmp_path / "t" / "figure3.png").exists()  # no paper-profile run: no paper figure


@pytest.fixture(scope="module")
def learnable_voc(tmp_path_factory):
    a = tmp_path_factory.mktemp("voc_learn_archives")
    generate(a, trainval12=0)  # the generator's defaults: 240 trainval and 120 test scenes of 128 px
    out = tmp_path_factory.mktemp("voc_learn")
    prep.prepare(a, out, log=lambda *x: None)
    return out


@pytest.mark.slow
def test_trained_ssd_beats_untrained(learnable_voc, tmp_path):
    """Real learning: the tiny profile's SSD after 200 steps against the same network untrained (lr 0),
    on the same held-out scenes."""
    from experiments.voc_detection import main

    trained = main(tiny_overrides(learnable_voc, tmp_path))
    untrained = main(tiny_overrides(learnable_voc, tmp_path, "optim.lr=0.0", "train.max_steps=1"))
    assert trained["status"] == untrained["status"] == "completed"
    chance = guessing_maps(learnable_voc)
    assert trained["metrics"]["mAP"] > max(untrained["metrics"]["mAP"], *chance), (trained["metrics"],
                                                                                   untrained["metrics"], chance)


def guessing_maps(root, seeds: int = 20, per_image: int = 10) -> list[float]:
    """Chance baselines: the mAP of detectors that guess, `per_image` boxes on every test image with
    the sizes of training objects (drawn from the trainval annotations), anywhere in the image, of a
    random class with a random score, one detector per seed. A trained SSD beats all of them."""
    from PIL import Image

    classes = json.loads((root / "prepared.json").read_text())["classes"]
    gts = ground_truth(root, "2007_test", classes)
    sizes = np.array([[o["box"][2] - o["box"][0], o["box"][3] - o["box"][1]]
                      for _, objs in annotations(root, "2007_trainval") for o in objs])
    ids = [i for i, _ in annotations(root, "2007_test")]
    with Image.open(root / "VOCdevkit" / "VOC2007" / "JPEGImages" / f"{ids[0]}.jpg") as im:
        w, h = im.size  # the generator draws every scene at one size
    maps = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        dets = []
        for k in range(len(gts)):
            wh = sizes[rng.integers(len(sizes), size=per_image)]
            xy = rng.uniform(0, 1, (per_image, 2)) * np.maximum([w, h] - wh, 0)
            dets.append(det(k, np.concatenate([xy, xy + wh], 1), rng.random(per_image),
                            rng.integers(1, len(classes) + 1, per_image)))
        maps.append(voc07_map(dets, gts, len(classes))[0])
    return maps


@pytest.mark.heavy
def test_fp16_without_scaling_can_end_diverged(tiny_voc, tmp_path):
    """The paper's SSD cell: a non-finite loss for train.diverge_after steps ends the run as
    `diverged` through the engine, not as a crash (an lr that blows FP16 up stands in for SSD's
    underflow-driven divergence at full scale)."""
    from experiments.voc_detection import main

    s = main(tiny_overrides(tiny_voc, tmp_path, "precision=fp16", "width=0.0625", "task.image_size=64",
                            "train.batch_size=2", "train.max_steps=6", "train.diverge_after=2", "optim.name=sgd",
                            "optim.lr=1.0e+12", "optim.momentum=0.0", "task.eval_max_images=2", "train.log_every=1"))
    assert s["status"] == "diverged" and "non-finite" in s["error"]


def test_ssd_augmentation_keeps_boxes_labels_and_difficult_aligned(tiny_voc):
    """The paper profile's SSD augmentation (zoom out, IoU crop, flip) drops boxes; their labels and
    difficult flags go with them, and every box stays inside its image."""
    from data_prep.voc.dataset import VOCDetectionSet
    from experiments.voc_detection.task import train_transform

    for size in (None, 300):  # the v2 pipeline (each image at its size), SSDTrain (resized to SSD's input)
        ds = VOCDetectionSet(tiny_voc, ["2007_trainval"], ["circle", "square", "triangle"],
                             train_transform("ssd", size))
        torch.manual_seed(0)
        for i in range(len(ds)):
            img, t = ds[i]
            n = len(t["boxes"])
            assert img.dtype == torch.uint8 and len(t["labels"]) == len(t["difficult"]) == n
            h, w = img.shape[-2:]
            assert size is None or (h, w) == (size, size)
            b = t["boxes"]
            assert n == 0 or (b[:, 0].min() >= 0 and b[:, 2].max() <= w and b[:, 3].max() <= h
                              and (b[:, 2] > b[:, 0]).all())


def test_both_paper_recipes_fix_conv1_1_to_conv2_2():
    """SSD (ssd_pascal.py freeze_layers) and py-faster-rcnn (lr_mult 0) train VGG-16 from conv3_1 on: the
    paper profile of each says so and builds it so; the tiny profile (from scratch) trains every layer."""
    import models
    from mpt import config as C

    for name in ("ssd300_vgg16", "faster_rcnn_vgg16"):
        cfg = C.resolve("voc_detection", [f"model={name}", "task.data_root=/nonexistent"])
        assert cfg.task.freeze_through == "conv2_2", name
        assert C.resolve("voc_detection", ["profile=tiny", f"model={name}"]).task.freeze_through == ""
        m = models.build(name, width=1 / 16, size=64, freeze="conv2_2")
        vgg = m.backbone.vgg if name == "ssd300_vgg16" else m.backbone.body
        convs = [x for x in vgg if isinstance(x, torch.nn.Conv2d)]
        assert [c.weight.requires_grad for c in convs[:6]] == [False] * 4 + [True] * 2, name
        assert all(p.requires_grad for p in m.head.parameters()) if name == "ssd300_vgg16" else True
    with pytest.raises(UserError, match="task.freeze_through='conv9_9'"):
        models.build("ssd300_vgg16", width=1 / 16, size=64, freeze="conv9_9")


def test_the_rpn_trains_on_no_anchor_that_crosses_the_image_border():
    """py-faster-rcnn's anchor_target_layer (allowed_border 0; Ren et al. 2015, 3.3): an anchor that
    crosses the border is neither object nor background. The paper profile sets the rule; without it
    (the tiny profile) every anchor keeps its label."""
    import models
    from torchvision.models.detection.image_list import ImageList

    from mpt import config as C

    assert C.resolve("voc_detection", ["model=faster_rcnn_vgg16", "task.data_root=/nonexistent"]).task.rpn_allowed_border == 0
    torch.manual_seed(0)
    images = ImageList(torch.zeros(1, 3, 128, 160), [(128, 160)])
    target = [{"boxes": torch.tensor([[4.0, 4.0, 60.0, 60.0]]), "labels": torch.tensor([1])}]
    labels = {}
    for border in (0, -1):
        m = models.build("faster_rcnn_vgg16", width=1 / 16, size=128, rpn_allowed_border=border)
        feats = m.backbone(images.tensors)
        anchors = m.rpn.anchor_generator(images, list(feats.values()))
        if border >= 0:
            m.rpn._image_sizes = images.image_sizes
        labels[border], _ = m.rpn.assign_targets_to_anchors(anchors, target)
        a = anchors[0]
    outside = (a[:, 0] < 0) | (a[:, 1] < 0) | (a[:, 2] >= 160) | (a[:, 3] >= 128)
    assert 0 < outside.sum() < len(a)
    assert (labels[0][0][outside] == -1).all()  # no target at all
    assert (labels[-1][0][outside] >= 0).any()  # labelled without the rule
    assert torch.equal(labels[0][0][~outside], labels[-1][0][~outside])  # inside: the same labels
