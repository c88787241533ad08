"""The One Billion Word benchmark (Chelba et al. 2013) as a vocabulary and token-id shards.

The paper's bigLSTM (Figure 5, section 4.5) trains on the benchmark's official release,
1-billion-word-language-modeling-benchmark-r13output.tar.gz (statmt.org), laid out as:

    1-billion-word-language-modeling-benchmark-r13output/
      training-monolingual.tokenized.shuffled/news.en-00001-of-00100 .. news.en-00099-of-00100
      heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050 .. -00049-of-00050

(99 training shards: shard 00000 of the 100 became the held-out data, split 50 ways; get-data.sh of
the benchmark.) One tokenised sentence per line, tokens separated by spaces. As in Jozefowicz et al.
2016, the test set is held-out shard 0 (news.en.heldout-00000-of-00050).

Output (README.md):
    OUT/vocab.txt          "word count" per line; the line number is the id (0-based)
    OUT/train/<shard>.bin  little-endian uint32 ids, each sentence as <S> w1 .. wn </S>, in file order
    OUT/heldout/<shard>.bin
    OUT/prepared.json      counts per shard and the ids of <S>, </S>, <UNK>; written last (the
                           completion marker)

The vocabulary is the benchmark's: every word seen at least 3 times in the training shards, plus <S>,
</S> and <UNK> (793,471 entries for the official release, "words with count below 3 were discarded"),
sorted by count, most frequent first -- the order the log-uniform sampler of the sampled softmax
assumes. `vocab=` uses a given vocabulary file instead (one word per line, optionally followed by its
count, e.g. the 1b_word_vocab.txt of Jozefowicz et al.). Out-of-vocabulary words become <UNK>.

Re-running is safe: a complete output is left alone (force=True redoes it); an interrupted run keeps
its finished shards in OUT/.partial/ and resumes, unless the archive or vocabulary changed.
"""
from __future__ import annotations

import collections
import concurrent.futures
import datetime
import gzip
import hashlib
import json
import os
import shutil
import tarfile
import time
import zlib
from pathlib import Path

import numpy as np

from data_prep.archives import safe_relpath
from data_prep.prepared import MARKER, already_prepared, check_id_file, sweep_temp_files
from data_prep.progress import Progress
from data_prep.workers import worker_pool
from mpt.errors import UserError
from mpt.rundir import atomic_write_bytes, atomic_write_json

TOP = "1-billion-word-language-modeling-benchmark-r13output"
ARCHIVE = TOP + ".tar.gz"
URL = "http://www.statmt.org/lm-benchmark/" + ARCHIVE
TRAIN_DIR = "training-monolingual.tokenized.shuffled"
HELDOUT_DIR = "heldout-monolingual.tokenized.shuffled"
TRAIN = [f"news.en-{i:05d}-of-00100" for i in range(1, 100)]
HELDOUT = [f"news.en.heldout-{i:05d}-of-00050" for i in range(50)]
TEST = HELDOUT[0]
SPLITS = {"train": (TRAIN_DIR, TRAIN), "heldout": (HELDOUT_DIR, HELDOUT)}

BOS, EOS, UNK = "<S>", "</S>", "<UNK>"
MIN_COUNT = 3
# The official release: 30,301,028 training sentences (TFDS / Hugging Face lm1b), 793,471 words.
OFFICIAL = {"train_sentences": 30_301_028, "vocab_size": 793_471}
# A training set this large is taken to be meant as the official release and checked against it.
_OFFICIAL_ABOVE = 10_000_000

VOCAB = "vocab.txt"
PARTIAL = ".partial"
STATE = "state.json"
_ENCODING = dict(encoding="utf-8", errors="surrogateescape")  # keeps any byte sequence round-trippable


def _redownload(what: str) -> UserError:
    return UserError(f"{what}; re-download {ARCHIVE} from {URL} and run again")


# ------------------------------------------------------------------ reading the release


def _member_split(name: str):
    """(split, shard) for an archive path of a benchmark shard, else None."""
    parts = name.rstrip("/").split("/")
    if len(parts) < 2:
        return None
    for split, (folder, names) in SPLITS.items():
        if parts[-2] == folder and parts[-1] in names:
            return split, parts[-1]
    return None


