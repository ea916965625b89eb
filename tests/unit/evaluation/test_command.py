"""`flashcp eval` (`flashcp.evaluation.command`) in one process, through the CLI as a user runs it.

* A run's checkpoint evaluated on its eval set gives what the run's own evaluation after that
  step gave (the held-out loss, perplexity and targets; DPO: loss, rewards, margin, accuracy,
  with LoRA and without) within the float32 rule, counts exactly; the checkpoint of another
  step is rejected by the same rule (negative control). Without LoRA the DPO reference must be
  the starting weights, not the loaded checkpoint (which would make every margin 0).
* A model directory alone: DPO compares the model with itself (loss log 2, rewards 0), and
  says so.
* What is refused before anything is built: no eval set, nothing to evaluate (a seeded random
  model), only broken checkpoints, a directory that is no run; results are never overwritten.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import numerics
from flashcp import cli
from flashcp.data.sources import BUILTIN_CORPUS, read_records
from flashcp.metrics.writer import read_metrics
from flashcp.rundir import EVAL_RESULTS_FILE
from helpers.configs import TINY_GLM, TINY_LM, merged, tiny_config
from helpers.paths import ROOT
from helpers.trainruns import Fit

DPO_FILE = ROOT / "src" / "flashcp" / "data" / "dpo_default.jsonl"


def _eval(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["eval", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _results(run: Path) -> dict[str, Any]:
    return json.loads((run / EVAL_RESULTS_FILE).read_text())


def _evals(run: Path) -> dict[int, dict[str, float]]:
    """The run's own evaluations by step."""
    return {int(r["step"]): {k: v for k, v in r.items() if k.startswith("eval/")}
            for r in read_metrics(run) if "eval/loss" in r}  # fmt: skip


@pytest.mark.equivalence
def test_a_run_checkpoint_evaluates_as_the_run_did(
    tmp_path: Path, fit: Fit, capsys: pytest.CaptureFixture[str]
) -> None:
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in read_records(BUILTIN_CORPUS)[-9:]))
    cfg = tiny_config(tmp_path, base=TINY_LM, train={"steps": 2},
                      checkpoint={"every": 1, "keep_last": 2},
                      eval={"path": str(held_out), "every": 1})  # fmt: skip
    fit(cfg)
    run = Path(cfg.run.output_dir)
    code, out, _ = _eval([str(run)], capsys)
    assert code == 0, out
    want = _evals(run)[2]
    got = _results(run)
    assert got["weights"]["step"] == 2 and got["weights"]["checkpoint"].endswith("step_2")
    metrics = got["metrics"]
    for key in ("eval/targets", "eval/rows", "eval/batches"):
        assert metrics[key] == want[key], key
    n, loss = want["eval/targets"], want["eval/loss"]
    numerics.assert_close(metrics["eval/loss"], loss, n=n, scale=loss, what="eval/loss")
    assert metrics["eval/perplexity"] == pytest.approx(math.exp(metrics["eval/loss"]))
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"flashcp eval pretrain: loss {metrics['eval/loss']:.4f} | perplexity")
    assert f"{int(n):,} targets in {int(want['eval/rows'])} rows" in last
    assert f"results {run / EVAL_RESULTS_FILE}" in last
    assert got["provenance"]["command"] and got["degrees"] == {"dp": 1, "pp": 1, "cp": 1,
                                                                "ep": 1}  # fmt: skip
    # negative control: step 1's checkpoint (named by checkpoint.resume) is another model
    code, out, _ = _eval([str(run), f"checkpoint.resume={run / 'checkpoints' / 'step_1'}"],
                         capsys)  # fmt: skip
    assert code == 0 and "kept the earlier eval_results.json as" in out
    stale = _results(run)["metrics"]["eval/loss"]
    numerics.assert_close(stale, _evals(run)[1]["eval/loss"], n=n, scale=loss)
    numerics.assert_rejects(stale, loss, n=n, scale=loss)
    (kept,) = run.glob("eval_results.old-*.json")  # the first results, not overwritten
    assert json.loads(kept.read_text())["metrics"] == metrics


DPO: dict[str, dict[str, Any]] = merged(
    TINY_GLM,
    model={"max_seq_len": 128},
    train={"steps": 2, "lr": 3e-3, "warmup_steps": 1, "seed": 0},
    dpo={"beta": 0.1},
    checkpoint={"every": 2},
    run={"recipe": "dpo"},
)


@pytest.mark.equivalence
@pytest.mark.parametrize("lora", [True, False])
def test_dpo_checkpoint_rewards_against_the_starting_weights(
    tmp_path: Path, fit: Fit, capsys: pytest.CaptureFixture[str], lora: bool
) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(DPO_FILE.read_text().splitlines()[-7:]) + "\n")
    extra = {"lora": {"rank": 4, "target_modules": [".*q_proj", ".*v_proj"]}} if lora else {}
    cfg = tiny_config(tmp_path, base=DPO, eval={"path": str(pairs)}, **extra)
    fit(cfg)
    run = Path(cfg.run.output_dir)
    code, out, _ = _eval([str(run)], capsys)
    assert code == 0, out
    want, got = _evals(run)[2], _results(run)["metrics"]
    for key in ("eval/examples", "eval/targets", "eval/rewards/accuracy"):
        assert got[key] == want[key], key
    n = want["eval/targets"] / want["eval/examples"]  # the rule's DPO basis (test_evaluate)
    scale = 0.1 * (abs(want["eval/logps/chosen"]) + abs(want["eval/logps/rejected"]))
    for key in ("eval/loss", "eval/rewards/margin", "eval/rewards/chosen"):
        numerics.assert_close(got[key], want[key], n=n, scale=scale, what=key)
    assert abs(want["eval/rewards/margin"]) > 1e-3  # the policy moved away from its reference
    reference = _results(run)["reference"]
    assert ("adapters off" in reference) if lora else ("starting weights" in reference)
    assert "rewards/accuracy" in out.strip().splitlines()[-1]


