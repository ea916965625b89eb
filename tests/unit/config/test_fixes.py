"""Every fix the validator prints is itself valid (issue 27, defect 7).

Each case below is a refused config; the test reads the fixes off the printed line (`set
key=value ...`), applies each one as a user would (the printed overrides after the case's own)
and runs the same preflight again (`flashcp.preflight.check_raw`: the config's
validation, then this machine's device and dispatch, the memory plans, the model directory,
a sample of the data): the problem is gone and no new one appears. The table reaches every
place a config rule offers fixes (`flashcp.config.validate` and every other module of
`flashcp.config` that reports to `Checks`, a recipe's rules included; checked against their
source), and the cases the
issue names print the right fixes: a `from_pretrained` model's max_seq_len is never "raised",
and `parallel.cp=3` comes with the data.seq_len it needs.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flashcp import fa_dispatch
from flashcp.attention import registry as cp_modes
from flashcp.config import read_yaml
from flashcp.config.checks import Checks
from flashcp.cp.layout import Assignment
from flashcp.models import build_model, preset
from flashcp.models.hf_config import hf_config
from flashcp.models.hf_save import save_hf_checkpoint
from flashcp.preflight import check_raw
from flashcp.problems import Problem
from helpers.paths import ROOT

GPT = "configs/gpt/tiny_cp2.yaml"
MOE = "configs/glm/tiny_moe_cp2.yaml"
DPO = "configs/glm/tiny_moe_dpo_lora_pp2_cp2.yaml"

# (id, config, overrides, launch: world_size / nnodes, the refused key)
CASES: list[tuple[str, str, list[str], dict[str, int], str]] = [
    ("shard_gradients", GPT, ["parallel.shard_gradients=true"], {}, "parallel.shard_gradients"),
    ("dump_grads_sharded", GPT, ["parallel.shard_optimizer=true", "debug.dump_grads=true"], {},
     "debug.dump_grads"),
    ("world_size", GPT, [], {"world_size": 3}, "parallel"),
    ("nnodes", GPT, [], {"nnodes": 3}, "parallel"),
    ("ep_without_experts", GPT, ["parallel.ep=2"], {}, "parallel.ep"),
    ("ep_not_dividing_dp_cp", MOE, ["parallel.ep=3"], {}, "parallel.ep"),
    ("ep_vs_experts", MOE, ["parallel.dp=3", "parallel.ep=3"], {}, "parallel.ep"),
    ("pp_layers", GPT, ["parallel.pp=2", "train.grad_accum=2", "parallel.pp_layers=[2,1]"], {},
     "parallel.pp_layers"),
    ("grad_accum_vs_pp", GPT, ["parallel.pp=2"], {}, "train.grad_accum"),
    ("kv_chunk", GPT, ["attention.kv_chunk=3"], {}, "attention.kv_chunk"),
    ("chunked_without_implementation", GPT,
     ["parallel.cp_mode=ring_like", "attention.query_chunk=8"], {}, "attention.query_chunk"),
    ("seq_len_vs_layout", GPT, ["data.seq_len=250"], {}, "data.seq_len"),
    ("seq_len_vs_max", GPT, ["data.seq_len=512"], {}, "data.seq_len"),
    ("seq_len_vs_pretrained_max", MOE,
     ["model.from_pretrained={model_dir}", "data.tokenizer=byte", "data.seq_len=128"], {},
     "data.seq_len"),
    ("layers_vs_stages", GPT, ["parallel.pp=3", "train.grad_accum=3"], {}, "model.num_layers"),
    ("vocab_vs_byte_tokenizer", GPT, ["model.vocab_size=100"], {}, "model.vocab_size"),
    ("min_lr_above_lr", GPT, ["train.min_lr=1.0"], {}, "train.min_lr"),
    ("offload_without_recompute", GPT, ["train.offload_activations=true"], {},
     "train.offload_activations"),
    ("loss_chunk_negative", GPT, ["train.loss_chunk_tokens=-1"], {}, "train.loss_chunk_tokens"),
    ("bf16_with_cpu_device", GPT, ["train.dtype=bfloat16", "run.device=cpu"], {}, "train.dtype"),
    ("fp32_with_gpu_device", GPT, ["train.dtype=float32", "run.device=gpu"], {}, "train.dtype"),
    ("section_of_another_recipe", DPO, ["run.recipe=pretrain"], {}, "lora"),
    ("overwrite_resume_inside", GPT,
     ["run.output_dir={tmp}/run", "run.overwrite=true",
      "checkpoint.resume={tmp}/run/checkpoints/step_2"], {}, "run.overwrite"),
    ("router_bias_with_lora", DPO, ["model.router_bias_update_rate=0.001"], {},
     "model.router_bias_update_rate"),
    ("lora_targets_empty", DPO, ["lora.target_modules=[]"], {}, "lora.target_modules"),
    ("label_smoothing_vs_loss", DPO, ["dpo.label_smoothing=0.1", "dpo.loss_type=ipo"], {},
     "dpo.label_smoothing"),
    ("dpo_trains_no_mtp", DPO, ["model.mtp_layers=1", "model.mtp_loss_weight=0.3"], {},
     "model.mtp_loss_weight"),
    ("max_restarts_negative", GPT, ["run.max_restarts=-1"], {}, "run.max_restarts"),
    ("preempt_signal_unknown", GPT, ["run.preempt_signal=SIGKILL"], {}, "run.preempt_signal"),
    ("straggler_ratio_not_above_1", GPT, ["run.straggler_ratio=1"], {}, "run.straggler_ratio"),
    ("straggler_window_negative", GPT, ["run.straggler_window=-1"], {}, "run.straggler_window"),
    ("checkpoint_write_zero", GPT, ["hardware.checkpoint_write_gb_per_s=0"], {},
     "hardware.checkpoint_write_gb_per_s"),
    # this machine (no GPU) and the model directory, checked by the same preflight
    ("gpu_device_here", GPT, ["run.device=gpu"], {}, "run.device"),
    ("bf16_here", GPT, ["train.dtype=bfloat16"], {}, "train.dtype"),
    ("mtp_without_tensors", MOE,
     ["model.from_pretrained={mtp_dir}", "data.tokenizer=byte", "data.seq_len=64"], {},
     "model.mtp_layers"),
]  # fmt: skip


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The directories cases point at, and a CP mode without chunked attention."""
    tmp = tmp_path_factory.mktemp("fixes")
    (tmp / "run" / "checkpoints" / "step_2").mkdir(parents=True)
    args = preset("tiny_glm_moe", vocab_size=300, max_seq_len=64)
    model_dir = tmp / "glm45"
    save_hf_checkpoint(build_model(args, seed=5), model_dir)
    mtp_dir = tmp / "glm45_saved_by_transformers"
    save_hf_checkpoint(build_model(args, seed=5), mtp_dir)
    declared = {**hf_config(args), "num_nextn_predict_layers": 1}
    (mtp_dir / "config.json").write_text(json.dumps(declared))
    ring = cp_modes.CPMode("ring_like", 1, lambda w, c, m, k: Assignment.contiguous(w),
                           implementation="flashcp.attention.local:LOCAL")  # fmt: skip
    cp_modes.register(ring)
    yield {"{tmp}": str(tmp), "{model_dir}": str(model_dir), "{mtp_dir}": str(mtp_dir)}
    del cp_modes.MODES["ring_like"]