def _lines(data: bytes) -> list[str]:
    """The sentences of one shard: one per line ('\\n' only -- the text may hold other Unicode
    separators inside a sentence, which str.splitlines would split on)."""
    text = data.decode(**_ENCODING)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


class Source:
    """The release as an archive file (.tar.gz as downloaded, or .tar) or as an unpacked folder.
    `shards(splits)` yields (split, shard name, bytes) in archive order; `fingerprint` names it."""

    def __init__(self, path: Path):
        path = Path(path)
        if not path.exists():
            raise UserError(f"{path} does not exist; give the downloaded {ARCHIVE} (from {URL}) or the folder "
                            f"it unpacks to")
        self.path = path
        if path.is_dir():
            top = path / TOP if (path / TOP).is_dir() else path
            self.files = {}
            for split, (folder, names) in SPLITS.items():
                for n in names:
                    f = top / folder / n
                    if f.is_file():
                        self.files[(split, n)] = f
            if not self.files:
                raise UserError(f"{path} holds no benchmark shards (expected {TOP}/{TRAIN_DIR}/{TRAIN[0]} ...); "
                                f"give the downloaded {ARCHIVE} or the folder it unpacks to")
            self.check_complete(set(self.files))
            stat = [(str(f.relative_to(top)), f.stat().st_size) for f in sorted(self.files.values())]
            digest = hashlib.sha256(json.dumps(stat).encode()).hexdigest()
            self.fingerprint = {"path": str(path.resolve()), "files": digest}
        else:
            st = path.stat()
            self.files = None
            self.fingerprint = {"path": str(path.resolve()), "bytes": st.st_size, "mtime": int(st.st_mtime)}

    @staticmethod
    def check_complete(seen: set) -> None:
        for split, (folder, names) in SPLITS.items():
            missing = [n for n in names if (split, n) not in seen]
            if missing:
                raise _redownload(f"the release lacks {len(missing)} of its {len(names)} {folder} shards "
                                  f"(first: {missing[0]}); the download is incomplete")

    def shards(self, splits=("train", "heldout")):
        if self.files is not None:
            for (split, name), f in self.files.items():
                if split in splits:
                    yield split, name, f.read_bytes()
            return
        seen = set()
        try:
            with tarfile.open(self.path, mode="r|*") as tar:  # one sequential pass, gzip or not
                for member in tar:
                    # Shards are written under our own names, but a tampered path is refused, not trusted.
                    safe_relpath(member.name, "member path", self.path)
                    key = _member_split(member.name) if member.isfile() else None
                    if key is None:
                        continue
                    if key in seen:
                        raise _redownload(f"{self.path} holds {member.name} twice")
                    seen.add(key)
                    if key[0] in splits:
                        yield key[0], key[1], tar.extractfile(member).read()
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise _redownload(f"{self.path} is truncated or corrupt ({type(e).__name__}: {e})") from None
        self.check_complete(seen)


# ------------------------------------------------------------------ vocabulary


def _count(data: bytes) -> tuple[collections.Counter, int]:
    counts: collections.Counter = collections.Counter()
    lines = _lines(data)
    for line in lines:
        counts.update(line.split())
    return counts, len(lines)


def build_vocab(counts: collections.Counter, sentences: int, min_count: int = MIN_COUNT) -> list[tuple[str, int]]:
    """(word, count) in id order: words seen >= min_count times, <S> and </S> (one per sentence) and
    <UNK> (the tokens of the rarer words), most frequent first, ties by byte order. A literal <S>,
    </S> or <UNK> in the text is an unknown word."""
    specials = {BOS, EOS, UNK}
    kept = [(w, c) for w, c in counts.items() if c >= min_count and w not in specials]
    unk = sum(c for w, c in counts.items() if c < min_count or w in specials)
    kept += [(BOS, sentences), (EOS, sentences), (UNK, unk)]
    kept.sort(key=lambda wc: (-wc[1], wc[0].encode(**_ENCODING)))
    return kept


