#!/usr/bin/env bash
# Quick start: create .venv if missing, install flashcp, run the main job on CPU: a 2-process
# context-parallel training run of a tiny GPT over gloo (dual-chunk CP FlashMask attention).
#
#   bash scripts/quickstart.sh                  # 60 steps into runs/quickstart
#   bash scripts/quickstart.sh train.steps=10   # extra key.sub=value overrides for the job
#   RUN_DIR=runs/qs2 bash scripts/quickstart.sh # another run directory
#
# Every run succeeds, also in a checkout that already holds a quickstart run: the job runs with
# run.overwrite=true, so `flashcp train` first moves an earlier run in RUN_DIR aside to
# RUN_DIR.old-<YYYYmmdd-HHMMSS> (printed; nothing is deleted), then trains from scratch.
# The install step is skipped when .venv already has flashcp from this checkout, installed by
# this script or scripts/test.sh from the same pyproject.toml (.venv/flashcp-install.sha256).
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
STAMP=.venv/flashcp-install.sha256
want=$(.venv/bin/python -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
  && .venv/bin/python -c 'import flashcp, os, sys
here = os.path.join(os.path.realpath("src"), "")
sys.exit(not os.path.realpath(flashcp.__file__).startswith(here))' 2>/dev/null; then
  echo "== flashcp is installed in .venv (this checkout, same pyproject.toml): not reinstalling"
else
  echo "== installing flashcp (CPU paddlepaddle from PyPI)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[cpu]" 2>&1 \
    | { grep -v -E "^WARNING: Location|^\s*$" || true; }
  echo "$want" >"$STAMP"
fi
echo "== which FlashAttention version this machine would run"
.venv/bin/flashcp explain-dispatch --head-dim 64
RUN_DIR=${RUN_DIR:-runs/quickstart}
echo "== 2-process context-parallel training of a tiny GPT on CPU (configs/gpt/tiny_cp2.yaml)"
echo "   = python -m paddle.distributed.launch --nproc_per_node 2 src/flashcp/train.py --config ..."
echo "   run directory: $RUN_DIR (an earlier run there is moved aside to $RUN_DIR.old-<time>)"
.venv/bin/flashcp train configs/gpt/tiny_cp2.yaml run.output_dir="$RUN_DIR" \
  checkpoint.resume=never run.overwrite=true "$@"
.venv/bin/flashcp plot "$RUN_DIR"
echo "== done: run directory $RUN_DIR: metrics in $RUN_DIR/metrics.jsonl, curves in" \
  "$RUN_DIR/metrics.png, logs in $RUN_DIR/logs"