@pytest.fixture(autouse=True)
def _no_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (fa_dispatch.FLAG_VERSION, fa_dispatch.ENV_FA4_POLICY):
        monkeypatch.delenv(key, raising=False)


def printed_fixes(error: Problem) -> list[list[str]]:
    """The fixes as the printed line gives them: each `set key=value ...` of the message."""
    fixes = []
    for part in re.split(r"(?:^|, or |: )set ", error.message)[1:]:
        words = []
        for word in part.split(" "):
            word = word.rstrip(",")
            if not re.match(r"^[\w.]+=", word):
                break
            words.append(word)
        if words:
            fixes.append(words)
    return fixes


def _check(config: str, overrides: list[str], launch: dict[str, int]) -> list[Problem]:
    _, errors = check_raw(read_yaml(ROOT / config), source=config, overrides=overrides,
                          **launch)  # fmt: skip
    return errors


def _fill(items: list[str], places: dict[str, str]) -> list[str]:
    out = []
    for item in items:
        for key, value in places.items():
            item = item.replace(key, value)
        out.append(item)
    return out


CONFIG = Path(inspect.getfile(Checks)).parent


def _fix_sites() -> list[tuple[str, int, int]]:
    """(file, first line, last line) of every `add(..., fixes=...)` call in `flashcp.config`
    (the core rules, the layout rules, each recipe's rules)."""
    return [
        (path.name, node.lineno, node.end_lineno)  # type: ignore[misc]
        for path in sorted(CONFIG.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add"
        and any(k.arg == "fixes" for k in node.keywords)
    ]


def test_every_printed_fix_is_valid(
    places: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each case's refusal names at least one fix; each printed fix, applied after the case's
    own overrides, leaves no problem but the case's other ones; and the cases reach every
    `add(..., fixes=...)` of `flashcp.config`."""
    hit: set[tuple[str, int]] = set()
    original = Checks.add

    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("fixes"):
            caller = sys._getframe(1)
            hit.add((Path(caller.f_code.co_filename).name, caller.f_lineno))
        original(self, *args, **kwargs)

    monkeypatch.setattr(Checks, "add", recording)
    for name, config, overrides, launch, key in CASES:
        given = _fill(overrides, places)
        errors = _check(config, given, launch)
        mine = [e for e in errors if e.key == key]
        assert len(mine) == 1, f"{name}: {errors}"
        fixes = printed_fixes(mine[0])
        assert fixes, f"{name}: {mine[0]} names no fix"
        others = {e.key for e in errors if e is not mine[0]}
        for fix in fixes:
            after = _check(config, [*given, *fix], launch)
            assert all(e.key in others for e in after), f"{name}: {' '.join(fix)}: {after}"
    sites = _fix_sites()
    assert len(sites) >= 20
    missed = [(name, a, b) for name, a, b in sites
              if not any(name == f and a <= line <= b for f, line in hit)]  # fmt: skip
    assert missed == [], f"{missed} (file, lines) offer fixes no case checks"


def test_the_fixes_the_issue_names(places: dict[str, str]) -> None:
    """A from_pretrained model's max_seq_len is its config.json's: "raise model.max_seq_len" is
    not offered (the preset's is); parallel.cp=3 comes with a seq_len that divides by 6."""
    pretrained = _fill(["model.from_pretrained={model_dir}", "data.tokenizer=byte",
                        "data.seq_len=128"], places)  # fmt: skip
    (error,) = _check(MOE, pretrained, {})
    assert printed_fixes(error) == [["data.seq_len=64"]]
    (error,) = _check(GPT, ["data.seq_len=512"], {})
    assert printed_fixes(error) == [["data.seq_len=256"], ["model.max_seq_len=512"]]
    (error,) = _check(GPT, [], {"world_size": 3})
    assert printed_fixes(error) == [["parallel.cp=3", "data.seq_len=252"]]
    assert error.message.endswith(", or launch with --nproc_per_node 2")
    (error,) = _check(GPT, ["train.dtype=float32", "run.device=gpu"], {})  # no GPU here
    assert printed_fixes(error) == [["run.device=cpu"]]


def test_printed_fixes_parse_what_the_message_says() -> None:
    """The reader of the printed line (what the test applies) against known lines."""
    err = Problem("k", "bad", ((("a.b", 1), ("c.d", [3, 2])), (("e", None),)), "go away")
    assert err.message == "bad: set a.b=1 c.d=[3,2], or set e=null, or go away"
    assert printed_fixes(err) == [["a.b=1", "c.d=[3,2]"], ["e=null"]]
    assert printed_fixes(Problem("k", "bad [set on the command line: x=1]")) == []


@pytest.mark.parametrize("path", sorted(Path(ROOT / "configs").rglob("tiny_*.yaml")), ids=str)
def test_shipped_tiny_configs_pass_the_preflight(path: Path) -> None:
    """The negative control: no shipped tiny config is refused (nothing to fix)."""
    assert _check(str(path.relative_to(ROOT)), [], {}) == []
