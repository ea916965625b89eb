#!/usr/bin/env bash
# Quick start: create .venv if missing, install flashcp, run the main job on CPU
# (a 2-process context-parallel FlashMask attention run over gloo, checked against one process).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Paddle warns about ccache (only relevant to building custom C++ ops) in every process.
export PYTHONWARNINGS="ignore:No ccache found"
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($PY --version 2>&1)"
  "$PY" -m venv .venv
else
  echo "== reusing .venv"
fi
echo "== installing flashcp (CPU paddlepaddle from PyPI)"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e . 2>&1 \
  | { grep -v -E "^WARNING: Location|^\s*$" || true; }
echo "== which FlashAttention version this machine would run"
.venv/bin/flashcp explain-dispatch --head-dim 64
echo "== 2-process CP run (python -m paddle.distributed.launch --nproc_per_node 2 src/flashcp/smoke.py)"
LOG_DIR=$(mktemp -d)
OMP_NUM_THREADS=1 .venv/bin/python -m paddle.distributed.launch --nproc_per_node 2 --log_level WARNING \
  --log_dir "$LOG_DIR" src/flashcp/smoke.py
echo "== done: worker logs in $LOG_DIR"
