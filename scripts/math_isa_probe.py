#!/usr/bin/env python
"""Which environment settings change the float32 results of Paddle's and numpy's math kernels?

BLAS and friends pick their kernels by the CPU's instruction set, so the same float32 program
gives slightly different bits on another x86-64 machine. This probe emulates "another machine"
on this one: it re-runs a fixed set of workloads in a fresh process per setting and reports,
for each, whether the results differ from the default run, and by how much.

What the CPU wheel of Paddle 3.3.1 computes with (check `paddle/libs`): dense matmuls go to
MKL-ML (`libmklml_intel.so`, MKL 2019.0 Update 5, `cblas_sgemm`); oneDNN (`libdnnl.so.3`) ships
but dygraph training does not call it (`ONEDNN_VERBOSE=1` prints no primitive). numpy's
matmul goes to its bundled OpenBLAS (`DYNAMIC_ARCH`: the core type is picked at load), and its
own SIMD loops (exp, sum, ...) are dispatched by CPU feature (`NPY_DISABLE_CPU_FEATURES`).
flashcp's CPU FlashMask kernel is numpy, so both libraries matter.

Workloads (float32, seeded, single-threaded):

* `paddle_matmul`: `paddle.matmul` of [256, 512] x [512, 256] (MKL sgemm);
* `numpy_matmul`: the same in numpy (OpenBLAS sgemm);
* `numpy_exp_sum`: `np.exp` and row sums of a [256, 512] block (numpy SIMD loops);
* `model_fwd_bwd`: tiny GPT forward + backward on a causal-document mask (logits, gradients);
* `train_steps`: 4 optimizer steps of `configs/gpt/tiny_cp2.yaml` at CP = 1 (losses,
  gradient norms) — the golden-loss quantity;
* `dpo_steps`: 3 steps of `configs/glm/tiny_dpo_lora_cp2.yaml` at CP = 1 (losses, rewards).

Per setting and workload it prints `same` (bitwise) or the max |difference| relative to the
max |value| of the default result, in float32 eps units (2^-23 ≈ 1.19e-7).

    python scripts/math_isa_probe.py                  # every setting, all workloads (~2 min)
    python scripts/math_isa_probe.py --quick          # skip the training workloads
    python scripts/math_isa_probe.py --json out.json  # also write the table as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EPS32 = float(np.finfo(np.float32).eps)
AVX512_NUMPY = "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL"

CI_SECOND_PASS = {"MKL_DEBUG_CPU_TYPE": "5", "OPENBLAS_CORETYPE": "Haswell"}
"""An AVX2 host as this machine can emulate it — MKL's AVX2 path (MKL 2019 takes it on AMD only
when told `MKL_DEBUG_CPU_TYPE=5`) and OpenBLAS's Haswell kernels: `MATH_ENV` of
`scripts/test.sh`, whose second pass runs the equivalence and golden tests under it."""

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "MKL_ENABLE_INSTRUCTIONS=SSE4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "MKL_ENABLE_INSTRUCTIONS=AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "MKL_ENABLE_INSTRUCTIONS=AVX512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "MKL_CBWR=AVX2": {"MKL_CBWR": "AVX2"},
    "MKL_DEBUG_CPU_TYPE=5": {"MKL_DEBUG_CPU_TYPE": "5"},
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "OPENBLAS_CORETYPE=SkylakeX": {"OPENBLAS_CORETYPE": "SkylakeX"},
    "OPENBLAS_CORETYPE=Haswell": {"OPENBLAS_CORETYPE": "Haswell"},
    "OPENBLAS_CORETYPE=Sandybridge": {"OPENBLAS_CORETYPE": "Sandybridge"},
    "OPENBLAS_CORETYPE=Nehalem": {"OPENBLAS_CORETYPE": "Nehalem"},
    "NPY_DISABLE_CPU_FEATURES=AVX512*": {"NPY_DISABLE_CPU_FEATURES": AVX512_NUMPY},
    "MKL_DEBUG_CPU_TYPE=5 + ..._INSTRUCTIONS=SSE4_2": {
        "MKL_DEBUG_CPU_TYPE": "5",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
    "MKL_DEBUG_CPU_TYPE=5 + MKL_CBWR=COMPATIBLE": {
        "MKL_DEBUG_CPU_TYPE": "5",
        "MKL_CBWR": "COMPATIBLE",
    },
    "CI MATH_ENV (MKL type 5 + OpenBLAS Haswell)": CI_SECOND_PASS,
}
"""Each setting is applied alone on top of the calling environment (minus any of these keys)."""

PROBED_KEYS = sorted({k for env in SETTINGS.values() for k in env})


# ------------------------------------------------------------------------ child: workloads


def _openblas_core() -> str:
    """The core type numpy's OpenBLAS picked (`openblas_get_corename`), or '?'."""
    import ctypes

    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for lib in sorted(libs.glob("libopenblas*.so*")):
        handle = ctypes.CDLL(str(lib))
        for name in (
            "openblas_get_corename64_",
            "openblas_get_corename",
            "scipy_openblas_get_corename64_",
        ):
            fn = getattr(handle, name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return "?"


def _matrices() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((256, 512)).astype(np.float32),
        rng.standard_normal((512, 256)).astype(np.float32),
    )


