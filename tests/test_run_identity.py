"""A run's identity includes its data (issue: a second dataset must never resume the first one's run),
and a run directory is never continued with another config."""
import re
import shutil

import pytest

from conftest import tiny_overrides
from data_prep.imagenet import prepare as prep
from data_prep.imagenet.tiny import generate
from experiments.ilsvrc_cnns import main as ilsvrc
from mpt import config as C
from mpt import identity, prepared
from mpt.errors import UserError

SHORT = ("model=resnet50_preact", "train.max_steps=2", "train.eval_max_batches=1")


@pytest.fixture(scope="module")
def second_imagenet(tmp_path_factory):
    """Another prepared dataset with the same shape as the default tiny one (same counts, same
    classes): only its content differs."""
    arch = tmp_path_factory.mktemp("tiny_archives_seed1")
    generate(arch, seed=1)
    out = tmp_path_factory.mktemp("tiny_prepared_seed1") / "imagenet"
    prep.prepare(arch, out, workers=2, log=lambda *a: None)
    return out


@pytest.mark.heavy
def test_same_config_on_two_datasets_is_two_runs(tiny_imagenet, second_imagenet, tmp_path):
    a = C.resolve("ilsvrc_cnns", tiny_overrides(tiny_imagenet, tmp_path, *SHORT))
    b = C.resolve("ilsvrc_cnns", tiny_overrides(second_imagenet, tmp_path, *SHORT))
    assert a.data_fingerprint not in ("", "none", "unprepared")
    assert a.data_fingerprint != b.data_fingerprint
    assert identity.run_dir(a) != identity.run_dir(b)
    sa = ilsvrc(tiny_overrides(tiny_imagenet, tmp_path, *SHORT))
    sb = ilsvrc(tiny_overrides(second_imagenet, tmp_path, *SHORT))
    assert sa["status"] == sb["status"] == "completed"
    assert sa["run_name"] != sb["run_name"]
    assert (identity.run_dir(a) / "summary.json").is_file() and (identity.run_dir(b) / "summary.json").is_file()


def test_fingerprint_ignores_the_path(tiny_imagenet, tmp_path):
    """The same prepared data elsewhere (another cluster's file system) is the same run."""
    moved = tmp_path / "elsewhere" / "imagenet"
    shutil.copytree(tiny_imagenet, moved)
    a = C.resolve("ilsvrc_cnns", tiny_overrides(tiny_imagenet, tmp_path, *SHORT))
    b = C.resolve("ilsvrc_cnns", tiny_overrides(moved, tmp_path, *SHORT))
    assert identity.cell_id(a) == identity.cell_id(b)
    assert prepared.data_fingerprint(tmp_path / "nothing") == "unprepared"


def test_fingerprint_cannot_be_set(tiny_imagenet, tmp_path):
    with pytest.raises(UserError, match="data_fingerprint is computed"):
        C.resolve("ilsvrc_cnns", tiny_overrides(tiny_imagenet, tmp_path, "data_fingerprint=abc"))


@pytest.mark.heavy
def test_resume_with_another_config_is_refused_and_the_run_untouched(tiny_imagenet, tmp_path):
    over = tiny_overrides(tiny_imagenet, tmp_path, *SHORT)
    s = ilsvrc(over)
    assert s["status"] == "completed"
    d = identity.run_dir(C.resolve("ilsvrc_cnns", over))
    # What a run directory made by another config (or another dataset) looks like to this one.
    cfg_text = (d / "config.yaml").read_text().replace("data_fingerprint: ", "data_fingerprint: x", 1)
    (d / "config.yaml").write_text(cfg_text)
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    with pytest.raises(UserError, match=r"holds another config \(data_fingerprint: 'x"):
        ilsvrc(over)
    after = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    assert after == before


@pytest.mark.heavy
def test_a_failed_start_keeps_a_completed_result(tiny_imagenet, tmp_path):
    """Re-running a completed cell with a broken infrastructure key must not mark it failed."""
    over = tiny_overrides(tiny_imagenet, tmp_path, *SHORT)
    assert ilsvrc(over)["status"] == "completed"
    d = identity.run_dir(C.resolve("ilsvrc_cnns", over))
    summary = (d / "summary.json").read_bytes()
    # Another data_root with the same prepared content: same run; its images are gone.
    broken = tmp_path / "broken" / "imagenet"
    shutil.copytree(tiny_imagenet, broken)
    shutil.rmtree(broken / "train")
    # the kept result is returned before the data is read (a final result is never re-opened)
    assert ilsvrc(tiny_overrides(broken, tmp_path, *SHORT))["status"] == "completed"
    assert (d / "summary.json").read_bytes() == summary


