"""The tiny_check command (experiments.ilsvrc_cnns.tiny_check): user mistakes are one line, and a
key=value after a list option overrides every run."""
import pytest


@pytest.mark.parametrize("argv,msg", [
    (["--models", "lenet"], "unknown model 'lenet'"),
    # a key=value after a list option is an override of every run, not a precision named 'foo=1'
    (["--precisions", "fp32", "foo=1"], "unknown config key 'foo'"),
    (["--threads", "-1"], "--threads -1: give 1 or more"),  # was torch's traceback
])
def test_tiny_check_errors_are_one_line(tmp_path, capsys, argv, msg):
    from experiments.ilsvrc_cnns.tiny_check import main
    from mpt.errors import cli

    with pytest.raises(SystemExit) as e:
        cli(main)(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--seeds", "0",
                   "--models", "alexnet", *argv])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1 and msg in err[0], err
