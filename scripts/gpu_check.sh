#!/usr/bin/env bash
# One-shot GPU check for a CUDA machine (H20, H100, B200, ...): install, test, benchmark, one
# summary to paste into an issue.
#
#   bash scripts/gpu_check.sh [WHEEL_FILE_OR_DIR ...]
#   bash scripts/gpu_check.sh --print-deps    # flashcp's non-paddle deps + test extras, then exit
#   bash scripts/gpu_check.sh --print-plan    # the card, CUDA build and index it would use, exit
#   bash scripts/gpu_check.sh --check-prereqs [WHEEL_FILE_OR_DIR ...]
#                                             # only the prerequisites of that run (step P), exit
#
# P. Checks the prerequisites before anything else, each with a clear message and exit 5: bash
#    >= 4.4; $PYTHON >= 3.10 with its venv module (ensurepip too: Debian's python3-venv) when
#    .venv-gpu is to be created; and the package indexes the install will read: Paddle's wheel
#    index when paddlepaddle-gpu comes from it, the Python package index ($PIP_INDEX_URL, else
#    PyPI) unless directories of wheels are given.
# 0. Reads the card with `nvidia-smi` (name, compute capability, driver) and picks Paddle's
#    wheel index for it: CUDA 12.6 (cu126) for SM80/SM90, CUDA 12.9 (cu129) for SM100 and newer
#    (B200-class cards need a CUDA >= 12.8 build). $PADDLE_GPU_INDEX overrides the choice.
# 1. Creates .venv-gpu (separate from the CPU .venv: `paddlepaddle` and `paddlepaddle-gpu` both
#    provide the `paddle` module) and installs into it
#    - with no arguments, the documented one command: `pip install -e ".[gpu,test]"
#      --extra-index-url $PADDLE_GPU_INDEX` (paddlepaddle-gpu from Paddle's index, everything
#      else from PyPI); $PADDLE_GPU_VERSION pins another paddlepaddle-gpu version;
#    - with arguments, paddlepaddle-gpu from the given .whl files and/or directories of wheels
#      (directories are used with `--no-index --find-links DIR`), then `-e ".[test]"` (its
#      dependencies looked up in the directories first, then on the package index);
#    - the FA4 CuTe kernels (`paddlefleet_ops`, not on PyPI) from $FLASHCP_FA4_WHEEL (a wheel or
#      a directory of wheels) when it is set.
# 2. Checks that Paddle sees a CUDA GPU (exits 3 with "no CUDA GPU: ..." otherwise) and that its
#    CUDA build can run this card (exits 4 when an SM100 card meets a CUDA < 12.8 build).
# 3. Reports FA3 (SM90 only) and FA4 (SM100 + CuTe kernels) availability - an SM100 card
#    without the CuTe kernels is reported, never silently skipped - and prints
#    `flashcp explain-dispatch --head-dim 128`, as configured and with --deterministic.
# 4. Runs `pytest -m gpu tests` WITHOUT the deterministic flags (FLAGS_cudnn_deterministic and
#    FLAGS_embedding_deterministic unset: the kernels a run with `train.deterministic: false`
#    uses, e.g. FA3's non-deterministic backward on SM90; tests that need determinism set it
#    themselves), then the GPU unit tests again with FLAGS_cudnn_deterministic=1 (the
#    deterministic dispatch, e.g. FA3 downgraded to FA2).
# 5. Runs `scripts/bench_kernel.py --device gpu --full --head-dim 128`, writing
#    $FLASHCP_GPU_CHECK_OUT/bench_kernel_gpu.{json,md} (never the CPU docs/bench_kernel.*).
# 5b. With 2+ GPUs, `scripts/bench_collective_sync.py --jobs`: the step time of a 2-GPU EP job
#    with and without FLASHCP_SYNC_COLLECTIVES=1 (the device drain per NCCL collective that the
#    watchdog's task tracking replaced), $FLASHCP_GPU_CHECK_OUT/collective_sync.json.
# 6. Prints one summary block (flashcp commit, card, CUDA build, install source, FA3/FA4,
#    effective fa_version, pytest counts, benchmark speed-ups) and exits non-zero if any step
#    failed.
#
# Environment:
#   PADDLE_GPU_INDEX       wheel index (default: chosen from the card, see step 0)
#   PADDLE_GPU_VERSION     paddlepaddle-gpu version (default: the `gpu` extra's pin, 3.3.1;
#                          unpinned when installing from given directories unless set)
#   FLASHCP_FA4_WHEEL      paddlefleet_ops wheel file or directory (FA4 CuTe kernels, SM100)
#   PYTHON                 interpreter that creates the venv (default python3, >= 3.10)
#   FLASHCP_GPU_VENV       the venv (default .venv-gpu)
#   FLASHCP_GPU_CHECK_OUT  logs and benchmark results (default build/gpu_check)
#   FLASHCP_GPU_BENCH_ARGS extra bench_kernel.py arguments, split on spaces (e.g. "--repeats 3")
#   FLASHCP_GPU_CHECK_COMPUTE_CAP
#                          the compute capability to plan for (e.g. 10.0) instead of asking
#                          nvidia-smi (machines without it; the unit test)
#   FLASHCP_GPU_CHECK_BASH_VERSION
#                          the bash version to check instead of this shell's (the unit test)
#   FLASHCP_GPU_CHECK_SKIP_INSTALL=1
#                          install nothing; run steps 2-6 with $FLASHCP_GPU_CHECK_PYTHON, else
#                          the venv's python if it exists, else .venv/bin/python. The unit test
#                          uses this on CPU machines to check the "no CUDA GPU" exit.
#
# Exit codes: 0 pass, 1 a step failed, 2 usage, 3 no CUDA GPU, 4 the CUDA build cannot run the
# card, 5 a prerequisite is missing.

