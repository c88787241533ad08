"""Turn the official AISHELL-1 release into the layout Kaldi/ESPnet recipes read, plus
duration-sorted manifests and the character vocabulary for the DeepSpeech 2 task.

Input (--archives DIR): data_aishell.tgz from openslr.org/33, holding
    data_aishell/wav/<speaker>.tar.gz       per speaker: <split>/<speaker>/<utt>.wav, split train|dev|test
    data_aishell/transcript/aishell_transcript_v0.8.txt   "<utt> <words separated by spaces>"
Output (--out OUT):
    OUT/data_aishell/wav/<split>/<speaker>/<utt>.wav, OUT/data_aishell/transcript/aishell_transcript_v0.8.txt
    OUT/manifests/{train,dev,test}.jsonl    id, audio path, duration, transcript (characters, no spaces)
    OUT/vocab.txt                           the training transcripts' characters, one per line
    OUT/prepared.json                       completion marker: counts, hours, vocabulary size, digest

Checks: member paths stay inside OUT and follow the layout; each speaker tar opens (a truncated one
fails with its name) and holds only its own speaker's WAVs; every WAV decodes as 16 kHz audio; every
transcript line has its WAV (a transcript without audio is an error). A WAV without a transcript
line is left out and counted, as the Kaldi and ESPnet AISHELL recipes do (the release has a few
hundred). The official counts (train 120,098 / dev 14,326 / test 7,176 transcribed utterances) are
recorded ("official"). Resumable: WAVs already extracted with the right size are not rewritten (temp
files of a killed run are removed); the marker is written last.
"""
from __future__ import annotations

import datetime
import re
import tarfile
import time
import zlib
from pathlib import Path

from data_prep.archives import safe_name, safe_relpath
from data_prep.prepared import MARKER, already_prepared, sweep_temp_files
from data_prep.progress import Progress
from data_prep.speech import SAMPLE_RATE, decode, write_manifest
from mpt.errors import UserError
from mpt.rundir import atomic_write_bytes, atomic_write_json, atomic_write_text, sampled_digest

ARCHIVE = "data_aishell.tgz"
ROOT = "data_aishell"
TRANSCRIPT = f"{ROOT}/transcript/aishell_transcript_v0.8.txt"
SPLITS = ("train", "dev", "test")
OFFICIAL = {"train": 120_098, "dev": 14_326, "test": 7_176}
_WHERE = "download data_aishell.tgz again from openslr.org/33"


def parse_transcript(data: bytes, what: str) -> dict[str, str]:
    """utterance id -> characters (the release's word segmentation spaces removed: CER is per character)."""
    out = {}
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{what} is not UTF-8 text; {_WHERE}") from None
    for i, line in enumerate(lines, 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) < 2 or not re.fullmatch(r"[A-Z0-9]+", parts[0]):
            raise UserError(f"{what} line {i} is not '<utterance id> <words>': {line[:60]!r}")
        if parts[0] in out:
            raise UserError(f"{what} names {parts[0]} twice (line {i})")
        out[parts[0]] = "".join(parts[1:])
    return out


def _speaker_tar(fileobj, name: str, out: Path, audio: dict) -> int:
    """Extract one data_aishell/wav/<speaker>.tar.gz (a stream inside the outer archive)."""
    spk = safe_name(name.rsplit("/", 1)[1][: -len(".tar.gz")], "speaker id", name)
    kept = 0
    try:
        with tarfile.open(fileobj=fileobj, mode="r|gz") as tf:
            for m in tf:
                rel = safe_relpath(m.name, "member path", name)
                if m.isdir():
                    continue
                parts = rel.split("/")
                if not m.isfile() or len(parts) != 3 or parts[0] not in SPLITS or parts[1] != spk \
                        or not parts[2].endswith(".wav"):
                    raise UserError(f"{name} holds {rel!r}; a speaker archive holds only "
                                    f"<train|dev|test>/{spk}/<utterance>.wav")
                uid = safe_name(parts[2][:-4], "utterance id", name)
                data = tf.extractfile(m).read()
                x, sr = decode(data, f"{name}:{rel}")
                if sr != SAMPLE_RATE:
                    raise UserError(f"{name}:{rel} is {sr} Hz audio; AISHELL-1 is {SAMPLE_RATE} Hz")
                path = f"{ROOT}/wav/{rel}"
                if uid in audio:
                    raise UserError(f"{name}: utterance {uid} appears twice in the release")
                audio[uid] = {"id": uid, "audio": path, "duration": round(len(x) / sr, 4), "split": parts[0]}
                target = out / path
                if target.is_file() and target.stat().st_size == len(data):
                    kept += 1
                else:
                    atomic_write_bytes(target, data)
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise UserError(f"{name} is truncated or not a tar.gz ({type(e).__name__}: {e}); {_WHERE}") from None
    return kept


