"""A benchmark's outputs: its raw record (JSON) and the Markdown page rendered from that record
alone, so no figure on a page can disagree with the data; `--report-only` re-renders the page
from the JSON without measuring anything.

Page prose lives in Jinja2 templates (`templates/*.md.j2`); a benchmark's `view(record)` adds
the figures that take more than formatting to derive. The filters below are the formatting
every page shares.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from bench import stats

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TEMPLATES = Path(__file__).resolve().parent / "templates"
DASH = "–"
"""What a table cell shows for a figure that was not measured."""

Record = dict[str, Any]


def fmt(value: float | None, spec: str = "", none: str = DASH) -> str:
    """`value` in the format `spec` (`format(value, spec)`), `none` when it is missing."""
    return none if value is None else format(value, spec)


def span(values: Iterable[float], spec: str = ".4f", sep: str = DASH) -> str:
    """`lo–hi` of `values` in the format `spec`, or one number when both ends read the same."""
    values = list(values)
    lo, hi = format(min(values), spec), format(max(values), spec)
    return lo if lo == hi else f"{lo}{sep}{hi}"


def spread(record: Mapping[str, float] | None, spec: str = ".3f") -> str:
    """`median (min–max)` of a `bench.stats.spread` record, a dash when there is none."""
    if not record:
        return DASH
    return (
        f"{format(record['median'], spec)} "
        f"({format(record['min'], spec)}{DASH}{format(record['max'], spec)})"
    )


ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES, encoding="utf-8"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)
ENV.filters.update(fmt=fmt, span=span, spread=spread, median=stats.median)


def render(template: str, **context: Any) -> str:
    """The page `templates/<template>` rendered with `context`."""
    return ENV.get_template(template).render(**context)


def macro(template: str, name: str) -> Callable[..., str]:
    """Macro `name` of `templates/<template>` (a table a benchmark also prints on its own)."""
    return getattr(ENV.get_template(template).module, name)


def write_json(path: Path, record: Record, indent: int = 2) -> None:
    """`record` as indented JSON with a final newline (parent directories created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=indent) + "\n")


def shown(path: Path) -> str:
    """`path` relative to the repository when inside it (for messages)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class Page:
    """One benchmark's JSON record and the page rendered from it.

    `add_arguments` gives the benchmark `--json` (default `default_json`), `--markdown`
    (default: the JSON path with `.md`) and `--report-only`; `write` stores a fresh record and
    its page; `rewrite` is what `--report-only` does.
    """

    template: str
    default_json: Path
    view: Callable[[Record], Mapping[str, Any]] | None = None
    indent: int = 2

    def render(self, record: Record) -> str:
        """The whole page, every figure from `record`."""
        context = self.view(record) if self.view is not None else {}
        return render(self.template, rec=record, **context)

    def add_arguments(
        self,
        parser: argparse.ArgumentParser,
        report_only: str = "re-render the page from --json, no run",
    ) -> None:
        parser.add_argument(
            "--json", type=Path, default=self.default_json, help="the record (raw results)"
        )
        parser.add_argument(
            "--markdown", type=Path, default=None, help="the page (default: --json with .md)"
        )
        parser.add_argument("--report-only", action="store_true", help=report_only)

    def paths(self, args: argparse.Namespace) -> tuple[Path, Path]:
        """(the record, the page) named by `args`."""
        return args.json, args.markdown or args.json.with_suffix(".md")

    def load(self, args: argparse.Namespace) -> Record:
        return json.loads(self.paths(args)[0].read_text())

    def write(self, args: argparse.Namespace, record: Record) -> str:
        """Store `record` and its page; returns the page."""
        out, md = self.paths(args)
        write_json(out, record, self.indent)
        page = self.render(record)
        md.write_text(page)
        print(f"wrote {shown(out)} and {shown(md)}")
        return page

    def rewrite(self, args: argparse.Namespace) -> int:
        """`--report-only`: the page again from the stored record; exit status 0."""
        md = self.paths(args)[1]
        md.write_text(self.render(self.load(args)))
        print(f"wrote {shown(md)}")
        return 0
