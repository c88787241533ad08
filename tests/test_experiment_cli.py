"""An experiment's command line (mpt.cli.cli_main, `python -m experiments.<name> ...`): options such as
--print-config are accepted before, between or after the key=value words; an unknown one is one line."""
import dataclasses

import pytest
import yaml

from mpt import cli
from mpt import config as C
from mpt import identity, registry
from mpt.task import Task


@dataclasses.dataclass
class _NoKeys:
    """A task config without task.* keys."""


class _Regression(Task):
    def loss(self, model, batch):
        return model(batch).mean(), len(batch)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cli")
    (tmp_path / "config.yaml").write_text(f"base: {{device: cpu, out_dir: {tmp_path}, wandb: {{mode: disabled}}}}\n"
                                          "models: {linear: {}}\n")
    return registry.register("cli_options_anywhere", _Regression, _NoKeys, tmp_path / "config.yaml")


@pytest.mark.parametrize("argv", [["--print-config", "model=linear", "seed=3"],
                                  ["model=linear", "--print-config", "seed=3"],
                                  ["model=linear", "seed=3", "--print-config"]])
def test_print_config_anywhere_on_the_command_line(experiment, capsys, argv):
    cli.cli_main(experiment, argv)
    out = capsys.readouterr().out
    cfg = C.resolve(experiment, ["model=linear", "seed=3"])
    assert yaml.safe_load(out) == C.to_dict(cfg) and cfg.seed == 3
    assert out.endswith(f"# run directory: {identity.run_dir(cfg)}\n") and not identity.run_dir(cfg).exists()


@pytest.mark.parametrize("argv", [["-h"], ["model=linear", "--help"]])
def test_help_anywhere(experiment, capsys, argv):
    cli.cli_main(experiment, argv)
    assert capsys.readouterr().out.startswith("usage: python -m ")


@pytest.mark.parametrize("argv,msg", [
    (["model=linear", "--print-confg"], "unknown option '--print-confg'; the options are -h, --help, --print-config"),
    (["model=linear", "seed"], "bad argument 'seed': write key=value"),
])
def test_a_bad_word_is_one_line(experiment, capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        cli.cli_main(experiment, [*argv, "--print-config"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and msg in err[0], err
