"""ILSVRC12's input pipelines at uint8: the workers decode and crop, the device normalises.

A sample leaves a worker as a uint8 (3, crop, crop) tensor -- 151 KB at 224 px where the float32
ToTensor/Normalize pipeline sent 602 KB -- and `normalise` turns the batch into the model's float input
on the device, after the copy (Task.loss and eval_sums call it). The float work per image (~0.6 ms a
core) and three quarters of the host-to-device bytes are gone from the input pipeline.

Every augmentation is a Plan drawn from the image's size alone (its JPEG header is read, not the
pixels), with the random numbers torchvision's transforms draw, in their order, so a run's crops and
flips follow the laws they followed on PIL images (RandomResizedCrop + flip; Caffe's warp to
resize x resize, RandomCrop + flip; the evaluation's resize and centre crop):

    resize the whole image to (rh, rw)  ->  crop (top, left, h, w)  ->  resize to (oh, ow)  ->  flip

A Plan runs in one of two places (task.decode):
  cpu  the worker decodes with libjpeg-turbo (data_prep.archives.rgb_tensor) and applies the plan with
       antialiased bilinear resizes on uint8 tensors. Where the plan's next resize shrinks the image at
       least twofold, the JPEG is decoded at 1/2, 1/4 or 1/8 scale in the DCT domain instead (libjpeg-turbo's
       scaled decode, through simplejpeg; PIL's draft mode where simplejpeg refuses the file): a 1000x750
       photograph whose crop ends at 224 px decodes a quarter of its pixels.
       A crop box is then rounded to the smaller image's pixel grid (within k/2 source pixels at 1/k).
  gpu  the worker reads the file and draws the plan; the batch's JPEGs are decoded together on the GPU
       (nvJPEG through torchvision.io.decode_jpeg(device="cuda")) and the plans applied there, in the
       DataLoader's pin-memory thread while the step trains (EncodedBatch.pin_memory): for nodes with few
       cores per GPU (decode_on_device).
"""
from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DECODES = ("cpu", "gpu")


def normalise(x: torch.Tensor) -> torch.Tensor:
    """A uint8 image batch -> the float32 input torchvision's ToTensor + Normalize gave, with the same
    operations in the same order (bit-identical on the CPU), on x's device and in x's memory format.
    A float batch is taken as already normalised (the benchmarks' synthetic tensors)."""
    if x.dtype != torch.uint8:
        return x
    mean, std = _mean_std(x.device)
    return x.to(torch.float32).div(255).sub(mean).div(std)


@functools.lru_cache(maxsize=None)
def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """MEAN and STD as (3, 1, 1) tensors on `device`, made once: a host-to-device copy per batch would
    wait on the host, and a CUDA graph (train.cuda_graphs) cannot capture one."""
    return (torch.tensor(MEAN, dtype=torch.float32, device=device).view(-1, 1, 1),
            torch.tensor(STD, dtype=torch.float32, device=device).view(-1, 1, 1))


@dataclass(frozen=True)
class Plan:
    """One image's geometry, in source pixels: resize the whole (H, W) image to (rh, rw), crop
    (top, left, h, w) of that, resize the crop to (oh, ow), flip left-right if `flip`."""
    rh: int
    rw: int
    top: int
    left: int
    h: int
    w: int
    oh: int
    ow: int
    flip: bool


def _flip(p: float) -> bool:
    """RandomHorizontalFlip's draw (torch.rand(1) < p; compared as a Python float, the same answer for
    p = 0.5, which float32 holds exactly). Taken only where flipping is on: the flip-free profiles'
    Compose had no flip, so they draw nothing here either."""
    return torch.rand(1).item() < p


# RandomResizedCrop's defaults: the crop's share of the image's area and the range of its aspect ratio,
# whose logarithm torchvision takes in float32 (the bounds of its uniform draw).
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
LOG_RATIO = tuple(torch.log(torch.tensor(RATIO)).tolist())


