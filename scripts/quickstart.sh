#!/usr/bin/env bash
# Quick start: create .venv if missing, install flashcp, run the main job on CPU: a 2-process
# context-parallel training run of a tiny GPT over gloo (dual-chunk CP FlashMask attention).
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
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[cpu]" 2>&1 \
  | { grep -v -E "^WARNING: Location|^\s*$" || true; }
echo "== which FlashAttention version this machine would run"
.venv/bin/flashcp explain-dispatch --head-dim 64
RUN_DIR=${RUN_DIR:-runs/quickstart}
echo "== 2-process context-parallel training of a tiny GPT on CPU (configs/gpt/tiny_cp2.yaml)"
echo "   = python -m paddle.distributed.launch --nproc_per_node 2 src/flashcp/train.py --config ..."
.venv/bin/flashcp train configs/gpt/tiny_cp2.yaml run.output_dir="$RUN_DIR" checkpoint.resume=never
.venv/bin/flashcp plot "$RUN_DIR"
echo "== done: metrics in $RUN_DIR/metrics.jsonl, curves in $RUN_DIR (PNG), logs in $RUN_DIR/logs"
