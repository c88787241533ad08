"""A small *real* English->French translation task in the WMT15 archive formats: the human
translations of the user-interface messages that installed programs ship as gettext catalogues.

    python -m data_prep.wmt15.real_gettext --out DIR [--locale-dir /usr/share/locale] [--max-words 12]
        [--dev 500 --test 500 --train 0 --seed 0]

Source: every French message catalogue (LC_MESSAGES/*.mo under --locale-dir/fr, the compiled form
of the .po files translators of Debian's and GNU's programs write: coreutils, apt, dpkg, glib, gtk,
git, postgres, the iso-codes country and language names, ...). Each catalogue maps an English
message to its French translation, e.g. "Permission denied" -> "Permission non accordée". Kept: plain
singular messages of 1 to --max-words words, one line, with keyboard-accelerator marks (_Open, &Open)
removed; left out: plural forms, messages with a context, untranslated or copied ones (French ==
English), and messages holding printf / brace format fields or markup (their placeholders are not
language). An English message with several translations (one per catalogue) keeps the most frequent
(ties: the first in catalogue-name order), so every source string has one reference.

Split: by source string (each appears once), so no dev or test sentence is seen in training; a fixed
permutation of the sorted sources (--seed) gives the test set, then dev, then training (--train 0:
all the rest). The pairs are written like data_prep.wmt15.tiny (Europarl + News Commentary archives,
dev.tgz, SGML test-full.tgz), so `python -m data_prep.wmt15` prepares them like the real WMT15
release. Deterministic given the installed catalogues and the arguments.
"""
from __future__ import annotations

import collections
import re
import struct
from pathlib import Path

import numpy as np

from mpt.errors import UserError

from ..command import generator_command
from .tiny import write_release

LOCALE_DIR = "/usr/share/locale"
# printf conversions (%s, %1$d, %-10.3lu), brace fields ({0}, {name}), markup and escapes: strings with
# these are templates for a program, not sentences; their placeholders would be copied, not translated.
_FORMAT = re.compile(r"%|\{|\}|<|>|\\|\$|`|\t")
# A keyboard accelerator mark before a letter: "_Open" (GTK), "&Open" (Qt/KDE); "~" in some catalogues.
_ACCEL = re.compile(r"(?<![\w])[_&~](?=\w)")


def read_mo(path: Path) -> dict:
    """The messages of a compiled gettext catalogue (GNU .mo): {msgid: msgstr} with a tuple key
    (msgid, plural) -> list for plural entries and msgctxt + '\\x04' + msgid keys kept as they are.
    Our own reader (the format is a header and two tables of (length, offset)): gettext's
    GNUTranslations also parses the header's Plural-Forms and raises on some catalogues' headers."""
    data = path.read_bytes()
    if len(data) < 28:
        raise ValueError("shorter than a .mo header")
    magic = struct.unpack("<I", data[:4])[0]
    end = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if end is None:
        raise ValueError("not a GNU .mo file (bad magic number)")
    _, n, orig, trans = struct.unpack(end + "4I", data[4:20])
    out = {}
    for i in range(n):
        ln, off = struct.unpack(end + "2I", data[orig + 8 * i:orig + 8 * i + 8])
        tn, toff = struct.unpack(end + "2I", data[trans + 8 * i:trans + 8 * i + 8])
        if off + ln > len(data) or toff + tn > len(data):
            raise ValueError("truncated")
        msgid, msgstr = data[off:off + ln], data[toff:toff + tn]
        if b"\x00" in msgid:  # plural entry: msgid \0 msgid_plural -> msgstr[0] \0 msgstr[1] ...
            out[tuple(msgid.decode("utf-8", "replace").split("\x00"))] = msgstr.decode("utf-8", "replace").split("\x00")
        else:
            out[msgid.decode("utf-8", "replace")] = msgstr.decode("utf-8", "replace")
    return out


def _clean(s: str) -> str:
    return " ".join(_ACCEL.sub("", s).split())


