"""Evaluation on a held-out set (`eval.path`), one package by role:

* `evaluator`: the evaluation itself — an eval set dealt over the run's layout and run
  forward-only through the recipe's own loss (`Evaluator`, `build_evaluator`), a training
  run's evaluator and when it is due (`training_evaluator`, `run_if_due`: every `eval.every`
  steps and after the last) and its log line;
* `command`: `flashcp eval`, a model or a run's checkpoint evaluated without training
  (`Evaluation`, one per rank; `check`, `select_weights`), which writes `eval_results.json`.

The trainer imports `evaluator`; `command` builds its ranks as training does
(`flashcp.parallelize`) and sits beside it, below the trainer.
"""
