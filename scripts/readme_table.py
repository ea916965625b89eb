"""`python scripts/readme_table.py [--write | --check]`: the README's "Measured here" table from
the benchmark JSON, `bench.readme_table`."""

import sys

from bench.readme_table import main

if __name__ == "__main__":
    sys.exit(main())