@pytest.mark.heavy
def test_print_config_shows_the_cell_and_runs_nothing(tiny_imagenet, tmp_path):
    import subprocess
    import sys

    import yaml

    from conftest import REPO

    over = tiny_overrides(tiny_imagenet, tmp_path, *SHORT)
    r = subprocess.run([sys.executable, "-m", "experiments.ilsvrc_cnns", "--print-config", *over], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    cfg = C.resolve("ilsvrc_cnns", over)
    assert shown == C.to_dict(cfg) and f"# run directory: {identity.run_dir(cfg)}" in r.stdout
    assert not identity.run_dir(cfg).exists()
    bad = subprocess.run([sys.executable, "-m", "experiments.ilsvrc_cnns", "--print-config", "bogus=1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown config key 'bogus'")
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("override", [
    "train.max_steps=-1", "train.epochs=-1", "optim.lr=nan", "optim.lr=-0.1", "train.diverge_after=0",
    "train.log_every=0", "train.eval_every_epochs=0", "optim.momentum=1.5",
    "optim.betas=[0.9,1.5]", "width=inf",
])
def test_values_out_of_range_are_one_line_errors(override):
    """A value that makes no sense is refused when the config is resolved -- by a run,
    and by `slurm.submit --dry-run` (which resolves every cell the same way) -- instead of becoming a
    result ("completed" at step 0, a NaN loss) or a traceback."""
    from mpt.config import resolve
    from mpt.errors import UserError

    key = override.split("=")[0]
    with pytest.raises(UserError, match=rf"^{re.escape(key)}=.* is out of range: it must be "):
        resolve("ilsvrc_cnns", ["profile=tiny", override])


def test_dry_run_refuses_an_out_of_range_value(capsys):
    from slurm import submit

    with pytest.raises(SystemExit) as e:
        submit.cli(submit.main)(["experiments/ilsvrc_cnns/grid.yaml", "--profile", "tiny", "--backend", "local",
                                 "--dry-run", "--set", "train.log_every=0"])
    assert e.value.code == 2
    assert "train.log_every=0 is out of range" in capsys.readouterr().err


def test_channels_last_is_a_speed_setting_not_an_identity(tiny_imagenet, tmp_path):
    """channels_last (auto | true | false) changes the layout, not the numbers a run means: every value
    names the same run directory; what a run used is in env.json; another value is a one-line error."""
    over = tiny_overrides(tiny_imagenet, tmp_path, *SHORT)
    dirs = {identity.run_dir(C.resolve("ilsvrc_cnns", [*over, f"channels_last={v}"])) for v in ("auto", "true", "false")}
    assert len(dirs) == 1 and dirs == {identity.run_dir(C.resolve("ilsvrc_cnns", over))}
    with pytest.raises(UserError, match="expects one of auto, true, false"):
        C.resolve("ilsvrc_cnns", [*over, "channels_last=maybe"])


def test_channels_last_auto_is_on_only_where_tensor_cores_compute():
    import torch

    from mpt.precision import channels_last_pays

    cfg = C.resolve("ilsvrc_cnns", ["profile=tiny"])
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    def pays(device, cnn=True, **kw):
        for k, v in kw.items():
            setattr(cfg, k, v)
        return channels_last_pays(cfg, device, cnn)
    # measured on an H200: NHWC halves a mixed step, speeds TF32, but slows strict FP32 2.1x
    assert pays(cuda, precision="mixed", tf32=False, channels_last="auto")
    assert pays(cuda, precision="fp32", tf32=True) and not pays(cuda, precision="fp32", tf32=False)
    assert not pays(cuda, precision="fp16_storage") and not pays(cuda, precision="fp8")
    assert not pays(cpu, precision="mixed") and not pays(cuda, cnn=False, precision="mixed")
    assert pays(cpu, precision="fp32", channels_last=True) and not pays(cuda, precision="mixed", channels_last=False)


@pytest.mark.heavy
def test_env_json_records_the_layout_and_the_fp32_reductions(tiny_imagenet, tmp_path):
    import json

    s = ilsvrc(tiny_overrides(tiny_imagenet, tmp_path, *SHORT, "channels_last=true", "precision=mixed"))
    env = json.loads((tmp_path / "ilsvrc_cnns" / s["run_name"] / "env.json").read_text())
    assert s["status"] == "completed" and env["channels_last"] is True
    assert env["fp16_reduced_precision_reduction"] is False and env["bf16_reduced_precision_reduction"] is False
    assert env["tf32_matmul"] is False


def test_a_batch_the_accumulation_does_not_divide_is_refused_before_anything_runs(capsys):
    import subprocess
    import sys

    from conftest import REPO

    r = subprocess.run([sys.executable, "-m", "experiments.ilsvrc_cnns", "--print-config", "profile=tiny",
                        "train.batch_size=10", "train.accum_steps=3"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "train.batch_size=10 must divide by train.accum_steps=3" in r.stderr


@pytest.mark.parametrize("experiment, bad, says", [
    ("voc_detection", "task.ap_rule=foo", "task.ap_rule='foo'; choose one of"),
    ("voc_detection", "impl=paper", "voc_detection runs impl=autocast only"),
    ("ilsvrc_cnns", "task.init=xavier", "unknown task.init='xavier'"),
    ("deepspeech2", "model=english task.pad_to_multiple=0", "task.pad_to_multiple=0 must be >= 1"),
    ("dcgan", "train.accum_steps=2", "train.accum_steps must be 1"),
    ("wmt_translation", "task.plateau_decay=1.5", "task.plateau_decay=1.5 must be in (0, 1)"),
    ("lm_biglstm", "task.emb_grad_scale=0", "task.emb_grad_scale=0.0 must be positive"),
])
def test_a_bad_task_key_is_refused_when_the_config_is_resolved(experiment, bad, says):
    """Task.check runs at resolve time: --print-config (and a grid's --dry-run, which resolves every
    cell the same way) refuses the cell in one line, before any run directory or data exists."""
    with pytest.raises(UserError, match=re.escape(says)):
        C.resolve(experiment, ["profile=tiny", "task.data_root=/nonexistent", *bad.split()])
