"""PASCAL VOC detection sets read from the tree data_prep.voc writes (the VOCdevkit layout).

A sample is (image, target): the image a tv_tensors.Image (uint8, 3 x H x W), the target
{"boxes": BoundingBoxes (N, 4) XYXY in pixels, "labels": int64 (N,) with 1..C (0 = background),
"difficult": bool (N,), "index": the sample's index}. VOC's 1-based inclusive pixel coordinates
(xmin, ymin, xmax, ymax) become the continuous box (xmin - 1, ymin - 1, xmax, ymax), whose IoU is the
devkit's "+1" IoU exactly, clipped to the image: a box partly outside (some VOC boxes start at 0 or end
one past the edge) would otherwise be dropped whole by SanitizeBoundingBoxes. data_prep.voc checked that
every box keeps at least a pixel inside its image."""
from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors

from mpt.errors import UserError

from ..archives import rgb_tensor
from ..prepared import read_prepared
from .prepare import MARKER, check_box, parse_annotation


def read_marker(root) -> dict:
    path = Path(root) / MARKER
    if not path.is_file():
        raise UserError(f"{root} is not a prepared VOC folder (no {MARKER}); run "
                        f"python -m data_prep.voc --archives DIR --out {root}")
    return read_prepared(root, f"rerun python -m data_prep.voc --archives DIR --out {root} --force")


def read_rgb(path: str) -> torch.Tensor:
    """A JPEG as uint8 3 x H x W in HWC memory (channels last, what uint8 resizing is fast on):
    data_prep.archives.rgb_tensor, the same pixels as PIL's in about 2/3 of its time (VOC-sized photographs)."""
    return rgb_tensor(Path(path).read_bytes())


class VOCDetectionSet(Dataset):
    def __init__(self, root, sets: list[str], classes: list[str], transforms=None, keep_difficult: bool = True):
        root = Path(root)
        info = read_marker(root)
        self.classes = list(classes)
        index = {c: i + 1 for i, c in enumerate(self.classes)}
        self.items = []
        for s in sets:
            if s not in info["sets"]:
                raise UserError(f"{root} has no VOC set {s!r} (it has {', '.join(info['sets'])}); add its archive "
                                f"(e.g. VOCtrainval_11-May-2012.tar for 2012_trainval) and prepare again")
            year, split = s.split("_", 1)
            base = root / "VOCdevkit" / f"VOC{year}"
            ids = (base / "ImageSets" / "Main" / f"{split}.txt").read_text().split()
            for i in ids:
                objs = parse_annotation((base / "Annotations" / f"{i}.xml").read_bytes(), base / f"{i}.xml")
                if not keep_difficult:
                    objs = [o for o in objs if not o["difficult"]]
                unknown = {o["name"] for o in objs} - set(index)
                if unknown:
                    raise UserError(f"{base}/Annotations/{i}.xml names {sorted(unknown)}, not in the class list "
                                    f"of {root / MARKER}; prepare the data again")
                boxes = torch.tensor([[x0 - 1, y0 - 1, x1, y1] for x0, y0, x1, y1 in (o["bbox"] for o in objs)],
                                     dtype=torch.float32).reshape(-1, 4)
                self.items.append((str(base / "JPEGImages" / f"{i}.jpg"), boxes,
                                   torch.tensor([index[o["name"]] for o in objs], dtype=torch.int64),
                                   torch.tensor([bool(o["difficult"]) for o in objs], dtype=torch.bool)))
        self.transforms = transforms

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        path, boxes, labels, difficult = self.items[i]
        try:
            img = read_rgb(path)
        except OSError as e:  # data_prep.voc decoded every image: this one changed since
            raise UserError(f"cannot read {path} ({e}); it changed after data_prep.voc checked it: "
                            f"prepare the data again with --force") from None
        h, w = img.shape[-2:]
        # The prep checked every box against its image; an annotation or image changed since could leave a
        # box outside, which training drops silently (down to a loss of 0 and an mAP of 0).
        xml = Path(path).parent.parent / "Annotations" / f"{Path(path).stem}.xml"
        for k, (b, label) in enumerate(zip(boxes.tolist(), labels.tolist())):
            check_box({"name": self.classes[label - 1], "bbox": (b[0] + 1, b[1] + 1, b[2], b[3])}, k, (w, h), xml,
                      "it changed after data_prep.voc checked it: prepare the data again with --force")
        boxes = boxes.clone()
        boxes[:, 0::2].clamp_(0, w)
        boxes[:, 1::2].clamp_(0, h)
        target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(h, w)),
                  "labels": labels.clone(), "difficult": difficult.clone(), "index": i}
        img = tv_tensors.Image(img)
        if self.transforms is not None:
            img, target = self.transforms(img, target)
        return img, target
