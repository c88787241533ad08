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
    # issue 29 item 6: data that used to pass the prep and then train on nothing or fail in training
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
    assert not f.backbone.body[0].weight.requires_grad  # conv1/conv2 fixed, as in py-faster-rcnn
    with pytest.raises(UserError, match="not found"):
        models.build("ssd300_vgg16", width=1 / 16, size=64, backbone=str(tmp_path / "none.pt"))
    with pytest.raises(UserError, match="this model \\(width\\) needs"):
        models.build("ssd300_vgg16", width=1 / 8, size=64, backbone=str(tmp_path / "vgg.pt"))


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

    cfg = C.resolve("voc_detection", args)
    checkpoint = C.run_dir(cfg) / "checkpoint.pt"
    task = Task()
    task.datasets(cfg)  # sets the class count from the prepared data
    model = task.build_model(cfg)
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

    ds = VOCDetectionSet(tiny_voc, ["2007_trainval"], ["circle", "square", "triangle"], train_transform("ssd"))
    torch.manual_seed(0)
    for i in range(len(ds)):
        img, t = ds[i]
        n = len(t["boxes"])
        assert img.dtype == torch.float32 and len(t["labels"]) == len(t["difficult"]) == n
        h, w = img.shape[-2:]
        b = t["boxes"]
        assert n == 0 or (b[:, 0].min() >= 0 and b[:, 2].max() <= w and b[:, 3].max() <= h and (b[:, 2] > b[:, 0]).all())
