"""What the tests share: the float32 comparison rule (`numerics`), the dense attention oracle
(`reference`), mask and MoE references, fake groups, the tiny configs and the in-process run
(`configs`), and the multi-process harness (`launch`, `jobs`, `trainruns`) over the library's
own supervisor. Imported as `helpers` from `tests/`, which pytest puts on `sys.path`
(`pythonpath` in pyproject.toml) and the harness puts on launched workers' `PYTHONPATH`."""
