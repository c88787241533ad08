"""The patient: TARGET on the command line (module:function, module:TaskClass, experiment:NAME; the package
docstring says what each returns) loaded as a model, its loss, its batches and its optimizer."""
from __future__ import annotations

import copy
import functools
import importlib
import inspect
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from mpt.config import Config
from mpt.errors import UserError, one_line
from mpt.task import Task

STEPS = 20  # training steps of every phase; also how many batches a Task's patient draws
FORM = ("return (model, loss, batches) or (model, loss, batches, optimizer), or a dict with those keys, "
        "where loss(model, batch) gives the mean loss and optimizer(model) builds the optimizer "
        "(see mpt/doctor/examples.py)")


@dataclass
class Patient:
    """The model under examination. Every phase trains its own deep copy of `model` (same weights)."""
    name: str
    model: nn.Module
    loss: Callable  # loss(model, batch) -> mean loss, or (mean loss, items)
    batches: list
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    notes: list[str] = field(default_factory=list)
    seed: int = 0  # every phase starts the random stream here: the replays draw the same dropout masks, samples
    task: Task | None = None  # a Task's loss is called on a fresh copy of it in every phase (state it carries
    #                           across batches, the bigLSTM's recurrent state, must start afresh in each replay)

    def loss_fn(self) -> Callable:
        return copy.deepcopy(self.task).loss if self.task is not None else self.loss


class LossError(UserError):
    """The user's loss (or the model it calls) raised: one line naming their file and line (`cause`: what it
    raised)."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause


_NOT_THEIRS = (Path(torch.__file__).parent, Path(__file__).resolve().parents[1])  # torch; mpt (less the examples)


def _their_frame(tb) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback in the user's code: not torch's, not this package's own machinery
    (mpt/doctor/examples.py, the toys, counts as a user's file)."""
    frames = traceback.extract_tb(tb)
    for f in reversed(frames):
        path = Path(f.filename).resolve()
        if path.name == "examples.py" and path.parent == _NOT_THEIRS[1] / "doctor":
            return f
        if not any(path.is_relative_to(d) for d in _NOT_THEIRS) and "site-packages" not in path.parts \
                and not f.filename.startswith("<frozen"):
            return f
    return frames[-1] if frames else None


def _where(e: BaseException) -> str:
    f = _their_frame(e.__traceback__)
    return f" at {f.filename}:{f.lineno} (in {f.name})" if f else ""


def _call_factory(factory: Callable, target: str, *args):
    """factory(*args) -- the user's function or Task class -- with what it raises (or its sys.exit, which
    would end the doctor with no word) as one line naming where in their code."""
    try:
        return factory(*args)
    except UserError:
        raise
    except SystemExit as e:  # sys.exit(msg) exits 1 having printed msg; sys.exit() exits 0
        code = 0 if e.code is None else e.code
        said = f"code {code}" if isinstance(code, int) else f"code 1 ({code!r})"
        raise UserError(f"{target}: the factory exited with {said} (sys.exit{_where(e)}) instead of returning "
                        f"the patient; {FORM}") from None
    except Exception as e:  # noqa: BLE001 -- anything their code raises
        raise UserError(f"{target}: the factory raised {one_line(e)}{_where(e)}; fix it there") from None


def check_model(model: nn.Module, name: str) -> None:
    """A model the replays can train: parameters, with values (not on PyTorch's meta device)."""
    params = list(model.parameters())
    if not params:
        raise UserError(f"{name}: the model ({type(model).__name__}) has no parameters: there is nothing to train "
                        f"and no precision to choose; return the model whose weights the loss trains")
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise UserError(f"{name}: the model's {meta[0]} ({len(meta)} tensors in all) is on the meta device (a shape "
                        f"without values); materialise it before returning it: model.to_empty(device='cpu') and "
                        f"initialise it, or load_state_dict(..., assign=True)")


def call_loss(loss_fn: Callable, model: nn.Module, batch, name: str):
    """loss_fn(model, batch), whose exceptions -- a bug in the user's loss or model -- become one line naming
    where in their code it happened (a LossError) instead of a traceback through the doctor."""
    try:
        return loss_fn(model, batch)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 -- anything their code raises
        f = _their_frame(e.__traceback__)
        where = f" at {f.filename}:{f.lineno} (in {f.name})" if f else ""
        raise LossError(f"{name}: loss(model, batch) raised {one_line(e)}{where}; fix it there (the doctor "
                        f"calls it as a training step would)", e) from None


