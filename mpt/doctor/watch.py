"""Watch a real training loop: a few lines in the user's own loop, where the replays of `python -m mpt.doctor`
cannot go (their own data pipeline, schedule, checkpointing)::

    with mpt.doctor.watch(model, every=10, optimizer=opt, scaler=scaler, scheduler=sched) as w:
        for i, batch in enumerate(loader):
            with torch.autocast("cuda", torch.float16):
                loss = loss_fn(model, batch)
            scaler.scale(loss).backward()
            scaler.step(opt); scaler.update(); sched.step(); opt.zero_grad()
            w.step(loss)                      # after the optimizer step: ends this step
            if i % 1000 == 0:
                ckpt = {...}; w.check_checkpoint(ckpt); torch.save(ckpt, path)
    print("\\n".join(w.report()))

Every `every`-th step is sampled at module granularity: hooks take the min and max of each module's inputs and
outputs as the forward pass makes them, and of the gradients of its outputs and inputs as the backward pass makes
them (its weights' as each backward ends, placed where its backward began), on the device, in execution order; at
w.step() the sample is stacked and read in one host transfer. Every `trace_every`-th step (from step 0), and on the
steps after a non-finite value, every operation of forward and backward is recorded instead, seen by a dispatch
mode (about twice a step's time, paid only then).
The steps between cost one detached reference to the loss, kept until the next sample, which checks them all at
once on the device (non-finite when a loss since the last sample was).
From the samples:
  - the run-up of each module's largest |value| (forward; gradients as the loop holds them, x S);
  - the first non-finite value: the first record in execution order that holds inf/nan -- everything recorded
    before it was finite, so its module made it (an output, a module's own gradients) or the code between
    modules did (an input; the gradient arriving at an output: the parent's own code, the loss) -- not a module
    that passed it on. The operation that made it is then traced on the next steps; a trace also names a value
    that overflows inside a module whose output stays finite (a sum of squares in a norm), which no
    module-level record shows. Weights already non-finite cannot be traced (a GradScaler keeps them finite by
    skipping the update);
  - a non-finite loss or a skipped update between samples makes the next steps traced until it is seen;
  - setup mistakes (one line each, said once: mpt.doctor.setup_checks).
The module-level sample is mpt.doctor.module_sample's, the trace mpt.doctor.trace's (the examination's replay
finds its first overflow with the same tracer).
"""
from __future__ import annotations

import collections
import math
import sys
from typing import Callable

import torch
import torch.nn as nn

from mpt.bands import hook_targets
from mpt.doctor.module_sample import ModuleSample
from mpt.doctor.setup_checks import SETUP, SetupChecks
from mpt.doctor.trace import OUTSIDE, Slots, Trace, module_labels
from mpt.errors import UserError
from mpt.torch_private import scaler_scale_tensor

RUN_UP = 8  # samples of each module's largest |value| kept


