#!/usr/bin/env bash
# One-shot GPU check for a CUDA machine (H20, H100, ...): install, test, benchmark, one summary.
#
#   bash scripts/gpu_check.sh [WHEEL_FILE_OR_DIR ...]
#   bash scripts/gpu_check.sh --print-deps    # flashcp's non-paddle deps + test extras, then exit
#
# 1. Creates .venv-gpu (separate from the CPU .venv: `paddlepaddle` and `paddlepaddle-gpu` both
#    provide the `paddle` module) and installs into it
#    - paddlepaddle-gpu from the given .whl files and/or directories of wheels (directories are
#      used with `--no-index --find-links DIR`); with no arguments from Paddle's index
#      $PADDLE_GPU_INDEX, version $PADDLE_GPU_VERSION;
#    - flashcp itself (`pip install -e . --no-deps`) and its dependencies and test extras as
#      listed in pyproject.toml, minus `paddlepaddle` (read with tomllib, so the list never
#      drifts from the project's). When directories were given these are looked up there first,
#      then on the package index.
# 2. Checks that Paddle sees a CUDA GPU; exits 3 with "no CUDA GPU: ..." otherwise.
# 3. Prints `flashcp explain-dispatch --head-dim 128`, as configured and with --deterministic.
# 4. Runs `pytest -m gpu tests` with FLAGS_cudnn_deterministic=1.
# 5. Runs `scripts/bench_kernel.py --device gpu --full --head-dim 128`, writing
#    $FLASHCP_GPU_CHECK_OUT/bench_kernel_gpu.{json,md} (never the CPU docs/bench_kernel.*).
# 6. Prints one summary block (install source, GPU, effective fa_version, pytest counts,
#    benchmark speed-ups) and exits non-zero if any step failed.
#
# Environment:
#   PADDLE_GPU_INDEX       wheel index used without arguments
#                          (default https://www.paddlepaddle.org.cn/packages/stable/cu126/)
#   PADDLE_GPU_VERSION     paddlepaddle-gpu version (default 3.3.1 from the index; unpinned
#                          when installing from given directories unless set)
#   PYTHON                 interpreter that creates the venv (default python3, >= 3.10)
#   FLASHCP_GPU_VENV       the venv (default .venv-gpu)
#   FLASHCP_GPU_CHECK_OUT  logs and benchmark results (default build/gpu_check)
#   FLASHCP_GPU_BENCH_ARGS extra bench_kernel.py arguments, split on spaces (e.g. "--repeats 3")
#   FLASHCP_GPU_CHECK_SKIP_INSTALL=1
#                          install nothing; run steps 2-6 with $FLASHCP_GPU_CHECK_PYTHON, else
#                          the venv's python if it exists, else .venv/bin/python. The unit test
#                          uses this on CPU machines to check the "no CUDA GPU" exit.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}

# Resolve the arguments before leaving the caller's directory.
WHEELS=()
DIRS=()
LINKS=()
PRINT_DEPS=0
for arg in "$@"; do
  case "$arg" in
    -h | --help)
      usage
      exit 0
      ;;
    --print-deps)
      PRINT_DEPS=1
      ;;
    *)
      if [ -d "$arg" ]; then
        DIRS+=("$(cd "$arg" && pwd)")
        LINKS+=(--find-links "${DIRS[-1]}")
      elif [ -f "$arg" ] && [[ "$arg" == *.whl ]]; then
        WHEELS+=("$(cd "$(dirname "$arg")" && pwd)/$(basename "$arg")")
      else
        echo "gpu_check: '$arg' is neither a .whl file nor a directory of wheels" >&2
        echo "usage: bash scripts/gpu_check.sh [WHEEL_FILE_OR_DIR ...]" >&2
        exit 2
      fi
      ;;
  esac
done

cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=${FLASHCP_GPU_VENV:-$ROOT/.venv-gpu}
OUT=${FLASHCP_GPU_CHECK_OUT:-$ROOT/build/gpu_check}
PADDLE_GPU_INDEX=${PADDLE_GPU_INDEX:-https://www.paddlepaddle.org.cn/packages/stable/cu126/}
HEAD_DIM=128
PIP_OPTS=(--disable-pip-version-check --progress-bar off)

# flashcp's dependencies and test extras from pyproject.toml, without paddlepaddle; one a line.
read_deps() {
  "$1" - <<'EOF'
import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
reqs = list(project.get("dependencies", []))
reqs += list(project.get("optional-dependencies", {}).get("test", []))
for req in reqs:
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1)
    if re.sub(r"[-_.]+", "-", name).lower() != "paddlepaddle":
        print(req.strip())
EOF
}