def default_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def load(target: str, overrides: list[str] = (), profile: str | None = None, steps: int = STEPS) -> Patient:
    """The Patient named by TARGET (the package docstring)."""
    if ":" not in target:
        raise UserError(f"{target!r}: write module:function (e.g. mpt.doctor.examples:underflow) or experiment:NAME")
    mod_name, attr = target.split(":", 1)
    if mod_name == "experiment":
        return _from_experiment(attr, list(overrides), profile, steps)
    if overrides or profile:
        raise UserError(f"--profile and key=value overrides are for experiment:NAME targets, not {target!r}")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserError(f"cannot import module {mod_name!r} ({type(e).__name__}: {e}); give a module importable "
                        f"from the current directory, e.g. mpt.doctor.examples:underflow") from None
    except SyntaxError as e:  # (its traceback is the doctor's import machinery; the line is the user's)
        raise UserError(f"cannot import module {mod_name!r}: {type(e).__name__}: {e.msg} at {e.filename}:{e.lineno}; "
                        f"fix it there") from None
    except Exception as e:  # noqa: BLE001 -- whatever their module's top level raises
        raise UserError(f"cannot import module {mod_name!r}: it raised {one_line(e)}{_where(e)}; fix it there") \
            from None
    obj = getattr(mod, attr, None)
    if obj is None:
        public = sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_")
                        and getattr(v, "__module__", None) == mod.__name__)
        raise UserError(f"module {mod_name!r} has no {attr!r}; it defines: {', '.join(public) or 'nothing callable'}")
    if inspect.isclass(obj) and issubclass(obj, Task):
        return _from_task(_call_factory(obj, target, Config()), target, steps)
    if not callable(obj):
        raise UserError(f"{target} is a {type(obj).__name__}, not a function; {FORM}")
    got = _call_factory(obj, target)
    if isinstance(got, Task):
        return _from_task(got, target, steps)
    return _from_value(got, target)


def _from_value(got: Any, target: str) -> Patient:
    keys = ("model", "loss", "batches", "optimizer")
    if isinstance(got, dict):
        unknown = set(got) - set(keys)
        if unknown or not {"model", "loss", "batches"} <= set(got):
            raise UserError(f"{target} returned a dict with keys {sorted(got)}; {FORM}")
        parts = [got.get(k) for k in keys]
    elif isinstance(got, (tuple, list)) and len(got) in (3, 4):
        parts = list(got) + [None] * (4 - len(got))
    else:
        what = f"a {len(got)}-tuple" if isinstance(got, (tuple, list)) else f"a value of type {type(got).__name__}"
        raise UserError(f"{target} returned {what}; {FORM}")
    model, loss, batches, opt = parts
    if not isinstance(model, nn.Module):
        raise UserError(f"{target}: the model is a {type(model).__name__}, not a torch.nn.Module; {FORM}")
    check_model(model, target)
    if not callable(loss):
        raise UserError(f"{target}: the loss is a {type(loss).__name__}, not a function loss(model, batch); {FORM}")
    if opt is not None and not callable(opt):
        raise UserError(f"{target}: the optimizer is a {type(opt).__name__}, not a function optimizer(model); {FORM}")
    try:
        batches = list(batches)
    except TypeError:
        raise UserError(f"{target}: the batches are a {type(batches).__name__}, not a list of batches; "
                        f"{FORM}") from None
    if not batches:
        raise UserError(f"{target}: no batches; give at least one (the doctor cycles through them)")
    note = "optimizer: SGD, lr 0.01, momentum 0.9 (the default; return your own as the 4th item)"
    return Patient(target, model, loss, batches, opt or default_optimizer, [] if opt else [note])


def _from_task(task: Task, name: str, steps: int) -> Patient:
    """A Task's model, optimizer, loss and first `steps` training batches, as the engine would draw them
    (mpt.data's seeded sampler and dataset, the task's collate and order); one optimizer, constant lr."""
    from torch.utils.data import DataLoader

    from mpt.data import EpochSampler, SeededDataset

    if task.own_step:
        raise UserError(f"{name}: {type(task).__qualname__} has its own train_step (several losses or optimizers); "
                        f"the doctor runs the default loss step: give module:function returning one model and loss")
    cfg = task.cfg
    torch.manual_seed(cfg.seed)
    train, _ = task.datasets()
    model = task.build_model()
    if isinstance(model, nn.ModuleDict):
        raise UserError(f"{name}: the task builds several models ({', '.join(model)}); the doctor examines one")
    check_model(model, name)
    micro = max(1, cfg.train.batch_size // cfg.train.accum_steps)
    if len(train) < micro:
        raise UserError(f"{name}: train.batch_size={micro} is larger than the training set ({len(train)})")
    ds = SeededDataset(train, cfg.seed)
    sampler = EpochSampler(len(train), cfg.seed, task.shuffle_train, batch_size=micro,
                           order=functools.partial(task.train_order, train), with_epoch=True)
    loader = DataLoader(ds, batch_size=micro, sampler=sampler, drop_last=True, collate_fn=task.collate)
    batches, epoch = [], 0
    while len(batches) < steps:
        sampler.set_epoch(epoch)
        ds.set_epoch(epoch)
        for b in loader:
            batches.append(b)
            if len(batches) == steps:
                break
        epoch += 1

    def optimizer(m):
        opts = dict(task.optimizers(m))
        if len(opts) != 1:
            raise UserError(f"{name}: the task has {len(opts)} optimizers; the doctor examines one")
        return next(iter(opts.values()))

    notes = [f"batches: the first {steps} training batches of {micro} (train.batch_size / accum_steps)",
             ("optimizer: the task's own optimizers()" if type(task).optimizers is not Task.optimizers
              else f"optimizer: optim.name={cfg.optim.name}, optim.lr={cfg.optim.lr}") + "; no schedule applied"]
    return Patient(name, model, task.loss, batches, optimizer, notes, cfg.seed, task)


def _from_experiment(name: str, overrides: list[str], profile: str | None, steps: int) -> Patient:
    from mpt import config, registry

    args = ([f"profile={profile}"] if profile else []) + overrides
    cfg = config.resolve(name, args)
    label = f"experiment:{name} ({cfg.model}, profile {cfg.profile})"
    return _from_task(registry.get_experiment(name).task(cfg), label, steps)