def _resized_crop(h: int, w: int) -> tuple[int, int, int, int]:
    """RandomResizedCrop.get_params(img, SCALE, RATIO) for an (h, w) image: the same generator calls in
    the same order and the same float32 arithmetic, so the same (top, left, height, width) for the same
    generator state (tests/test_imagenet_pipeline.py compares them over thousands of draws). Written out
    because torchvision's costs ~55 us an image (a size tensor, the log of the ratios, a fresh tensor per
    draw), ~5% of a worker's time per image here."""
    area = h * w
    u = torch.empty(1)
    for _ in range(10):
        target_area = area * u.uniform_(*SCALE).item()
        aspect_ratio = u.uniform_(*LOG_RATIO).exp_().item()
        cw = int(round(math.sqrt(target_area * aspect_ratio)))
        ch = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            top = torch.randint(0, h - ch + 1, size=(1,)).item()
            left = torch.randint(0, w - cw + 1, size=(1,)).item()
            return top, left, ch, cw
    # Ten misses: torchvision's fallback, the centre crop at the nearest allowed aspect ratio.
    if w / h < min(RATIO):
        cw, ch = w, int(round(w / min(RATIO)))
    elif w / h > max(RATIO):
        cw, ch = int(round(h * max(RATIO))), h
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def _resized_shorter(h: int, w: int, size: int) -> tuple[int, int]:
    """torchvision's Resize(size) for an int size: the shorter side to `size`, the other in proportion
    (truncated, as torchvision.transforms.functional._compute_resized_output_size does)."""
    if h <= w:
        return size, int(size * w / h)
    return int(size * h / w), size


def draw_plan(augment: str, train: bool, h: int, w: int, crop: int, resize: int, flip: bool) -> Plan:
    """The plan of one (h, w) image, drawn from torch's global generator (seeded per sample by
    mpt.data.SeededDataset) exactly as the PIL transforms drew: same calls, same order."""
    if augment == "torchvision":
        if train:
            return Plan(h, w, *_resized_crop(h, w), crop, crop, flip and _flip(0.5))
        rh, rw = _resized_shorter(h, w, resize)
        return Plan(rh, rw, *_centre(rh, rw, crop), crop, crop, crop, crop, False)
    if augment == "caffe":
        if train:
            top, left = _random_crop(resize, resize, crop)
            return Plan(resize, resize, top, left, crop, crop, crop, crop, flip and _flip(0.5))
        return Plan(resize, resize, *_centre(resize, resize, crop), crop, crop, crop, crop, False)
    raise ValueError(f"no plan for augment={augment!r}")


def _random_crop(h: int, w: int, crop: int) -> tuple[int, int]:
    """RandomCrop.get_params's corner of a crop x crop square in an (h, w) image, drawn as it draws it
    (no draw where the crop is the whole image)."""
    if h < crop or w < crop:
        raise ValueError(f"Required crop size {(crop, crop)} is larger than input image size {(h, w)}")
    if (h, w) == (crop, crop):
        return 0, 0
    return torch.randint(0, h - crop + 1, size=(1,)).item(), torch.randint(0, w - crop + 1, size=(1,)).item()


def _centre(h: int, w: int, crop: int) -> tuple[int, int]:
    """CenterCrop's corner (torchvision rounds (size - crop) / 2 to the nearest int)."""
    return int(round((h - crop) / 2.0)), int(round((w - crop) / 2.0))


