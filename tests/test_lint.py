"""The lint configuration in pyproject.toml ([tool.ruff]) holds for the whole repository: this test is
how CI runs ruff (the README's test command), and how a finding shows up in the edit-test loop."""
import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed: run `bash setup.sh` (requirements.txt pins it)")
def test_ruff_check_is_clean():
    # --no-cache: no .ruff_cache written into the checkout by a test run; the whole tree takes < 1 s.
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"ruff check found (fix them, or a `# noqa: CODE -- why`):\n{res.stdout}{res.stderr}"