def read_vocab_file(path: Path) -> list[tuple[str, int]]:
    """A vocabulary file: one word per line (optionally 'word count'); missing <S>, </S>, <UNK>
    are put first (frequent ids: the log-uniform sampler expects them near the top)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"vocabulary file {path} not found")
    words: list[tuple[str, int]] = []
    for i, line in enumerate(path.read_text(**_ENCODING).split("\n"), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise UserError(f"{path}:{i}: expected 'word' or 'word count', got {line[:60]!r}")
        words.append((parts[0], int(parts[1]) if len(parts) == 2 else 0))
    names = [w for w, _ in words]
    if len(set(names)) != len(names):
        dup = next(w for w, c in collections.Counter(names).items() if c > 1)
        raise UserError(f"{path} lists {dup!r} twice")
    missing = [s for s in (EOS, BOS, UNK) if s not in set(names)]
    return [(s, 0) for s in missing] + words


def write_vocab(path: Path, vocab: list[tuple[str, int]]) -> None:
    atomic_write_bytes(path, "".join(f"{w} {c}\n" for w, c in vocab).encode(**_ENCODING))


def load_vocab(path: Path) -> list[str]:
    return [ln.split(" ")[0] for ln in Path(path).read_text(**_ENCODING).split("\n") if ln]


# ------------------------------------------------------------------ encoding

_IDS: dict[str, int] = {}


def _init_worker(vocab_path: str) -> None:
    global _IDS
    _IDS = {w: i for i, w in enumerate(load_vocab(Path(vocab_path)))}


def encode(data: bytes, ids: dict[str, int] | None = None) -> tuple[np.ndarray, dict]:
    """One shard's text -> uint32 ids (<S> w1 .. wn </S> per sentence) and its counts."""
    ids = _IDS if ids is None else ids
    bos, eos, unk = ids[BOS], ids[EOS], ids[UNK]
    out: list[int] = []
    lines = _lines(data)
    longest = 0
    for line in lines:
        words = line.split()
        out.append(bos)
        out.extend(ids.get(w, unk) if w not in (BOS, EOS) else unk for w in words)
        out.append(eos)
        longest = max(longest, len(words) + 2)
    arr = np.asarray(out, dtype="<u4")
    words = arr.size - 2 * len(lines)
    return arr, {"sentences": len(lines), "words": words, "tokens": int(arr.size),
                 "sha256": hashlib.sha256(arr.tobytes()).hexdigest()[:16],  # for the run identity
                 "unk": int((arr == unk).sum()), "max_sentence_tokens": longest}


def _encode_worker(data: bytes):
    return encode(data)


# ------------------------------------------------------------------ the preparation


def _map(pool, workers, fn, items, done):
    """fn over items (split, name, data) -> done(split, name, result); at most 2 x workers in flight
    so a 4 GB release is never held in memory at once."""
    if pool is None:
        for split, name, data in items:
            done(split, name, fn(data))
        return
    pending = {}
    limit = 2 * workers
    for split, name, data in items:
        pending[pool.submit(fn, data)] = (split, name)
        while len(pending) >= limit:
            finished, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in finished:
                done(*pending.pop(f), f.result())
    for f in concurrent.futures.as_completed(list(pending)):
        done(*pending.pop(f), f.result())


def _reset(out: Path, log) -> None:
    (out / MARKER).unlink(missing_ok=True)
    (out / VOCAB).unlink(missing_ok=True)
    for name in (PARTIAL, "train", "heldout"):
        if (out / name).exists():
            log(f"removing {out / name}")
            shutil.rmtree(out / name)


