"""`python scripts/bench_data.py ...`: the data-pipeline benchmark, `bench.data` (its docstring
says what it measures and how)."""

from bench.data import main

if __name__ == "__main__":
    main()
