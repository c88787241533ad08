"""Can my model train in FP16, and how? `python -m mpt.doctor TARGET` measures it on the user's own model.

TARGET is one of:
  module:function    function() returns (model, loss, batches) or (model, loss, batches, optimizer), or a
                     dict with those keys: `loss(model, batch)` gives the mean loss (or (mean loss, items),
                     as Task.loss), `batches` is a list of batches (tensors, or tuples/dicts of tensors),
                     `optimizer(model)` builds the optimizer (default: SGD, lr 0.01, momentum 0.9);
                     mpt/doctor/examples.py has six. An error raised in the loss is one line naming the
                     user's file and line.
  module:TaskClass   a subclass of mpt.task.Task (its datasets, model, optimizer and loss under the
                     default Config); a function returning a Task instance works too.
  experiment:NAME    one of this repository's experiments, with --profile and key=value overrides as a run
                     takes them (its data must be prepared).

What it does, through the one recipe and step code every run uses (mpt.precision, mpt.step.TrainStep):
  1. trains a copy of the model for --steps steps in FP32 with every measurement on (mpt.numerics:
     gradient exponent histograms per layer, section 3.1's swamping; probes.ValueRanges for the forward pass;
     mpt.memory.ActivationMeter for the bytes saved for backward);
  2. replays the same steps from the same weights and random stream in FP16 without loss scaling
     (precision=fp16, S = 1), watching for the first operation that makes inf/nan (trace.first_overflow);
  3. decides a verdict from the measurements: fp16 as it is, fp16 + a static S (which), fp16 + dynamic S,
     or bf16 / layers kept in FP32 -- and replays the same steps once more in the recipe it recommends,
     so the verdict says whether that recipe then trains (skipped steps, progress against FP32);
  4. rounds one FP32 pass's values to every format (whatif.py: the FP16/BF16 elements, and every simulated
     precision through its recipe's own quantisers) and, with --keep-wide PRECISION, finds the smallest set of
     modules to compute wide for that precision to train, each set checked by a replay; with --formats, the
     narrowest simulated format that trains as FP32 does (narrowest.py), its answer a replay too.
It prints a one-screen report and writes report.md, report.json and histograms.png (--out).

"Progress" is how far a replay got, as a share of how far FP32 got: its mean loss over the last quarter of the
steps against the untrained model's and FP32's on the same batches, (untrained - it) / (untrained - FP32);
100% = learned as FP32 did, 0 = did not learn. It is not judged (the report says so) when FP32 itself lowered that
loss by less than 1% of how much its own loss moves over the steps (max - min: a constant added to the loss changes
nothing), or by less than 2^-13 of the loss: two numbers within the noise make no ratio.
Where FP32's own loss climbed (replay.diverges) the examination stops there with one line: no verdict.

The package, in the order of an examination:
  targets.py      TARGET -> a Patient (the model, its loss, batches and optimizer)
  replay.py       train(): the patient's steps under one precision, measured
  verdict.py      measurements -> findings, the recipe to use, and whether its replay confirms it
  examination.py  examine(): the replays and the verdict in order -> the report as a dict (report.json)
  whatif.py       one FP32 pass rounded to every format: shares flushed and overflowed, SQNR, a verdict each
  keep_wide.py    the smallest set of modules kept wide, promoted greedily, each set replayed
  narrowest.py    the narrowest simulated format that trains as FP32 does (--formats)
  report.py       the one-screen text, report.md, report.json and histograms.png
  __main__.py     the command line
  examples.py     toys whose answers are known (the tests' and the README's patients)
  probes.py       ValueRanges: where forward activations and weights fall in FP16's range, per layer
  trace.py        every operation of a step with the module running it: the first-inf finder of the FP16 replay
                  (first_overflow) and of watch()
  watch.py        watch(model, every=10, ...): a user's own training loop watched (the first non-finite value's
                  producer, each module's run-up, setup mistakes); not part of an examination
  module_sample.py  watch()'s module-level sample (the min and max of each module's values and gradients)
  setup_checks.py   watch()'s checks of the loop's setup (loss scaling, the schedule, checkpoints)
"""
from mpt.doctor.watch import watch  # noqa: F401 -- `with mpt.doctor.watch(model) as w:`