# Before anything bash-4.4-specific runs (`set -u` with empty arrays, negative indexes).
BASH_SEEN=${FLASHCP_GPU_CHECK_BASH_VERSION:-${BASH_VERSINFO[0]}.${BASH_VERSINFO[1]}}
BASH_MAJOR=${BASH_SEEN%%.*}
BASH_MINOR=${BASH_SEEN#*.}
BASH_MINOR=${BASH_MINOR%%.*}
if [ "$BASH_MAJOR" -lt 4 ] || { [ "$BASH_MAJOR" -eq 4 ] && [ "$BASH_MINOR" -lt 4 ]; }; then
  echo "gpu_check: this is bash $BASH_SEEN; the script needs bash >= 4.4 (macOS ships 3.2:" \
    "install a newer bash, e.g. 'brew install bash', and run it with that)" >&2
  exit 5
fi
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}

# Resolve the arguments before leaving the caller's directory.
WHEELS=()
DIRS=()
LINKS=()
PRINT_DEPS=0
PRINT_PLAN=0
CHECK_PREREQS=0
for arg in "$@"; do
  case "$arg" in
    -h | --help)
      usage
      exit 0
      ;;
    --print-deps)
      PRINT_DEPS=1
      ;;
    --print-plan)
      PRINT_PLAN=1
      ;;
    --check-prereqs)
      CHECK_PREREQS=1
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
PADDLE_INDEX_BASE=https://www.paddlepaddle.org.cn/packages/stable
HEAD_DIM=128

# ------------------------------------------------- 0. the card and the CUDA build it needs
CARD="(nvidia-smi not found)"
CAP=${FLASHCP_GPU_CHECK_COMPUTE_CAP:-}
if [ -n "$CAP" ]; then
  CARD="compute capability $CAP (FLASHCP_GPU_CHECK_COMPUTE_CAP)"
elif command -v nvidia-smi >/dev/null 2>&1; then
  if SMI=$(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader \
    2>/dev/null | head -n 1) && [ -n "$SMI" ]; then
    CARD="$SMI (name, compute capability, driver)"
    CAP=$(cut -d, -f2 <<<"$SMI" | tr -d ' ')
  else
    CARD="(nvidia-smi found no GPU)"
  fi
