"""Evaluation on a held-out set (`eval.path`), one package by role:

* `evaluator`: the evaluation itself — an eval set dealt over the run's layout and run
  forward-only through the recipe's own loss (`Evaluator`, `build_evaluator`), when it is due
  during training (`is_due`) and its log line; the trainer runs it every `eval.every` steps;
* `command`: `flashcp eval`, a model or a run's checkpoint evaluated without training
  (`Evaluation`, one per rank; `check`, `select_weights`), which writes `eval_results.json`.

The trainer imports `evaluator`; `command` builds its ranks as training does
(`flashcp.parallelize`) and sits beside it, below the trainer.
"""