class Watch:
    """The watch on a user's loop (module docstring). `log` gets each finding's line once (default: stderr)."""

    def __init__(self, model: nn.Module, every: int = 10, optimizer: torch.optim.Optimizer | None = None,
                 scaler=None, scheduler=None, log: Callable[[str], None] | None = None, trace_every: int | None = None):
        if not isinstance(model, nn.Module):
            raise UserError(f"watch(model=...): got a {type(model).__name__}; give the torch.nn.Module you train")
        if int(every) != every or every < 1:
            raise UserError(f"watch(every={every}): sample every k >= 1 steps (10 costs a few % of step time)")
        if trace_every is not None and (int(trace_every) != trace_every or trace_every < 1):
            raise UserError(f"watch(trace_every={trace_every}): trace every k >= 1 steps (default 10 x every)")
        if scaler is not None and not hasattr(scaler, "is_enabled"):
            raise UserError(f"watch(scaler=...): got a {type(scaler).__name__}; give the torch.amp.GradScaler")
        self.model, self.every = model, int(every)
        # Every operation traced (about twice a step's time) this often, from step 0: what overflows inside a
        # module whose output stays finite shows only there.
        self.trace_every = int(trace_every or 10 * self.every)
        self.optimizer, self.scaler, self.scheduler = optimizer, scaler, scheduler
        self.log = log or (lambda line: print(f"mpt.doctor.watch: {line}", file=sys.stderr))
        self.step_count = 0  # steps ended by step()
        self.first: dict | None = None  # the first non-finite value: step, module, phase, op
        self.findings: dict[str, str] = {}  # kind -> its line (each kind once)
        self.run_up: dict[str, collections.deque] = {}  # module -> (step, fwd max, bwd max) of recent samples
        # The run-up as it stood at the first non-finite value: the samples after it (chased, traced, all
        # nan once the weights are) would push the ones that lead to it out of `run_up`.
        self.run_up_to_first: dict[str, list] = {}
        self.samples = 0  # sampled steps, traced ones included
        self.traced = 0
        self._names = module_labels(model)
        self._rec: Trace | ModuleSample | None = None  # this step's sample, when it is one
        self._slots = Slots()  # where each sample and trace writes its min and max values
        self._wslots = Slots()  # and the weights' as the sampled step begins (gathered there)
        # Leaf modules and those owning weights (mpt.bands.hook_targets): a container's input and output
        # are its first and last child's.
        self._plan = [(m, self._names[m], next(m.children(), None) is None, bool(getattr(m, "inplace", False)),
                       [p for p in m.parameters(recurse=False) if p.requires_grad]) for _, m in hook_targets(model)]
        self._params = [(self._names[_owner(model, n)], p) for n, p in model.named_parameters() if p.numel()]
        # The min and max of each weight as the sampled step began, stacked (None: not taken)
        self._weights: torch.Tensor | None = None
        self._parent = {self._names[m]: self._names[model.get_submodule(n.rpartition(".")[0])]
                        for n, m in model.named_modules() if n}
        # The losses since the last sample, detached (views of the loop's own, no copies), checked all at once as the
        # next sample is read. No arithmetic a step: right after a training step each small op took 10-30x its
        # usual time on a CPU (cold caches, no page faults counted): a flag of five ops (detach, isfinite, all,
        # not, or) cost ~0.14 ms a step there, an in-place add into a float64 sum ~40 us, a detach ~10 us.
        self._losses: list[torch.Tensor] = []
        self._copy_losses = False  # the loop rewrites one loss tensor in place: copy each (_add_loss)
        self._chase = 0  # steps left to sample one after another, chasing a non-finite value seen between samples
        self._chase_from = 0  # the first step that could have made it
        # Inside the `with` block: only there are the hooks (or a trace's dispatch mode) that step() places taken
        # away again by __exit__ -- a recording begun outside it would stay on the model and slow every later step.
        self._entered = False
        self.setup = SetupChecks(optimizer, scaler, scheduler, self._find)

    @property
    def recording(self) -> str | None:
        """What the next step records, as the step before decided: "traced", "sampled", or None."""
        return "traced" if isinstance(self._rec, Trace) else "sampled" if self._rec is not None else None

    # -- the user's calls ----------------------------------------------------------------------------------
    def __enter__(self) -> "Watch":
        if self._entered:
            raise UserError("watch(...) entered twice: use one `with mpt.doctor.watch(...) as w:` block around the loop")
        self._entered = True
        self.setup.attach()
        self._begin()
        return self

    def __exit__(self, *exc) -> None:
        self._stop()
        self._rec = None
        self.setup.detach()
        self._entered = False

    def step(self, loss: torch.Tensor | None = None) -> None:
        """End the step (call it last in the iteration, after the optimizer's and the scheduler's step): read
        the sample if this step was one, check the setup, and start the next step's sample when it is due.
        `loss`: the step's loss, watched for inf/nan between samples (on the device: no host read)."""
        if not self._entered:
            raise UserError("w.step() outside the watch's `with` block: call it inside "
                            "`with mpt.doctor.watch(model, ...) as w:` (the block takes the watch's hooks away at its end)")
        if isinstance(loss, torch.Tensor) and loss.is_floating_point():
            self._add_loss(loss)
        stepped = self.setup.updated(self.step_count)
        if self._rec is not None:
            self._read()
        elif self.optimizer is not None and self.scaler is not None and not stepped and self.first is None \
                and self.setup.opt_steps > 0:
            self._start_chase(self.step_count)  # the scaler skipped an update between samples: find what overflowed
        self.setup.step_ended(self.step_count, stepped)
        self.step_count += 1
        self._begin()

    def _add_loss(self, loss: torch.Tensor) -> None:
        held = self._losses
        if not self._copy_losses and held and held[-1].data_ptr() == loss.data_ptr() and loss.numel():
            # One tensor rewritten in place step after step (a CUDA graph's static output): a view would show only
            # its last value, so each loss is copied from here on (the one it rewrote is not seen).
            self._copy_losses = True
        # (detached: a loss held with its graph would keep the graph's nodes alive)
        held.append(loss.detach().clone() if self._copy_losses else loss.detach())

    def _loss_flag(self) -> torch.Tensor:
        """Whether a loss since the last sample was non-finite (a 0-dim bool, on the losses' device); lets them go."""
        losses, self._losses = self._losses, []
        if not losses:  # (no loss given since the last sample)
            return torch.zeros((), dtype=torch.bool)
        first = losses[0]
        if all(x.shape == first.shape and x.dtype == first.dtype and x.device == first.device for x in losses):
            return ~torch.isfinite(torch.stack(losses)).all()  # (the common case: one scalar a step)
        return ~torch.stack([torch.isfinite(x).all().to(first.device) for x in losses]).all()

    def check_checkpoint(self, checkpoint: dict) -> bool:
        """Does the dict the loop saves hold the GradScaler's state? Without it a resumed run restarts S at
        init_scale and skips steps while it backs off again (dynamic) or loses the scale it found. Returns
        True when it is there (or there is no enabled scaler)."""
        return self.setup.check_checkpoint(checkpoint)

    def report(self) -> list[str]:
        """The findings, the first non-finite value with its module's run-up, and the modules with the largest
        values, as lines."""
        out = [f"watched {self.step_count} steps, {self.samples} sampled (every {self.every}), {self.traced} of them "
               f"traced; largest |value| per module, gradients as the loop holds them (x the loss scale)"]
        if self.scaler is not None and self.scaler.is_enabled() and self.step_count:
            now = float(self.scaler.get_scale())
            if now <= 1.0 and self.setup.fell(now):  # the counts as the loop ended (and a fall after the last sample)
                self.findings["scale_fell"] = self.setup.fell(now, self.step_count)
        out += [f"{'SETUP' if kind in SETUP else 'NOTE'}: {line}" for kind, line in self.findings.items()]
        run_up = self.run_up
        if self.first:
            out.append(f"FIRST NON-FINITE: {_event(self.first)}")
            run_up = self.run_up_to_first  # the samples before it: what led there
            out.append(f"  its run-up: {self._run_up_line(self.first['module'], run_up)}")
        top = sorted(run_up, key=lambda m: -max((max(f, b) for _, f, b in run_up[m]), default=0.0))[:3]
        for m in top:
            out.append(f"  largest |value| in {m}: {self._run_up_line(m, run_up)}")
        return out

    # -- sampling ------------------------------------------------------------------------------------------
    def _begin(self) -> None:
        trace = self._chase or self.step_count % self.trace_every == 0
        if not (trace or self.step_count % self.every == 0):
            return
        self._weights = None
        if not trace:  # (the weights taken as the step's forward begins)
            self._rec = ModuleSample(self._plan, on_start=self._take_weights, slots=self._slots)
            return
        self._take_weights()
        # Tracing: every operation, attributed to the innermost running module (forward and backward).
        self._rec = Trace(self.model, self._names, slots=self._slots)
        self._rec.__enter__()

    def _take_weights(self) -> None:
        # The weights as the step starts: a value made non-finite by an earlier, unsampled step is not
        # blamed on the first operation that reads it.
        # (their min and max: no copy of the weights is made)
        if not self._params:
            return
        # (written into reused pairs, gathered in one indexing: not ~300 0-dim tensors made and stacked)
        record = self._wslots.record
        with torch.no_grad():  # (out= takes a weight there without a detached view of it)
            sid = [record(p) for _, p in self._params]
        self._weights = self._wslots.gather(sid)

    def _stop(self) -> None:
        if isinstance(self._rec, Trace):
            self._rec.__exit__(None, None, None)
        elif self._rec is not None:
            self._rec.close()

    def _read(self) -> None:
        rec = self._rec
        self._stop()
        self._rec = None
        self.samples += 1
        traced = isinstance(rec, Trace)
        self.traced += traced
        weights, values, tail = self._transfer(rec)
        step = self.step_count
        bad_loss = bool(tail[0])
        per: dict[str, list[float]] = {}
        for (module, phase, what), v in zip(rec.names, values):
            if module != OUTSIDE and what != "input":
                fb = per.get(module)
                if fb is None:
                    fb = per[module] = [0.0, 0.0]
                i = phase == "backward"
                if v != v or (v > fb[i] and fb[i] == fb[i]):  # the larger; nan (v != v) wins, and inf
                    fb[i] = v
        for module, (f, b) in per.items():
            self.run_up.setdefault(module, collections.deque(maxlen=RUN_UP)).append((step, f, b))
        bad_w = next((name for (name, _), v in zip(self._params, weights) if not math.isfinite(v)), None)
        i = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        bad = None if i is None else (rec.names[self._first_of(rec, i)], values[i])
        self._look(step, traced, bad_w, bad, bad_loss)
        if rec.fp16:
            self.setup.check_fp16(step, tail[1] if len(tail) > 1 else None)

    def _transfer(self, rec) -> tuple[list[float], list[float], list[float]]:
        """The sample on the host: the largest |value| of each weight as the step began and of each record, then
        whether a loss since the last sample was non-finite, and the GradScaler's scale."""
        extra = [self._loss_flag()]
        if self.scaler is not None and self.scaler.is_enabled():
            scale = scaler_scale_tensor(self.scaler)
            extra.append(scale if scale is not None else torch.ones(()))
        # max |x| of each record from its min and max, on the device (nan wins), then one host transfer.
        w = self._weights
        dev = (rec.values or [w if w is not None else torch.zeros(())])[0].device
        f32 = torch.float32
        # (the values come gathered into one tensor)
        mm = torch.cat([v if v.dtype == f32 and v.device == dev else v.to(dev, f32)
                        for v in rec.values]).view(-1, 2) if rec.values else None
        wm = w.to(dev, f32).view(-1, 2) if w is not None else None
        parts = [torch.maximum(-wm[:, 0], wm[:, 1]) if wm is not None else None,
                 torch.maximum(-mm[:, 0], mm[:, 1]) if mm is not None else None,
                 torch.stack([t.to(dev, torch.float32) for t in extra])]
        flat = torch.cat([x for x in parts if x is not None]).tolist()  # the one host transfer
        nw, no = len(self._params) if w is not None else 0, len(rec.names)
        return flat[:nw], flat[nw:nw + no], flat[nw + no:]

    def _look(self, step: int, traced: bool, bad_w: str | None, bad: tuple | None, bad_loss: bool) -> None:
        """What the sample says of the first non-finite value: it is found, named by a trace, or chased."""
        if self.first is None:
            if bad_w is not None:
                self._event({"step": step, "module": bad_w, "phase": "before the step", "what": "its weights",
                             "value": "non-finite"})
            elif bad is not None:
                (module, phase, what), v = bad
                e = {"step": step, "value": "nan" if math.isnan(v) else "inf"}
                self._event({**e, "module": module, "phase": phase, "op": what} if traced else
                            {**e, "what": what, **self._producer(module, phase, what)})
            elif traced and self._chase:
                self._countdown(step, f"at step {self._chase_from}" if self._chase_from == step - self.every else
                                f"between steps {self._chase_from} and {step - self.every}")
            elif bad_loss and not self._chase:
                self._start_chase(step - self.every + 1)  # a non-finite loss since the last sample
        elif traced and self._chase:  # naming the operation behind a value first seen at module level
            if bad_w is not None:
                self._chase = 0
                self._find("untraced", f"the operation behind step {self.first['step']}'s non-finite value cannot "
                                       f"be traced: the update made the weights non-finite (a GradScaler skips it)")
            elif bad is not None:
                (module, phase, op), v = bad
                self._event({"step": step, "value": "nan" if math.isnan(v) else "inf", "module": module,
                             "phase": phase, "op": op})
            else:
                self._countdown(step, f"at step {self.first['step']}")

    @staticmethod
    def _first_of(rec, i: int) -> int:
        """The record that names the producer among those of one gradient tensor: a tensor that is one module's
        input and another's output gets both records at once, the output's first; its maker is the module whose
        input gradient it is (the deepest such)."""
        gid = getattr(rec, "grads", None) and rec.grads[i]
        if gid is None:
            return i
        same = [i]
        while same[-1] + 1 < len(rec.grads) and rec.grads[same[-1] + 1] == gid:  # its hooks fire together
            same.append(same[-1] + 1)
        made = [j for j in same if rec.names[j][2] == "input gradient"]
        return max(made, key=lambda j: rec.names[j][0].count(".")) if made else i

    def _producer(self, module: str, phase: str, what: str) -> dict:
        """Who made the first non-finite record of a module-level sample: the module itself (its output, its own
        gradients), or the operations between modules (an input: its parent's own code or the batch; the
        gradient arriving at an output: the parent's own code or the loss)."""
        if what in ("output", "input gradient", "weight gradient"):
            return {"module": module, "phase": phase}
        parent = self._parent.get(module)
        return {"module": parent or OUTSIDE, "phase": phase, "between": module}

    def _countdown(self, step: int, when: str) -> None:
        self._chase -= 1
        if not self._chase:
            self._find("one_off", f"a non-finite value {when}, not made again in the {self.every} steps after it, "
                                  f"all traced: a one-off (a batch? the loss?)")

    def _start_chase(self, since: int) -> None:
        self._chase, self._chase_from = self.every, max(0, since)

    def _event(self, e: dict) -> None:
        if "op" in e and self.first is not None:  # the trace of a value first seen at module level
            self.first["traced"] = e
            self._chase = 0
            self.log(f"traced: {_traced(e)}")
            return
        self.first = e
        self.run_up_to_first = {m: [r for r in rows if r[0] < e["step"]] for m, rows in self.run_up.items()}
        if e["phase"] == "backward" and self.scaler is not None and self.scaler.is_enabled():
            e["note"] = "the GradScaler skips such a step and lowers S: expected while it finds its scale"
        self.log(f"first non-finite value: {_event(e)}")
        # Name the operation: trace the next steps (a module whose output stays finite hides it at module level).
        self._chase = self.every if e["phase"] != "before the step" and "op" not in e else 0

    def _run_up_line(self, module: str, run_up: dict) -> str:
        rows = list(run_up.get(module, ()))[-4:]
        if rows or not self.first:
            return ", ".join(f"step {s} fwd {f:.3g} bwd {b:.3g}" for s, f, b in rows) or "not sampled"
        return f"not sampled before step {self.first['step']}"

    def _find(self, kind: str, line: str) -> None:
        if kind not in self.findings:
            self.findings[kind] = line
            self.log(line)


