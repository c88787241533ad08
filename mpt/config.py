"""Typed configuration: defaults in one place, each experiment states only what differs.

Resolution order (later wins):
    dataclass defaults  <  experiments/<name>/config.yaml `base:`  <  `models: {<model>: ...}`
    <  `profiles: {<profile>: ...}`  <  `profiles: {<profile>: {models: {<model>: ...}}}`
    <  command-line `key=value` overrides (dotted keys).

An unknown key or a value of the wrong type is a one-line UserError. The resolved config is saved
with every run (config.yaml in the run directory) and hashed into the run's content id.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import math
import os
import pathlib
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from mpt import precisions
from mpt.errors import UserError

REPO = pathlib.Path(__file__).resolve().parent.parent


def infra(default=dataclasses.MISSING, **kw):
    """A field that describes where/how a run executes, not what it computes: left out of the
    content id, so the same cell on another cluster (other paths, workers, logging) is the same run."""
    return field(default=default, metadata={"infra": True}, **kw)


def added(default):
    """A key added after runs were stored, whose `default` reproduces them: at that value it is left out
    of the content id (those runs keep their ids and directories, and a stored config without it is the
    same run); any other value is another run."""
    return field(default=default, metadata={"added": default})


@dataclass
class OptimCfg:
    name: str = "sgd"  # sgd | adam | adamw | adagrad | rmsprop
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    alpha: float = 0.99  # rmsprop decay
    initial_accumulator_value: float = 0.0  # adagrad


@dataclass
class SchedCfg:
    name: str = "constant"  # constant | step | multistep | poly | cosine | exponential (mpt.optim.SCHEDULES: open)
    warmup_epochs: float = 0.0
    step_epochs: float = 30.0  # step: multiply by gamma every step_epochs
    milestones: list[float] = field(default_factory=list)  # multistep: epochs
    gamma: float = 0.1  # step, multistep; exponential: the factor per epoch, applied smoothly (gamma ** epoch)
    power: float = 1.0  # poly


@dataclass
class TrainCfg:
    epochs: float = 1.0
    max_steps: int = 0  # >0 overrides epochs (optimizer steps, skipped ones included)
    batch_size: int = 256  # GLOBAL batch: split evenly over ranks, then over accum_steps
    accum_steps: int = 1
    clip_grad_norm: float = 0.0  # 0 = off; applied to unscaled FP32 gradients
    eval_every_epochs: float = 1.0
    eval_max_batches: int = 0  # 0 = the whole validation set
    diverge_after: int = 20  # K consecutive non-finite losses end the run as "diverged"
    log_every: int = infra(10)
    ckpt_every_steps: int = infra(0)
    ckpt_every_minutes: float = infra(30.0)
    # DataLoader worker processes per rank. auto: the cores this process may use (its affinity mask,
    # and SLURM_CPUS_PER_TASK under SLURM) less one for the main process, at least 0
    # (mpt.ranks.loader_workers). A speed setting: kept as written here -- the count depends on the
    # node a run lands on, not on what it computes -- and the count a run used is in its env.json.
    num_workers: int | typing.Literal["auto"] = infra(4)
    progress: bool = infra(True)
    # cuDNN autotuning: a win for fixed input shapes; a task whose shapes change every batch (Faster
    # R-CNN's rescaled images) re-tunes at each new shape, so its config turns it off.
    cudnn_benchmark: bool = infra(True)
    # How long a rank waits in a collective (DDP all-reduce, checkpoint gather) before the process group
    # fails: a rank that died or hangs must end the job, not keep the others waiting for hours. Longer
    # than the slowest thing one rank does alone (an evaluation, rank 0 writing a checkpoint).
    dist_timeout_min: float = infra(20.0)
    # Each micro-batch's forward and backward captured once as a CUDA graph and replayed (mpt.graphs):
    # the same kernels on the same inputs, one launch instead of hundreds -- for launch-bound steps
    # (small batches per GPU). A speed setting, not part of a run's identity. Needs CUDA, one rank,
    # accum_steps=1, no numerics sampling, a task with a static step (Task.graphable); refused otherwise.
    cuda_graphs: bool = infra(False)


@dataclass
class ScalerCfg:
    # Dynamic loss scaling is not in the paper (section 5 lists it as future work); these are
    # torch.amp.GradScaler's defaults.
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


@dataclass
class NumericsCfg:
    every: int = 0  # sample the FP16 numerics every N steps; 0 = off (costs nothing)
    # Exponent range of the gradient histograms (the end bins also count everything beyond):
    # down to 2^-64, below Figure 3's axis (about 2^-60 by our reading; mpt.numerics.HIST_LO / HIST_HI).
    hist_lo: int = -64
    hist_hi: int = 16
    # Every N steps, the SQNR of the model's output and of each parameter's gradient against FP32 on the
    # same weights and batch (two extra forward/backward passes on the step's first micro-batch; the
    # training itself is not moved, bit for bit: mpt.numerics.FidelityObserver); 0 = off.
    sqnr_every: int = added(0)


@dataclass
class FP8Cfg:
    # precision=fp8 only (beyond the paper; mpt.fp8.FP8State). Defaults: Transformer
    # Engine's DelayedScaling (history 1024, "max", margin 0) and the FP8 paper's 16-bit first/last layers.
    scaling: str = "delayed"  # delayed (amax history) | current (amax of the tensor now)
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"  # max | most_recent
    margin: int = 0  # scale = FP8_MAX / amax / 2^margin
    ends: str = "bf16"  # bf16: first and last weight-bearing layer of each model in BF16 | fp8: every layer


PRESET = "preset"  # a fmt.* key left to the precision's preset (mpt.formats.RECIPES)


@dataclass
class RoleFmtCfg:
    # One tensor role's format (mpt.formats.TensorFormat's fields); `preset`: the precision's own.
    element: str = PRESET  # e4m3 | e5m2 | e2m1 | fp16 | bf16 | any row of mpt.formats.ELEMENTS; none: drop an own operand
    granularity: str = PRESET  # tensor | row | tile128 | block128x128 | mx32 | nvfp4_16 | block16x16
    scale_rounding: str = PRESET  # exact | pow2 | floor | rceil | e4m3
    rounding: str = PRESET  # nearest | stochastic
    hadamard: typing.Literal["preset", True, False] = PRESET  # the 16x16 random Hadamard transform


@dataclass
class FmtCfg:
    # The format recipe of a simulated-format precision (fp8, fp8_rowwise, ..., nvfp4: mpt.formats), field by
    # field; every key at `preset` trains the precision's preset as it is. mpt.precisions.format_recipe
    # resolves them; an impossible combination is a one-line error there.
    x: RoleFmtCfg = field(default_factory=RoleFmtCfg)  # the input activations
    w: RoleFmtCfg = field(default_factory=RoleFmtCfg)  # the weights
    g: RoleFmtCfg = field(default_factory=RoleFmtCfg)  # the gradient arriving at each product's output
    # The backward products' own operands (FormatRecipe): the weight for the data gradient, and x and g for
    # the weight gradient under wgrad=own; a field set here starts from the preset's (or from w, x, g).
    w_dgrad: RoleFmtCfg = field(default_factory=RoleFmtCfg)
    x_wgrad: RoleFmtCfg = field(default_factory=RoleFmtCfg)
    g_wgrad: RoleFmtCfg = field(default_factory=RoleFmtCfg)
    wgrad: str = PRESET  # shared | high | own
    accumulate: str = PRESET  # fp32 | an element format (linear layers only)
    # The last fraction of the weight-bearing layers kept in BF16; the last fraction of the steps in BF16.
    keep_last: float | typing.Literal["preset"] = PRESET
    bf16_tail: float | typing.Literal["preset"] = PRESET


@dataclass
class WandbCfg:
    mode: typing.Literal["auto", "online", "offline", "disabled"] = infra("auto")  # auto: online with WANDB_API_KEY
    project: str = infra("mixed-precision-training-1710.03740")
    entity: str = infra("")
    tags: list[str] = field(default_factory=list, metadata={"infra": True})


@dataclass
class Config:
    experiment: str = ""
    model: str = ""
    width: float = 1.0  # channel multiplier: tiny variants for tests and the demo
    profile: str = "paper"  # paper | tiny (CPU smoke data) -- tables never mix them
    seed: int = 0
    precision: str = "fp32"  # one of mpt.precisions.PRECISIONS: fp32 | fp16 | mixed | bf16 | fp16_pure | ...
    impl: str = "autocast"  # autocast | paper
    # FP16/BF16 dot products on a CPU: emulated (FP32 math on the FP16 operands, rounded once: section
    # 3.3's arithmetic) | native (PyTorch's CPU kernels) | auto (emulated; BF16 native where the CPU has
    # BF16 instructions). A GPU always runs its own kernels. mpt.half_math.HalfMath; env.json records
    # what auto picked.
    half_math: str = "auto"
    loss_scale: str = "auto"  # auto | dynamic | <number>
    # fp16_pure / bf16_pure: how the optimizer's FP32 result is rounded into the weights (mpt.rounding):
    # nearest | stochastic (seeded, checkpointed) | kahan (a compensation buffer per weight)
    rounding: str = "nearest"
    fp8: FP8Cfg = field(default_factory=FP8Cfg)
    fmt: FmtCfg = field(default_factory=FmtCfg)  # the simulated formats' recipe, field by field (beyond the paper)
    tf32: bool = False  # off by default so FP32 baselines are strict
    # NHWC activations and weights: on CUDA the tensor cores' convolutions read them directly (no
    # transposes). A speed setting, not part of a run's identity; auto = on for the image CNNs
    # (Task.channels_last) on CUDA in the precisions that compute in FP16/BF16/TF32, off elsewhere
    # (precision.channels_last_pays). What a run used is in its env.json.
    channels_last: typing.Literal["auto", True, False] = infra("auto")
    device: str = infra("auto")
    out_dir: str = infra("runs")
    optim: OptimCfg = field(default_factory=OptimCfg)
    sched: SchedCfg = field(default_factory=SchedCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    scaler: ScalerCfg = field(default_factory=ScalerCfg)
    numerics: NumericsCfg = field(default_factory=NumericsCfg)
    wandb: WandbCfg = field(default_factory=WandbCfg)
    task: Any = None  # the experiment's own dataclass (experiments/<name>/task.py: TaskCfg)
    # Computed, never set: the identity of the prepared dataset under task.data_root (see
    # data_fingerprint). Not an infra key, so a run on other data is another run (another directory).
    data_fingerprint: str = ""


# ----------------------------------------------------------------------------------------------
# setting values with type checks


def _coerce(value, tp, key: str, what: str = "config key"):
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):  # e.g. num_workers: an integer or auto
        for alt in typing.get_args(tp):
            try:
                return _coerce(value, alt, key, what)
            except UserError:
                pass
        show = " or ".join(_describe(a) for a in typing.get_args(tp))
        raise UserError(f"{what} {key!r} expects {show}, got {value!r}")
    if origin is typing.Literal:  # a closed set of values, e.g. channels_last: auto | true | false
        args = typing.get_args(tp)
        for a in args:
            if value == a and type(value) is type(a):
                return a
        show = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
        raise UserError(f"{what} {key!r} expects one of {show}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, item_tp, key, what) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{what} {key!r} expects true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UserError(f"{what} {key!r} expects an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # yaml reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise UserError(f"{what} {key!r} expects a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{what} {key!r} expects a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp} for {key}")


def _describe(tp) -> str:
    """A type as an error message names it: an integer, auto, ..."""
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _field_types(dc) -> dict[str, Any]:
    return _class_field_types(type(dc))


@functools.lru_cache(maxsize=None)
def _class_field_types(cls) -> dict[str, Any]:
    # get_type_hints is slow, and a grid resolves every cell: once per class.
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def set_key(cfg, dotted: str, value, *, where: str = "override") -> None:
    """Set cfg.<dotted> = value with a type check. Unknown keys are an error naming the valid ones."""
    obj, parts = cfg, dotted.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(obj):
            raise UserError(f"unknown config key {dotted!r} ({where}): {'.'.join(parts[:i])} has no sub-keys")
        types = _field_types(obj)
        if part not in types:
            prefix = ".".join(parts[:i])
            valid = ", ".join((f"{prefix}.{k}" if prefix else k) for k in types)
            raise UserError(f"unknown config key {dotted!r} ({where}); valid keys here: {valid}")
        if i == len(parts) - 1:
            cur = getattr(obj, part)
            if dataclasses.is_dataclass(cur):
                if not isinstance(value, dict):
                    raise UserError(f"config key {dotted!r} ({where}) is a section; give a mapping or set {dotted}.<key>")
                for k, v in value.items():
                    set_key(cfg, f"{dotted}.{k}", v, where=where)
            else:
                try:
                    setattr(obj, part, _coerce(value, types[part], dotted))
                except UserError as e:  # name where the value came from: a config.yaml section, the command line
                    raise UserError(f"{e} ({where})") from None
        else:
            obj = getattr(obj, part)


def apply_mapping(cfg, mapping: dict | None, where: str) -> None:
    if mapping is not None and not isinstance(mapping, dict):
        raise UserError(f"{where} must be a mapping of config keys, not a {type(mapping).__name__}")
    for k, v in (mapping or {}).items():
        set_key(cfg, k, v, where=where)


def parse_overrides(overrides: list[str], example: str = "precision=mixed optim.lr=0.1") -> list[tuple[str, Any]]:
    """`key=value` words -> [(key, value)], each value read as YAML (numbers, true/false, lists)."""
    out = []
    for o in overrides:
        if "=" not in o:
            raise UserError(f"bad argument {o!r}: write key=value, e.g. {example}")
        k, v = o.split("=", 1)
        try:
            val = safe_load(v) if v != "" else ""
        except yaml.YAMLError:
            val = v
        out.append((k.strip(), val))
    return out


def parse_options(argv: list[str], defaults: dict[str, Any], prog: str, example: str = "") -> dict[str, Any]:
    """A command's own `key=value` options (a benchmark's, not a run's config), typed like their
    defaults and read like config overrides. `-h` lists the keys; an unknown key is a UserError."""
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: python -m {prog} [key=value ...]\nkeys (default):")
        for k, v in defaults.items():
            print(f"  {k}={str(v).lower() if isinstance(v, bool) else v}")
        raise SystemExit(0)
    out = dict(defaults)
    for k, v in parse_overrides(argv, example or " ".join(f"{k}={v}" for k, v in list(defaults.items())[:2])):
        if k not in defaults:
            raise UserError(f"unknown key {k!r}; valid keys: {', '.join(defaults)}")
        out[k] = _coerce(v, type(defaults[k]), k, "option")
        if isinstance(out[k], float) and not math.isfinite(out[k]):
            raise UserError(f"option {k!r} expects a finite number, got {v!r}")
    return out


# ----------------------------------------------------------------------------------------------
# experiments


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


_EXPERIMENTS: dict[str, Experiment] = {}
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
    old = _EXPERIMENTS.get(name)
    if old is not None and (old.task.__qualname__, old.task.__module__) != (task.__qualname__, task.__module__):
        raise ValueError(f"two experiments named {name!r}: {old.task.__module__} and {task.__module__}")
    if old is not None and (old.config_yaml, old.task_cfg.__qualname__) != (exp.config_yaml, task_cfg.__qualname__):
        # The same task registered again (a module imported twice) is fine; with another config.yaml or
        # task config it would silently replace what the first registration's runs were resolved with.
        raise ValueError(f"experiment {name!r} ({task.__qualname__}) is already registered with {old.config_yaml} "
                         f"and {old.task_cfg.__qualname__}; register it once, or under another name, for "
                         f"{exp.config_yaml} and {task_cfg.__qualname__}")
    _EXPERIMENTS[name] = exp
    return exp


def _discoverable() -> list[str]:
    """Experiments of EXPERIMENT_PACKAGES (folders with a config.yaml), for the error's list."""
    names = set(_EXPERIMENTS)
    for pkg in EXPERIMENT_PACKAGES:
        spec = importlib.util.find_spec(pkg)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            names.update(p.parent.name for p in pathlib.Path(folder).glob("*/config.yaml"))
    return sorted(names)


