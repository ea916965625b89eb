"""A researcher's first week, through the command line only (issue 27's done-when): a GLM-4
directory saved by transformers → `flashcp train` SFT at CP 2 on ShareGPT rows → `flashcp
export` → `flashcp train` DPO + LoRA at CP 2 from that export on TRL implicit-prompt rows →
`flashcp eval` of the DPO run → `flashcp export --merge-lora` → transformers'
`AutoModelForCausalLM` and `AutoTokenizer` load the export, and its cross-entropy on the
assistant tokens of held-out conversations equals `flashcp eval` of the same directory.

Every step is a `flashcp` process, as a user types it (no Python call into flashcp), with the
shipped tiny configs and only command-line overrides; the ranks run without torch on their
path (as a user's do). Nothing sets `checkpoint.every`: the final step is saved by default,
which `flashcp export` needs.

Marker `hf`: run with `bash scripts/test.sh hf` (installs torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import numerics
from bench.hfdir import chat_records, preference_records, write_jsonl
from flashcp.rundir import EVAL_RESULTS_FILE
from helpers.paths import CONFIGS, ROOT

from .test_eval_reference import SEQ_LEN, _directory, _reference
from .test_hf_reference import _transformers

pytestmark = pytest.mark.hf


def flashcp(*args: str, cwd: Path) -> str:
    """`flashcp ARGS` as a user runs it (torch off the path); its output; exit 0 asserted."""
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "hf-torch" not in p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(
        [sys.executable, "-m", "flashcp", *args], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"flashcp {' '.join(args)} exited {done.returncode}:\n{out}"
    return out


def sharegpt(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversations as ShareGPT rows (`conversations`: `from` human/gpt/system)."""
    role = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"conversations": [{"from": role[m["role"]], "value": m["content"]}
                               for m in r["messages"]]} for r in records]  # fmt: skip


def implicit_prompt(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's implicit-prompt preference rows: `chosen` / `rejected` whole conversations."""
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
            for r in records]  # fmt: skip


@pytest.mark.timeout(900)
def test_hf_directory_sft_dpo_lora_eval_export_through_the_cli(tmp_path: Path) -> None:
    _, base = _directory(tmp_path, "glm")
    sft_rows = write_jsonl(tmp_path / "sft.jsonl", sharegpt(chat_records(24)))
    prefs = write_jsonl(tmp_path / "prefs.jsonl",
                        implicit_prompt(preference_records(16, as_messages=True)))  # fmt: skip
    held_out_prefs = write_jsonl(tmp_path / "held_out_prefs.jsonl",
                                 preference_records(6, as_messages=True, start=30))  # fmt: skip
    held_out = chat_records(6, start=40)
    held_out_chat = write_jsonl(tmp_path / "held_out.jsonl", held_out)
    common = [f"data.seq_len={SEQ_LEN}", "train.steps=3", "train.lr=1e-3"]

    # SFT at CP 2 from the transformers directory (replacing the config's preset)
    sft = tmp_path / "sft"
    out = flashcp("train", str(CONFIGS / "glm" / "tiny_cp2.yaml"), f"model.from_pretrained={base}",
                  "run.recipe=sft", f"data.path={sft_rows}", *common, f"run.output_dir={sft}",
                  cwd=ROOT)  # fmt: skip
    assert "step 3/3" in out
    sft_hf = tmp_path / "sft_hf"
    flashcp("export", str(sft), str(sft_hf), cwd=ROOT)  # the final step, saved by default

    # DPO + LoRA at CP 2 from the SFT export
    dpo = tmp_path / "dpo"
    out = flashcp("train", str(CONFIGS / "glm" / "tiny_dpo_lora_cp2.yaml"),
                  f"model.from_pretrained={sft_hf}", f"data.path={prefs}", *common,
                  f"run.output_dir={dpo}", cwd=ROOT)  # fmt: skip
    assert "step 3/3" in out

    # flashcp eval of the DPO run on held-out preferences (its layout, launched)
    out = flashcp("eval", str(dpo), f"eval.path={held_out_prefs}", cwd=ROOT)
    results = json.loads((dpo / EVAL_RESULTS_FILE).read_text())["metrics"]
    assert results["eval/examples"] == 6
    assert {"eval/rewards/accuracy", "eval/rewards/margin", "eval/loss"} <= results.keys()

    # the merged export loads into transformers with its tokenizer ...
    merged = tmp_path / "merged"
    flashcp("export", str(dpo), str(merged), "--merge-lora", cwd=ROOT)
    tf = _transformers()
    model = tf.AutoModelForCausalLM.from_pretrained(str(merged), attn_implementation="eager")
    tokenizer = tf.AutoTokenizer.from_pretrained(str(merged))
    assert tokenizer.chat_template is not None
    # ... and its held-out cross-entropy on the assistant tokens is flashcp eval's of it
    config = tmp_path / "eval_merged.yaml"
    config.write_text(json.dumps({
        "model": {"from_pretrained": str(merged)},
        "data": {"seq_len": SEQ_LEN, "micro_batch_size": 2},
        "eval": {"path": str(held_out_chat)},
        "run": {"recipe": "sft", "device": "cpu", "output_dir": str(tmp_path / "eval_merged")},
    }))  # fmt: skip
    flashcp("eval", str(config), cwd=ROOT)
    got = json.loads((tmp_path / "eval_merged" / EVAL_RESULTS_FILE).read_text())["metrics"]
    nll, targets, _ = _reference(model, merged, held_out)
    assert got["eval/targets"] == targets
    want = nll / targets
    numerics.assert_close(got["eval/loss"], want, n=targets, scale=want, what="eval/loss")
    # negative control: the base directory's cross-entropy is another number
    base_nll, _, _ = _reference(tf.AutoModelForCausalLM.from_pretrained(str(base)), base,
                                held_out)  # fmt: skip
    numerics.assert_rejects(got["eval/loss"], base_nll / targets, n=targets, scale=want)
