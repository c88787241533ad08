"""What is read from an archive and what a release's archive is written with: member paths and class names
checked before they become paths under --out (an absolute path or a `..` component would write outside it:
path traversal), images decoded with a one-line error naming the member, and a deterministic tar.gz writer."""
from __future__ import annotations

import contextlib
import io
from pathlib import PurePosixPath

from mpt.errors import UserError



def safe_relpath(name: str, what: str, source) -> str:
    """`name` (a member path like 'a/b.jpg') as a relative POSIX path that stays inside the output
    folder, or a one-line UserError naming the archive. `what` says what the name is."""
    bad = (not name or "\x00" in name or "\\" in name or name.startswith("/")
           or any(part in ("..",) for part in PurePosixPath(name).parts))
    if bad:
        raise UserError(f"{source}: unsafe {what} {name!r} (absolute, '..' or odd characters); "
                        f"the archive is damaged or tampered with: download it again")
    return str(PurePosixPath(name))



def safe_name(name: str, what: str, source) -> str:
    """A single path component (a class id such as a WNID, a speaker id): no separators at all."""
    if not name or "/" in name or name in (".", "..") or "\\" in name or "\x00" in name:
        raise UserError(f"{source}: unsafe {what} {name!r} (must be a plain name); "
                        f"the archive is damaged or tampered with: download it again")
    return name



def rgb_tensor(data: bytes):
    """Encoded image bytes as a uint8 (3, H, W) RGB tensor (HWC in memory). A JPEG goes to libjpeg-turbo
    through simplejpeg (its SIMD build, ~7% faster than torchvision's bundled decoder on ImageNet-sized
    photographs; both give PIL's pixels bit for bit: tests/test_imagenet_pipeline.py), then torchvision's
    decoder for what simplejpeg refuses (a CMYK JPEG), then PIL for anything else (a PNG named .JPEG, as
    ILSVRC's train set holds one). torchvision deprecates its decoders from 0.29 (pinned here; their
    successor, torchcodec, is not a dependency): that warning is silenced. A damaged file raises PIL's
    OSError."""
    import warnings

    import torch
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    x = simplejpeg_rgb(data)
    if x is not None:
        return x
    try:
        from torchvision.io import ImageReadMode, decode_image as tv_decode

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return tv_decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except (ImportError, RuntimeError):
        pass
    with Image.open(io.BytesIO(data)) as im:
        return pil_to_tensor(im.convert("RGB"))



def simplejpeg_rgb(data: bytes, min_height: int = 0, min_width: int = 0):
    """A JPEG's bytes as a uint8 (3, H, W) RGB tensor (HWC in memory) through simplejpeg (libjpeg-turbo's SIMD
    build), decoded in the DCT domain at the smallest scale of at least min_height x min_width (0: whole);
    None for what it does not decode (not a JPEG, a CMYK one, simplejpeg not installed): the caller's fallback."""
    if data[:2] != b"\xff\xd8":
        return None
    import torch

    try:
        import simplejpeg

        a = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_height, min_width=min_width)
    except (ImportError, ValueError):
        return None
    return torch.from_numpy(a).permute(2, 0, 1)


def decode_image(data, what: str, fix: str, kind: str = "an image") -> tuple[str, tuple[int, int]]:
    """(format, (width, height)) of an image -- its bytes or a path -- decoded in full, as a loader will
    decode it; a one-line UserError naming `what` and `fix` for one that does not decode: a damaged body
    passes a look at its first bytes and an archive's CRC (computed over the damage), then fails a
    training run mid-epoch."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            im.load()
            return im.format, im.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise UserError(f"{what} does not decode as {kind} ({str(e)[:80]}); {fix}") from None



@contextlib.contextmanager
def tar_gz_writer(fileobj):
    """A tar.gz being written to `fileobj` whose bytes depend on its members only: with add_member's
    fixed times, and 0 for the gzip header's time (tarfile's "w:gz" writes the current time there, so
    every generation of the same release had new bytes, digests and data_fingerprint)."""
    import gzip
    import tarfile

    with gzip.GzipFile(filename="", mode="wb", fileobj=fileobj, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        yield tf



def add_member(tf, name: str, data: bytes) -> None:
    """Add a file to a tar being written, with fixed times and modes (deterministic archives)."""
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tf.addfile(info, io.BytesIO(data))
