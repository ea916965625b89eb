#!/usr/bin/env bash
# The test command (README, .ci/run): venv, install with test extras, lint, unit + integration
# tests under coverage (worker processes included), then the equivalence and golden tests
# (marker `equivalence`) a second time under another CPU's math kernels (MATH_ENV below), then
# the coverage gates.
#
#   bash scripts/test.sh              # everything (what CI runs)
#   bash scripts/test.sh unit         # unit tests only (parallel, xdist)
#   bash scripts/test.sh integration  # multi-process gloo jobs only
#   bash scripts/test.sh gpu          # gpu-marked tests (skip with a reason without a GPU)
#   bash scripts/test.sh hf           # transformers' own GLM models as the reference (torch)
#   bash scripts/test.sh mutation [PATH ...]  # mutmut on the changed modules (scripts/mutation.py)
#
# The hf tier (marker `hf`, tests/hf) needs PyTorch: it is installed on first use into
# .venv/hf-torch (pip --target, torch without its CUDA extras plus sympy/mpmath, ~0.9 GB) and
# put on PYTHONPATH for that pytest run only, so the other tiers never import torch. `all` (CI)
# runs it as a third pass; FLASHCP_TORCH_SPEC picks another torch (default torch==2.13.0, which
# on this machine kind is a local CPU wheel; from PyPI on x86-64 it is a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TIER=${1:-all}
case "$TIER" in all | unit | integration | gpu | hf | mutation) ;; *)
  echo "usage: bash scripts/test.sh [all|unit|integration|gpu|hf|mutation [PATH ...]]" >&2
  exit 2
  ;;
esac

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv with $($PY --version 2>&1)"
  "$PY" -m venv .venv
fi
VPY=$ROOT/.venv/bin/python
echo "== installing flashcp with CPU paddlepaddle and the test extras"
"$VPY" -m pip install --quiet --disable-pip-version-check -e ".[cpu,test]" 2>&1 \
  | { grep -v -E "^WARNING: Location|^\s*$" || true; }
# The stamp scripts/quickstart.sh checks: this install covers its own (no reinstall needed).
"$VPY" -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())' \
  >.venv/flashcp-install.sha256

if [ "$TIER" = mutation ]; then  # not CI: mutmut into .venv/mutmut, each module against its tests
  shift
  exec "$VPY" scripts/mutation.py "$@"
fi

echo "== ruff"
"$VPY" -m ruff check src tests scripts

export OMP_NUM_THREADS=1
export PYTHONHASHSEED=0
# Another x86-64 host's kernels, as this machine can emulate them (measured with
# scripts/math_isa_probe.py, docs/portability.md): MKL's AVX2 path (MKL 2019 in the Paddle wheel
# takes it on AMD only when told) and OpenBLAS's Haswell kernels for numpy. Both change float32
# results here; the equivalence and golden tests must pass under either set of kernels.
MATH_ENV=(MKL_DEBUG_CPU_TYPE=5 OPENBLAS_CORETYPE=Haswell)
export COVERAGE_FILE=$ROOT/.coverage
rm -f .coverage .coverage.* coverage.xml

TORCH_DIR=$ROOT/.venv/hf-torch
TORCH_SPEC=${FLASHCP_TORCH_SPEC:-torch==2.13.0}
install_torch() {
  local stamp="$TORCH_DIR/.flashcp-installed"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$TORCH_SPEC" ]; then
    echo "== installing $TORCH_SPEC into $TORCH_DIR (hf tier only)"
    rm -rf "$TORCH_DIR"
    "$VPY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$TORCH_DIR" \
      "$TORCH_SPEC" sympy==1.14.0 mpmath==1.3.0 2>&1 | { grep -v -E "^WARNING: Location|^\s*$" || true; }
    echo "$TORCH_SPEC" >"$stamp"
  fi
}

HF_SEL=(tests/hf -m hf)
case "$TIER" in
  unit)
    SEL=(tests/unit -m "not integration and not gpu and not hf")
    SEL2=(tests/unit -m "equivalence and not integration and not gpu and not hf")
    ;;
  integration)
    SEL=(tests/integration -m "integration and not hf")
    SEL2=(tests/integration -m "equivalence and integration and not hf")
    ;;
  gpu) SEL=(tests -m gpu) SEL2=() ;;
  hf) SEL=() SEL2=() ;;
  all) SEL=(tests -m "not gpu and not hf") SEL2=(tests -m "equivalence and not gpu and not hf") ;;
esac

LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
run_hf() {  # the hf tier: torch on PYTHONPATH for this pytest alone; sets hf_summary
  install_torch
  echo "== pytest ${HF_SEL[*]} (torch from $TORCH_DIR)"
  set +e
  PYTHONPATH="$TORCH_DIR${PYTHONPATH:+:$PYTHONPATH}" "$VPY" -m coverage run -m pytest \
    "${HF_SEL[@]}" -n 0 -p no:cacheprovider 2>&1 | tee "$LOG"
  local hf_status=${PIPESTATUS[0]}
  set -e
  hf_summary=$(grep -E "^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s" "$LOG" | tail -n 1)
  if [ "$hf_status" -ne 0 ]; then  # 5 (nothing collected) fails too: the tier must run
    echo "hf tier FAILED: $hf_summary" >&2
    exit "$hf_status"
  fi
}

if [ "$TIER" = hf ]; then
  run_hf
  echo "$hf_summary"
  exit 0
fi

echo "== pytest ${SEL[*]}"
set +e
# -n 2: the integration tests in two xdist lanes, each lane's multi-process jobs one after
# another on its worker, the unit tests filling in (see tests/conftest.py). --durations: the
# slowest 25 in the log, to keep the run inside its time budget.
"$VPY" -m coverage run -m pytest "${SEL[@]}" -n 2 --dist loadgroup -p no:cacheprovider --durations=25 \
  2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
summary=$(grep -E "^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s" "$LOG" | tail -n 1)
if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
  exit "$status"
fi
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests for tier '$TIER'" >&2
  exit 5
fi

summary2=""
if [ ${#SEL2[@]} -gt 0 ]; then
  echo "== pytest ${SEL2[*]} again under ${MATH_ENV[*]} (another CPU's kernels)"
  set +e
  env "${MATH_ENV[@]}" "$VPY" -m pytest "${SEL2[@]}" -n 2 --dist loadgroup -p no:cacheprovider \
    2>&1 | tee "$LOG"
  status=${PIPESTATUS[0]}
  set -e
  summary2=$(grep -E "^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s" "$LOG" | tail -n 1)
  if [ "$status" -ne 0 ]; then  # the failing pass's pytest summary stays the last line
    echo "main run: $summary"
    echo "second pass under ${MATH_ENV[*]} FAILED:"
    echo "$summary2"
    exit "$status"
  fi
  summary2="second pass under ${MATH_ENV[*]}: ${summary2//=/}"
  summary2=$(echo "$summary2" | tr -s ' ' | sed -e 's/ *$//')
fi

hf_summary=""
if [ "$TIER" = all ]; then
  run_hf
  hf_summary="hf tier (transformers reference): ${hf_summary//=/}"
  hf_summary=$(echo "$hf_summary" | tr -s ' ' | sed -e 's/ *$//')
fi

gate_fail=()
if [ "$TIER" = all ]; then
  echo "== coverage (workers included)"
  "$VPY" -m coverage combine --quiet
  "$VPY" -m coverage xml --quiet -o coverage.xml
  "$VPY" -m coverage report --skip-covered --sort=cover | tail -n 25
  echo "== gate 1: src/flashcp/fa_dispatch.py at 100% line and branch coverage"
  "$VPY" -m coverage report --include="*/flashcp/fa_dispatch.py" --fail-under=100 \
    || gate_fail+=("fa_dispatch.py below 100% line+branch coverage")
  TOTAL_MIN=$(cat scripts/coverage_min.txt)
  echo "== gate 2: project total >= ${TOTAL_MIN}%"
  "$VPY" -m coverage report --fail-under="$TOTAL_MIN" >/dev/null \
    || gate_fail+=("project coverage below ${TOTAL_MIN}% ($("$VPY" -m coverage report --format=total)%)")
  echo "== gate 3: patch coverage >= 90% (diff-cover against the merge base)"
  BASE_REF=${DIFF_COVER_BASE:-origin/main}
  if base=$(git merge-base HEAD "$BASE_REF" 2>/dev/null) && [ -n "$base" ]; then
    "$ROOT/.venv/bin/diff-cover" coverage.xml --compare-branch="$base" --fail-under=90 \
      || gate_fail+=("patch coverage below 90% against $BASE_REF ($base)")
  else
    echo "no merge base with $BASE_REF (fresh clone or no remote): patch gate skipped"
  fi
fi

if [ ${#gate_fail[@]} -gt 0 ]; then
  [ -z "$hf_summary" ] || echo "$hf_summary"
  [ -z "$summary2" ] || echo "$summary2"
  echo "$summary"
  for g in "${gate_fail[@]}"; do echo "GATE FAILED: $g"; done
  exit 1
fi
[ -z "$hf_summary" ] || echo "$hf_summary"
[ -z "$summary2" ] || echo "$summary2"
echo "$summary"
