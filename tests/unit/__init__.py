"""Unit tests, laid out like `flashcp` (`unit/<package>/test_<module>.py`; `unit/bench` for
`scripts/bench`, `unit/repo` for the repository's own files). Every test directory is a package
(`__init__.py`), so pytest imports `unit.data.test_dpo` and `unit.recipes.test_dpo` as distinct
modules: its default import mode needs packages or unique basenames, and this suite uses
packages throughout (tests/integration and tests/hf too)."""