def usable(en: str, fr: str, max_words: int) -> tuple[str, str] | None:
    """(English, French) cleaned, or None for a pair that is not a plain sentence translation."""
    if not en or not fr or "\n" in en.strip() or "\n" in fr.strip() or "\x04" in en:
        return None
    if _FORMAT.search(en) or _FORMAT.search(fr):
        return None
    en, fr = _clean(en), _clean(fr)
    if not en or not fr or en.lower() == fr.lower() or not any(c.isalpha() for c in en):
        return None
    if len(en.split()) > max_words or len(fr.split()) > 2 * max_words:
        return None
    return en, fr


def catalogue_pairs(locale_dir: Path, max_words: int = 12) -> tuple[list[tuple[str, str]], dict]:
    """Unique (English, French) pairs of every French catalogue under locale_dir, sorted by English,
    and counts of what was read. One-line error when no French catalogue is installed."""
    folder = Path(locale_dir) / "fr" / "LC_MESSAGES"
    files = sorted(folder.glob("*.mo")) if folder.is_dir() else []
    if not files:
        raise UserError(f"no French gettext catalogues (*.mo) in {folder}; install programs that ship them "
                        f"(e.g. `apt-get install coreutils apt dpkg iso-codes` without `path-exclude "
                        f"/usr/share/locale/*` in /etc/dpkg/dpkg.cfg.d/) or pass --locale-dir")
    votes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    first: dict[tuple[str, str], int] = {}
    counts = collections.Counter()
    for k, f in enumerate(files):
        try:
            cat = read_mo(f)
        except (OSError, ValueError, struct.error):
            counts["unreadable_catalogues"] += 1
            continue
        counts["catalogues"] += 1
        for en, fr in cat.items():
            counts["messages"] += 1
            if not isinstance(en, str) or not isinstance(fr, str):
                counts["plural"] += 1
                continue
            p = usable(en, fr, max_words)
            if p is None:
                continue
            votes[p[0]][p[1]] += 1
            first.setdefault(p, k)
    pairs = []
    for en in sorted(votes):
        fr = min(votes[en], key=lambda t: (-votes[en][t], first[(en, t)], t))
        pairs.append((en, fr))
    counts["pairs"] = len(pairs)
    return pairs, dict(counts)


def generate(out: Path, locale_dir: str = LOCALE_DIR, max_words: int = 12, dev: int = 500, test: int = 500,
             train: int = 0, seed: int = 0) -> Path:
    if min(dev, test) < 1 or train < 0 or max_words < 1:
        raise UserError("--dev, --test and --max-words must be at least 1, --train at least 0 (0 = all the rest)")
    pairs, counts = catalogue_pairs(Path(locale_dir), max_words)
    if len(pairs) < dev + test + 1:
        raise UserError(f"only {len(pairs)} usable French catalogue pairs under {locale_dir}; "
                        f"--dev {dev} + --test {test} leave no training pair")
    order = np.random.default_rng(seed).permutation(len(pairs))
    pairs = [pairs[i] for i in order]  # each source string once: the split cannot leak a test sentence
    te, dv, tr = pairs[:test], pairs[test:test + dev], pairs[test + dev:]
    if train:
        tr = tr[:train]
    half = len(tr) * 2 // 3
    return write_release(out, {"europarl": tr[:half], "news_commentary": tr[half:]}, dv, te, (
        "Real-data stand-in for WMT15 (data_prep.wmt15.real_gettext): English user-interface messages and "
        "their human French translations from the gettext catalogues under "
        f"{Path(locale_dir) / 'fr' / 'LC_MESSAGES'} ({counts.get('catalogues', 0)} catalogues, "
        f"{len(pairs)} unique pairs of <= {max_words} words; {len(tr)} train, {len(dv)} dev, {len(te)} test); "
        "not WMT15.\n").encode("utf-8"))


main = generator_command(
    "wmt15.real_gettext", __doc__.split("\n\n")[0], generate, out_help="folder for the archives",
    options=[("--locale-dir", LOCALE_DIR, "folder holding fr/LC_MESSAGES/*.mo"),
             ("--max-words", 12, "longest English message kept, in words"),
             ("--dev", 500), ("--test", 500), ("--train", 0, "training pairs (0: every pair not in dev or test)")],
    seed_help="permutation of the pairs before the split")


if __name__ == "__main__":
    main()
