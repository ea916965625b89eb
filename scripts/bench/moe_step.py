"""Where a MoE training step's time goes, against its own GEMM floor and the core's GEMM peak.

One training step (forward, the chunked loss, backward, AdamW) of a MoE model at GLM-4.5-Air's
and Qwen3-MoE's shapes scaled down to what one CPU core runs in seconds (`SHAPES`: every width
divided, the expert count and top-k kept), float32, one thread. In the same run, interleaved
rounds, medians of process CPU seconds:

* the step, and its parts each run alone, forward + backward, on inputs of the step's shapes:
  per decoder layer the attention sublayer (input norm, projections, rotary, the FlashMask CPU
  kernel, output projection) and the MoE sublayer; within the MoE sublayer the router (scores,
  top-k, normalisation), the routed experts' compute on the laid-out rows (their GEMMs and
  SwiGLU) and the shared expert; the LM head with the chunked loss; the optimizer step. What
  the MoE sublayer spends besides its three parts is the token movement around the experts
  (dispatch plan, permute, relayout, combine); what the step spends besides its parts is
  unattributed (embedding, residual adds, the post-attention norm, the autograd engine);
* the step's GEMM floor: every matrix multiply the step runs (`gemm_shapes`: attention's
  projections, the router, each expert's rows at this step's routing, the shared expert, the
  head), forward and the two backward GEMMs (dX, dW) each, back to back;
* the core's GEMM peak: a 2048³ float32 matmul.

The model FLOPs come from `flashcp.metrics.flops` (the family's inventory: one source). Results:
`docs/moe_step.json`, rendered into `docs/moe_step.md`.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench import report, stats
from bench.rounds import interleave

SHAPES: dict[str, dict[str, Any]] = {
    "glm45_air / 8": dict(
        preset="tiny_glm_moe", vocab_size=32768, hidden_size=512, num_layers=2, num_heads=12,
        num_kv_heads=1, head_dim=64, intermediate_size=1368, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=176, num_shared_experts=1,
        first_k_dense_replace=0, use_qk_norm=False,
    ),
    "qwen3_30b_a3b / 4": dict(
        preset="tiny_qwen3_moe", vocab_size=32768, hidden_size=512, num_layers=2, num_heads=8,
        num_kv_heads=1, head_dim=64, intermediate_size=1536, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=192, mlp_only_layers=(),
    ),
}  # fmt: skip
"""Each shape: GLM-4.5-Air's widths ÷ 8 (hidden 4096 → 512, heads 96/8 → 12/1, expert 1408 →
176), Qwen3-30B-A3B's ÷ 4 (2048 → 512, 32/4 → 8/1, expert 768 → 192); 128 experts top-8 kept;
the vocabulary 32,768 (÷ 4.6); two MoE layers."""
TOKENS = 2048
PEAK_N = 2048


@dataclass(frozen=True)
class Gemm:
    """One matrix multiply of the step: `[m, k] @ [k, n]`, `what` it is."""

    what: str
    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        """Forward and the two backward GEMMs (dX, dW): 3 × 2mkn."""
        return 6 * self.m * self.k * self.n


def gemm_shapes(args: Any, tokens: int, expert_rows: Sequence[Sequence[int]]) -> list[Gemm]:
    """Every GEMM of a step of `tokens` tokens through `args`' decoder layers (each a MoE layer
    here, `expert_rows[layer][e]` rows routed to expert e) and the LM head."""
    h, d = int(args.hidden_size), int(args.head_size)
    q, kv = int(args.num_heads) * d, int(args.num_kv_heads) * d
    out: list[Gemm] = []
    for layer in range(int(args.num_layers)):
        out += [Gemm("attention q/k/v", tokens, h, q + 2 * kv), Gemm("attention o", tokens, q, h),
                Gemm("router", tokens, h, int(args.num_experts))]  # fmt: skip
        inter = int(args.moe_intermediate_size)
        for rows in expert_rows[layer]:
            if rows:
                out += [Gemm("experts gate/up", int(rows), h, 2 * inter),
                        Gemm("experts down", int(rows), inter, h)]  # fmt: skip
        if args.num_shared_experts:
            shared = inter * int(args.num_shared_experts)
            out += [Gemm("shared gate/up", tokens, h, 2 * shared),
                    Gemm("shared down", tokens, shared, h)]  # fmt: skip
    out.append(Gemm("head", tokens, h, int(args.vocab_size)))
    return out


def shares(phases: dict[str, float], step: float) -> dict[str, float]:
    """Each phase's fraction of the step, `unattributed` the rest (may be < 0 within noise)."""
    out = {name: t / step for name, t in phases.items()}
    out["unattributed"] = 1.0 - sum(out.values())
    return out


