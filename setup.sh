#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with the pinned requirements in .venv, and (as root,
# on Debian/Ubuntu) the system packages the cluster tests and the HTML-report test use:
# slurm-wlm + munge (a real one-node SLURM, slurm/local_cluster.sh), chromium (headless render) and
# espeak-ng (synthesized speech for the tiny LibriSpeech/AISHELL releases), mate-backgrounds (12 nature
# photographs, the real-photograph ImageNet-format set).
# Safe to re-run: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip answers quickly when everything is already installed at the pinned versions.
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt

need=()
command -v sbatch >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v espeak-ng >/dev/null 2>&1 || need+=(espeak-ng)  # tiny speech releases (data_prep/*/tiny.py)
[ -d /usr/share/backgrounds/mate/nature ] || need+=(mate-backgrounds)  # real photographs (data_prep/imagenet/real_photos.py)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "setup: optional system packages missing: ${need[*]} (install them as root for the SLURM, report, speech and real-photograph tests; those tests skip without them)"
  fi
fi
echo "setup: ready (.venv: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