def work_kernels() -> dict[str, np.ndarray]:
    import paddle

    a, b = _matrices()
    return {
        "paddle_matmul": paddle.matmul(paddle.to_tensor(a), paddle.to_tensor(b)).numpy(),
        "numpy_matmul": a @ b,
        "numpy_exp_sum": np.exp(a * 0.25).sum(axis=1),
    }


def work_model() -> dict[str, np.ndarray]:
    import paddle

    from flashcp import masks
    from flashcp.attention.context import AttentionContext
    from flashcp.models import build_model, preset

    paddle.seed(0)
    model = build_model(preset("tiny"))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 260, (2, 64))
    pos = np.broadcast_to(np.arange(64), (2, 64)).copy()
    ctx = AttentionContext(mask=masks.causal_document_mask([[20, 44], [64]]).indices, causal=True)
    logits = model.logits(model(paddle.to_tensor(ids), paddle.to_tensor(pos), ctx))
    (logits * logits).mean().backward()
    grads = [p.grad.numpy().ravel() for _, p in model.named_parameters() if p.grad is not None]
    return {"model_logits": logits.numpy(), "model_grads": np.concatenate(grads)}


def _train(config: str, steps: int, keys: tuple[str, ...], extra: list[str]) -> np.ndarray:
    from flashcp.config import load_config
    from flashcp.metrics.writer import read_metrics
    from flashcp.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        overrides = [f"train.steps={steps}", "checkpoint.every=0", "checkpoint.resume=never",
                     "train.deterministic=true", f"run.output_dir={out}", *extra]  # fmt: skip
        Trainer(load_config(REPO / config, overrides)).fit()
        rows = read_metrics(Path(out))
    return np.array([[float(r[k]) for k in keys] for r in rows], dtype=np.float64)


def work_training() -> dict[str, np.ndarray]:
    return {
        "train_steps": _train("configs/gpt/tiny_cp2.yaml", 4, ("loss", "grad_norm"),
                              ["parallel.cp=1"]),
        "dpo_steps": _train("configs/glm/tiny_dpo_lora_cp2.yaml", 3,
                            ("loss", "rewards/chosen", "rewards/margin"), ["parallel.cp=1"]),
    }  # fmt: skip


def child(out: Path, quick: bool) -> None:
    results = {**work_kernels(), **work_model()}
    if not quick:
        results.update(work_training())
    np.savez(out, **results)
    print(json.dumps({"openblas_core": _openblas_core()}))


# ------------------------------------------------------------------------ parent: compare


def run_setting(env_extra: dict[str, str], quick: bool, tmp: Path, name: str) -> tuple[dict, dict]:
    env = {k: v for k, v in os.environ.items() if k not in PROBED_KEYS}
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    env.update(env_extra)
    out = tmp / (re.sub(r"[^A-Za-z0-9]+", "_", name) + ".npz")
    cmd = [sys.executable, __file__, "--child", str(out), *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: child failed\n{proc.stdout}\n{proc.stderr[-3000:]}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    with np.load(out) as data:
        return {k: data[k] for k in data.files}, info


def compare(got: np.ndarray, base: np.ndarray) -> dict[str, float | bool]:
    """Bitwise equality, and max |got - base| / max |base| (also in float32 eps units)."""
    same = bool(np.array_equal(got, base))
    diff = float(np.max(np.abs(got.astype(np.float64) - base.astype(np.float64))))
    scale = float(np.max(np.abs(base))) or 1.0
    return {"same": same, "max_abs": diff, "rel": diff / scale, "eps": diff / scale / EPS32}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="kernels and model only")
    parser.add_argument("--json", type=Path, default=None, help="write the table here")
    parser.add_argument("--only", action="append", default=None, help="only these settings")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.quick)
        return 0
    names = [
        "default",
        *[n for n in SETTINGS if n != "default" and (not args.only or n in args.only)],
    ]
    table: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base, base_info = run_setting({}, args.quick, Path(tmp), "default")
        print(f"default: numpy OpenBLAS core {base_info['openblas_core']}")
        workloads = list(base)
        print(f"{'setting':<46}" + "".join(f"{w:>15}" for w in workloads))
        for name in names[1:]:
            got, info = run_setting(SETTINGS[name], args.quick, Path(tmp), name)
            row = {w: compare(got[w], base[w]) for w in workloads}
            table[name] = {"env": SETTINGS[name], "openblas_core": info["openblas_core"],
                           "workloads": row}  # fmt: skip
            cells = "".join(
                f"{'same' if r['same'] else format(r['eps'], '.3g') + ' eps':>15}"
                for r in row.values()
            )
            print(f"{name:<46}{cells}   (OpenBLAS core {info['openblas_core']})", flush=True)
    print("cells: 'same' = bitwise equal to default; else max|diff| / max|default| in float32 eps")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