def prepare(archive: Path, out: Path, vocab: Path | None = None, force: bool = False, workers: int = 8,
            min_count: int = MIN_COUNT, log=print) -> dict:
    """Prepare OUT from the release at `archive` (file or folder); return prepared.json's content
    (with "skipped": True when OUT was already complete and force is False)."""
    out = Path(out)
    info = already_prepared(out, force, log, describe=lambda i: (
        f"{i['vocab_size']:,} words, {i['totals']['train_tokens']:,} training tokens"))
    if info is not None:
        return {**info, "skipped": True}
    if min_count < 1:
        raise UserError(f"--min-count {min_count} must be at least 1")
    start = time.time()
    source = Source(archive)
    state = {"source": source.fingerprint, "min_count": min_count,
             "vocab": None if vocab is None else hashlib.sha256(Path(vocab).read_bytes()).hexdigest()
             if Path(vocab).is_file() else str(vocab)}
    part = _open_partial(out, state, force, log)
    # Pass 1: the vocabulary.
    vocab_path = part / VOCAB
    if not vocab_path.is_file():
        write_vocab(vocab_path, _vocabulary(source, vocab, workers, min_count, start, log))
    ids_list = load_vocab(vocab_path)
    special = {s: ids_list.index(s) for s in (BOS, EOS, UNK)}
    # Pass 2: the token ids, one file per shard, each written atomically (a re-run skips finished ones).
    stats = _encode(source, part, vocab_path, workers, start, log)
    totals, warnings, standard = _check(source, part, stats, ids_list)
    for w in warnings:
        log(f"warning: {w}")
    for name in (VOCAB, "train", "heldout"):
        if (out / name).exists():
            shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
        os.replace(part / name, out / name)
    for f in list((out / "train").glob("*.bin.json")) + list((out / "heldout").glob("*.bin.json")):
        f.unlink()
    info = {
        "dataset": "lm1b (One Billion Word benchmark, r13output)",
        "format": "little-endian uint32 token ids; each sentence <S> w1 .. wn </S>; ids = line numbers of vocab.txt",
        "vocab_size": len(ids_list), "bos": special[BOS], "eos": special[EOS], "unk": special[UNK],
        "vocab_source": str(vocab) if vocab is not None else f"training-shard counts >= {min_count}",
        "min_count": min_count,
        "shards": {split: [{"name": n, "file": f"{split}/{n}.bin", **stats[split][n]} for n in names]
                   for split, (folder, names) in SPLITS.items()},
        "test": f"heldout/{TEST}.bin",
        "totals": totals, "standard": standard, "warnings": warnings,
        "source": source.fingerprint, "prepared_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "seconds": round(time.time() - start, 1),
    }
    atomic_write_json(out / MARKER, info)
    shutil.rmtree(part)
    log(f"prepared {out}: {len(ids_list):,} words; train {totals['train_sentences']:,} sentences, "
        f"{totals['train_tokens']:,} tokens; test ({TEST}) "
        f"{stats['heldout'][TEST]['tokens']:,} tokens; {time.time() - start:.0f} s")
    return info


def _open_partial(out: Path, state: dict, force: bool, log) -> Path:
    """The work folder of this preparation: started afresh, or an interrupted one of the same inputs resumed."""
    out.mkdir(parents=True, exist_ok=True)
    part = out / PARTIAL
    if force:
        _reset(out, log)
    elif (part / STATE).is_file():
        if json.loads((part / STATE).read_text()) != state:
            log(f"{part} holds work from another archive or vocabulary; starting over")
            _reset(out, log)
        else:
            log(f"resuming the interrupted preparation in {out}")
    elif any((out / n).exists() for n in ("train", "heldout", VOCAB)):
        raise UserError(f"{out} already has train/, heldout/ or {VOCAB} that this tool did not finish (no {MARKER}); "
                        f"choose an empty --out, or pass --force to replace them")
    part.mkdir(exist_ok=True)
    sweep_temp_files(out, log)  # temp files of a write killed half-way (kill -9)
    atomic_write_json(part / STATE, state)
    return part


def _vocabulary(source: "Source", vocab: Path | None, workers: int, min_count: int, start: float, log) -> list[str]:
    """The words: a given vocabulary file, or the training shards' words seen >= min_count times."""
    if vocab is not None:
        words = read_vocab_file(Path(vocab))
        log(f"vocabulary: {len(words):,} words from {vocab}")
        return words
    counts: collections.Counter = collections.Counter()
    sentences = 0

    def counted(split, name, result):
        nonlocal sentences
        counts.update(result[0])
        sentences += result[1]
        progress.add()

    with worker_pool(workers) as pool, Progress("lm1b counting words", len(TRAIN), "shards") as progress:
        _map(pool, workers, _count, source.shards(("train",)), counted)
    log(f"counting words: {sentences:,} sentences in {len(TRAIN)} shards, {time.time() - start:.0f} s")
    if not counts:
        raise _redownload(f"the training shards of {source.path} hold no words (all empty)")
    words = build_vocab(counts, sentences, min_count)
    log(f"vocabulary: {len(words):,} words seen >= {min_count} times, with {BOS}, {EOS}, {UNK}")
    return words


