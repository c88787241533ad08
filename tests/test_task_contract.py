"""The Task contract (mpt/task.py): the README's worked toy trains through the unchanged engine, a misspelt
hook fails when the class is defined, and what is missing is named."""
import dataclasses
import re

import pytest
import torch

from conftest import REPO
from toy_gan import run_task
from mpt import engine
from mpt.task import Task
from toy_mlp import config


def _readme_task() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## The Task: what an experiment adds"):text.index("## Configs and runs")]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_toy_is_a_complete_experiment(tmp_path, one_thread):
    scope: dict = {}
    exec(compile(_readme_task(), "README.md", "exec"), scope)
    cfg = config(tmp_path, optim={"lr": 0.05}, train={"max_steps": 40})
    task = scope["Regression"](cfg)
    train, _ = task.datasets()
    y = train.tensors[1]
    baseline = float(((y - y.mean()) ** 2).mean())  # the best constant prediction's MSE
    s = engine.run(cfg, task)
    assert s["status"] == "completed" and s["step"] == 40
    # a linear model of a sum: it must get far below the constant predictor (y's variance, ~8)
    assert s["metrics"]["mse"] < 0.05 * baseline, (s["metrics"], baseline)


def test_a_misspelt_hook_fails_at_class_definition():
    with pytest.raises(TypeError, match="evalute.*'evaluate'"):
        class Typo(Task):
            def evalute(self, ev):
                return {}

    class Helpers(Task):  # unrelated public methods are fine
        def loss(self, model, batch):
            return model(batch).mean(), len(batch)

        def translate(self, model, sources):
            return sources

        def real_images(self, n):
            return n


def test_the_engine_refuses_a_task_that_is_not_a_task(tmp_path):
    class Duck:
        primary_metric, higher_is_better = "mse", False

    with pytest.raises(TypeError, match="Duck must subclass mpt.task.Task"):
        engine.Run(config(tmp_path), Duck())


def test_a_task_without_loss_is_refused_at_class_definition():
    """Not at step 1, after the run directory, the data and the model exist: when the class is defined,
    in one line naming the class and the fix. Its own train_step, or a loss it inherits, is enough."""
    with pytest.raises(TypeError, match=r"\.NoLoss has no loss: define loss\(self, model, batch\) -> \(mean loss, "
                                        r"items\), or a train_step of its own$"):
        class NoLoss(Task):
            primary_metric = "mse"

            def datasets(self):
                ds = torch.utils.data.TensorDataset(torch.randn(32, 2), torch.randn(32, 1))
                return ds, ds

            def build_model(self):
                return torch.nn.Linear(2, 1)

    class OwnStep(Task):  # several losses or optimizers: its own body, no loss hook
        def train_step(self, ctx, micro_batches):
            return {}, 0

    class Inherited(OwnStep):  # its base's train_step counts
        pass


def test_optimizers_must_be_named_after_the_models_they_train(tmp_path, one_thread):
    from toy_gan import ToyGan, config as gan_config

    from mpt.errors import UserError
    from mpt.optim import build_optimizer

    class Renamed(ToyGan):
        def optimizers(self, model):
            cfg = self.cfg
            return {"D": build_optimizer(cfg.optim, model["discriminator"].parameters()),
                    "G": build_optimizer(cfg.optim, model["generator"].parameters())}

    with pytest.raises(UserError, match=r"names \['D', 'G'\], which the model has no entry for"):
        run_task(gan_config(tmp_path), Renamed)


def test_an_experiment_of_its_own_registers_and_runs_outside_the_repository(tmp_path, one_thread):
    """The core finds experiments in its registry, not in experiments/: a task and config.yaml kept
    anywhere register under a name, resolve (--print-config refuses a bad key in one line) and run."""
    from dataclasses import dataclass

    from mpt import cli
    from mpt import config as C
    from mpt import registry
    from mpt.errors import UserError

    scope: dict = {}
    exec(compile(_readme_task(), "README.md", "exec"), scope)

    @dataclass
    class RegressionCfg:
        noise: float = 0.0

    (tmp_path / "config.yaml").write_text(
        "base: {model: linear, device: cpu, out_dir: %s, optim: {lr: 0.05}, wandb: {mode: disabled},\n"
        "       train: {batch_size: 16, max_steps: 20, num_workers: 0, progress: false}}\n"
        "models: {linear: {}}\n" % (tmp_path / "runs"))
    exp = registry.register("regression_of_its_own", scope["Regression"], RegressionCfg, tmp_path / "config.yaml")
    assert registry.get_experiment("regression_of_its_own") is exp
    with pytest.raises(UserError, match="unknown config key 'task.nosie'.*task.noise"):
        C.resolve("regression_of_its_own", ["task.nosie=1"])
    s = cli.main("regression_of_its_own", [])
    assert s["status"] == "completed" and s["step"] == 20
    assert (tmp_path / "runs" / "regression_of_its_own" / s["run_name"] / "summary.json").is_file()


@dataclasses.dataclass
class _NoKeys:
    """A task config without task.* keys."""


def test_a_task_registered_again_with_another_config_is_refused(tmp_path):
    """The same Task registered twice under one name replaced its config.yaml without a word."""
    from mpt import registry

    class Twice(Task):
        def loss(self, model, batch):
            return model(batch).mean(), len(batch)

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for f in (a, b):
        f.write_text("models: {m: {}}\n")
    exp = registry.register("registered_twice", Twice, _NoKeys, a)
    assert registry.register("registered_twice", Twice, _NoKeys, a).config_yaml == exp.config_yaml  # the same again: fine
    with pytest.raises(ValueError, match=r"'registered_twice' \(.*Twice\) is already registered with .*a\.yaml"):
        registry.register("registered_twice", Twice, _NoKeys, b)
    assert registry.get_experiment("registered_twice").config_yaml == a.resolve()


@pytest.mark.parametrize("text,why", [("", "it is empty"), ("base: {device: cpu}\n", "it has no models: section")])
def test_a_config_yaml_without_models_says_so(tmp_path, text, why):
    """An empty config.yaml said "unknown model ''; choose one of:" and an empty list."""
    from mpt import config as C
    from mpt import registry
    from mpt.errors import UserError

    class NoModels(Task):
        def loss(self, model, batch):
            return model(batch).mean(), len(batch)

    (tmp_path / "config.yaml").write_text(text)
    name = f"no_models_{len(text)}"
    registry.register(name, NoModels, _NoKeys, tmp_path / "config.yaml")
    with pytest.raises(UserError, match=f"config.yaml defines no models \\({why}\\); give it a models: mapping"):
        C.resolve(name, [])
