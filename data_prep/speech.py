"""What the speech data_preps share (LibriSpeech, AISHELL-1): checked audio decoding, the manifest
format the DeepSpeech 2 task reads, and espeak-ng synthesis for the tiny releases.

Manifest: <out>/manifests/<split>.jsonl, one utterance per line, sorted by duration (SortaGrad,
Amodei et al. 2016 section 3.1, reads the shortest first):
    {"id": "<utterance id>", "audio": "<path relative to out>", "duration": <seconds>, "text": "<transcript>"}

Audio I/O is soundfile (libsndfile): torchaudio 2.9+ moved torchaudio.load to torchcodec, which
this project does not install; soundfile reads FLAC and WAV and is what torchaudio used to wrap.
"""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from mpt.errors import UserError
from mpt.rundir import atomic_write_text

SAMPLE_RATE = 16_000  # LibriSpeech and AISHELL-1 are 16 kHz, 16-bit mono


def decode(data: bytes | str | Path, what: str) -> tuple[np.ndarray, int]:
    """(float32 samples, sample rate) of a FLAC/WAV file or its bytes; a one-line error naming
    `what` when it cannot be decoded (truncated, not audio, empty) or its samples are not finite or
    beyond full scale (check_samples). The preps check every file with it, and the DeepSpeech 2 task
    reads every utterance through it, so a file changed after its prep is refused as it is read."""
    import soundfile as sf

    try:
        src = io.BytesIO(data) if isinstance(data, bytes) else str(data)
        x, sr = sf.read(src, dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001  (libsndfile raises several types)
        raise UserError(f"{what} is unreadable audio ({type(e).__name__}: {str(e)[:80]}); "
                        f"the archive is damaged: download it again") from None
    if x.shape[0] == 0:
        raise UserError(f"{what} holds no audio samples; the archive is damaged: download it again")
    check_samples(x, what)
    return x.mean(axis=1), sr


def check_samples(x: np.ndarray, what: str) -> None:
    """Samples must be finite and within full scale [-1, 1]: integer PCM (LibriSpeech's FLAC, AISHELL-1's
    WAV) always is, but a float WAV can hold NaN, inf or any magnitude, and one NaN sample makes every
    loss it enters NaN -- the run ends "diverged", a wrong paper cell, not an error."""
    finite = np.isfinite(x)
    if not finite.all():
        raise UserError(f"{what} holds {int((~finite).sum())} non-finite audio sample(s) (NaN or inf); the file "
                        f"is damaged: download the archive again or remove the utterance")
    peak = float(np.abs(x).max())
    if peak > 1.0:
        raise UserError(f"{what} has samples up to {peak:.4g}, outside full scale [-1, 1]; the file is damaged: "
                        f"download the archive again or remove the utterance")


def write_manifest(path: Path, rows: list[dict]) -> None:
    rows = sorted(rows, key=lambda r: (r["duration"], r["id"]))
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_manifest(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except FileNotFoundError:
        raise UserError(f"no manifest {path}; prepare the data first (python -m data_prep.librispeech or "
                        f"python -m data_prep.aishell)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"manifest {path} is unreadable ({type(e).__name__}); prepare the data again") from None


# ------------------------------------------------------------------------------------------------
# espeak-ng: real synthesized speech for the tiny releases


def have_espeak() -> bool:
    return shutil.which("espeak-ng") is not None


def espeak(text: str, voice: str, rate: int, pitch: int, rng: np.random.Generator,
           sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """int16 samples of `text` spoken by espeak-ng (voice such as 'en-us+f2' or 'cmn+m3', rate in
    words per minute, pitch 0-99), resampled to `sample_rate`, with a little room noise and random
    silence before and after so that utterances differ beyond the voice settings."""
    import soundfile as sf
    import torch
    import torchaudio.functional as AF

    if not have_espeak():
        raise UserError("espeak-ng is not installed; run setup.sh as root (apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as d:
        wav = Path(d) / "u.wav"
        # A list of arguments, no shell; "--" ends options so text starting with '-' is spoken.
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(rate), "-p", str(pitch), "-w", str(wav), "--", text],
                       check=True, capture_output=True)
        x, sr = sf.read(str(wav), dtype="float32")
    y = AF.resample(torch.from_numpy(x), sr, sample_rate).numpy()
    pad = [np.zeros(int(rng.uniform(0.05, 0.3) * sample_rate), np.float32) for _ in range(2)]
    y = np.concatenate([pad[0], y * rng.uniform(0.5, 0.9), pad[1]])
    y = y + rng.normal(0, rng.uniform(0.001, 0.01), y.shape).astype(np.float32)
    return (np.clip(y, -1, 1) * 32767).astype(np.int16)


def encode(samples: np.ndarray, fmt: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """FLAC or WAV bytes (16-bit PCM) of int16 samples."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sample_rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()

