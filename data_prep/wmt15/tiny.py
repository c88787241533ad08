"""A tiny WMT15 English-French release for tests and CPU demos: the official archive names and member
paths (data_prep/wmt15/prepare.py) holding a synthetic language pair.

    python -m data_prep.wmt15.tiny --out DIR [--train 6000 --dev 300 --test 300 --seed 0]

The "English" is a small grammar (subject, verb, object, an optional prepositional phrase; singular
and plural nouns, 0-2 adjectives); its "French" translation is what a translation model must learn
from French: adjectives move behind the noun in mirror order (word reordering), articles take the
noun's gender and number (le/la/les, un/une/des), adjectives agree in gender and number (+e, +s),
verbs agree with the subject's number (voit/voient) -- agreement across words the source does not
mark (gender). Only two of the five training corpora are shipped (Europarl and News Commentary),
with dev.tgz and the SGML test-full.tgz. Byte-for-byte deterministic given the arguments.
"""
from __future__ import annotations

import io
import tarfile
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np

from mpt.errors import UserError
from mpt.rundir import atomic_write_bytes

from ..command import generator_command
from .prepare import CORPORA, DEV, SRC, TEST_ARCHIVE, TEST_FILES, TGT

# (English singular, English plural, French singular, French plural, gender)
NOUNS = [("dog", "dogs", "chien", "chiens", "m"), ("cat", "cats", "chat", "chats", "m"),
         ("house", "houses", "maison", "maisons", "f"), ("car", "cars", "voiture", "voitures", "f"),
         ("boy", "boys", "garcon", "garcons", "m"), ("girl", "girls", "fille", "filles", "f"),
         ("bird", "birds", "oiseau", "oiseaux", "m"), ("table", "tables", "table", "tables", "f"),
         ("book", "books", "livre", "livres", "m"), ("tree", "trees", "arbre", "arbres", "m"),
         ("flower", "flowers", "fleur", "fleurs", "f"), ("city", "cities", "ville", "villes", "f"),
         ("horse", "horses", "cheval", "chevaux", "m"), ("door", "doors", "porte", "portes", "f"),
         ("friend", "friends", "ami", "amis", "m"), ("river", "rivers", "riviere", "rivieres", "f")]
# English -> French masculine singular; feminine adds -e (unless it ends in -e), plural adds -s.
ADJS = [("big", "grand"), ("small", "petit"), ("red", "rouge"), ("green", "vert"), ("black", "noir"),
        ("blue", "bleu"), ("yellow", "jaune"), ("pretty", "joli"), ("strong", "fort"), ("slow", "lent"),
        ("cold", "froid"), ("warm", "chaud")]
# (English 3rd singular, plural, French 3rd singular, plural)
VERBS = [("sees", "see", "voit", "voient"), ("likes", "like", "aime", "aiment"), ("eats", "eat", "mange", "mangent"),
         ("finds", "find", "trouve", "trouvent"), ("takes", "take", "prend", "prennent"),
         ("follows", "follow", "suit", "suivent"), ("watches", "watch", "regarde", "regardent")]
PREPS = [("with", "avec"), ("in", "dans"), ("behind", "derriere"), ("under", "sous")]
_ART = {("the", "m", False): "le", ("the", "f", False): "la", ("the", "m", True): "les", ("the", "f", True): "les",
        ("a", "m", False): "un", ("a", "f", False): "une", ("a", "m", True): "des", ("a", "f", True): "des"}


def _adj_fr(base: str, gender: str, plural: bool) -> str:
    w = base + ("e" if gender == "f" and not base.endswith("e") else "")
    return w + ("s" if plural else "")


def _np(rng: np.random.Generator) -> tuple[list[str], list[str], bool]:
    noun = NOUNS[rng.integers(len(NOUNS))]
    plural = bool(rng.random() < 0.4)
    definite = bool(rng.random() < 0.6)
    adjs = [ADJS[i] for i in rng.choice(len(ADJS), size=int(rng.choice(3, p=[0.5, 0.35, 0.15])), replace=False)]
    en_art = "the" if definite else ("a" if not plural else "some")
    en = [en_art] + [a[0] for a in adjs] + [noun[1] if plural else noun[0]]
    fr = [_ART[("the" if definite else "a", noun[4], plural)], noun[3] if plural else noun[2]]
    fr += [_adj_fr(a[1], noun[4], plural) for a in reversed(adjs)]  # behind the noun, mirror order
    return en, fr, plural


