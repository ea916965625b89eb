"""What the plan needs from a config, resolved once (`Setup`), and the rules every part of the
plan shares: micro-batches in flight per pipeline stage, the mechanisms a recompute mode can
carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashcp.config.device_rule import compute_dtype, resolve_device
from flashcp.config.schema import Config
from flashcp.models.config import ModelArgs
from flashcp.plan.features import Features, features_of


@dataclass(frozen=True)
class Setup:
    """What the plan needs from a config, resolved."""

    args: ModelArgs
    dp: int
    pp: int
    cp: int
    ep: int
    pp_layers: list[int] | None
    schedule: str
    tokens: int
    """Local tokens per micro-batch on a rank: micro_batch_size × seq_len / cp."""
    batch: int
    seq: int
    grad_accum: int
    device: str
    compute: str
    param_dtype: str
    shard: bool
    chunk: int
    lora_targets: list[str] | None
    lora_rank: int
    dpo: bool
    grad_clip: float
    bucket_bytes: int
    features: Features = Features()
    """The long-context mechanisms planned (`flashcp.plan.features`; all off by default)."""

    @property
    def tile(self) -> int:
        """Local tokens of one sequence tile (`model.tile_tokens` of every row of the
        micro-batch at once: the tiles cut the token axis, `flashcp.models.tiling`), at most
        all of them; 0 untiled."""
        if not self.features.tile_tokens:
            return 0
        rows = self.tokens // self.batch
        return min(self.features.tile_tokens, rows) * self.batch

    @property
    def shard_degree(self) -> int:
        return self.dp * self.cp if self.shard else 1

    @property
    def expert_shard_degree(self) -> int:
        """ZeRO-1 sharding of the routed experts' optimizer state: over their edp group (the
        dp·cp/ep ranks holding the same experts)."""
        return self.dp * self.cp // self.ep if self.shard else 1


def setup(cfg: Config, device: str | None = None, features: Features | None = None) -> Setup:
    """Resolve the plan's inputs from `cfg` (on `device`, else `run.device`; `features`: the
    mechanisms to plan, default the ones `cfg` asks for, `features_of`)."""
    dev = device or resolve_device(cfg)
    p, d, t = cfg.parallel, cfg.data, cfg.train
    seq = d.seq_len
    divisor = p.seq_divisor
    if p.pad and seq % divisor:
        seq = -(-seq // divisor) * divisor
    lora = cfg.extras.get("lora")
    return Setup(
        args=cfg.model,
        dp=p.dp,
        pp=p.pp,
        cp=p.cp,
        ep=p.ep,
        pp_layers=p.pp_layers,
        schedule=p.pp_schedule,
        tokens=d.micro_batch_size * seq // p.cp,
        batch=d.micro_batch_size,
        seq=seq,
        grad_accum=t.grad_accum,
        device=dev,
        compute=compute_dtype(cfg, dev, check=False),
        param_dtype=t.param_dtype,
        shard=p.shard_optimizer,
        chunk=t.loss_chunk_tokens,
        lora_targets=list(lora.target_modules) if lora is not None else None,
        lora_rank=int(lora.rank) if lora is not None else 0,
        dpo=cfg.run.recipe == "dpo",
        grad_clip=float(t.grad_clip),
        bucket_bytes=int(p.grad_bucket_mb * 2**20),
        features=features_of(cfg) if features is None else features,
    )


def in_flight(s: Setup, stage: int) -> int:
    """Micro-batches forwarded but not yet back-propagated at once on `stage`."""
    if s.pp == 1:
        return 1
    if s.schedule == "gpipe":
        return s.grad_accum
    return min(s.pp - stage, s.grad_accum)


def numel(specs: list[Any], trained: bool | None = None) -> int:
    """Elements of `specs`; only the trained (or frozen) ones when `trained` is given."""
    return sum(x.numel for x in specs if trained is None or x.trained == trained)


def check_features(f: Features, recompute: str) -> None:
    """`ValueError` for mechanisms the recompute mode cannot carry: offload moves what a
    recomputed layer keeps, tiling re-runs a recomputed layer's token-wise parts in tiles."""
    needs = [name for name, on in (("offload_activations", f.offload_activations),
                                   ("tile_tokens", f.tile_tokens > 0)) if on]  # fmt: skip
    if needs and recompute == "none":
        raise ValueError(
            f"{' and '.join(needs)} need model.recompute full or refined (it is none)"
        )
    for name in ("tile_tokens", "query_chunk", "kv_chunk"):
        if getattr(f, name) < 0:
            raise ValueError(f"{name} must be >= 0 (0 = off), got {getattr(f, name)}")