if [ "$PRINT_DEPS" = 1 ]; then
  read_deps "$PY"
  exit 0
fi

# ------------------------------------------------------------------ summary, printed once at exit
STEP="start"
INSTALL_SRC="(not run)"
GPU_DESC="(not checked)"
FA_CONFIGURED="(not run)"
FA_DETERMINISTIC="(not run)"
PYTEST_DESC="(not run)"
BENCH_DESC="(not run)"
FAILURES=()

summary() {
  local rc=$?
  trap - EXIT
  if [ "$rc" -ne 0 ] && [ ${#FAILURES[@]} -eq 0 ]; then
    FAILURES+=("aborted during: $STEP (exit $rc)")
  fi
  echo
  echo "==================== flashcp GPU check: summary ===================="
  printf '  %-20s %s\n' "install" "$INSTALL_SRC"
  printf '  %-20s %s\n' "GPU" "$GPU_DESC"
  printf '  %-20s %s\n' "fa_version" "$FA_CONFIGURED (as configured), $FA_DETERMINISTIC (deterministic), head_dim $HEAD_DIM"
  printf '  %-20s %s\n' "pytest -m gpu" "$PYTEST_DESC"
  printf '  %-20s %s\n' "kernel benchmark" "$BENCH_DESC"
  printf '  %-20s %s\n' "outputs" "$OUT"
  if [ ${#FAILURES[@]} -eq 0 ]; then
    echo "  result: PASS"
  else
    echo "  result: FAIL"
    local f
    for f in "${FAILURES[@]}"; do
      echo "    - $f"
    done
  fi
  echo "===================================================================="
  if [ "$rc" -eq 0 ] && [ ${#FAILURES[@]} -gt 0 ]; then
    rc=1
  fi
  exit "$rc"
}
trap summary EXIT

mkdir -p "$OUT"

# -------------------------------------------------------------------------------- 1. install
# pip install from the given directories only; with `fallback`, retry on the index on failure.
pip_from_links() {
  local mode=$1
  shift
  if "$VPY" -m pip install "${PIP_OPTS[@]}" --no-index "${LINKS[@]}" "$@"; then
    return 0
  fi
  [ "$mode" = fallback ] || return 1
  echo "== not everything for '$*' is in the given directories: retrying with the package index"
  "$VPY" -m pip install "${PIP_OPTS[@]}" "${LINKS[@]}" "$@"
}

install_paddle() {
  local spec=("${WHEELS[@]}")
  if [ ${#LINKS[@]} -gt 0 ]; then
    if [ ${#spec[@]} -eq 0 ]; then
      spec=("paddlepaddle-gpu${PADDLE_GPU_VERSION:+==$PADDLE_GPU_VERSION}")
    fi
    INSTALL_SRC="paddlepaddle-gpu from ${WHEELS[*]:+${WHEELS[*]} }(--no-index, --find-links ${DIRS[*]})"
    if pip_from_links strict "${spec[@]}"; then
      return 0
    fi
    # paddlepaddle-gpu itself strictly from the given files, only its dependencies from the index
    echo "== retrying: paddlepaddle-gpu itself from the given files (--no-deps), its dependencies from the index"
    pip_from_links strict --no-deps "${spec[@]}"
    "$VPY" -m pip install "${PIP_OPTS[@]}" "${LINKS[@]}" "${spec[@]}"
    INSTALL_SRC="$INSTALL_SRC (its dependencies from the package index)"
  elif [ ${#WHEELS[@]} -gt 0 ]; then
    INSTALL_SRC="paddlepaddle-gpu from ${WHEELS[*]}"
    "$VPY" -m pip install "${PIP_OPTS[@]}" "${WHEELS[@]}"
  else
    local version=${PADDLE_GPU_VERSION:-3.3.1}
    INSTALL_SRC="paddlepaddle-gpu==$version from $PADDLE_GPU_INDEX"
    "$VPY" -m pip install "${PIP_OPTS[@]}" "paddlepaddle-gpu==$version" -i "$PADDLE_GPU_INDEX"
  fi
}

# pip install, from the given directories first when there are any.
pip_deps() {
  if [ ${#LINKS[@]} -gt 0 ]; then
    pip_from_links fallback "$@"
  else
    "$VPY" -m pip install "${PIP_OPTS[@]}" "$@"
  fi
}

if [ "${FLASHCP_GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
  STEP="install (skipped)"
  if [ -n "${FLASHCP_GPU_CHECK_PYTHON:-}" ]; then
    VPY=$FLASHCP_GPU_CHECK_PYTHON
  elif [ -x "$VENV/bin/python" ]; then
    VPY=$VENV/bin/python
  else
    VPY=$ROOT/.venv/bin/python
  fi
  INSTALL_SRC="skipped (FLASHCP_GPU_CHECK_SKIP_INSTALL=1), using $VPY"
  echo "== install skipped: using $VPY"
else
  STEP="install: venv"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV with $("$PY" --version 2>&1)"
    "$PY" -m venv "$VENV"
  else
    echo "== reusing $VENV"
  fi
  VPY=$VENV/bin/python
  if "$VPY" -m pip show paddlepaddle >/dev/null 2>&1; then
    FAILURES+=("the CPU package paddlepaddle is installed in $VENV")
    echo "gpu_check: $VENV has the CPU package 'paddlepaddle', which shadows paddlepaddle-gpu;" >&2
    echo "           delete $VENV and run this script again" >&2
    exit 1
  fi
  STEP="install: paddlepaddle-gpu"
  echo "== installing paddlepaddle-gpu"
  install_paddle
  STEP="install: flashcp dependencies"
  if ! "$VPY" -c "import tomllib" 2>/dev/null; then
    pip_deps tomli
  fi
  DEPS_TXT=$(read_deps "$VPY")
  mapfile -t DEPS <<<"$DEPS_TXT"
  echo "== installing flashcp's dependencies and test extras: ${DEPS[*]}"
  pip_deps "${DEPS[@]}"
  STEP="install: flashcp"
  echo "== installing flashcp (editable, --no-deps)"
  pip_deps -e . --no-deps
fi

# ------------------------------------------------------------------------------ 2. CUDA GPU
STEP="GPU check"
echo "== checking for a CUDA GPU"
if GPU_INFO=$("$VPY" - 2>"$OUT/gpu_check.err" <<'EOF'
import sys

import paddle

if not paddle.is_compiled_with_cuda():
    print(
        f"no CUDA GPU: this Paddle ({paddle.__version__}) is a CPU build "
        "(paddle.is_compiled_with_cuda() is False); install paddlepaddle-gpu"
    )
    sys.exit(3)
count = paddle.device.cuda.device_count()
if count == 0:
    print(
        "no CUDA GPU: paddlepaddle-gpu sees 0 CUDA devices "
        "(check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES)"
    )
    sys.exit(3)
major, minor = paddle.device.cuda.get_device_capability()
name = paddle.device.cuda.get_device_name()
print(
    f"{name} (SM {major}.{minor}), {count} device(s), Paddle {paddle.__version__}, "
    f"CUDA {paddle.version.cuda()}"
)
EOF
); then
  GPU_DESC=$GPU_INFO
  echo "   $GPU_DESC"
else
  rc=$?
  if [ -z "$GPU_INFO" ]; then
    GPU_INFO="no CUDA GPU: importing paddle failed ($(tail -n 1 "$OUT/gpu_check.err"))"
  fi
  GPU_DESC="none"
  FAILURES+=("$GPU_INFO")
  echo "gpu_check: $GPU_INFO" >&2
  exit $((rc == 3 ? 3 : 4))
fi

# ------------------------------------------------------------------------ 3. explain-dispatch
STEP="explain-dispatch"
EXPLAIN_RESULT=""
explain() {
  local log=$1
  shift
  echo "== flashcp explain-dispatch --head-dim $HEAD_DIM $*"
  if "$VPY" -m flashcp explain-dispatch --head-dim "$HEAD_DIM" "$@" >"$log" 2>&1; then
    EXPLAIN_RESULT=$(sed -n 's/^Effective fa_version: //p' "$log")
  else
    EXPLAIN_RESULT="failed"
    FAILURES+=("flashcp explain-dispatch $* failed (see $log)")
  fi
  sed 's/^/   /' "$log"
}
explain "$OUT/explain.log"
FA_CONFIGURED="$EXPLAIN_RESULT"
explain "$OUT/explain_deterministic.log" --deterministic
FA_DETERMINISTIC="$EXPLAIN_RESULT"

# ----------------------------------------------------------------------------- 4. GPU tests
STEP="pytest -m gpu"
echo "== FLAGS_cudnn_deterministic=1 pytest -m gpu tests"
set +e
FLAGS_cudnn_deterministic=1 "$VPY" -m pytest -m gpu tests -p no:cacheprovider \
  --junitxml "$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.log"
PYTEST_RC=${PIPESTATUS[0]}
set -e
PYTEST_LINE=$(grep -E "^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s" \
  "$OUT/pytest_gpu.log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//' || true)
count() {
  local n
  n=$(grep -oE "[0-9]+ $1" <<<"$PYTEST_LINE" | grep -oE "^[0-9]+" || true)
  echo "${n:-0}"
}
PYTEST_DESC="$(count passed) passed, $(count failed) failed, $(count "errors?") errors, $(count skipped) skipped (exit $PYTEST_RC)"
if [ "$PYTEST_RC" -ne 0 ]; then
  FAILURES+=("pytest -m gpu exited $PYTEST_RC: ${PYTEST_LINE:-see $OUT/pytest_gpu.log}")
elif [ "$(count passed)" -eq 0 ]; then
  FAILURES+=("pytest -m gpu passed no test although a GPU is visible: ${PYTEST_LINE:-?}")
fi

# ------------------------------------------------------------------------ 5. kernel benchmark
STEP="kernel benchmark"
EXTRA=()
read -r -a EXTRA <<<"${FLASHCP_GPU_BENCH_ARGS:-}"
BENCH_JSON=$OUT/bench_kernel_gpu.json
echo "== scripts/bench_kernel.py --device gpu --full --head-dim $HEAD_DIM ${EXTRA[*]}"
set +e
"$VPY" scripts/bench_kernel.py --device gpu --full --head-dim "$HEAD_DIM" \
  --json "$BENCH_JSON" "${EXTRA[@]}" 2>&1 | tee "$OUT/bench_kernel_gpu.log"
BENCH_RC=${PIPESTATUS[0]}
set -e
if [ -f "$BENCH_JSON" ]; then
  BENCH_DESC=$("$VPY" - "$BENCH_JSON" <<'EOF' || echo "unreadable $BENCH_JSON"
import json
import statistics
import sys

report = json.load(open(sys.argv[1]))
summary = report["summary"]
headline = summary["headline_family"]
head = summary["families"].get(headline, {})
parts = [
    f"{headline}: "
    + ", ".join(
        f"S={s} {row['speedup']:.1f}x" for s, row in head.items() if row["speedup"] is not None
    )
]
others = {fam: rows for fam, rows in summary["families"].items() if fam != headline}
at = str(max((int(s) for rows in others.values() for s in rows), default=0))
sp = [
    rows[at]["speedup"]
    for rows in others.values()
    if at in rows and rows[at]["speedup"] is not None
]
if sp:
    parts.append(
        f"{len(sp)} families at S={at}: min {min(sp):.1f}x, median {statistics.median(sp):.1f}x"
    )
versions = sorted({r["fa_version"] for r in report["results"] if r.get("fa_version")})
parts.append(f"flashcp ran fa_version {'/'.join(map(str, versions)) or '?'}")
if summary["errors"]:
    parts.append(f"{len(summary['errors'])} failed points")
print("; ".join(parts))
EOF
  )
else
  BENCH_DESC="no results"
fi
if [ "$BENCH_RC" -ne 0 ]; then
  FAILURES+=("bench_kernel.py exited $BENCH_RC (see $OUT/bench_kernel_gpu.log)")
fi

STEP="done"
[ ${#FAILURES[@]} -eq 0 ]
