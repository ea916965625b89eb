"""The memory planner: bytes per rank before launch (`flashcp plan`, `flashcp validate`).

    from flashcp.plan import plan
    p = plan(load_config("configs/glm/glm4_9b_cp8.yaml"), budget_gib=96)
    p.peak.total_bytes, p.peak.items, p.fits

Pure arithmetic over the config (no Paddle tensors): `flashcp.plan.params` lists each stage's
parameters exactly as the models build them, `flashcp.plan.activations` what autograd keeps
per layer (in `counts`' units; the routed experts' rows in `moe_rows`, attention's transient
bytes in `attention_scratch`), `flashcp.plan.model` the moments of a step where a rank peaks
(assembled from `state`, `layer`, `head`, `forward`, `optimizer` and `host`), and
`flashcp.plan.report` the text, JSON and over-budget messages.
"""

from flashcp.plan.model import GIB, ITEM_DOCS, ITEMS, Plan, RankPlan, plan

__all__ = ["GIB", "ITEMS", "ITEM_DOCS", "Plan", "RankPlan", "plan"]
