"""WMT15 English-French (the paper's Figure 4 data) as subword-id files.

Input (--archives DIR): the official WMT15 downloads (statmt.org/wmt15/translation-task.html), as
fairseq's prepare-wmt14en2fr.sh and the TensorFlow translate.py tutorial read them:

    training-parallel-europarl-v7.tgz   training/europarl-v7.fr-en.{en,fr}
    training-parallel-commoncrawl.tgz   commoncrawl.fr-en.{en,fr}
    training-parallel-un.tgz            un/undoc.2000.fr-en.{en,fr}
    training-parallel-nc-v10.tgz        news-commentary-v10.fr-en.{en,fr} (under training/ in some copies)
    training-giga-fren.tar              giga-fren.release2.fixed.{en,fr}.gz   (the 10^9 French-English corpus)
    dev.tgz                             dev/newstest2013.{en,fr}              (validation: translate.py's dev set)
    test-full.tgz                       test-full/newstest2014-fren-src.en.sgm, -ref.fr.sgm (test, SGML)

A member is found by its file name (any folder above it, checked by data_prep.archives.safe_relpath).
A subset of the training corpora is allowed (--corpora, default: every corpus whose archive is there);
the dev and test archives are required.

Output (--out OUT):
    OUT/spm.en.model, spm.fr.model   SentencePiece BPE models, one per language (--vocab, default 40,000
                                     each: translate.py's en_vocab_size / fr_vocab_size); ids 0 <pad>,
                                     1 <s> (translate.py's _GO), 2 </s>, 3 <unk>
    OUT/{train,dev,test}.{en,fr}.bin the ids of every sentence, concatenated (uint16, or uint32 for a
                                     vocabulary above 65,535), no <s> / </s>
    OUT/{train,dev,test}.{en,fr}.idx int64 offsets: sentence i is bin[idx[i]:idx[i+1]]
    OUT/{dev,test}.{en,fr}.txt       the raw sentences (sacrebleu's references are test.fr.txt)
    OUT/prepared.json                counts, sizes, digests; written last (the completion marker)

Checks: every wanted member is in its archive (a missing one is a one-line error naming the archive);
a truncated tar or gzip is a one-line error; the two sides of every corpus have the same line count
(misaligned files are an error naming both counts); the SGML test files hold the same segment ids.
Pairs with an empty side are dropped (counted in the marker); a corpus or dev set left with no pair
is an error naming its archive. Re-running is safe: a complete output is left alone (--force redoes
it); an interrupted run resumes from its finished stages in OUT/.partial unless the archives or the
options changed.

Deterministic: the same archives give the same bytes (and so the same data_fingerprint) on any
machine and in any folder -- the subword models are trained on an evenly spread sample chosen
without randomness, on one thread, and hold no path.
"""
from __future__ import annotations

import dataclasses
import datetime
import gzip
import html
import io
import json
import os
import re
import shutil
import tarfile
import time
import zlib
from pathlib import Path, PurePosixPath

import numpy as np

from data_prep.archives import safe_relpath
from data_prep.prepared import MARKER, already_prepared, sweep_temp_files
from data_prep.progress import Progress
from mpt.errors import UserError
from mpt.rundir import atomic_write, atomic_write_json, sampled_digest

URL = "https://www.statmt.org/wmt15/translation-task.html"
SRC, TGT = "en", "fr"  # Figure 4: English to French
PARTIAL, STATE = ".partial", "state.json"
PAD, BOS, EOS, UNK = 0, 1, 2, 3
VOCAB = 40_000  # translate.py: --en_vocab_size 40000 --fr_vocab_size 40000
SPM_SENTENCES = 2_000_000  # sentences per language the subword model is trained on (an evenly spread sample)


@dataclasses.dataclass(frozen=True)
class Corpus:
    archive: str
    stem: str  # member file name = <stem>.<lang>[.gz]
    gz: bool = False


