"""`python -m flashcp` runs the same CLI as the `flashcp` console script."""

from flashcp.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