fi
CAP_MAJOR=${CAP%%.*}
if [[ "$CAP_MAJOR" =~ ^[0-9]+$ ]] && [ "$CAP_MAJOR" -ge 10 ]; then
  CUDA_TAG=cu129
  CUDA_WHY="SM${CAP/./} needs a CUDA >= 12.8 build"
else
  CUDA_TAG=cu126
  CUDA_WHY="CUDA 12.6 build${CAP:+ for SM${CAP/./}}"
fi
if [ -n "${PADDLE_GPU_INDEX:-}" ]; then
  CUDA_WHY="PADDLE_GPU_INDEX given; the card alone would pick $CUDA_TAG: $CUDA_WHY"
else
  PADDLE_GPU_INDEX=$PADDLE_INDEX_BASE/$CUDA_TAG/
fi

if [ "$PRINT_PLAN" = 1 ]; then
  echo "card: $CARD"
  echo "index: $PADDLE_GPU_INDEX ($CUDA_WHY)"
  echo "install: python -m pip install -e \".[gpu,test]\" --extra-index-url $PADDLE_GPU_INDEX"
  exit 0
fi
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
    if not re.sub(r"[-_.]+", "-", name).lower().startswith("paddlepaddle"):
        print(req.strip())
EOF
}

# --------------------------------------------------------------------------- P. prerequisites
PREREQ_PROBLEM=""

# $PY is Python >= 3.10 (and, with `venv`, can create a venv with pip); else sets PREREQ_PROBLEM.
check_python() {
  local need_venv=$1 version
  if ! command -v "$PY" >/dev/null 2>&1; then
    PREREQ_PROBLEM="no Python: '$PY' is not a command; set PYTHON=/path/to/python3.10 (or newer)"
    return 1
  fi
  if ! version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
    PREREQ_PROBLEM="'$PY' does not run as Python; set PYTHON=/path/to/python3.10 (or newer)"
    return 1
  fi
  local major=${version%%.*} minor=${version#*.}
  if ! [[ "$major" =~ ^[0-9]+$ && "$minor" =~ ^[0-9]+$ ]] ||
    [ "$major" -lt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -lt 10 ]; }; then
    PREREQ_PROBLEM="'$PY' is Python $version; flashcp needs Python >= 3.10: set PYTHON=/path/to/python3.10 (or newer)"
    return 1
  fi
  if [ "$need_venv" = venv ] && ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    PREREQ_PROBLEM="'$PY' (Python $version) cannot create a venv: its venv/ensurepip modules are missing (Debian/Ubuntu: apt install python$version-venv)"
    return 1
  fi
}

# The package index at $1 answers for project $2 within 15 s (else PREREQ_PROBLEM, naming the
# setting $3 that chooses that index).
check_index() {
  local url=$1 project=$2 setting=$3 why
  if why=$("$PY" - "${url%/}/$project/" 2>&1 <<'EOF'
import sys
import urllib.request

with urllib.request.urlopen(sys.argv[1], timeout=15) as response:  # honours *_PROXY
    response.read(1)
EOF
  ); then
    return 0
  fi
  why=$(tail -n 1 <<<"$why")
  PREREQ_PROBLEM="cannot reach the package index $url (${why:-no answer}): check the network or proxy (HTTPS_PROXY), set $setting, or give the wheels: bash scripts/gpu_check.sh WHEEL_FILE_OR_DIR ..."
  return 1
}