CORPORA = {
    "europarl": Corpus("training-parallel-europarl-v7.tgz", "europarl-v7.fr-en"),
    "commoncrawl": Corpus("training-parallel-commoncrawl.tgz", "commoncrawl.fr-en"),
    "un": Corpus("training-parallel-un.tgz", "undoc.2000.fr-en"),
    "news_commentary": Corpus("training-parallel-nc-v10.tgz", "news-commentary-v10.fr-en"),
    "giga": Corpus("training-giga-fren.tar", "giga-fren.release2.fixed", gz=True),
}
DEV = Corpus("dev.tgz", "newstest2013")
TEST_ARCHIVE = "test-full.tgz"
TEST_FILES = {SRC: "newstest2014-fren-src.en.sgm", TGT: "newstest2014-fren-ref.fr.sgm"}


def _fetch(what: str) -> str:
    return f"{what}; download it again from {URL}"


# ------------------------------------------------------------------ reading archives


def extract(archive: Path, wanted: dict[str, Path]) -> None:
    """Copy the members named (by file name) in `wanted` out of `archive` to their paths, in one
    sequential pass. One-line errors for a missing archive, a truncated one, a missing member."""
    if not archive.is_file():
        raise UserError(_fetch(f"no {archive.name} in {archive.parent}"))
    left = dict(wanted)

    def copy(src, f):
        while block := src.read(1 << 20):
            f.write(block)
            progress.set(raw.tell())

    try:
        # progress in bytes of the archive read (compressed, for a .tgz): giga-fren's tar is 2.6 GB
        with open(archive, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as tar, \
                Progress(f"wmt15 {archive.name}", archive.stat().st_size, "bytes") as progress:
            for m in tar:
                progress.set(raw.tell())
                base = PurePosixPath(safe_relpath(m.name, "member path", archive)).name
                if not m.isfile() or base not in left:
                    continue
                src = tar.extractfile(m)
                atomic_write(left.pop(base), lambda f: copy(src, f))
                if not left:
                    break
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, OSError) as e:
        raise UserError(_fetch(f"{archive} is truncated or corrupt ({type(e).__name__}: {e})")) from None
    if left:
        raise UserError(_fetch(f"{archive} lacks {', '.join(sorted(left))}"))


def _open_lines(path: Path, gz: bool, source: str, progress: Progress | None = None):
    """The lines of a text file ('\\n' only: the corpora hold other Unicode separators inside
    sentences), decoded as UTF-8 (undecodable bytes replaced), whitespace collapsed; with `progress`,
    the bytes of the file read so far (compressed, for a .gz) go there."""
    try:
        with open(path, "rb") as raw, (gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw) as f:
            for k, line in enumerate(f):
                if progress is not None and k % 8192 == 0:
                    progress.set(raw.tell())
                yield " ".join(line.decode("utf-8", errors="replace").split())
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise UserError(_fetch(f"{source} is truncated or corrupt ({type(e).__name__}: {e})")) from None


def pair_lines(src: Path, tgt: Path, gz: bool, name: str, out_src: Path, out_tgt: Path) -> dict:
    """Write the aligned, non-empty pairs of two parallel files; the files must have equal line counts."""
    n = kept = 0
    progress = Progress(f"wmt15 {name}: pairing lines", src.stat().st_size, "bytes")
    a = _open_lines(src, gz, f"{name} ({src.name})", progress)
    b = _open_lines(tgt, gz, f"{name} ({tgt.name})")
    with open(str(out_src) + ".tmp", "w", encoding="utf-8") as fs, open(str(out_tgt) + ".tmp", "w", encoding="utf-8") as ft, \
            progress:
        while True:
            x, y = next(a, None), next(b, None)
            if x is None or y is None:
                if x is not None or y is not None:
                    na = n + (x is not None) + sum(1 for _ in a)
                    nb = n + (y is not None) + sum(1 for _ in b)
                    raise UserError(_fetch(f"{name}: {src.name} has {na:,} lines but {tgt.name} has {nb:,}; "
                                           f"the parallel files are misaligned"))
                break
            n += 1
            if x and y:
                fs.write(x + "\n")
                ft.write(y + "\n")
                kept += 1
    os.replace(str(out_src) + ".tmp", out_src)
    os.replace(str(out_tgt) + ".tmp", out_tgt)
    return {"lines": n, "pairs": kept, "dropped_empty": n - kept}


