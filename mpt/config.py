"""Typed configuration: defaults in one place, each experiment states only what differs.

Resolution order (later wins):
    dataclass defaults  <  experiments/<name>/config.yaml `base:`  <  `models: {<model>: ...}`
    <  `profiles: {<profile>: ...}`  <  `profiles: {<profile>: {models: {<model>: ...}}}`
    <  command-line `key=value` overrides (dotted keys).

An unknown key or a value of the wrong type is a one-line UserError (mpt.config_parse). The resolved
config is saved with every run (config.yaml in the run directory) and hashed into the run's content id
(mpt.identity); the experiments it resolves are mpt.registry's."""
from __future__ import annotations

import dataclasses
import math
import pathlib
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from mpt import precisions
from mpt.config_parse import apply_mapping, load_experiment_yaml, parse_overrides, set_key
from mpt.errors import UserError
from mpt.identity import canonical_loss_scale, run_dir
from mpt.prepared import check_prepared, data_fingerprint
from mpt.registry import Experiment, get_experiment
from mpt.rundir import check_path_length


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
    # The quantisers' elementwise chains fused by torch.compile (mpt.fused): the same bits, a speed setting, not part of
    # a run's identity. Off by default: compiling takes 20-70 s on a CPU (docs/beyond_the_paper.md), longer than a test
    # or a smoke run; without a C++ compiler it says so on stderr and runs eager.
    compile: bool = infra(False)


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
    # BF16 instructions). A GPU runs its own kernels but for emulated. mpt.half_math.HalfMath; env.json records
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
    # Computed, never set: the identity of the prepared dataset under task.data_root
    # (mpt.prepared.data_fingerprint). Not an infra key, so a run on other data is another run (another directory).
    data_fingerprint: str = ""



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


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
