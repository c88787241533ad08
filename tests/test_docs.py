"""The docs are a guide, not a lab notebook: no tracked Markdown file outside a results folder cites a commit
of this repository or a date. A figure names the command that made it, its results file and the machine;
the results file's own `env` records when and from which code, and its name may carry a date."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

NOT_YET: set = set()  # files allowed to keep a hash or date while being rewritten (none now)

HEX = re.compile(r"(?<![0-9A-Za-z])[0-9a-f]{7,12}(?![0-9A-Za-z])")
DATE = re.compile(r"(?<!\d)\d{4}-[01]\d-[0-3]\d(?!\d)")
# The run of characters around a date that a file name or link spans (a name may hold a date).
TOKEN_STOP = " \t`()[]<>|,;\"'"
FILE_NAME = re.compile(r"results/|\.(json|md|csv|log|txt|png|yaml)\b|\.\{")


def _git(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", *args], cwd=REPO, input=stdin, capture_output=True, text=True,
                          check=True).stdout


class _Docs(dict):
    """Path -> text; shown by its size in a failure, whose message lists what was found."""

    def __repr__(self) -> str:
        return f"<{len(self)} tracked Markdown files>"


@pytest.fixture(scope="module")
def docs() -> _Docs:
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the docs check reads the tracked files and the commits")
    try:
        _git("rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    except subprocess.CalledProcessError:
        pytest.skip("not a git checkout with commits: the docs check reads the tracked files and the commits")
    paths = [p for p in _git("ls-files", "-z", "--", "*.md").split("\0")
             if p and "results" not in Path(p).parts and p not in NOT_YET]
    return _Docs({p: (REPO / p).read_text(encoding="utf-8") for p in paths if (REPO / p).is_file()})


def _lines(docs: dict[str, str], pattern: re.Pattern):
    for path, text in docs.items():
        for n, line in enumerate(text.splitlines(), 1):
            for m in pattern.finditer(line):
                yield path, n, line, m


def test_no_commit_hash_in_docs(docs):
    hits = list(_lines(docs, HEX))
    tokens = sorted({m.group() for *_, m in hits})
    # One git process answers for every token: "<object> commit", "... missing" or "... ambiguous".
    answers = _git("cat-file", "--batch-check=%(objecttype)",
                   stdin="".join(f"{t}^{{commit}}\n" for t in tokens)).splitlines() if tokens else []
    commits = {t for t, a in zip(tokens, answers) if a == "commit"}
    found = [f"{path}:{n}: {m.group()}" for path, n, _, m in hits if m.group() in commits]
    assert not found, ("commit hashes in the docs (name the command, results file and machine instead):\n"
                       + "\n".join(found))


def _in_file_name(line: str, start: int, end: int) -> bool:
    while start > 0 and line[start - 1] not in TOKEN_STOP:
        start -= 1
    while end < len(line) and line[end] not in TOKEN_STOP:
        end += 1
    return bool(FILE_NAME.search(line[start:end]))


def test_no_date_in_docs(docs):
    found = [f"{path}:{n}: {m.group()}" for path, n, line, m in _lines(docs, DATE)
             if not _in_file_name(line, m.start(), m.end())]
    assert not found, ("dates in the docs outside a results file's name (the file records when):\n"
                       + "\n".join(found))


def test_the_checks_see_what_they_forbid():
    """The patterns on lines like the ones they must catch and the ones they must leave alone."""
    assert HEX.search("measured at 0123abc89 (2-core CPU)").group() == "0123abc89"
    assert HEX.search("source digest 91db50ba4081a29b") is None  # 16 digits: not a short hash
    bad = "Measured 2026-11-25 on a 2-core CPU"
    m = DATE.search(bad)
    assert m and not _in_file_name(bad, m.start(), m.end())
    for ok in ("`results/cpu-2026-11-21-full-width-b2-memory.json`; 2-core x86_64 CPU",
               "[call4](results/nvidia-h200-2026-11-28-gpu_check-call4.json)",
               "(`-2026-11-28-gpu_check-call1.json`)",
               "`results/cpu-2026-11-25-tiny-w32-b4-80px-half-math.{json,md}`"):
        m = DATE.search(ok)
        assert m and _in_file_name(ok, m.start(), m.end()), ok
