"""One launched process of the CP benchmarks, `bench.cp_worker` (run by `bench.cp` under
`paddle.distributed.launch`)."""

from bench.cp_worker import main

if __name__ == "__main__":
    main()
