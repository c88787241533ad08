"""The experiment registry: an experiment registers itself by name (register(), in its package's
__init__) and the core finds it by that name (get_experiment), never by its place in a folder."""
from __future__ import annotations

import importlib
import importlib.util
import pathlib
import re
from dataclasses import dataclass

from mpt import REPO
from mpt.errors import UserError


@dataclass(frozen=True)
class Experiment:
    """What the core needs of an experiment: its name (a run's directory and a grid's `experiment:`),
    its Task subclass and TaskCfg dataclass (the task.* keys), and its config.yaml (base:, models:,
    profiles:). An experiment registers itself (register(), in its package's __init__); the core
    finds it by name in the registry, never by its place in a folder."""
    name: str
    task: type
    task_cfg: type
    config_yaml: pathlib.Path

    @property
    def where(self) -> str:
        """config.yaml as the user knows it: relative to the repository when inside it."""
        try:
            return str(self.config_yaml.relative_to(REPO))
        except ValueError:
            return str(self.config_yaml)


EXPERIMENTS: dict[str, Experiment] = {}
# The packages an experiment named but not yet registered is looked for in (importing
# <package>.<name> registers it): this repository's experiments/. A project of its own registers its
# experiments before naming them (import them), or appends its package here.
EXPERIMENT_PACKAGES = ["experiments"]


def register(name: str, task: type, task_cfg: type, config_yaml=None) -> Experiment:
    """Register an experiment under `name`; config_yaml defaults to config.yaml beside the task's module."""
    if not re.fullmatch(r"[A-Za-z_]\w*", name or ""):
        raise ValueError(f"experiment name {name!r} must be an identifier (it names run directories)")
    if config_yaml is None:
        config_yaml = pathlib.Path(importlib.import_module(task.__module__).__file__).parent / "config.yaml"
    exp = Experiment(name, task, task_cfg, pathlib.Path(config_yaml).resolve())
    old = EXPERIMENTS.get(name)
    if old is not None and (old.task.__qualname__, old.task.__module__) != (task.__qualname__, task.__module__):
        raise ValueError(f"two experiments named {name!r}: {old.task.__module__} and {task.__module__}")
    if old is not None and (old.config_yaml, old.task_cfg.__qualname__) != (exp.config_yaml, task_cfg.__qualname__):
        # The same task registered again (a module imported twice) is fine; with another config.yaml or
        # task config it would silently replace what the first registration's runs were resolved with.
        raise ValueError(f"experiment {name!r} ({task.__qualname__}) is already registered with {old.config_yaml} "
                         f"and {old.task_cfg.__qualname__}; register it once, or under another name, for "
                         f"{exp.config_yaml} and {task_cfg.__qualname__}")
    EXPERIMENTS[name] = exp
    return exp


def _discoverable() -> list[str]:
    """Experiments of EXPERIMENT_PACKAGES (folders with a config.yaml), for the error's list."""
    names = set(EXPERIMENTS)
    for pkg in EXPERIMENT_PACKAGES:
        spec = importlib.util.find_spec(pkg)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            names.update(p.parent.name for p in pathlib.Path(folder).glob("*/config.yaml"))
    return sorted(names)


def get_experiment(name) -> Experiment:
    """The registered experiment `name` (an Experiment is returned as it is)."""
    if isinstance(name, Experiment):
        return name
    if name not in EXPERIMENTS and re.fullmatch(r"[A-Za-z_]\w*", name or ""):
        for pkg in EXPERIMENT_PACKAGES:
            if importlib.util.find_spec(pkg) is not None and importlib.util.find_spec(f"{pkg}.{name}") is not None:
                importlib.import_module(f"{pkg}.{name}")
                break
    if name not in EXPERIMENTS:
        raise UserError(f"unknown experiment {name!r}; choose one of: {', '.join(_discoverable())}")
    return EXPERIMENTS[name]
