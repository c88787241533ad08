"""The Task contract: what an experiment gives the one training loop (mpt/engine.py).

A new experiment is a subclass of Task. The engine calls these methods and nothing else; every hook
but `datasets`, `build_model` and `loss` has a default, so a subclass writes only what its workload differs
in. Which hook wins is never a question: there is one of each, and a default calls the others.

A task is built once, the same way everywhere (the engine, the benchmark, the doctor, a test):
Task(cfg, facts). Every hook sees the resolved config as self.cfg and what the task reads from its
prepared data -- a class count, an alphabet, a vocabulary -- as self.facts (the task's own frozen
Facts dataclass, from read_facts(cfg) unless given: the benchmark gives ILSVRC12's 1,000 classes
without any data). No hook depends on another having run first.

Lifecycle, in the engine's order (Run.setup), on every rank:
  0. check(cfg)                              when the config is resolved (mpt.config.resolve), before
                                             any run directory exists: --print-config and a grid's
                                             --dry-run refuse a bad task key in one line.
     Task(cfg, facts=None)                   facts None: read_facts(cfg) reads them from the data.
  1. datasets() -> (train, val)              under torch.manual_seed(cfg.seed).
  2. build_model() -> nn.Module              one module, or an nn.ModuleDict of named models (a GAN).
  3. optimizers(model) -> {name: opt}        default: one "main" from cfg.optim over param_groups();
     schedules(optimizers, ...)               default: cfg.sched per optimizer (mpt.optim.SCHEDULES).
  4. per iteration: train_step(ctx, micro)   default: the loss step over self.loss (below);
     measured_loss(model, batch)              numerics.sqnr_every's measurement (default: self.loss).
  5. per evaluation: evaluate(ev)            default: the additive sums of eval_sums over the
                                             validation share of every rank, then eval_metrics.
  6. at a checkpoint: state_dict(), and load_state_dict() at resume (every rank its own).

Data seam: collate(samples) batches samples (default: torch's default_collate), train_order(train,
epoch, generator) orders an epoch of the training set (default None: a seeded random permutation, or
the dataset's order when shuffle_train is False), data_files names the files under task.data_root
that identify the prepared data beside its prepared.json (hashed into cfg.data_fingerprint), and
expected_data(cfg) names the dataset task.data_root must hold (mpt.config.resolve refuses another
experiment's data in one line).

A public method whose name is one or two letters from a hook's (`evalute`) is an error when the
class is defined: it would otherwise never be called, and the default would run silently. So is a
task with neither `loss` nor a train_step of its own (inherited counts).
"""
from __future__ import annotations

import difflib
import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import default_collate

from mpt.optim import build_optimizer, update_factor


