"""Experiment grids on a SLURM cluster (submitit job arrays) or on this machine.

    python -m slurm.submit experiments/<name>/grid.yaml --profile tiny|paper --backend slurm|local
    python -m slurm.status experiments/<name>/grid.yaml --profile tiny|paper

Everything cluster-specific (partition, account, GPUs per node, time limit, ...) lives in
slurm/clusters/<name>.yaml; grids (experiments/<name>/grid.yaml) say only what each run needs.
See slurm/README.md.
"""
