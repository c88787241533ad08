"""The real English->French pair of data_prep.wmt15.real_gettext: the .mo reader and filters on a
catalogue written here, the release in the official WMT15 format prepared by the real prep, the split
(no test source in training), the one-line error without catalogues, and (slow) the tiny recipe
learning the installed catalogues' translations."""
import json
import struct

import pytest

from conftest import REPO  # the repository (conftest also puts it on sys.path)
from data_prep.wmt15 import prepare as prep
from data_prep.wmt15 import real_gettext as rg
from mpt.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def write_mo(path, entries: dict) -> None:
    """A little-endian GNU .mo catalogue (what msgfmt writes, without the optional hash table):
    keys str or (singular, plural) -> str or list of plural translations."""
    items = sorted(((k if isinstance(k, str) else "\x00".join(k)).encode(),
                    (v if isinstance(v, str) else "\x00".join(v)).encode()) for k, v in entries.items())
    n = len(items)
    data_at = 28 + 16 * n
    blob, orig, trans = b"", [], []
    for table, i in ((orig, 0), (trans, 1)):
        for it in items:
            table.append((len(it[i]), data_at + len(blob)))
            blob += it[i] + b"\x00"
    head = struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + b"".join(struct.pack("<2I", *x) for x in orig + trans) + blob)


def fake_locale(root):
    d = root / "fr" / "LC_MESSAGES"
    pairs = {f"remove the file number {i}": f"supprimer le fichier numéro {i}" for i in range(40)}
    write_mo(d / "a.mo", {**pairs, "": "Content-Type: text/plain; charset=UTF-8\n",
                          "_Open": "_Ouvrir", "Save": "Enregistrer", "Close": "Fermer",
                          ("one file", "%d files"): ["un fichier", "%d fichiers"],  # plural: left out
                          "menu\x04Quit": "Quitter",  # with a context: left out
                          "cannot open %s": "impossible d'ouvrir %s",  # printf template: left out
                          "Linux": "Linux",  # not translated: left out
                          "untranslated": ""})
    write_mo(d / "b.mo", {"Save": "Sauvegarder", "Close": "Fermer"})  # "Close": 2 votes for Fermer
    write_mo(d / "c.mo", {"Save": "Enregistrer"})
    return root


def test_reader_filters_and_votes(tmp_path):
    pairs, counts = rg.catalogue_pairs(fake_locale(tmp_path))
    got = dict(pairs)
    assert got["Open"] == "Ouvrir"  # accelerator marks removed
    assert got["Save"] == "Enregistrer" and got["Close"] == "Fermer"  # the most frequent translation
    for gone in ("one file", "Quit", "menu\x04Quit", "cannot open %s", "Linux", "untranslated", ""):
        assert gone not in got
    assert counts["catalogues"] == 3 and counts["plural"] == 1 and len(pairs) == 43
    assert [e for e, _ in pairs] == sorted(got)  # one pair per source string


def test_release_is_official_format_prepared_by_real_prep(tmp_path):
    loc = fake_locale(tmp_path / "locale")
    arch = rg.generate(tmp_path / "arch", str(loc), dev=5, test=6)
    assert {p.name for p in arch.iterdir()} >= {prep.CORPORA["europarl"].archive,
                                                 prep.CORPORA["news_commentary"].archive, prep.DEV.archive,
                                                 prep.TEST_ARCHIVE}
    out = tmp_path / "prep"
    prep.prepare(arch, out, vocab=60, log=lambda *a: None)
    info = json.loads((out / "prepared.json").read_text())
    assert info["pairs"] == {"train": 43 - 11, "dev": 5, "test": 6}
    from data_prep.wmt15.dataset import Prepared

    data = Prepared(out)
    test_en = set(data.text("test", "en"))
    assert len(test_en) == 6 and not test_en & set(data.text("dev", "en"))
    train_en = {data.spm("en").decode(s.tolist()) for s, _ in data.split("train")}
    assert not test_en & train_en  # split by source string: no test sentence is trained on
    assert rg.generate(tmp_path / "arch2", str(loc), dev=5, test=6) and all(
        (tmp_path / "arch2" / p.name).read_bytes() == p.read_bytes() for p in arch.iterdir())  # deterministic


def test_no_catalogues_is_a_one_line_error(tmp_path):
    with pytest.raises(UserError, match=r"no French gettext catalogues .* in .*fr/LC_MESSAGES; install") as e:
        rg.generate(tmp_path / "arch", str(tmp_path / "empty"))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="leave no training pair"):
        rg.generate(tmp_path / "arch", str(fake_locale(tmp_path / "loc")), dev=30, test=30)


def installed_pairs():
    """The installed catalogues' pairs, or skip with the generator's own one-line reason."""
    try:
        return rg.catalogue_pairs(rg.LOCALE_DIR)
    except UserError as e:
        pytest.skip(str(e))


def test_installed_catalogues_read(tmp_path):
    pairs, counts = installed_pairs()
    assert len(pairs) > 2000, counts  # this machine: 89 catalogues, 29,984 pairs
    assert all(e != f and "%" not in e and "\n" not in e for e, f in pairs)


@pytest.mark.slow
def test_real_pair_tiny_run_learns(tmp_path):
    """grid_gettext.yaml's FP32 seed-0 cell, exactly as the grid resolves it (README "Real human
    translations": test BLEU ~16 over 500 test sentences, ~5 min on one core): BLEU far above the
    untrained model's and clearly above copying the English source (7.2 here: messages keep option
    names and identifiers), and the perplexity far below the untrained one."""
    import sacrebleu

    from mpt.cli import main
    from slurm.grid import load

    installed_pairs()
    arch = rg.generate(tmp_path / "arch", rg.LOCALE_DIR)  # the measured release
    prep.prepare(arch, tmp_path / "p", vocab=1000, log=lambda *a: None)
    from data_prep.wmt15.dataset import Prepared

    where = [f"task.data_root={tmp_path / 'p'}", f"out_dir={tmp_path / 'runs'}"]
    (cell,) = load(REPO / "experiments/wmt_translation/grid_gettext.yaml", "tiny", where,
                   ["precision=fp32", "seed=0"]).cells
    n = cell.cfg.task.bleu_max_sentences  # the run scores the first n test sentences
    data = Prepared(tmp_path / "p")
    copy = sacrebleu.corpus_bleu(data.text("test", "en")[:n], [data.text("test", "fr")[:n]], force=True).score
    untrained = main("wmt_translation", cell.overrides + ["train.max_steps=1", "optim.lr=0.0",
                                                         f"out_dir={tmp_path / 'untrained'}"])
    trained = main("wmt_translation", cell.overrides)
    assert untrained["metrics"]["bleu"] < 1
    # the margin over copying is ~9 BLEU over seeds (README); 5 leaves room for seed and machine noise
    assert trained["metrics"]["bleu"] > max(copy + 5.0, 20 * untrained["metrics"]["bleu"]), (
        trained["metrics"], untrained["metrics"], copy)
    assert trained["metrics"]["perplexity"] < untrained["metrics"]["perplexity"] / 10
