"""What the tests share: the dense attention oracle (`reference`), mask and MoE references, fake
groups, a bf16 toy model, model inputs (`batches`), the tiny configs (`configs`), repository
paths (`paths`), and the multi-process harness (`launch`, `trainruns`) over the library's own
supervisor. Imported as `helpers` from `tests/`, which pytest puts on `sys.path` (`pythonpath`
in pyproject.toml) and the harness puts on launched workers' `PYTHONPATH`. What the scripts use
as well lives on their side and the tests import it from there: the float32 comparison rule
(`bench.numerics`) and `flashcp train` jobs with their golden losses (`bench.jobs`)."""