# -- measuring ------------------------------------------------------------------------------------


def _cpu(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def measure_shape(name: str, spec: dict[str, Any], rounds: int) -> dict[str, Any]:
    import paddle

    from flashcp import masks
    from flashcp.attention.context import AttentionContext
    from flashcp.metrics.flops import causal_keys, flops_per_token
    from flashcp.models import build_model, preset
    from flashcp.models.layers import rotary_tables
    from flashcp.models.moe_dispatch import build_dispatch, permute, relayout
    from flashcp.models.rope import model_inverse_frequencies

    spec = dict(spec)
    args = preset(spec.pop("preset"), max_seq_len=TOKENS, **spec)
    paddle.seed(0)
    model = build_model(args, seed=0)
    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(0, args.vocab_size, (1, TOKENS)))
    labels = paddle.to_tensor(rng.integers(0, args.vocab_size, (1, TOKENS)))
    pos = paddle.arange(TOKENS, dtype="int64").unsqueeze(0)
    ctx = AttentionContext(mask=masks.causal_mask(1, TOKENS).indices, causal=True)
    inv = model_inverse_frequencies(args)
    rotary = rotary_tables(pos, inv, interleaved=args.interleaved_rotary)
    layers = model.decoder_layers()
    h = int(args.hidden_size)

    def x_like() -> paddle.Tensor:
        x = paddle.to_tensor(rng.standard_normal((1, TOKENS, h)).astype("float32"))
        x.stop_gradient = False
        return x

    def step() -> None:
        hidden = model(ids, pos, ctx)
        loss = -model.token_logprobs(hidden, labels).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()

    def backward_of(out: paddle.Tensor) -> None:
        (out * paddle.ones_like(out)).sum().backward()

    layer = layers[0]
    moe = layer.mlp
    flat = x_like().reshape([-1, h])
    routing = moe.gate.route(flat.detach())
    dispatch = build_dispatch(routing.ids, moe.gate.num_experts, None)
    layout = moe.experts.plan(dispatch.counts, flat)
    laid = relayout(dispatch, layout.row_index(), layout.rows)
    rows = permute(flat.detach(), laid, "float32").detach()
    rows.stop_gradient = False

    def attention() -> None:
        backward_of(layer.self_attn(layer.input_layernorm(x_like()), rotary, ctx))

    def moe_layer() -> None:
        backward_of(moe(layer.post_attention_layernorm(x_like())))

    def router() -> None:
        r = moe.gate.route(x_like().reshape([-1, h]))
        backward_of(r.weights)

    def experts() -> None:
        backward_of(moe.experts(rows, layout))

    def shared() -> None:
        if moe.shared_experts is not None:
            backward_of(moe.shared_experts(x_like()))

    def head_loss() -> None:
        (-model.token_logprobs(model.model.norm(x_like()), labels).mean()).backward()

    def optimizer() -> None:
        opt.step()

    counts = []
    for each in layers:  # this step's routing per layer, from the step's own inputs
        with paddle.no_grad():
            r = each.mlp.gate.route(x_like().reshape([-1, h]))
        counts.append(np.bincount(r.ids.numpy().ravel(), minlength=args.num_experts).tolist())
    gemms = gemm_shapes(args, TOKENS, counts)
    mats = [(paddle.randn([g.m, g.k]), paddle.randn([g.k, g.n]), paddle.randn([g.m, g.n]))
            for g in gemms]  # fmt: skip

    def floor() -> None:
        for a, b, c in mats:
            paddle.matmul(a, b)
            paddle.matmul(c, b, transpose_y=True)
            paddle.matmul(a, c, transpose_x=True)

    big = paddle.randn([PEAK_N, PEAK_N])

    def peak() -> None:
        paddle.matmul(big, big)

    parts: dict[str, Callable[[], None]] = {
        "step": step, "attention": attention, "moe": moe_layer, "router": router,
        "routed experts": experts, "shared expert": shared, "head and loss": head_loss,
        "optimizer": optimizer, "gemm floor": floor, "peak": peak,
    }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in parts}
    for rnd in interleave(list(parts), rounds, warmup=1):
        for part in rnd.order:
            t = _cpu(parts[part])
            opt.clear_grad()
            if rnd.timed:
                times[part].append(t)
    med = {k: float(np.median(v)) for k, v in times.items()}
    n_layers = len(layers)
    moe_rest = med["moe"] - med["router"] - med["routed experts"] - med["shared expert"]
    phases = {
        "attention (norm, projections, rotary, kernel)": n_layers * med["attention"],
        "router (scores, top-k, normalisation)": n_layers * med["router"],
        "routed experts (GEMMs, SwiGLU)": n_layers * med["routed experts"],
        "dispatch / permute / combine": n_layers * moe_rest,
        "shared expert": n_layers * med["shared expert"],
        "head and loss": med["head and loss"],
        "optimizer": med["optimizer"],
    }
    model_flops = flops_per_token(args, TOKENS, keys=causal_keys(TOKENS)) * TOKENS
    peak_flops = 2 * PEAK_N**3 / med["peak"]
    return {
        "name": name,
        "shape": {k: getattr(args, k) for k in ("hidden_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "num_shared_experts", "vocab_size")},  # fmt: skip
        "tokens": TOKENS,
        "rounds": rounds,
        "seconds": {k: stats.spread(v) for k, v in times.items()},
        "phases": phases,
        "shares": shares(phases, med["step"]),
        "model_flops": model_flops,
        "gemm_flops": sum(g.flops for g in gemms),
        "peak_gflops": peak_flops / 1e9,
        "step_gflops": model_flops / med["step"] / 1e9,
        "fraction_of_peak": model_flops / med["step"] / peak_flops,
        "step_over_floor": med["step"] / med["gemm floor"],
        "expert_rows_max_over_mean": float(max(max(c) / np.mean(c) for c in counts)),
    }


def view(rec: dict[str, Any]) -> dict[str, Any]:
    """The cases that meet the issue's targets (≥ 0.75 of the peak or ≤ 1.25× the floor)."""
    top = {c["name"]: [f"{k} {100 * v:.0f} %" for k, v in sorted(
        c["shares"].items(), key=lambda kv: -kv[1])[:3]] for c in rec["cases"]}  # fmt: skip
    return {"met": [c["name"] for c in rec["cases"]
                    if c["fraction_of_peak"] >= 0.75 or c["step_over_floor"] <= 1.25],
            "top": top}  # fmt: skip


PAGE = report.Page("moe_step.md.j2", report.DOCS / "moe_step.json", view=view)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    PAGE.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.report_only:
        return PAGE.rewrite(args)
    import paddle

    cases = []
    for name, spec in SHAPES.items():
        print(f"== {name}", flush=True)
        case = measure_shape(name, spec, args.rounds)
        print(f"   step {case['seconds']['step']['median']:.2f} s, "
              f"{case['fraction_of_peak']:.2f} of the GEMM peak, "
              f"{case['step_over_floor']:.2f}× its GEMM floor", flush=True)  # fmt: skip
        cases.append(case)
    rec = {
        "environment": {"paddle": paddle.__version__, "python": platform.python_version(),
                        "cpus": os.cpu_count(), "threads": os.environ.get("OMP_NUM_THREADS"),
                        "loadavg": list(os.getloadavg())},  # fmt: skip
        "cases": cases,
    }
    PAGE.write(args, rec)
    return 0