def test_a_model_alone_is_its_own_dpo_reference(
    tmp_path: Path, fit: Fit, capsys: pytest.CaptureFixture[str]
) -> None:
    """No checkpoint (checkpoint.resume=never): the weights the run started from (its
    init_from, an HF-layout export of a seeded model) against themselves."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(DPO_FILE.read_text().splitlines()[-5:]) + "\n")
    from flashcp.models import build_model
    from flashcp.models.hf_save import save_hf_checkpoint

    cfg = tiny_config(tmp_path, base=DPO, eval={"path": str(pairs)})
    start = tmp_path / "start"
    save_hf_checkpoint(build_model(cfg.model, seed=3), start)
    config = tmp_path / "dpo.yaml"
    config.write_text(json.dumps(merged(DPO, eval={"path": str(pairs)},
                                        checkpoint={"init_from": str(start)},
                                        run={"output_dir": str(tmp_path / "out")})))  # fmt: skip
    code, out, _ = _eval([str(config)], capsys)
    assert code == 0, out
    got = _results(tmp_path / "out")
    assert got["weights"] == {"checkpoint": None, "step": None, "start": str(start)}
    m = got["metrics"]
    assert m["eval/rewards/margin"] == m["eval/rewards/accuracy"] == 0.0
    # every pair's margin is exactly 0, so its loss is float32 softplus(0) = log 2 up to one
    # rounding, averaged over the pairs in float32: the rule with n = the pairs, scale = log 2
    numerics.assert_close(m["eval/loss"], math.log(2), n=m["eval/examples"], scale=math.log(2),
                          what="eval/loss")  # fmt: skip
    assert "note: the reference is the model itself" in out and "rewards and margins are 0" in out


def test_what_eval_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    held_out = tmp_path / "x.jsonl"
    held_out.write_text(json.dumps({"text": "held out"}) + "\n")
    config = tmp_path / "c.yaml"
    raw = merged(TINY_LM, run={"output_dir": str(tmp_path / "empty")})
    config.write_text(json.dumps(raw))
    code, _, err = _eval([str(config), f"eval.path={held_out}"], capsys)
    assert code == 2 and "nothing to evaluate" in err and "model.from_pretrained" in err
    code, _, err = _eval([str(config)], capsys)
    assert code == 2 and "eval.path: null: set eval.path" in err
    # the config's preflight, as `flashcp train` and `flashcp validate` run it, on what an
    # evaluation reads (issue 38): a held-out set with no usable record is refused before any
    # model is built; the same set with a record passes that check (the control, above)
    empty = tmp_path / "empty_text.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    code, _, err = _eval([str(config), f"eval.path={empty}"], capsys)
    assert code == 2 and f"eval.path: {empty}: no usable records" in err, err
    code, _, err = _eval([str(tmp_path)], capsys)
    assert code == 2 and "without config.yaml or config.json" in err
    broken = tmp_path / "empty" / "checkpoints" / "step_3"
    broken.mkdir(parents=True)
    (broken / "model.safetensors").write_bytes(b"torn")
    code, _, err = _eval([str(config), f"eval.path={held_out}"], capsys)
    assert code == 2 and "no intact checkpoint" in err
    assert not (tmp_path / "empty" / EVAL_RESULTS_FILE).exists()


def test_eval_of_a_hugging_face_model_directory_as_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flashcp eval DIR` on a model directory (config.json + weights + tokenizer, no
    config.yaml) evaluates that model with its tokenizer, as `lm-eval` / transformers do
    (issue 37): the loss of its own weights, not of a seeded initialisation."""
    from flashcp.data.tokenizer import ByteTokenizer
    from flashcp.models import build_model, preset
    from flashcp.models.hf_save import save_hf_checkpoint

    directory = tmp_path / "Qwen3-tiny"
    save_hf_checkpoint(build_model(preset("tiny_qwen3"), seed=3), directory)
    ByteTokenizer().save_pretrained(directory)  # a tokenizer directory AutoTokenizer reads
    held_out = tmp_path / "x.jsonl"
    held_out.write_text("".join(json.dumps({"text": f"held out row {i}"}) + "\n"
                                for i in range(8)))  # fmt: skip
    out = tmp_path / "eval"
    code, text, err = _eval([str(directory), f"eval.path={held_out}", f"run.output_dir={out}"],
                            capsys)  # fmt: skip
    assert code == 0, err
    got = _results(out)
    assert got["weights"]["start"] == str(directory.resolve())
    again = tmp_path / "again"
    save_hf_checkpoint(build_model(preset("tiny_qwen3"), seed=4), directory)  # other weights
    code, _, err = _eval([str(directory), f"eval.path={held_out}", f"run.output_dir={again}"],
                         capsys)  # fmt: skip
    assert code == 0, err
    assert _results(again)["metrics"]["eval/loss"] != got["metrics"]["eval/loss"]
