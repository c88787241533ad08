"""train.num_workers=auto: parsed as an integer or auto (anything else a one-line error naming the
key), resolved where the loader is built from the cores this process may use (its affinity mask, and
SLURM_CPUS_PER_TASK under SLURM) less one, a speed setting that leaves a run's identity alone, and the
default of every paper profile."""
import json

import pytest

from conftest import tiny_overrides
from mpt import config as C
from mpt import config_parse, identity, registry
from mpt.errors import UserError
from mpt.ranks import loader_workers, usable_cpus

EXPERIMENTS = ("ilsvrc_cnns", "voc_detection", "deepspeech2", "wmt_translation", "lm_biglstm", "dcgan")


@pytest.fixture
def cores(monkeypatch):
    """cores(n, slurm=None, local=None): this process may run on n cores, under SLURM with
    SLURM_CPUS_PER_TASK=slurm, or as one of `local` torchrun ranks of a node."""
    def set_(n, slurm=None, local=None):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(n)))
        for k, v in (("SLURM_CPUS_PER_TASK", slurm), ("LOCAL_WORLD_SIZE", local)):
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, str(v))
    return set_


def test_auto_is_the_cores_less_one(cores):
    cores(16)
    assert (usable_cpus(), loader_workers("auto")) == (16, 15)
    cores(1)
    assert loader_workers("auto") == 0  # the main process alone: no worker
    assert loader_workers(3) == 3  # an integer is taken as it is


def test_auto_takes_the_smaller_of_the_mask_and_slurm(cores):
    cores(64, slurm=10)  # a node without task binding: the mask shows the whole node
    assert loader_workers("auto") == 9
    cores(4, slurm=10)  # a binding tighter than the allocation
    assert loader_workers("auto") == 3
    cores(8, slurm="")  # set but empty: the mask alone
    assert loader_workers("auto") == 7


def test_auto_shares_the_mask_between_torchrun_ranks(cores):
    cores(64, local=8)
    assert loader_workers("auto") == 7
    cores(64, slurm=10, local=8)  # under SLURM each task's own allocation
    assert loader_workers("auto") == 9


def test_parse_auto_and_integers():
    cfg = C.resolve("ilsvrc_cnns", ["train.num_workers=auto"])
    assert cfg.train.num_workers == "auto"
    for given, want in (("3", 3), ("0", 0), ("2.0", 2)):
        assert C.resolve("ilsvrc_cnns", [f"train.num_workers={given}"]).train.num_workers == want


@pytest.mark.parametrize("bad, says", [
    ("-3", "train.num_workers=-3 is out of range: it must be >= 0, or auto"),
    ("lots", "config key 'train.num_workers' expects an integer or auto, got 'lots' (command line)"),
    ("true", "expects an integer or auto, got True"),
    ("1.5", "expects an integer or auto, got 1.5"),
])
def test_bad_value_is_one_line_naming_the_key(bad, says):
    with pytest.raises(UserError) as e:
        C.resolve("ilsvrc_cnns", [f"train.num_workers={bad}"])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_paper_profiles_default_to_auto_and_cpu_profiles_keep_theirs():
    for exp in EXPERIMENTS:
        models = config_parse.load_experiment_yaml(registry.get_experiment(exp).config_yaml)["models"]
        for m in models:
            assert C.resolve(exp, [f"model={m}"]).train.num_workers == "auto", (exp, m)
            assert C.resolve(exp, [f"model={m}", "profile=tiny"]).train.num_workers == 0, (exp, m)


def test_auto_is_a_speed_setting_not_an_identity():
    """The same cell with any worker count is the same run (one directory on every cluster); the
    config keeps `auto` as written, so a cell resolved on a login node does not carry its core count."""
    runs = {identity.run_dir(C.resolve("ilsvrc_cnns", [f"train.num_workers={v}"])) for v in ("auto", 0, 7)}
    assert len(runs) == 1


@pytest.mark.heavy
def test_env_json_records_the_count_a_run_used(tiny_imagenet, tmp_path, cores):
    from experiments.ilsvrc_cnns import main as ilsvrc

    cores(2)
    over = tiny_overrides(tiny_imagenet, tmp_path, "model=resnet50_preact", "train.max_steps=2",
                          "train.eval_max_batches=1", "train.num_workers=auto")
    s = ilsvrc(over)
    assert s["status"] == "completed"
    run = identity.run_dir(C.resolve("ilsvrc_cnns", over))
    assert json.loads((run / "env.json").read_text())["num_workers"] == 1
    assert "num_workers: auto" in (run / "config.yaml").read_text()