def _event(e: dict) -> str:
    if e["phase"] == "before the step":
        return (f"the weights of {e['module']} were already non-finite as step {e['step']} began (made in a step "
                f"between samples: lower every=, or use a GradScaler, which keeps them finite)")
    note = f" ({e['note']})" if e.get("note") else ""
    if "op" in e:
        return _traced(e) + note
    where = (f"in {e['module']}'s own operations between its modules, reaching {e['between']}'s {e['what']}"
             if "between" in e else f"in {e['module']} (its {e['what']})")
    return f"{e['value']} made {where}, {e['phase']}, step {e['step']}{note}" + (
        f"; traced: {_traced(e['traced'])}" if e.get("traced") else "")


def _traced(e: dict) -> str:
    return f"{e['value']} made by {e['op']} in {e['module']}, {e['phase']}, step {e['step']}"


def _owner(model: nn.Module, pname: str) -> nn.Module:
    return model.get_submodule(pname.rpartition(".")[0])


def watch(model: nn.Module, every: int = 10, optimizer=None, scaler=None, scheduler=None, log=None,
          trace_every: int | None = None) -> Watch:
    """`with mpt.doctor.watch(model, every=10, optimizer=opt, scaler=scaler, scheduler=sched) as w:` ... w.step()
    in the loop (module docstring)."""
    return Watch(model, every, optimizer, scaler, scheduler, log, trace_every)