def sentence(rng: np.random.Generator) -> tuple[str, str]:
    s_en, s_fr, s_pl = _np(rng)
    verb = VERBS[rng.integers(len(VERBS))]
    o_en, o_fr, _ = _np(rng)
    en = s_en + [verb[1] if s_pl else verb[0]] + o_en
    fr = s_fr + [verb[3] if s_pl else verb[2]] + o_fr
    if rng.random() < 0.25:
        prep = PREPS[rng.integers(len(PREPS))]
        p_en, p_fr, _ = _np(rng)
        en += [prep[0]] + p_en
        fr += [prep[1]] + p_fr
    return " ".join(en) + " .", " ".join(fr) + " ."


# ------------------------------------------------------------------ the archive formats


def _tar(path: Path, members: dict[str, bytes]) -> None:
    """A tar (gzip-compressed for .tgz) with fixed member times: deterministic bytes."""
    buf = io.BytesIO()
    gz = path.name.endswith(".tgz")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    if gz:
        import gzip

        with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as g:
            g.write(raw.getvalue())
        atomic_write_bytes(path, buf.getvalue())
    else:
        atomic_write_bytes(path, raw.getvalue())


def _lines(lines: list[str]) -> bytes:
    return "".join(s + "\n" for s in lines).encode("utf-8")


def _sgm(kind: str, lang: str, lines: list[str]) -> bytes:
    """WMT SGML: <srcset>/<refset> of <doc>s of <seg id="N">; ids restart at 1 in each document."""
    head = ('<srcset setid="newstest2014" srclang="any">' if kind == "src" else
            f'<refset setid="newstest2014" srclang="any" trglang="{lang}">')
    out, per_doc = [head], 50
    for d in range(0, len(lines), per_doc):
        out.append(f'<doc sysid="ref" docid="tiny-{d // per_doc:03d}" genre="news" origlang="en">')
        out += [f'<seg id="{i + 1}">{escape(s)}</seg>' for i, s in enumerate(lines[d:d + per_doc])]
        out.append("</doc>")
    out.append("</srcset>" if kind == "src" else "</refset>")
    return _lines(out)


def write_release(out: Path, train: dict[str, list[tuple[str, str]]], dev: list[tuple[str, str]],
                  test: list[tuple[str, str]], readme: bytes) -> Path:
    """Write the WMT15 archives for the given (English, French) pairs: `train` maps a corpus name of
    prepare.CORPORA to its pairs (the others are left out, as a partial download would)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, pairs in train.items():
        k = CORPORA[name]
        folder = {"europarl": "training/", "un": "un/"}.get(name, "")
        members = {}
        for i, lang in enumerate((SRC, TGT)):
            data = _lines([p[i] for p in pairs])
            if k.gz:
                import gzip

                data = gzip.compress(data, mtime=0)
            members[f"{folder}{k.stem}.{lang}" + (".gz" if k.gz else "")] = data
        _tar(out / k.archive, members)
    _tar(out / DEV.archive, {f"dev/{DEV.stem}.{lang}": _lines([p[i] for p in dev]) for i, lang in enumerate((SRC, TGT))})
    _tar(out / TEST_ARCHIVE, {f"test-full/{TEST_FILES[SRC]}": _sgm("src", SRC, [p[0] for p in test]),
                              f"test-full/{TEST_FILES[TGT]}": _sgm("ref", TGT, [p[1] for p in test])})
    atomic_write_bytes(out / "README.txt", readme)
    return out


def generate(out: Path, train: int = 6000, dev: int = 300, test: int = 300, seed: int = 0) -> Path:
    if min(train, dev, test) < 1:
        raise UserError("--train, --dev and --test must be at least 1")
    rng = np.random.default_rng(seed)
    pairs = [sentence(rng) for _ in range(train + dev + test)]
    tr = pairs[:train]
    half = train * 2 // 3  # two of the five corpora, as a partial download
    return write_release(out, {"europarl": tr[:half], "news_commentary": tr[half:]}, pairs[train:train + dev],
                         pairs[train + dev:], b"Synthetic English-French pair in the WMT15 archive formats "
                                              b"(data_prep.wmt15.tiny); not WMT15.\n")


main = generator_command(
    "wmt15.tiny", __doc__.split("\n\n")[0], generate, out_help="folder for the archives",
    options=[("--train", 6000), ("--dev", 300), ("--test", 300)])


if __name__ == "__main__":
    main()