def prepare(archives: Path, out: Path, force: bool = False, log=print) -> dict:
    archives, out = Path(archives), Path(out)
    if (info := already_prepared(out, force, log, sources=archives)) is not None:
        return info
    marker = out / MARKER
    path = archives / ARCHIVE
    if not path.is_file():
        raise UserError(f"no {ARCHIVE} in {archives}; download it from openslr.org/33")
    t0 = time.time()
    marker.unlink(missing_ok=True)
    sweep_temp_files(out, log)
    audio: dict[str, dict] = {}
    texts, kept, speakers = None, 0, 0
    try:
        # streamed: one pass over the 15 GB archive; its progress in compressed bytes read
        with open(path, "rb") as raw, tarfile.open(fileobj=raw, mode="r|gz") as outer, \
                Progress("aishell", path.stat().st_size, "bytes") as progress:
            for m in outer:
                progress.set(raw.tell())  # the speaker archives read so far
                name = safe_relpath(m.name, "member path", path)
                if m.isdir():
                    continue
                if name == TRANSCRIPT:
                    data = outer.extractfile(m).read()
                    texts = parse_transcript(data, f"{path}:{name}")
                    atomic_write_bytes(out / name, data)
                elif re.fullmatch(rf"{ROOT}/wav/[^/]+\.tar\.gz", name):
                    kept += _speaker_tar(outer.extractfile(m), f"{path}:{name}", out, audio)
                    speakers += 1
                elif not name.startswith(f"{ROOT}/"):
                    raise UserError(f"{path} holds {name!r}, outside {ROOT}/; {_WHERE}")
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise UserError(f"{path} is truncated or not a tar.gz ({type(e).__name__}: {e}); {_WHERE}") from None
    if texts is None:
        raise UserError(f"{path} holds no {TRANSCRIPT}; {_WHERE}")
    if not audio:
        raise UserError(f"{path} holds no speaker archives ({ROOT}/wav/<speaker>.tar.gz); {_WHERE}")
    no_audio = sorted(set(texts) - set(audio))
    if no_audio:
        raise UserError(f"{path}: {len(no_audio)} transcript lines have no WAV (first {no_audio[0]}); {_WHERE}")
    untranscribed = sorted(set(audio) - set(texts))
    counts, hours = {}, {}
    for split in SPLITS:
        rows = [{k: v for k, v in a.items() if k != "split"} | {"text": texts[u]}
                for u, a in audio.items() if a["split"] == split and u in texts]
        write_manifest(out / "manifests" / f"{split}.jsonl", rows)
        counts[split], hours[split] = len(rows), round(sum(r["duration"] for r in rows) / 3600, 3)
    vocab = sorted({c for u, a in audio.items() if a["split"] == "train" and u in texts for c in texts[u]})
    atomic_write_text(out / "vocab.txt", "".join(c + "\n" for c in vocab))
    info = {"dataset": "aishell", **counts, "hours": hours, "speakers": speakers, "vocab": len(vocab),
            "untranscribed_wavs": len(untranscribed), "official": counts == OFFICIAL,
            "archive": {"name": ARCHIVE, "bytes": path.stat().st_size, "digest": sampled_digest(path)},
            "skipped": kept, "seconds": round(time.time() - t0, 1),
            "prepared_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_json(marker, info)
    log(f"prepared AISHELL-1 {counts} ({len(vocab)} characters; {len(untranscribed)} WAVs without a transcript "
        f"left out; {kept} files kept from an earlier run) in {out}")
    return info
