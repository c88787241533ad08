"""ILSVRC's uint8 pipelines (data_prep.imagenet.pipeline) keep the laws of torchvision's PIL pipelines they
replaced: under the engine's per-sample seeding the same random numbers are drawn in the same order (the
same crops and flips), and the pixels, normalised on the device, are those of ToTensor + Normalize to within
decoder and resampler rounding. The GPU decode's steps run on the CPU here (only nvJPEG's call needs CUDA)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from data_prep.imagenet import pipeline
from data_prep.imagenet.pipeline import MEAN, STD, EncodedBatch, ImagePipeline, collate, decode_on_device, normalise
from mpt.errors import UserError

# (width, height): ILSVRC's typical 500x375, a portrait one, and 1000x750 (where crops that end at
# 224 px shrink >= 2x: decoded at 1/2 or 1/4 scale in the DCT domain).
SIZES = ((500, 375), (375, 500), (1000, 750), (640, 427))


def _photo(w: int, h: int, seed: int) -> bytes:
    """A smooth scene with texture (JPEG-like content: gradients, edges, noise), quality 90."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([128 + 100 * np.sin(x / (20 + 10 * c) + y / (35 + 5 * c) + rng.uniform(0, 6)) for c in range(3)], -1)
    img[(x - w / 2) ** 2 + (y - h / 3) ** 2 < (h / 5) ** 2] *= 0.4  # a dark disc: sharp edges
    img += rng.normal(0, 8, img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    d = tmp_path_factory.mktemp("photos")
    paths = []
    for k, (w, h) in enumerate(SIZES * 3):
        p = d / f"{k:02d}.JPEG"
        p.write_bytes(_photo(w, h, k))
        paths.append(str(p))
    return paths


def _pil_pipeline(augment: str, train: bool, flip: bool = True):
    """The float32 pipelines the uint8 ones replaced, from torchvision itself."""
    norm = [T.ToTensor(), T.Normalize(MEAN, STD)]
    flips = [T.RandomHorizontalFlip()] if flip else []
    if augment == "torchvision":
        if train:
            return T.Compose([T.RandomResizedCrop(224, antialias=True), *flips, *norm])
        return T.Compose([T.Resize(256, antialias=True), T.CenterCrop(224), *norm])
    warp = T.Resize((256, 256), antialias=True)
    return T.Compose([warp, T.RandomCrop(224), *flips, *norm] if train else [warp, T.CenterCrop(224), *norm])


@pytest.mark.parametrize("augment", ["torchvision", "caffe"])
@pytest.mark.parametrize("train", [True, False])
def test_same_draws_and_pixels_as_the_pil_pipeline(photos, augment, train):
    new = ImagePipeline("root", augment, train, 224, 256, flip=True)
    old = _pil_pipeline(augment, train)
    std, mean = torch.tensor(STD)[:, None, None], torch.tensor(MEAN)[:, None, None]
    for seed, path in enumerate(photos):
        torch.manual_seed(seed)
        a = old(Image.open(path).convert("RGB"))
        after_a = torch.rand(4)
        torch.manual_seed(seed)
        b = new(path)
        after_b = torch.rand(4)
        assert torch.equal(after_a, after_b), "a different number of draws: the crops' law changed"
        assert b.dtype == torch.uint8 and b.shape == (3, 224, 224)
        # The flip and the crop are the same draws: the images agree pixel for pixel to within rounding
        # (a mirrored or shifted crop would differ by tens of levels on these textures).
        diff = ((a * std + mean) * 255 - b.float()).abs()
        assert diff.mean() < 2.0 and diff.quantile(0.99) < 16, (path, diff.mean())


def test_dct_downscaled_decode_is_used_and_close(photos):
    """A 1000x750 JPEG whose plan shrinks it >= 2x decodes at a smaller scale, and its crop matches the
    full decode's to within resampling differences."""
    big = next(p for p in photos if Image.open(p).size == (1000, 750))
    data = open(big, "rb").read()
    plan = pipeline.draw_plan("caffe", False, 750, 1000, 224, 256, False)  # warp to 256x256: ~3x smaller
    small, scale = pipeline.decode_for(data, plan, 750, 1000)
    assert small.shape[-2:] == (375, 500) and scale == (0.5, 0.5)
    full = pipeline.decode_for(data, pipeline.Plan(750, 1000, 0, 0, 750, 1000, 750, 1000, False), 750, 1000)[0]
    assert full.shape[-2:] == (750, 1000)
    a, b = pipeline.apply_plan(small, plan, scale), pipeline.apply_plan(full, plan)
    assert (a.float() - b.float()).abs().mean() < 2.0


@pytest.mark.parametrize("k", [2, 4, 8])
def test_the_dct_scaled_decode_gives_pils_draft_pixels(photos, k):
    """The scaled decode (libjpeg-turbo through simplejpeg) is PIL's draft mode at the same 1/k, bit for bit."""
    from torchvision.transforms.functional import pil_to_tensor

    big = next(p for p in photos if Image.open(p).size == (1000, 750))
    data = open(big, "rb").read()
    # a plan whose crop of the whole image ends at 1/k of its size (slightly more: f just above k)
    plan = pipeline.Plan(750, 1000, 0, 0, 750, 1000, 750 // k - 1, 1000 // k - 1, False)
    got, scale = pipeline.decode_for(data, plan, 750, 1000)
    im = Image.open(big)
    im.draft("RGB", (1000 // k, 750 // k))
    assert im.size == (-(-1000 // k), -(-750 // k)) and scale == (im.size[1] / 750, im.size[0] / 1000)  # 1/k, rounded up
    assert torch.equal(got, pil_to_tensor(im.convert("RGB")))


def test_the_gpu_decode_path_gives_the_cpu_pipelines_images(photos):
    """decode=gpu: workers hand over the bytes and the drawn plan; decode_on_device (here on the CPU) gives
    the CPU decode's images (no DCT scaling there: equal where the CPU path decoded whole too)."""
    cpu = ImagePipeline("root", "torchvision", True, 224, 256, flip=True)
    gpu = ImagePipeline("root", "torchvision", True, 224, 256, flip=True, decode="gpu")
    samples, expected = [], []
    for seed, path in enumerate(photos[:6]):
        torch.manual_seed(seed)
        expected.append(cpu(path))
        torch.manual_seed(seed)
        samples.append((gpu(path), seed))
    x, y = collate(samples)
    assert isinstance(x, EncodedBatch) and y.tolist() == list(range(6))
    out = decode_on_device(x, torch.device("cpu"))
    assert out.dtype == torch.uint8 and out.shape == (6, 3, 224, 224)
    for k, e in enumerate(expected):
        assert (out[k].float() - e.float()).abs().mean() < 2.0


def test_normalise_is_totensor_then_normalize_bit_for_bit():
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    ref = torch.stack([T.Normalize(MEAN, STD)(xi.float().div(255)) for xi in x])
    assert torch.equal(normalise(x), ref)
    cl = normalise(x.contiguous(memory_format=torch.channels_last))
    assert cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(cl, ref)
    f = torch.randn(2, 3, 8, 8)
    assert normalise(f) is f  # float batches (the benchmarks' synthetic ones) are taken as normalised


def test_a_damaged_file_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "n01440764_1.JPEG"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all")
    with pytest.raises(UserError, match="cannot read image .*n01440764_1.JPEG") as e:
        ImagePipeline(tmp_path, "torchvision", True, 224, 256, True)(str(bad))
    assert "\n" not in str(e.value)


def test_task_checks_decode():
    from experiments.ilsvrc_cnns.task import Task, TaskCfg
    from mpt.config import Config

    for cfg, match in ((TaskCfg(decode="nvjpeg"), "task.decode"), (TaskCfg(augment="pad", decode="gpu", crop=32, resize=40),
                                                                   "task.decode=cpu")):
        with pytest.raises(UserError, match=match) as e:
            Task.check(Config(task=cfg))
        assert "\n" not in str(e.value)


def test_header_size_reads_the_frame_header_of_every_kind_of_file():
    """The frame header of baseline and progressive JPEGs (behind EXIF and comment segments), and PIL's
    answer for a PNG: (height, width), as PIL reports it."""
    img = Image.fromarray(np.zeros((37, 53, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x010E] = "a description long enough to make an APP1 segment"
    cases = {}
    for name, kw in (("baseline", {}), ("progressive", {"progressive": True}), ("exif", {"exif": exif.tobytes()})):
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90, **kw)
        cases[name] = buf.getvalue()
    buf = io.BytesIO()
    img.save(buf, "PNG")
    cases["png"] = buf.getvalue()
    for name, data in cases.items():
        assert pipeline.header_size(data) == (37, 53), name


def test_a_damaged_file_in_the_gpu_decodes_batch_is_one_line_naming_it(tmp_path, photos):
    """decode=gpu: the decode runs in the training process; a truncated JPEG in the batch (nvJPEG refuses
    it, libjpeg-turbo too) is named in one line, not a traceback from the decoder."""
    data = open(photos[0], "rb").read()
    bad = tmp_path / "n01440764_7.JPEG"
    bad.write_bytes(data[: len(data) // 2])
    gpu = ImagePipeline(tmp_path, "torchvision", True, 224, 256, flip=True, decode="gpu")
    x, _ = collate([(gpu(photos[1]), 0), (gpu(str(bad)), 1)])
    with pytest.raises(UserError, match="cannot read image .*n01440764_7.JPEG") as e:
        decode_on_device(x, torch.device("cpu"))
    assert "\n" not in str(e.value)


def test_the_gpu_decodes_batch_passes_a_cpu_loaders_pinning_unchanged(photos):
    """decode=gpu on a CUDA run decodes in the loader's pin-memory thread (EncodedBatch.pin_memory); where no
    GPU is visible the batch passes through the loader as it came from the collate."""
    from torch.utils.data import DataLoader

    gpu = ImagePipeline("root", "torchvision", True, 224, 256, flip=True, decode="gpu")
    batch = collate([(gpu(p), k) for k, p in enumerate(photos[:3])])
    if not torch.cuda.is_available():
        assert batch[0].pin_memory() is batch[0]
    loader = DataLoader([(gpu(p), k) for k, p in enumerate(photos[:4])], batch_size=2, collate_fn=collate,
                        pin_memory=torch.cuda.is_available())
    for x, y in loader:
        out = x if isinstance(x, torch.Tensor) else decode_on_device(x, torch.device("cpu"))
        assert out.shape == (2, 3, 224, 224) and out.dtype == torch.uint8


def test_the_crop_draws_are_torchvisions():
    """The pipeline's own RandomResizedCrop and RandomCrop draws give torchvision's get_params answers
    from the same generator state, and leave the generator where torchvision leaves it -- over ILSVRC's
    sizes and shapes that miss ten times (torchvision's centre-crop fallback)."""
    sizes = [(375, 500), (500, 375), (750, 1000), (333, 500), (256, 256), (224, 224), (1, 1), (2, 900), (900, 3),
             (40, 4000), (4000, 40), (300, 301)]
    for h, w in sizes:
        img = torch.empty(1, 1, 1).expand(3, h, w)
        for seed in range(300):
            torch.manual_seed(seed)
            want = T.RandomResizedCrop.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
            after_want = torch.rand(2)
            torch.manual_seed(seed)
            got = pipeline._resized_crop(h, w)
            assert got == want and torch.equal(torch.rand(2), after_want), (h, w, seed)
            if min(h, w) >= 224:
                torch.manual_seed(seed)
                want = T.RandomCrop.get_params(img, (224, 224))[:2]
                after_want = torch.rand(2)
                torch.manual_seed(seed)
                assert pipeline._random_crop(h, w, 224) == want and torch.equal(torch.rand(2), after_want)


@pytest.mark.parametrize("kind", ["baseline", "progressive", "grey", "444", "cmyk", "png"])
def test_rgb_tensor_gives_pils_pixels(kind):
    """data_prep.archives.rgb_tensor (simplejpeg, else torchvision's decoder, else PIL) gives the RGB
    pixels PIL gives, as a (3, H, W) uint8 tensor, for every kind of file an ILSVRC or VOC folder holds."""
    from data_prep.archives import rgb_tensor
    from torchvision.transforms.functional import pil_to_tensor

    img = Image.open(io.BytesIO(_photo(123, 77, 0)))
    buf = io.BytesIO()
    if kind == "png":
        img.save(buf, "PNG")
    elif kind == "grey":
        img.convert("L").save(buf, "JPEG", quality=90)
    elif kind == "cmyk":
        img.convert("CMYK").save(buf, "JPEG", quality=90)
    else:
        img.save(buf, "JPEG", quality=90, progressive=kind == "progressive", subsampling=0 if kind == "444" else -1)
    got = rgb_tensor(buf.getvalue())
    want = pil_to_tensor(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    assert got.dtype == torch.uint8 and got.shape == want.shape == (3, 77, 123)
    if kind == "cmyk":  # libjpeg-turbo's and PIL's CMYK conversions differ (Adobe's inverted CMYK): close
        assert (got.float() - want.float()).abs().mean() < 8
    else:
        assert torch.equal(got, want)
