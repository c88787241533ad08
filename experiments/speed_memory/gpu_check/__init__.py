"""The first GPU call in one command: what a GPU tells us that the CPU cannot, in one call of at
most 6 minutes on one H100 or H200 (a time-limited GPU job: the machine's start and a rerun must fit beside it),
into one results file.

    python -m experiments.speed_memory.gpu_check [--out DIR] [--parts a,b] [--budget 360]
    python -m experiments.speed_memory.gpu_check --cpu-smoke [--out DIR]   # the same steps, tiny, on the CPU

--out defaults to $OUT when that variable is set (a remote runner that returns only that folder), else
experiments/speed_memory/results.

A call reads the device, then runs its parts, most valuable first, each in its own process with its own
time limit (a failure is recorded and the others run): headline (ResNet-50 at batch 256 in every
precision and layout), e2e and ssd_e2e (training from JPEG files), resume, ds2_worst, cifar, models (every
Table 1 and Table 3 model), ddp (two GPUs). parts.py says what each measures.

Writes <out>/<device>-<date>-gpu_check.json (cpu-<date>-gpu_check-smoke.json for --cpu-smoke), atomically,
while every part runs (its finished rows every few seconds) and after it: a part killed at its limit,
a SIGINT/SIGTERM, even a SIGKILL of the whole call keeps what was finished. Prints a summary table.
Exit status 1 if any part failed, 2 on bad command-line input, 130 when interrupted.
Imports nothing beyond torch, torchvision, numpy and yaml (a GPU image may lack wandb, submitit, soundfile).

Modules: parts.py (the parts and the sizes they run at), data.py (the data they write), runner.py (a
part's process, the call's budget and work folder, the results file), report.py (the summary, --report's
tables), cli.py (the command line).
"""