def get_experiment(name) -> Experiment:
    """The registered experiment `name` (an Experiment is returned as it is)."""
    if isinstance(name, Experiment):
        return name
    if name not in _EXPERIMENTS and re.fullmatch(r"[A-Za-z_]\w*", name or ""):
        for pkg in EXPERIMENT_PACKAGES:
            if importlib.util.find_spec(pkg) is not None and importlib.util.find_spec(f"{pkg}.{name}") is not None:
                importlib.import_module(f"{pkg}.{name}")
                break
    if name not in _EXPERIMENTS:
        raise UserError(f"unknown experiment {name!r}; choose one of: {', '.join(_discoverable())}")
    return _EXPERIMENTS[name]


# ------------------------------------------------------------------ YAML that refuses a repeated key


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping naming a key twice. PyYAML keeps the last value without a
    word, so a grid listing `model:` twice under axes lost the first list's cells, and a config.yaml
    setting a key twice silently used the second. Merge keys (`<<: *base`) may still be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                if seen is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {key!r} (first at line {seen.line + 1})",
                        key_node.start_mark)
        return super().construct_mapping(node, deep)


def safe_load(stream):
    """yaml.safe_load that refuses a repeated key (UniqueKeyLoader): every config and grid file goes
    through it."""
    return yaml.load(stream, Loader=UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass


def yaml_error(e: yaml.YAMLError) -> str:
    """A YAML parse error on one line: what is wrong and where ("line 3, column 7")."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


def load_experiment_yaml(path: pathlib.Path) -> dict:
    try:
        st = path.stat()
        # A grid resolves every cell from the same file: parsed once per version of it (a copy each time).
        data = copy.deepcopy(_parse_yaml(str(path), st.st_mtime_ns, st.st_size))
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {yaml_error(e)}; fix that line") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must be a mapping with base:, models: and profiles:, not a {type(data).__name__}")
    unknown = set(data) - {"base", "models", "profiles"}
    if unknown:
        raise UserError(f"{path}: unknown top-level keys {sorted(unknown)}; allowed: base, models, profiles")
    for key in ("base", "models", "profiles"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise UserError(f"{path}: {key}: must be a mapping, not a {type(data[key]).__name__}")
    return data


@functools.lru_cache(maxsize=32)
def _parse_yaml(path: str, mtime_ns: int, size: int):
    with open(path) as f:
        return safe_load(f) or {}


def resolve(experiment: str | Experiment, overrides: list[str] | tuple = ()) -> Config:
    """The resolved config of one run of `experiment` (see the module docstring for the order)."""
    exp = get_experiment(experiment)
    experiment, where = exp.name, exp.where
    spec = load_experiment_yaml(exp.config_yaml)
    cfg = Config(experiment=experiment, task=exp.task_cfg())
    pairs = parse_overrides(list(overrides))
    cli = dict(pairs)
    if "experiment" in cli and cli["experiment"] != experiment:
        raise UserError(f"experiment={cli['experiment']} does not match the command's experiment {experiment!r}")
    apply_mapping(cfg, spec.get("base"), f"{where} base")
    model = str(cli.get("model", cfg.model))
    models = spec.get("models") or {}
    if not models:  # an empty (or models-less) config.yaml: "choose one of:" would list nothing
        raise UserError(f"{exp.config_yaml} defines no models ({'it is empty' if not spec else 'it has no models: section'}); "
                        f"give it a models: mapping (see experiments/*/config.yaml)")
    if model not in models:
        raise UserError(f"unknown model {model!r} for experiment {experiment}; choose one of: {', '.join(models)}")
    apply_mapping(cfg, models[model], f"{where} models.{model}")
    profile = str(cli.get("profile", cfg.profile))
    profiles = spec.get("profiles") or {}
    if profile != "paper" and profile not in profiles:
        raise UserError(f"unknown profile {profile!r}; choose one of: paper, {', '.join(profiles)}")
    prof = dict(profiles.get(profile) or {})
    per_model = prof.pop("models", None) or {}  # a profile may adjust single models too
    apply_mapping(cfg, prof, f"{where} profiles.{profile}")
    apply_mapping(cfg, per_model.get(model), f"{where} profiles.{profile}.models.{model}")
    for k, v in pairs:
        if k == "data_fingerprint":
            raise UserError("data_fingerprint is computed from the prepared dataset (task.data_root); "
                            "set task.data_root instead")
        set_key(cfg, k, v, where="command line")
    cfg.loss_scale = canonical_loss_scale(cfg.loss_scale, cfg.precision)
    task_cls = exp.task
    task_cls.check(cfg)  # the task's own keys, before any run directory or data is touched
    root = getattr(cfg.task, "data_root", None)
    if root:
        check_path_length("task.data_root", root, pathlib.Path(root) / "prepared.json")
        check_prepared(cfg, task_cls)
    cfg.data_fingerprint = data_fingerprint(root, getattr(task_cls, "data_files", ()))
    check_path_length("out_dir", cfg.out_dir, run_dir(cfg) / ".checkpoint.pt.xxxxxxxx.tmp")
    validate(cfg)
    return cfg


def check_path_length(key: str, value, longest) -> None:
    """A one-line UserError when `longest` (the longest path a run makes from the value of `key`) is
    longer than the file system allows (ENAMETOOLONG): a name over NAME_MAX bytes or a path over
    PATH_MAX, the limits of the deepest folder of it that exists (255 and 4096 on Linux)."""
    path = os.path.abspath(longest)
    base = path
    while not os.path.isdir(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    try:
        name_max, path_max = os.pathconf(base, "PC_NAME_MAX"), os.pathconf(base, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    long_name = max((len(p.encode()) for p in path.split(os.sep)), default=0)
    if long_name > name_max:
        why = f"a name in it has {long_name:,} bytes, the file system allows {name_max}"
    elif len(path.encode()) >= path_max:
        why = f"a path under it has {len(path.encode()):,} bytes, the file system allows {path_max - 1}"
    else:
        return
    v = str(value)
    shown = v if len(v) <= 60 else f"{v[:40]}...{v[-15:]} ({len(v):,} characters)"
    raise UserError(f"{key}={shown} is too long ({why}); choose a shorter {key}")


def check_prepared(cfg: Config, task_cls) -> None:
    """One line instead of a data loader's traceback when task.data_root holds prepared data that is not
    this run's: a prepared.json that is not a JSON mapping (damaged, or not written by data_prep), or
    another dataset's (its "dataset" is not the one Task.expected_data names). A missing marker is left
    to the task, which names the data_prep command."""
    root = cfg.task.data_root
    want = task_cls.expected_data(cfg) if hasattr(task_cls, "expected_data") else None
    prep = f"python -m data_prep.{want[1]} --archives DIR --out {root}" if want else "its data_prep command"
    marker = pathlib.Path(root) / "prepared.json"
    try:
        st = marker.stat()
    except OSError:
        return
    info, problem = _read_marker(str(marker), st.st_mtime_ns, st.st_size)
    if problem:
        raise UserError(f"{marker} {problem}; prepare the data again: {prep} --force")
    found = info.get("dataset")
    if want and found is not None and found != want[0]:
        raise UserError(f"task.data_root={root} holds {found!r} data (its prepared.json says so), but "
                        f"{cfg.experiment} model={cfg.model} reads {want[0]!r}: set task.data_root to "
                        f"the output of {prep}")


@functools.lru_cache(maxsize=16)
def _read_marker(path: str, mtime_ns: int, size: int) -> tuple[Any, str | None]:
    """(content of a prepared.json, None), or (None, why it is unusable); once per version of it."""
    try:
        info = json.loads(pathlib.Path(path).read_text())
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    except ValueError as e:
        return None, f"is not JSON ({str(e).splitlines()[0]}), not what data_prep writes"
    if not isinstance(info, dict):
        return None, f"holds a JSON {type(info).__name__}, not the mapping data_prep writes"
    return info, None


def canonical_loss_scale(value: str, precision: str = "") -> str:
    """One spelling per loss scale, so that equal recipes are one cell (one content id, one run
    directory): 8, 8.0, "8.0" and 8e0 are all "8"; 0.5 stays "0.5"; auto and dynamic in lower case.
    Given the precision, a spelling of what `auto` means there (mpt.precisions.parse_loss_scale) is
    `auto`: dynamic under mixed, and S = 1 under the precisions that never scale. fp16_pure and
    fp16_storage keep 1 and dynamic: there auto is no scaler at all, which skips no overflowing step.
    What is not a number is left for precisions.check to reject."""
    v = str(value).strip().lower()
    try:
        f = float(v)
    except ValueError:
        f = None
    if f is not None and not math.isfinite(f):
        return v
    if _means_auto(v, precision):
        return "auto"
    if f is None:
        return v
    return str(int(f)) if f.is_integer() and abs(f) < 2 ** 53 else repr(f)


def _means_auto(value: str, precision: str) -> bool:
    try:
        return precisions.parse_loss_scale(value, precision) == precisions.parse_loss_scale("auto", precision)
    except UserError:  # an unknown precision, or a loss scale it refuses: not auto's spelling
        return False


# Keys of a data_prep marker (prepared.json) that say when or where it was made, not what it holds.
_MARKER_VOLATILE = {"prepared_at", "seconds", "skipped", "source", "vocab_source", "warnings"}


def data_fingerprint(root, files=()) -> str:
    """A short content id of the prepared dataset at `root`, from what data_prep wrote: its marker
    (counts, class/vocabulary sizes, source-archive sizes and sampled digests, per-shard digests)
    and the `files` beside it that the experiment's task declares identify its data (Task.data_files,
    e.g. a class list or a vocabulary; those present are hashed) -- not the path, so the same data
    on another cluster is the same run. "unprepared" when there is no marker (the run itself then
    fails with the prep command)."""
    if not root:
        return "none"
    root = pathlib.Path(root)
    try:
        st = (root / "prepared.json").stat()
    except OSError:
        return "unprepared"
    # A grid resolves every cell on the same data: hash it once per marker version, not per cell
    # (the full 1B Word vocabulary alone is 10 MB).
    return _fingerprint(str(root.resolve()), st.st_mtime_ns, st.st_size, tuple(files))


@functools.lru_cache(maxsize=16)
def _fingerprint(root: str, mtime_ns: int, size: int, files: tuple[str, ...]) -> str:
    root = pathlib.Path(root)
    info, problem = _read_marker(str(root / "prepared.json"), mtime_ns, size)
    if problem:
        return "unprepared"
    blob = {k: v for k, v in info.items() if k not in _MARKER_VOLATILE}
    h = hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode())
    for name in files:
        if (root / name).is_file():
            h.update((root / name).read_bytes())
    return h.hexdigest()[:16]


RANGES = (  # (key, test, what it must be) for the core config (scaler.*: precisions.check); a task checks its own keys
    ("width", lambda v: v > 0, "> 0"),
    ("seed", lambda v: v >= 0, ">= 0"),
    ("train.epochs", lambda v: v > 0, "> 0 (train.max_steps > 0 overrides it)"),
    ("train.max_steps", lambda v: v >= 0, ">= 0 (0: train.epochs decides)"),
    ("train.batch_size", lambda v: v >= 1, ">= 1"),
    ("train.accum_steps", lambda v: v >= 1, ">= 1"),
    ("train.clip_grad_norm", lambda v: v >= 0, ">= 0 (0: off)"),
    ("train.eval_every_epochs", lambda v: v > 0, "> 0"),
    ("train.eval_max_batches", lambda v: v >= 0, ">= 0 (0: the whole validation set)"),
    ("train.diverge_after", lambda v: v >= 1, ">= 1"),
    ("train.log_every", lambda v: v >= 1, ">= 1"),
    ("train.ckpt_every_steps", lambda v: v >= 0, ">= 0 (0: off)"),
    ("train.ckpt_every_minutes", lambda v: v >= 0, ">= 0 (0: off)"),
    ("train.num_workers", lambda v: v >= 0, ">= 0, or auto (the cores this process may use, less one)"),
    ("train.dist_timeout_min", lambda v: v > 0, "> 0"),
    ("optim.lr", lambda v: v >= 0, ">= 0 (0: no update, e.g. an untrained baseline)"),
    ("optim.momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.weight_decay", lambda v: v >= 0, ">= 0"),
    ("optim.betas", lambda v: 0 <= v < 1, "two numbers in [0, 1)"),
    ("optim.eps", lambda v: v > 0, "> 0"),
    ("optim.alpha", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.initial_accumulator_value", lambda v: v >= 0, ">= 0"),
    ("sched.warmup_epochs", lambda v: v >= 0, ">= 0"),
    ("sched.step_epochs", lambda v: v > 0, "> 0"),
    ("sched.milestones", lambda v: v >= 0, "epochs >= 0"),
    ("sched.gamma", lambda v: v > 0, "> 0"),
    ("sched.power", lambda v: v > 0, "> 0"),
    ("numerics.every", lambda v: v >= 0, ">= 0 (0: off)"),
    ("numerics.sqnr_every", lambda v: v >= 0, ">= 0 (0: off)"),
)


def validate(cfg: Config) -> None:
    precisions.check(cfg)
    # Every numeric key's range: a value outside it would otherwise become a "result" (max_steps=-1 ->
    # "completed" at step 0, lr=nan -> "completed" with a NaN loss) or a traceback (log_every=0).
    for key, ok, want in RANGES:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        values = value if isinstance(value, list) else [value]
        values = [v for v in values if v != "auto"]  # a key that takes auto (train.num_workers) has no range then
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and ok(v) for v in values):
            raise UserError(f"{key}={value} is out of range: it must be {want}")
    n = cfg.numerics
    if n.hist_lo > n.hist_hi:
        raise UserError(f"numerics.hist_lo={n.hist_lo} must be <= numerics.hist_hi={n.hist_hi} "
                        f"(exponents of the first and last histogram bins)")
    row = precisions.BY_NAME[cfg.precision]
    if n.sqnr_every > 0 and not (row.storage == "float32" or (cfg.impl == "autocast" and "autocast" in row.impls)):
        fp32_weights = [p.name for p in precisions.TABLE if not p.tf32 and (p.storage == "float32" or "autocast" in p.impls)]
        raise UserError(f"numerics.sqnr_every compares against FP32 on the model's own weights, which precision="
                        f"{cfg.precision} impl={cfg.impl} stores in {row.storage}: use impl=autocast or a precision "
                        f"with FP32 weights ({', '.join(fp32_weights)})")
    t = cfg.train
    if t.cuda_graphs:  # what the config alone decides; the device, ranks and task: mpt.graphs.refusal
        why = None
        if t.accum_steps > 1:
            from mpt.graphs import refusal

            why = refusal(device="cuda", accum=t.accum_steps)
        elif n.every > 0 or n.sqnr_every > 0:
            why = (f"train.cuda_graphs=true replays a forward/backward that numerics sampling hooks "
                   f"(numerics.every={n.every}, numerics.sqnr_every={n.sqnr_every}): set both to 0 or "
                   f"train.cuda_graphs=false")
        elif not precision_graphable(cfg):
            why = (f"train.cuda_graphs=true: precision={cfg.precision} keeps host-side state per forward that "
                   f"a replay would not update; set train.cuda_graphs=false")
        if why:
            raise UserError(why)
    if t.batch_size % t.accum_steps:  # the world size divides it too: checked when the ranks are known
        raise UserError(f"train.batch_size={t.batch_size} must divide by train.accum_steps={t.accum_steps} "
                        f"(each micro-batch the same size)")


def precision_graphable(cfg) -> bool:
    from mpt.precision import recipe_class

    return recipe_class(cfg.precision, cfg.impl).graphable


# ----------------------------------------------------------------------------------------------
# identity


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _strip_infra(dc) -> dict:
    out = {}
    for f in dataclasses.fields(dc):
        v = getattr(dc, f.name)
        if f.metadata.get("infra") or ("added" in f.metadata and v == f.metadata["added"]):
            continue
        out[f.name] = _strip_infra(v) if dataclasses.is_dataclass(v) else v
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Keys added after runs were stored, with the value that reproduces those runs: at that value a key is
# left out of the content id (the runs keep their ids and directories) and a stored config without it
# is the same run. Another value is another run.
_ADDED_KEYS = {"half_math": "auto", "rounding": "nearest", "fp8": dataclasses.asdict(FP8Cfg()),
               "fmt": dataclasses.asdict(FmtCfg())}
# The same for keys inside a section (a dotted path; the section of experiments that have the key).
_ADDED_NESTED_KEYS = {"task.decode": "cpu"}
# Keys that became infrastructure (speed settings) after runs were stored, with the value those runs'
# ids were computed with: the id still counts that value, so every earlier run keeps its id.
_NOW_INFRA_KEYS = {"channels_last": False}


def config_difference(stored: dict, cfg: Config) -> str | None:
    """The first non-infrastructure key whose value differs between a run directory's stored
    config.yaml and cfg, as "key: <stored> stored, <new> now"; None when they are the same run."""
    new = _flat(json.loads(json.dumps(_strip_infra(cfg), default=str)))
    old = _flat(json.loads(json.dumps(stored, default=str))) if isinstance(stored, dict) else {}
    if isinstance(stored, dict):
        old = {**_flat(_ADDED_KEYS), **_ADDED_NESTED_KEYS, **old}
    for d in (new, old):  # one spelling per loss scale, as in cell_id
        if "loss_scale" in d:
            d["loss_scale"] = canonical_loss_scale(d["loss_scale"], str(d.get("precision", "")))
    for k in sorted(set(new) | set(old)):
        if k in new and k in old and old[k] != new[k]:
            return f"{k}: {old[k]!r} stored, {new[k]!r} now"
        if k in new and k not in old and new[k] not in ("", None):
            return f"{k}: not stored, {new[k]!r} now"
    return None


def cell_id(cfg: Config) -> str:
    """Content id of a run: sha256 of the resolved config without infrastructure keys (values as
    resolve() normalises them: a Config built by hand gets the same id as the resolved one)."""
    ident = _strip_infra(cfg)
    ident["loss_scale"] = canonical_loss_scale(ident["loss_scale"], ident["precision"])
    for k, default in _ADDED_KEYS.items():
        if ident.get(k) == default:
            del ident[k]
    for path, default in _ADDED_NESTED_KEYS.items():
        *sections, leaf = path.split(".")
        d = ident
        for sec in sections:
            d = d.get(sec) if isinstance(d, dict) else None
        if isinstance(d, dict) and d.get(leaf) == default:
            del d[leaf]
    ident.update(_NOW_INFRA_KEYS)
    from mpt import formats, precisions

    if ident["precision"] in precisions.FORMATS:  # what the simulated quantisers compute is part of what ran
        ident["quantisers"] = formats.QUANTISERS
    blob = json.dumps(ident, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_name(cfg: Config) -> str:
    return f"{cfg.model}-{cfg.precision}-s{cfg.seed}-{cell_id(cfg)[:10]}"


def run_dir(cfg: Config) -> pathlib.Path:
    return pathlib.Path(cfg.out_dir) / cfg.experiment / run_name(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