def _resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear, antialiased (torchvision's Resize on tensors). On the CPU torch's uint8 kernel; on a GPU,
    whose antialiased kernel takes floats only, through float32 and rounded back to uint8."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    if x.device.type == "cpu" or x.is_floating_point():
        return F.interpolate(x[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    y = F.interpolate(x[None].float(), size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    return y.round_().clamp_(0, 255).to(torch.uint8)


def apply_plan(x: torch.Tensor, p: Plan, scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Run plan p on the decoded uint8 (3, H', W') image x, decoded at `scale` (H'/H, W'/W) of the
    size the plan was drawn for (1/k when the JPEG was decoded at 1/k in the DCT domain)."""
    H, W = x.shape[-2:]
    if (p.rh, p.rw) != (round(H / scale[0]), round(W / scale[1])):  # a whole-image resize: from any scale
        x, sy, sx = _resize(x, (p.rh, p.rw)), 1.0, 1.0
    else:
        sy, sx = scale
    top, left = round(p.top * sy), round(p.left * sx)
    bottom, right = round((p.top + p.h) * sy), round((p.left + p.w) * sx)
    x = _resize(x[:, top:bottom, left:right], (p.oh, p.ow))
    return x.flip(-1) if p.flip else x.contiguous()


def dct_factor(p: Plan, h: int, w: int) -> float:
    """How much the plan shrinks the image before its first pixel-exact step: the most a DCT-domain
    decode may shrink it (the whole-image resize, else the crop's resize)."""
    if (p.rh, p.rw) != (h, w):
        return min(h / p.rh, w / p.rw)
    return min(p.h / p.oh, p.w / p.ow)


_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))


def header_size(data: bytes) -> tuple[int, int]:
    """(height, width) from an encoded image's header. A JPEG's start-of-frame segment is found by walking
    its marker segments (~10 us, a twelfth of opening it with PIL, which reads no pixels either); PIL
    answers for anything else (PNG, a JPEG this walk does not understand)."""
    if data[:2] == b"\xff\xd8":
        i, n = 2, len(data)
        while i + 9 <= n and data[i] == 0xFF:
            marker = data[i + 1]
            if marker == 0xFF:  # fill byte before a marker
                i += 1
                continue
            if marker in _SOF:
                return int.from_bytes(data[i + 5:i + 7], "big"), int.from_bytes(data[i + 7:i + 9], "big")
            if marker == 0xDA:  # start of scan before any frame header: not a JPEG we know
                break
            i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size
    return h, w


def decode_for(data: bytes, p: Plan, h: int, w: int) -> tuple[torch.Tensor, tuple[float, float]]:
    """The uint8 (3, H', W') image and its scale: at 1/2, 1/4 or 1/8 of (h, w) through libjpeg-turbo's
    DCT-domain scaling where the plan shrinks it at least that much, else whole through libjpeg-turbo
    (data_prep.archives.rgb_tensor: faster than PIL's decode at full size). Non-JPEG files, CMYK and
    greyscale JPEGs come out as RGB either way."""
    from torchvision.transforms.functional import pil_to_tensor

    from data_prep.archives import rgb_tensor, simplejpeg_rgb

    f = dct_factor(p, h, w)
    if f >= 2:
        # simplejpeg at 1/k, k the largest of 2, 4, 8 within f (its other scalings, 3/8-7/8, decode slower than
        # whole: speed_memory README): the pixels of PIL's draft at the same scale, in ~0.8 of its time. (Asked
        # for ceil(h / k) rows, libjpeg-turbo picks 1/k; PIL's draft, flooring, decodes an odd side whole at f = 2.)
        k = 8 if f >= 8 else 4 if f >= 4 else 2
        x = simplejpeg_rgb(data, math.ceil(h / k), math.ceil(w / k))
        if x is not None:
            return x, (x.shape[1] / h, x.shape[2] / w)
        im = Image.open(io.BytesIO(data))  # (what simplejpeg refuses: PIL's draft at the same scales)
        if im.format == "JPEG":
            im.draft("RGB", (math.ceil(w / f), math.ceil(h / f)))  # the largest 1/k with size >= that
            if im.size != (w, h):
                sw, sh = im.size
                return pil_to_tensor(im.convert("RGB")), (sh / h, sw / w)
    return rgb_tensor(data), (1.0, 1.0)


@dataclass(frozen=True)
class Encoded:
    """A sample for the GPU decode: the file's bytes and its drawn plan (to the device as they are)."""
    data: torch.Tensor  # uint8, 1-D: the encoded file
    plan: Plan
    path: str = ""  # where it was read from, and the prepared root: for the error naming a damaged file
    root: str = ""


class EncodedBatch:
    """A batch of Encoded samples as the collate gives it: the bytes stay on the host (nvJPEG reads
    host memory), so mpt.ranks.to_device passes this object through unchanged."""

    def __init__(self, samples: list[Encoded]):
        self.data = [s.data for s in samples]
        self.plans = [s.plan for s in samples]
        self.paths = [(s.path, s.root) for s in samples]

    def __len__(self):
        return len(self.data)

    def pin_memory(self, device=None):
        """What the DataLoader's pin-memory thread does with the batch (pin_memory=True: the CUDA runs):
        decode it on its GPU there, so nvJPEG's host stage and the crops' launches overlap the training
        step on the main thread, instead of running between steps. -> the uint8 (N, 3, h, w) batch on the
        GPU (Task.images normalises it); unchanged where no GPU is visible."""
        if not torch.cuda.is_available():
            return self
        device = torch.device("cuda", torch.cuda.current_device())
        side = _decode_stream(device)
        with torch.cuda.stream(side):
            out = decode_on_device(self, device)
        # This thread waits, not the training loop: the batch is whole when it is handed on, and no kernel
        # of `side` is still queued when the next batch's decode allocates. torchvision's GPU decoder
        # allocates its output on the caller's stream but writes it from a stream of its own that does not
        # wait on the caller's, so a block freed by kernels still queued could be overwritten
        # (pytorch/vision pull request 9606).
        side.synchronize()
        # The training loop reads the batch on its own stream: the allocator keeps the block until that
        # use is done, not just until `side` is.
        out.record_stream(torch.cuda.default_stream(device))
        return out


_STREAMS: dict = {}


def _decode_stream(device: torch.device):
    """One side stream per device for the pin-memory thread's decodes (the thread is the only user)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def decode_on_device(batch: EncodedBatch, device: torch.device) -> torch.Tensor:
    """The batch's JPEGs decoded together on the GPU (nvJPEG, batched), each plan applied there, as one
    uint8 (N, 3, oh, ow) tensor on `device`. Only the decode call needs CUDA: on a CPU device the same
    steps run with libjpeg-turbo (what the tests exercise)."""
    import warnings

    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # as rgb_tensor: the decoders' deprecation
            imgs = decode_jpeg(batch.data, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:  # a file nvJPEG refuses (a PNG named .JPEG, as ILSVRC's train set holds): each on the CPU
        imgs = [_host_decode(d, where).to(device) for d, where in zip(batch.data, batch.paths)]
    return torch.stack([apply_plan(x, p) for x, p in zip(imgs, batch.plans)])


def _host_decode(data: torch.Tensor, where: tuple[str, str]) -> torch.Tensor:
    from data_prep.archives import rgb_tensor

    from .dataset import damaged

    try:
        return rgb_tensor(data.numpy().tobytes())
    except (OSError, ValueError, SyntaxError, RuntimeError) as e:  # a damaged file: named, one line
        raise damaged(where[0], Path(where[1]), e) from None


class ImagePipeline:
    """A prepared ILSVRC split's per-sample work in a worker: read the file, draw the plan from its
    header, then decode and apply it (decode=cpu) or hand bytes and plan on (decode=gpu)."""

    def __init__(self, root, augment: str, train: bool, crop: int, resize: int, flip: bool, decode: str = "cpu"):
        self.root, self.augment, self.train, self.crop, self.resize, self.flip, self.decode = \
            Path(root), augment, train, crop, resize, flip, decode

    def __call__(self, path: str):
        from .dataset import damaged

        try:
            data = Path(path).read_bytes()
            h, w = header_size(data)
            p = draw_plan(self.augment, self.train, h, w, self.crop, self.resize, self.flip)
            if self.decode == "gpu":
                return Encoded(torch.frombuffer(bytearray(data), dtype=torch.uint8), p, str(path), str(self.root))
            x, scale = decode_for(data, p, h, w)
        except (OSError, ValueError, SyntaxError, RuntimeError) as e:  # PIL's and libjpeg's decode errors
            raise damaged(path, self.root, e) from None
        return apply_plan(x, p, scale)


def collate(samples):
    """torch's default_collate, or (EncodedBatch, labels) for the GPU decode's samples."""
    from torch.utils.data import default_collate

    if samples and isinstance(samples[0][0], Encoded):
        return EncodedBatch([s[0] for s in samples]), default_collate([s[1] for s in samples])
    return default_collate(samples)