class Task:
    primary_metric: str = ""  # key of evaluate()'s metrics that tables show, e.g. "top1"
    higher_is_better: bool = True
    channels_last: bool = False  # an image CNN: NHWC pays on CUDA (config key channels_last=auto)
    shuffle_train: bool = True  # False: samples in dataset order (a language model's streams)
    # The default train_step's forward/backward of one micro-batch has fixed shapes, no host syncs and no
    # data-dependent control flow: train.cuda_graphs may capture it (mpt.graphs)
    graphable: bool = False
    data_files: tuple[str, ...] = ()
    # The prepared data task.data_root must hold: (the "dataset" its prepared.json records, the data_prep
    # module that writes it), e.g. ("celeba", "celeba"); None: not checked (a task without prepared data).
    prepared_data: tuple[str, str] | None = None

    HOOKS = ("check", "read_facts", "datasets", "build_model", "optimizers", "param_groups", "schedules", "train_step", "loss",
             "measured_loss", "evaluate",
             "eval_sums", "eval_metrics", "collate", "train_order", "state_dict", "load_state_dict",
             "expected_data")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, value in vars(cls).items():
            if name in Task.HOOKS and name not in ("check", "read_facts", "expected_data") and callable(value) \
                    and "cfg" in inspect.signature(value).parameters:
                raise TypeError(f"{cls.__qualname__}.{name} takes a cfg argument; hooks read the config as "
                                f"self.cfg (Task(cfg, facts)): drop the argument")
            if name.startswith("_") or name in Task.HOOKS or not callable(value):
                continue
            close = difflib.get_close_matches(name, Task.HOOKS, n=1, cutoff=0.85)
            if close:
                raise TypeError(f"{cls.__qualname__}.{name} looks like a misspelt Task hook {close[0]!r}: "
                                f"rename it (the engine calls {close[0]})")
        # Said here, not at the first step: by then the run directory, the data and the model exist.
        if cls.loss is Task.loss and cls.train_step is Task.train_step:
            raise TypeError(f"{cls.__qualname__} has no loss: define loss(self, model, batch) -> (mean loss, items), "
                            f"or a train_step of its own")

    # -- 0: the config and the facts of the data ------------------------------------------------------
    @classmethod
    def check(cls, cfg) -> None:
        """Refuse a config this task cannot run, with a UserError naming the key and the fix. Only what
        the config alone decides (a choice out of a list, a range); what depends on the data (a class
        count, a vocabulary) is checked where the data is read. Default: nothing to check."""

    @classmethod
    def read_facts(cls, cfg):
        """What the hooks need to know of the prepared data under cfg.task.data_root (a class count, an
        alphabet), as the task's frozen Facts dataclass; read cheaply, before any dataset is opened.
        Default: None (a task whose hooks need nothing of the data)."""
        return None

    def __init__(self, cfg, facts=None):
        self.cfg = cfg
        self.facts = type(self).read_facts(cfg) if facts is None else facts

    # -- 1, 2: data and model (required) ----------------------------------------------------------
    def datasets(self) -> tuple[Any, Any]:
        raise NotImplementedError(f"{type(self).__qualname__} must define datasets() -> (train, val)")

    def build_model(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__qualname__} must define build_model()")

    # -- 3: optimizers ------------------------------------------------------------------------------
    def optimizers(self, model) -> dict:
        """Named optimizers. A task with several (a GAN's generator and discriminator) names each
        after the ModuleDict entry it trains; numerics sampling and DDP follow that naming."""
        return {"main": build_optimizer(self.cfg.optim, self.param_groups(model))}

    def schedules(self, optimizers: dict, steps_per_epoch: int, total_epochs: float) -> dict:
        """One learning-rate scheduler per optimizer (same names), stepped after each applied update and
        checkpointed. Default: cfg.sched through mpt.optim.lr_factor (the open SCHEDULES registry), a
        function of the fractional epoch. A schedule that needs more (the translation reference's decay
        on a training-loss plateau) is a scheduler of the task's own; one with an observe(logs) method is
        handed every iteration's logs by the training step (the task keeps no state for it)."""
        factor = update_factor(self.cfg.sched, steps_per_epoch, total_epochs)
        return {name: torch.optim.lr_scheduler.LambdaLR(opt, factor) for name, opt in optimizers.items()}

    def param_groups(self, model):
        """The default optimizer's parameters (torch param groups with their own settings)."""
        return model.parameters()

    # -- 4: the training step -----------------------------------------------------------------------
    def train_step(self, ctx, micro_batches: list) -> tuple[dict, Any]:
        """One iteration -> (logs: name -> device tensor, holding "loss"; items). Default: forward
        each micro-batch through self.loss under autocast, backward of loss / k, one optimizer step
        (mpt.step.TrainStep.forward_backward). A task with several losses or optimizers writes its own body with
        ctx.autocast, ctx.backward, ctx.sync and ctx.step (mpt.step.StepContext)."""
        return ctx.loss_step(self.loss, micro_batches)

    @property
    def own_step(self) -> bool:
        """Whether this task writes its own train_step (several losses or optimizers): the engine then runs
        it as the step's body; otherwise the step runs the default over self.loss itself."""
        return type(self).train_step is not Task.train_step

    def loss(self, model, batch):
        """(mean loss, items in batch) for the default train_step."""
        raise NotImplementedError(f"{type(self).__qualname__} must define loss(model, batch) or its own train_step")

    def measured_loss(self, model, batch):
        """What numerics.sqnr_every measures on one micro-batch (mpt.numerics.FidelityObserver): the loss
        whose gradients the iteration applies, or {optimizer name: its loss} where several optimizers
        train their own parameters (a GAN). Called twice per measurement, in FP32 and in the run's
        precision (each time under the random state and task state training is in). Default: loss()."""
        return self.loss(model, batch)[0]

    # -- 5: evaluation ------------------------------------------------------------------------------
    def evaluate(self, ev) -> dict[str, float]:
        """Metrics of the model on the validation set. Default: eval_sums over this rank's share,
        summed over ranks (ev.sums), then eval_metrics. A task adds metrics through super()."""
        return self.eval_metrics(ev.sums(self.eval_sums))

    def eval_sums(self, model, batch) -> dict[str, float]:
        raise NotImplementedError(f"{type(self).__qualname__} must define eval_sums and eval_metrics, or evaluate")

    def eval_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        raise NotImplementedError(f"{type(self).__qualname__} must define eval_sums and eval_metrics, or evaluate")

    # -- data seam ----------------------------------------------------------------------------------
    collate = staticmethod(default_collate)  # a plain function: DataLoader workers can pickle it

    @classmethod
    def expected_data(cls, cfg) -> tuple[str, str] | None:
        """(dataset, data_prep module) of the data task.data_root must hold for cfg, read when the
        config is resolved (before any data is opened). Default: prepared_data; a task whose dataset
        depends on the model (DeepSpeech 2: English or Mandarin) overrides it."""
        return cls.prepared_data

    def train_order(self, train, epoch: int, generator):
        """A permutation of the training set `train` (datasets()'s) for this epoch, depending only on
        (train, epoch, generator) so a resumed run sees the same order (SortaGrad's shortest-first
        epoch); None: the default."""
        return None

    # -- 6: state in the checkpoint ---------------------------------------------------------------
    def state_dict(self):
        """This rank's task state for the checkpoint (the bigLSTM's recurrent state); None: none."""
        return None

    def load_state_dict(self, state) -> None:
        pass
