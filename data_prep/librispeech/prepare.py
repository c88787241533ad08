"""Turn the official LibriSpeech archives into the tree torchaudio.datasets.LIBRISPEECH reads, plus
duration-sorted manifests for the DeepSpeech 2 task.

Input (--archives DIR): any of the official `<subset>.tar.gz` from openslr.org/12 (train-clean-100,
train-clean-360, train-other-500, dev-clean, dev-other, test-clean, test-other). Each holds
    LibriSpeech/<subset>/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac
    LibriSpeech/<subset>/<speaker>/<chapter>/<speaker>-<chapter>.trans.txt   "<utt id> <TRANSCRIPT>"
    LibriSpeech/{README,SPEAKERS,CHAPTERS,BOOKS,LICENSE}.TXT
Output (--out OUT):
    OUT/LibriSpeech/<subset>/...        as in the archive: torchaudio.datasets.LIBRISPEECH(OUT, url=<subset>)
    OUT/manifests/<subset>.jsonl        id, audio path, duration, transcript; shortest first
    OUT/manifests/<subset>.info.json    what that subset's manifest was made from (resume)
    OUT/prepared.json                   completion marker: per-subset counts, hours, archive digests

Checks: every member path stays inside OUT and has the official layout; every FLAC decodes as
16 kHz audio (a truncated or corrupt file fails with its name); every transcript line has its FLAC
and every FLAC its transcript line (the counts must agree); transcripts use LibriSpeech's alphabet
(A-Z, apostrophe, space). Whether each subset has its official utterance count is recorded
("official"). Resumable: a subset whose manifest was made from the same archive is skipped, files
already extracted with the right size are not rewritten (temp files of a killed run are removed);
the marker is written last.
"""
from __future__ import annotations

import datetime
import json
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
from mpt.rundir import atomic_write_bytes, atomic_write_json, sampled_digest

ROOT = "LibriSpeech"
# openslr.org/12: utterances per subset.
OFFICIAL = {"train-clean-100": 28_539, "train-clean-360": 104_014, "train-other-500": 148_688,
            "dev-clean": 2_703, "dev-other": 2_864, "test-clean": 2_620, "test-other": 2_939}
TOP_FILES = {"README.TXT", "SPEAKERS.TXT", "CHAPTERS.TXT", "BOOKS.TXT", "LICENSE.TXT"}
ALPHABET = re.compile(r"^[A-Z' ]+$")
_WHERE = "download it again from openslr.org/12"


def _parse_transcript(data: bytes, name: str, spk: str, ch: str) -> dict[str, str]:
    out = {}
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{name} is not UTF-8 text; {_WHERE}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        uid, _, text = line.partition(" ")
        if not uid.startswith(f"{spk}-{ch}-") or not ALPHABET.match(text.strip() or "?"):
            raise UserError(f"{name} line {i} is not '<{spk}-{ch}-NNNN> <TRANSCRIPT in A-Z' >': {line[:60]!r}")
        out[uid] = text.strip()
    return out