def _encode(source: "Source", part: Path, vocab_path: Path, workers: int, start: float, log) -> dict:
    """Every shard's token ids written beside its stats (.bin, then .bin.json: the mark of a finished shard);
    shards finished by an interrupted run are kept. -> {split: {shard: stats}}."""
    stats: dict[str, dict[str, dict]] = {"train": {}, "heldout": {}}
    for split in stats:
        (part / split).mkdir(exist_ok=True)
        for f in (part / split).glob("*.bin.json"):
            stats[split][f.name[: -len(".bin.json")]] = json.loads(f.read_text())

    def encoded(split, name, result):
        arr, info = result
        atomic_write_bytes(part / split / f"{name}.bin", arr.tobytes())
        atomic_write_json(part / split / f"{name}.bin.json", info)  # after the .bin: marks it complete
        stats[split][name] = info
        progress.add()

    todo = ((s, n, d) for s, n, d in source.shards() if n not in stats[s])
    left = sum(1 for split, (_, names) in SPLITS.items() for n in names if n not in stats[split])
    if left > 0:
        with worker_pool(workers, _init_worker, (str(vocab_path),)) as pool, \
                Progress("lm1b encoding", left, "shards") as progress:
            if pool is None:
                _init_worker(str(vocab_path))
            _map(pool, workers, _encode_worker, todo, encoded)
        log(f"encoding: {left} shards, {time.time() - start:.0f} s")
    else:
        log("encoding: every shard already done")
    return stats


def _check(source: "Source", part: Path, stats: dict, ids_list: list[str]) -> tuple[dict, list[str], bool]:
    """Checks before the output appears: each shard's size and ids (a shard kept from an interrupted run is
    read again: edited since, it would carry ids the vocabulary does not have); no empty release; against the
    official counts. -> (totals, warnings, whether the release is the standard one)."""
    for split, (folder, names) in SPLITS.items():
        for n in names:
            size = (part / split / f"{n}.bin").stat().st_size
            if size != 4 * stats[split][n]["tokens"]:
                raise UserError(f"{part / split / n}.bin has {size} bytes, expected {4 * stats[split][n]['tokens']}; "
                                f"rerun with --force")
            check_id_file(part / split / f"{n}.bin", "<u4", len(ids_list), "rerun with --force",
                          stats[split][n]["sha256"])
    totals = {f"{split}_{k}": sum(s[k] for s in stats[split].values())
              for split in stats for k in ("sentences", "words", "tokens", "unk")}
    # An empty release would train on nothing (0 tokens) or measure perplexity over nothing.
    if totals["train_words"] == 0:
        raise _redownload(f"the training shards of {source.path} hold no words (all empty)")
    if stats["heldout"][TEST]["words"] == 0:
        raise _redownload(f"the test shard {HELDOUT_DIR}/{TEST} of {source.path} holds no words")
    warnings = []
    standard = totals["train_sentences"] > _OFFICIAL_ABOVE
    if standard:
        if totals["train_sentences"] != OFFICIAL["train_sentences"]:
            warnings.append(f"{totals['train_sentences']:,} training sentences, the official release has "
                            f"{OFFICIAL['train_sentences']:,}")
        if len(ids_list) != OFFICIAL["vocab_size"]:
            warnings.append(f"vocabulary of {len(ids_list):,} words, the benchmark's has {OFFICIAL['vocab_size']:,}")
    return totals, warnings, standard


def text_of(ids: np.ndarray, vocab: list[str]) -> list[str]:
    """Decode a shard back to its lines (for checks): <S> w1 .. wn </S> -> 'w1 .. wn'."""
    bos, eos = vocab.index(BOS), vocab.index(EOS)
    lines, cur = [], None
    for t in ids.tolist():
        if t == bos:
            cur = []
        elif t == eos:
            lines.append(" ".join(cur))
            cur = None
        else:
            cur.append(vocab[t])
    return lines

