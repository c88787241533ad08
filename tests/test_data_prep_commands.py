"""The command line every data_prep command shares (data_prep.command): prep_command and
generator_command parse alike, a mistake is one line, and a complete output is skipped unless --force."""
from pathlib import Path

import pytest


def test_data_prep_commands_share_one_command_line(tmp_path, capsys):
    from data_prep.command import prep_command

    got = {}
    main = prep_command("x", "test", lambda src, out, **kw: got.update(src=src, out=out, **kw) or got,
                        source="--archive", source_help="", out_help="", workers_help="w",
                        extra=lambda p: p.add_argument("--vocab"))
    main(["--archive", "a", "--out", "o", "--vocab", "v", "--workers", "3"])
    assert got == {"src": tmp_path.__class__("a"), "out": tmp_path.__class__("o"), "force": False, "workers": 3,
                   "vocab": "v"}
    with pytest.raises(SystemExit) as e:
        main(["--archive", "a", "--out", "o", "--workers", "0"])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == "error: --workers must be at least 1"


def test_generators_share_one_command_line(capsys):
    from data_prep.command import generator_command
    from mpt.errors import UserError

    calls = []

    def generate(out, n, text, seed):
        if n < 0:
            raise UserError("--n must be at least 0")
        calls.append((out, n, text, seed))
        return {"a": out / "a.tar", "b": out / "b.tar"}

    main = generator_command("x.tiny", "test", generate, options=[("--n", 3), ("--text", "w", "what to say")])
    paths = main(["--out", "o", "--seed", "2", "--text", "z"])  # generate(out, *options in order, seed)
    assert calls == [(Path("o"), 3, "z", 2)] and paths["a"] == Path("o/a.tar")
    assert capsys.readouterr().out == "wrote o/a.tar, o/b.tar\n"  # a dict's values, joined
    main = generator_command("x.tiny", "test", lambda out, seed: out, done=lambda a, r, s: f"made {r} ({a.seed})")
    main(["--out", "o"])
    assert capsys.readouterr().out == "made o (0)\n"
    with pytest.raises(SystemExit) as e:  # a UserError is one line
        generator_command("x.tiny", "test", generate, options=[("--n", 3), ("--text", "w")])(["--out", "o", "--n", "-1"])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == "error: --n must be at least 0"


def test_already_prepared_skips_only_a_complete_output(tmp_path):
    from data_prep.prepared import MARKER, already_prepared
    from mpt.errors import UserError

    logs = []
    assert already_prepared(tmp_path, False, logs.append) is None and not logs  # no marker: work to do
    (tmp_path / MARKER).write_text('{"n": 7}')
    assert already_prepared(tmp_path, True, logs.append) is None and not logs  # --force
    assert already_prepared(tmp_path, False, logs.append) == {"n": 7}
    assert logs == [f"{tmp_path} is already prepared ({MARKER}); pass --force to redo it"]
    assert already_prepared(tmp_path, False, logs.append, describe=lambda i: f"{i['n']} items") == {"n": 7}
    assert logs[-1] == f"{tmp_path} is already prepared (7 items); pass --force to redo it"

    def changed(info):
        raise UserError("changed")

    with pytest.raises(UserError, match="changed"):
        already_prepared(tmp_path, False, logs.append, check=changed)
    assert len(logs) == 2  # a failed check says nothing more