def prepare_subset(archive: Path, subset: str, out: Path, log=print) -> dict:
    """Extract one <subset>.tar.gz and write its manifest; returns the subset's counts."""
    audio, texts, kept = {}, {}, 0
    try:
        # streamed: one pass over a 6-30 GB archive; its progress in compressed bytes read
        with open(archive, "rb") as raw, tarfile.open(fileobj=raw, mode="r|gz") as tf, \
                Progress(f"librispeech {subset}", archive.stat().st_size, "bytes") as progress:
            for m in tf:
                progress.set(raw.tell())
                name = safe_relpath(m.name, "member path", archive)
                if m.isdir():
                    continue
                if not m.isfile():
                    raise UserError(f"{archive}: {name} is a link or device, not a file; {_WHERE}")
                parts = name.split("/")
                if len(parts) == 2 and parts[0] == ROOT and parts[1] in TOP_FILES:
                    atomic_write_bytes(out / name, tf.extractfile(m).read())
                    continue
                if len(parts) != 5 or parts[0] != ROOT or parts[1] != subset:
                    raise UserError(f"{archive} holds {name!r}; the official archive holds only "
                                    f"{ROOT}/{subset}/<speaker>/<chapter>/<files> and {ROOT}/*.TXT")
                spk = safe_name(parts[2], "speaker id", archive)
                ch = safe_name(parts[3], "chapter id", archive)
                data = tf.extractfile(m).read()
                if parts[4] == f"{spk}-{ch}.trans.txt":
                    texts.update(_parse_transcript(data, f"{archive}:{name}", spk, ch))
                    target = out / name
                elif re.fullmatch(rf"{re.escape(spk)}-{re.escape(ch)}-\d+\.flac", parts[4]):
                    x, sr = decode(data, f"{archive}:{name}")
                    if sr != SAMPLE_RATE:
                        raise UserError(f"{archive}:{name} is {sr} Hz audio; LibriSpeech is {SAMPLE_RATE} Hz")
                    uid = parts[4][:-5]
                    audio[uid] = {"id": uid, "audio": name, "duration": round(len(x) / sr, 4)}
                    target = out / name
                else:
                    raise UserError(f"{archive} holds {name!r}, neither <speaker>-<chapter>-<utt>.flac nor "
                                    f"<speaker>-<chapter>.trans.txt")
                if target.is_file() and target.stat().st_size == len(data):
                    kept += 1  # written by an earlier, interrupted run (each file atomically)
                else:
                    atomic_write_bytes(target, data)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise UserError(f"{archive} is truncated or not a tar.gz ({type(e).__name__}: {e}); {_WHERE}") from None
    no_audio, no_text = sorted(set(texts) - set(audio)), sorted(set(audio) - set(texts))
    if no_audio:
        raise UserError(f"{archive}: {len(no_audio)} transcript lines have no FLAC (first {no_audio[0]}); {_WHERE}")
    if no_text:
        raise UserError(f"{archive}: {len(no_text)} FLACs have no transcript line (first {no_text[0]}); {_WHERE}")
    if not audio:
        raise UserError(f"{archive} holds no utterances; {_WHERE}")
    rows = [{**audio[u], "text": texts[u]} for u in audio]
    write_manifest(out / "manifests" / f"{subset}.jsonl", rows)
    info = {"utterances": len(rows), "speakers": len({u.split("-")[0] for u in audio}),
            "hours": round(sum(r["duration"] for r in rows) / 3600, 3),
            "official": len(rows) == OFFICIAL[subset],
            "archive": {"name": archive.name, "bytes": archive.stat().st_size, "digest": sampled_digest(archive)}}
    atomic_write_json(out / "manifests" / f"{subset}.info.json", info)
    log(f"  {subset}: {len(rows)} utterances, {info['hours']} h ({kept} files kept from an earlier run)")
    return info


def prepare(archives: Path, out: Path, force: bool = False, log=print) -> dict:
    archives, out = Path(archives), Path(out)
    if (info := already_prepared(out, force, log, sources=archives)) is not None:
        return info
    marker = out / MARKER
    if not archives.is_dir():
        raise UserError(f"--archives {archives} is not a folder")
    found = {s: archives / f"{s}.tar.gz" for s in OFFICIAL if (archives / f"{s}.tar.gz").is_file()}
    if not found:
        raise UserError(f"no LibriSpeech archive (<subset>.tar.gz, subset one of {', '.join(OFFICIAL)}) in "
                        f"{archives}; download them from openslr.org/12")
    t0 = time.time()
    marker.unlink(missing_ok=True)
    sweep_temp_files(out, log)
    subsets = {}
    for subset, path in found.items():
        info_path = out / "manifests" / f"{subset}.info.json"
        if info_path.is_file() and not force:
            prev = json.loads(info_path.read_text())
            if prev.get("archive") == {"name": path.name, "bytes": path.stat().st_size, "digest": sampled_digest(path)}:
                subsets[subset] = prev  # done by an earlier run from this very archive
                log(f"  {subset}: kept from an earlier run")
                continue
        subsets[subset] = prepare_subset(path, subset, out, log)
    info = {"dataset": "librispeech", "subsets": subsets, "vocab": "a-z, apostrophe, space",
            "seconds": round(time.time() - t0, 1),
            "prepared_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_json(marker, info)
    counts = ", ".join(f"{k} ({v['utterances']})" for k, v in subsets.items())
    log(f"prepared LibriSpeech {counts} in {out}")
    return info