_SEG = re.compile(r"<seg\s+id=\"?([^\">\s]+)\"?[^>]*>(.*?)</seg>", re.S)


def read_sgm(path: Path) -> tuple[list[str], list[str]]:
    """(segment ids, texts) of a WMT SGML file (<seg id="N">text</seg>), entities unescaped."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    segs = _SEG.findall(text)
    if not segs:
        raise UserError(_fetch(f"{path.name} holds no <seg id=...> segments; it is not a WMT SGML file"))
    return [i for i, _ in segs], [" ".join(html.unescape(t).split()) for _, t in segs]


# ------------------------------------------------------------------ subword ids


def spread_sample(lines, total: int, sentences: int):
    """Every line when total <= sentences, else `sentences` of them evenly spread over all `total`
    (line floor(k * total / sentences) for k = 0, 1, ...): the same sample on every run, no randomness."""
    k, pick = 0, 0
    for i, line in enumerate(lines):
        if i == pick:
            yield line
            k += 1
            pick = k * total // sentences if total > sentences else k
            if k == sentences:
                return


def train_spm(texts: list[Path], total: int, vocab: int, sentences: int, what: str = "sample") -> bytes:
    """A BPE model (its bytes) of a spread sample of the lines of `texts` (`total` lines in all).
    Deterministic, unlike sentencepiece's own sampling: its random generator is per thread and keeps
    running from one training to the next in a process (a resumed prep sampled differently), its
    model records the number of threads and the input and output paths (another machine or folder
    gave other bytes), so the sample is ours, one thread trains, and the model goes to memory."""
    import sentencepiece as spm

    def lines(progress):
        for t in texts:
            with open(t, encoding="utf-8", newline="\n") as f:
                for k, line in enumerate(f, 1):
                    if k % 8192 == 0:  # a call per line costs ~0.4 s of CPU per million lines
                        progress.add(8192)
                    yield line.rstrip("\n")

    model = io.BytesIO()
    # Only the reading of the sample shows progress: the merges that follow report nothing we can count.
    with Progress(what, total, "lines") as progress:
        spm.SentencePieceTrainer.train(
            sentence_iterator=spread_sample(lines(progress), total, sentences), model_writer=model,
            vocab_size=vocab, model_type="bpe", character_coverage=1.0, pad_id=PAD, bos_id=BOS, eos_id=EOS,
            unk_id=UNK, input_sentence_size=0, shuffle_input_sentence=False,
            hard_vocab_limit=False,  # a small corpus (the tiny set) may not have `vocab` pieces
            num_threads=1, minloglevel=2)
    return model.getvalue()


def encode_file(sp, text: Path, out_bin: Path, out_idx: Path, dtype, chunk: int = 100_000,
                progress: Progress | None = None) -> int:
    """Encode one sentence per line into concatenated ids + offsets (each file written atomically);
    the lines encoded are counted into `progress`."""
    offsets = [0]

    def write(f):
        buf = []
        with open(text, encoding="utf-8") as t:
            for line in t:
                buf.append(line.rstrip("\n"))
                if len(buf) == chunk:
                    _emit(f, buf)
                    buf.clear()
        _emit(f, buf)

    def _emit(f, lines):
        if not lines:
            return
        for ids in sp.encode(lines):
            offsets.append(offsets[-1] + len(ids))
            f.write(np.asarray(ids, dtype=dtype).tobytes())
        if progress is not None:
            progress.add(len(lines))

    atomic_write(out_bin, write)
    atomic_write(out_idx, lambda f: f.write(np.asarray(offsets, dtype=np.int64).tobytes()))
    return len(offsets) - 1


# ------------------------------------------------------------------ the pipeline


class _State:
    """Finished stages of an interrupted run (OUT/.partial/state.json), valid for one fingerprint."""

    def __init__(self, part: Path, fingerprint: dict):
        self.path = part / STATE
        old = json.loads(self.path.read_text()) if self.path.is_file() else None
        if old is None or old.get("fingerprint") != fingerprint:
            shutil.rmtree(part, ignore_errors=True)
            old = {"fingerprint": fingerprint, "done": {}}
        part.mkdir(parents=True, exist_ok=True)
        self.data = old

    def get(self, stage: str):
        return self.data["done"].get(stage)

    def set(self, stage: str, value) -> None:
        self.data["done"][stage] = value
        atomic_write_json(self.path, self.data)


def _choose(archives: Path, corpora: list[str] | None) -> list[str]:
    if corpora:
        unknown = [c for c in corpora if c not in CORPORA]
        if unknown:
            raise UserError(f"unknown corpus {unknown[0]!r}; choose from: {', '.join(CORPORA)}")
        for c in corpora:
            if not (archives / CORPORA[c].archive).is_file():
                raise UserError(_fetch(f"--corpora names {c} but {archives} has no {CORPORA[c].archive}"))
        return [c for c in CORPORA if c in corpora]
    found = [c for c, k in CORPORA.items() if (archives / k.archive).is_file()]
    if not found:
        raise UserError(_fetch(f"{archives} holds none of the WMT15 training archives "
                               f"({', '.join(k.archive for k in CORPORA.values())})"))
    return found


def prepare(archives: Path, out: Path, corpora: list[str] | None = None, vocab: int = VOCAB,
            spm_sentences: int = SPM_SENTENCES, force: bool = False, log=print) -> dict:
    archives, out = Path(archives), Path(out)
    if not archives.is_dir():
        raise UserError(f"--archives {archives} is not a folder; give the folder holding the WMT15 downloads")
    if (info := already_prepared(out, force, log, sources=archives)) is not None:
        return info
    marker = out / MARKER
    if vocab < 8:
        raise UserError(f"--vocab {vocab} is too small")
    t0 = time.time()
    chosen = _choose(archives, corpora)
    for name in (DEV.archive, TEST_ARCHIVE):
        if not (archives / name).is_file():
            raise UserError(_fetch(f"no {name} in {archives} (the dev/test sets)"))
    used = [CORPORA[c].archive for c in chosen] + [DEV.archive, TEST_ARCHIVE]
    sources = {a: {"bytes": (archives / a).stat().st_size, "digest": sampled_digest(archives / a)} for a in used}
    # "sample": how the subword models are trained (a partial run of the older, random sampling is redone)
    fingerprint = {"sources": sources, "corpora": chosen, "vocab": vocab, "spm_sentences": spm_sentences,
                   "sample": "spread"}
    if force:
        shutil.rmtree(out / PARTIAL, ignore_errors=True)
    marker.unlink(missing_ok=True)
    sweep_temp_files(out, log)
    part = out / PARTIAL
    state = _State(part, fingerprint)
    raw, text = part / "raw", part / "text"
    raw.mkdir(exist_ok=True)
    text.mkdir(exist_ok=True)
    counts = _pair_corpora(archives, chosen, state, raw, text, log)
    counts["dev"], counts["test"] = _dev_and_test(archives, state, raw, text)
    sps, sizes, dtype = _subwords(chosen, counts, state, part, text, vocab, spm_sentences, log)
    tokens = _write_ids(chosen, counts, state, part, text, out, sps, dtype)
    pairs = {"train": sum(counts[c]["pairs"] for c in chosen), "dev": counts["dev"]["pairs"],
             "test": counts["test"]["pairs"]}
    for split, n in pairs.items():  # the count check of what was written against what was read
        for lang in (SRC, TGT):
            got = np.fromfile(out / f"{split}.{lang}.idx", dtype=np.int64).size - 1
            if got != n:
                raise RuntimeError(f"wrote {got} {split}.{lang} sentences, expected {n}")
    info = {"dataset": "wmt15-fren", "src": SRC, "tgt": TGT, "corpora": chosen,
            "missing_corpora": [c for c in CORPORA if c not in chosen], "counts": counts, "pairs": pairs,
            "tokens": tokens, "vocab": sizes, "vocab_requested": vocab, "dtype": np.dtype(dtype).name,
            "special_ids": {"pad": PAD, "bos": BOS, "eos": EOS, "unk": UNK},
            "spm_digest": {lang: sampled_digest(out / f"spm.{lang}.model") for lang in (SRC, TGT)},
            "archives": sources, "seconds": round(time.time() - t0, 1),
            "prepared_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_json(marker, info)
    shutil.rmtree(part, ignore_errors=True)
    log(f"prepared WMT15 {SRC}-{TGT} in {out}: {pairs['train']:,} training pairs from {', '.join(chosen)}, "
        f"dev {pairs['dev']:,}, test {pairs['test']:,}; vocabularies {sizes}")
    return info


def _pair_corpora(archives: Path, chosen: list[str], state, raw: Path, text: Path, log) -> dict:
    """1. each training corpus: extract its two members, keep aligned non-empty pairs (resumable)."""
    counts = {}
    for c in chosen:
        k = CORPORA[c]
        got = state.get(f"pairs/{c}")
        if got is None:
            suffix = ".gz" if k.gz else ""
            files = {lang: raw / f"{k.stem}.{lang}{suffix}" for lang in (SRC, TGT)}
            log(f"  {k.archive}: extracting {k.stem}.{{{SRC},{TGT}}}{suffix}")
            extract(archives / k.archive, {p.name: p for p in files.values()})
            got = pair_lines(files[SRC], files[TGT], k.gz, f"{k.archive}", text / f"{c}.{SRC}", text / f"{c}.{TGT}")
            for p in files.values():
                p.unlink()
            state.set(f"pairs/{c}", got)
        counts[c] = got
        log(f"  {c}: {got['pairs']:,} pairs ({got['dropped_empty']:,} with an empty side dropped)")
        if got["pairs"] == 0:  # it would be listed in the marker's corpora but add nothing
            raise UserError(_fetch(f"{k.archive} holds no sentence pair ({got['lines']:,} lines, every one "
                                   f"with an empty side); or leave {c} out with --corpora"))
    return counts


def _dev_and_test(archives: Path, state, raw: Path, text: Path) -> tuple[dict, dict]:
    """2. dev (plain text) and test (SGML): their counts."""
    if state.get("dev") is None:
        files = {lang: raw / f"{DEV.stem}.{lang}" for lang in (SRC, TGT)}
        extract(archives / DEV.archive, {p.name: p for p in files.values()})
        got = pair_lines(files[SRC], files[TGT], False, DEV.archive, text / f"dev.{SRC}", text / f"dev.{TGT}")
        if got["pairs"] == 0:
            raise UserError(_fetch(f"{DEV.archive} holds no sentence pair in {DEV.stem}.{{{SRC},{TGT}}}"))
        state.set("dev", got)
    if state.get("test") is None:
        files = {lang: raw / f for lang, f in TEST_FILES.items()}
        extract(archives / TEST_ARCHIVE, {p.name: p for p in files.values()})
        (ids_s, src), (ids_t, tgt) = read_sgm(files[SRC]), read_sgm(files[TGT])
        if ids_s != ids_t:
            raise UserError(_fetch(f"{TEST_ARCHIVE}: {TEST_FILES[SRC]} has {len(ids_s):,} segments, "
                                   f"{TEST_FILES[TGT]} {len(ids_t):,} (or other ids); the test set is misaligned"))
        # Every test sentence is kept (BLEU is over the whole set); an empty one stays empty.
        for lang, lines in ((SRC, src), (TGT, tgt)):
            atomic_write(text / f"test.{lang}", lambda f, lines=lines: f.write("".join(s + "\n" for s in lines).encode()))
        state.set("test", {"lines": len(src), "pairs": len(src), "dropped_empty": 0})
    return state.get("dev"), state.get("test")


def _subwords(chosen, counts, state, part: Path, text: Path, vocab: int, spm_sentences: int, log):
    """3. one SentencePiece model per language, trained on the training text -> (processors, sizes, id dtype)."""
    import sentencepiece as spm

    for lang in (SRC, TGT):
        if state.get(f"spm/{lang}") is None:
            log(f"  training the {lang} subword model ({vocab:,} pieces)")
            model = train_spm([text / f"{c}.{lang}" for c in chosen], sum(counts[c]["pairs"] for c in chosen),
                              vocab, spm_sentences, f"wmt15 {lang} subword sample")
            atomic_write(part / f"spm.{lang}.model", lambda f, m=model: f.write(m))
            state.set(f"spm/{lang}", True)
    sps = {lang: spm.SentencePieceProcessor(model_file=str(part / f"spm.{lang}.model")) for lang in (SRC, TGT)}
    sizes = {lang: sps[lang].get_piece_size() for lang in (SRC, TGT)}
    dtype = np.uint16 if max(sizes.values()) <= 65536 else np.uint32
    return sps, sizes, dtype


def _write_ids(chosen, counts, state, part: Path, text: Path, out: Path, sps, dtype) -> dict:
    """4. ids: each corpus on its own (resumable), then the training set as their concatenation, written to
    `out` with dev, test, their text and the subword models -> tokens per split and language."""
    ids = part / "ids"
    ids.mkdir(exist_ok=True)
    todo = [(name, lang) for name in chosen + ["dev", "test"] for lang in (SRC, TGT)
            if state.get(f"ids/{name}.{lang}") is None]
    with Progress("wmt15 encoding", sum(counts[name]["pairs"] for name, _ in todo), "sentences") as progress:
        for name, lang in todo:
            n = encode_file(sps[lang], text / f"{name}.{lang}", ids / f"{name}.{lang}.bin",
                            ids / f"{name}.{lang}.idx", dtype, progress=progress)
            state.set(f"ids/{name}.{lang}", n)
    out.mkdir(parents=True, exist_ok=True)
    tokens = {}
    for lang in (SRC, TGT):
        offs, total = [np.zeros(1, dtype=np.int64)], 0
        with open(part / f"train.{lang}.bin.tmp", "wb") as f:
            for c in chosen:
                with open(ids / f"{c}.{lang}.bin", "rb") as g:
                    shutil.copyfileobj(g, f, 1 << 20)
                o = np.fromfile(ids / f"{c}.{lang}.idx", dtype=np.int64)
                offs.append(o[1:] + total)
                total += int(o[-1])
        os.replace(part / f"train.{lang}.bin.tmp", out / f"train.{lang}.bin")
        atomic_write(out / f"train.{lang}.idx", lambda f, o=np.concatenate(offs): f.write(o.tobytes()))
        tokens[f"train.{lang}"] = total
        for split in ("dev", "test"):
            for ext in ("bin", "idx"):
                shutil.copyfile(ids / f"{split}.{lang}.{ext}", out / f"{split}.{lang}.{ext}")
            shutil.copyfile(text / f"{split}.{lang}", out / f"{split}.{lang}.txt")
            tokens[f"{split}.{lang}"] = int(np.fromfile(out / f"{split}.{lang}.idx", dtype=np.int64)[-1])
        shutil.copyfile(part / f"spm.{lang}.model", out / f"spm.{lang}.model")
    return tokens