# Everything this run needs before it starts; prints each check, returns 1 on the first problem.
check_prereqs() {
  local need_venv=""
  echo "== prerequisites"
  echo "   bash $BASH_SEEN (>= 4.4)"
  if [ "${FLASHCP_GPU_CHECK_SKIP_INSTALL:-0}" = 1 ]; then
    echo "   install skipped: no Python or package index needed"
    return 0
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    need_venv=venv
  fi
  check_python "$need_venv" || return 1
  echo "   $PY: Python $("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')${need_venv:+, can create $VENV}"
  if [ ${#WHEELS[@]} -eq 0 ] && [ ${#DIRS[@]} -eq 0 ]; then
    check_index "$PADDLE_GPU_INDEX" paddlepaddle-gpu PADDLE_GPU_INDEX || return 1
    echo "   Paddle's wheel index reachable: $PADDLE_GPU_INDEX"
  fi
  if [ ${#DIRS[@]} -eq 0 ]; then
    local pypi=${PIP_INDEX_URL:-https://pypi.org/simple/}
    check_index "$pypi" pip PIP_INDEX_URL || return 1
    echo "   Python package index reachable: $pypi"
  fi
}

if [ "$CHECK_PREREQS" = 1 ]; then
  if check_prereqs; then
    echo "prerequisites: ok"
    exit 0
  fi
  echo "gpu_check: $PREREQ_PROBLEM" >&2
  exit 5
fi

if [ "$PRINT_DEPS" = 1 ]; then
  if ! check_python ""; then
    echo "gpu_check: $PREREQ_PROBLEM" >&2
    exit 5
  fi
  read_deps "$PY"
  exit 0
fi

# ------------------------------------------------------------------ summary, printed once at exit
STEP="start"
INSTALL_SRC="(not run)"
GPU_DESC="(not checked)"
FA3_DESC="(not checked)"
FA4_DESC="(not checked)"
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "unknown")
if ! git -C "$ROOT" diff --quiet HEAD 2>/dev/null; then
  COMMIT="$COMMIT (with local changes)"
fi
FA_CONFIGURED="(not run)"
FA_DETERMINISTIC="(not run)"
PYTEST_DESC="(not run)"
DETERMINISTIC_DESC="(not run)"
BENCH_DESC="(not run)"
SYNC_DESC="(not run)"
FAILURES=()

summary() {
  local rc=$?
  trap - EXIT
  if [ "$rc" -ne 0 ] && [ ${#FAILURES[@]} -eq 0 ]; then
    FAILURES+=("aborted during: $STEP (exit $rc)")
  fi
  echo
  echo "==================== flashcp GPU check: summary ===================="
  printf '  %-20s %s\n' "flashcp" "$COMMIT"
  printf '  %-20s %s\n' "card" "$CARD"
  printf '  %-20s %s\n' "CUDA build" "$PADDLE_GPU_INDEX ($CUDA_WHY)"
  printf '  %-20s %s\n' "install" "$INSTALL_SRC"
  printf '  %-20s %s\n' "GPU" "$GPU_DESC"
  printf '  %-20s %s\n' "FA3" "$FA3_DESC"
  printf '  %-20s %s\n' "FA4 (CuTe)" "$FA4_DESC"
  printf '  %-20s %s\n' "fa_version" "$FA_CONFIGURED (as configured), $FA_DETERMINISTIC (deterministic), head_dim $HEAD_DIM"
  printf '  %-20s %s\n' "pytest -m gpu" "$PYTEST_DESC"
  printf '  %-20s %s\n' "deterministic unit" "$DETERMINISTIC_DESC"
  printf '  %-20s %s\n' "kernel benchmark" "$BENCH_DESC"
  printf '  %-20s %s\n' "collective drain" "$SYNC_DESC"
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

STEP="prerequisites"
if ! check_prereqs; then
  FAILURES+=("prerequisite: $PREREQ_PROBLEM")
  echo "gpu_check: $PREREQ_PROBLEM" >&2
  exit 5
fi

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
    INSTALL_SRC="paddlepaddle-gpu==$PADDLE_GPU_VERSION from $PADDLE_GPU_INDEX"
    "$VPY" -m pip install "${PIP_OPTS[@]}" "paddlepaddle-gpu==$PADDLE_GPU_VERSION" \
      --extra-index-url "$PADDLE_GPU_INDEX"
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
  if [ ${#WHEELS[@]} -eq 0 ] && [ ${#LINKS[@]} -eq 0 ] && [ -z "${PADDLE_GPU_VERSION:-}" ]; then
    # The README's one command: paddlepaddle-gpu (the `gpu` extra) from Paddle's index.
    STEP="install: flashcp[gpu,test]"
    INSTALL_SRC="pip install -e \".[gpu,test]\" --extra-index-url $PADDLE_GPU_INDEX"
    echo "== $INSTALL_SRC"
    "$VPY" -m pip install "${PIP_OPTS[@]}" -e ".[gpu,test]" --extra-index-url "$PADDLE_GPU_INDEX"
  else
    STEP="install: paddlepaddle-gpu"
    echo "== installing paddlepaddle-gpu"
    install_paddle
    STEP="install: flashcp"
    echo "== installing flashcp with its dependencies and test extras (paddle already there)"
    pip_deps -e ".[test]"
  fi
  if [ -n "${FLASHCP_FA4_WHEEL:-}" ]; then
    STEP="install: FA4 CuTe kernels"
    echo "== installing the FA4 CuTe kernels (paddlefleet_ops) from $FLASHCP_FA4_WHEEL"
    if [ -d "$FLASHCP_FA4_WHEEL" ]; then
      "$VPY" -m pip install "${PIP_OPTS[@]}" --find-links "$FLASHCP_FA4_WHEEL" paddlefleet_ops
    else
      "$VPY" -m pip install "${PIP_OPTS[@]}" "$FLASHCP_FA4_WHEEL"
    fi
    INSTALL_SRC="$INSTALL_SRC; FA4 kernels from $FLASHCP_FA4_WHEEL"
  fi
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
cuda = paddle.version.cuda()
print(
    f"{name} (SM {major}.{minor}), {count} device(s), Paddle {paddle.__version__}, "
    f"CUDA {cuda}"
)
cuda_version = tuple(int(x) for x in str(cuda).split(".")[:2] if x.isdigit())
if major >= 10 and cuda_version < (12, 8):
    print(
        f"this Paddle is a CUDA {cuda} build, which cannot run SM{major}{minor} kernels: "
        "reinstall paddlepaddle-gpu from the cu129 index (CUDA >= 12.8)"
    )
    sys.exit(4)
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
  if [ "$rc" -ne 3 ] && [ "$(wc -l <<<"$GPU_INFO")" -gt 1 ]; then
    GPU_DESC=$(head -n 1 <<<"$GPU_INFO")
    GPU_INFO=$(tail -n 1 <<<"$GPU_INFO")
  fi
  FAILURES+=("$GPU_INFO")
  echo "gpu_check: $GPU_INFO" >&2
  exit $((rc == 3 ? 3 : 4))
fi

# ------------------------------------------------------------ 3. FA3 / FA4 availability
STEP="FA3/FA4 availability"
if AVAIL=$("$VPY" - 2>>"$OUT/gpu_check.err" <<'EOF'
from flashcp import dispatch

fa3, why3 = dispatch.probe_fa3()
fa4, why4 = dispatch.probe_fa4()
cap = dispatch.probe_capability()
print(("available: " if fa3 else "unavailable: ") + why3)
if fa4:
    print("available: " + why4)
elif cap is not None and cap[0] == dispatch.FA4_CAPABILITY_MAJOR:
    print(
        "NOT INSTALLED on this SM100 card: " + why4 + " - the FA4 tests and benchmark rows "
        "are skipped; paddlefleet_ops is not on PyPI: set FLASHCP_FA4_WHEEL=<wheel or dir> "
        "and run this script again"
    )
else:
    print("not applicable: " + why4)
EOF
); then
  FA3_DESC=$(sed -n 1p <<<"$AVAIL")
  FA4_DESC=$(sed -n 2p <<<"$AVAIL")
else
  FA3_DESC="probe failed (see $OUT/gpu_check.err)"
  FA4_DESC="probe failed (see $OUT/gpu_check.err)"
  FAILURES+=("the FA3/FA4 probe failed (see $OUT/gpu_check.err)")
fi
echo "   FA3: $FA3_DESC"
echo "   FA4: $FA4_DESC"

# ------------------------------------------------------------------------ 3b. explain-dispatch
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
# The default kernels: no deterministic flag inherited from the caller's environment either.
echo "== pytest -m gpu tests (FLAGS_cudnn_deterministic, FLAGS_embedding_deterministic unset)"
set +e
env -u FLAGS_cudnn_deterministic -u FLAGS_embedding_deterministic \
  "$VPY" -m pytest -m gpu tests -p no:cacheprovider \
  --junitxml "$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.log"
PYTEST_RC=${PIPESTATUS[0]}
set -e
# The last pytest summary line of log $1.
pytest_line() {
  grep -E "^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s" "$1" | tail -n 1 |
    sed -E 's/^=+ //; s/ =+$//' || true
}
count() {
  local n
  n=$(grep -oE "[0-9]+ $1" <<<"$PYTEST_LINE" | grep -oE "^[0-9]+" || true)
  echo "${n:-0}"
}
PYTEST_LINE=$(pytest_line "$OUT/pytest_gpu.log")
PYTEST_DESC="$(count passed) passed, $(count failed) failed, $(count "errors?") errors, $(count skipped) skipped (exit $PYTEST_RC)"
if [ "$PYTEST_RC" -ne 0 ]; then
  FAILURES+=("pytest -m gpu exited $PYTEST_RC: ${PYTEST_LINE:-see $OUT/pytest_gpu.log}")
elif [ "$(count passed)" -eq 0 ]; then
  FAILURES+=("pytest -m gpu passed no test although a GPU is visible: ${PYTEST_LINE:-?}")
fi

STEP="pytest -m gpu tests/unit (deterministic)"
echo "== FLAGS_cudnn_deterministic=1 pytest -m gpu tests/unit"
set +e
FLAGS_cudnn_deterministic=1 "$VPY" -m pytest -m gpu tests/unit -p no:cacheprovider \
  --junitxml "$OUT/pytest_gpu_deterministic.xml" 2>&1 | tee "$OUT/pytest_gpu_deterministic.log"
DETERMINISTIC_RC=${PIPESTATUS[0]}
set -e
PYTEST_LINE=$(pytest_line "$OUT/pytest_gpu_deterministic.log")
DETERMINISTIC_DESC="$(count passed) passed, $(count failed) failed, $(count "errors?") errors, $(count skipped) skipped (exit $DETERMINISTIC_RC)"
if [ "$DETERMINISTIC_RC" -ne 0 ]; then
  FAILURES+=("deterministic pytest -m gpu tests/unit exited $DETERMINISTIC_RC: ${PYTEST_LINE:-see $OUT/pytest_gpu_deterministic.log}")
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

# ------------------------------------------------- 5b. what a device drain per collective costs
STEP="collective sync benchmark"
GPUS=$(grep -oE "[0-9]+ device" <<<"$GPU_DESC" | grep -oE "^[0-9]+" || echo 0)
SYNC_JSON=$OUT/collective_sync.json
if [ "${GPUS:-0}" -ge 2 ]; then
  echo "== scripts/bench_collective_sync.py --jobs (step time with / without the drain)"
  set +e
  "$VPY" scripts/bench_collective_sync.py --jobs --rounds 2 --json "$SYNC_JSON" 2>&1 |
    tee "$OUT/collective_sync.log"
  SYNC_RC=${PIPESTATUS[0]}
  set -e
  if [ "$SYNC_RC" -ne 0 ]; then
    FAILURES+=("bench_collective_sync.py exited $SYNC_RC (see $OUT/collective_sync.log)")
    SYNC_DESC="failed (exit $SYNC_RC)"
  elif [ -f "$SYNC_JSON" ]; then
    SYNC_DESC=$("$VPY" - "$SYNC_JSON" <<'EOF' || echo "unreadable $SYNC_JSON"
import json
import sys

r = json.load(open(sys.argv[1]))
t = r["step_time_s"]
print(
    f"step {t['tracked']['median']:.3f} s tracked, {t['drain']['median']:.3f} s with the drain "
    f"(x{r['drain_over_tracked']['median']:.2f}), {r['config']}"
)
EOF
    )
  else
    SYNC_DESC="no results"
  fi
else
  SYNC_DESC="skipped: needs 2 GPUs"
fi

STEP="done"
[ ${#FAILURES[@]} -eq 0 ]
