"""`flashcp.problems`: how a refusal prints (one problem, several, with and without a kind or a
source) and how a fix's values are written as command-line overrides."""

from __future__ import annotations

from flashcp.problems import Problem, ProblemsError, as_fix, fix_overrides, one_line, with_note

A = Problem("train.steps", "0 is not positive", fixes=(as_fix({"train.steps": 10}),))
B = Problem("run.output_dir", "runs/x is in use", other="wait for that job to end")


def test_one_problem_prints_on_one_line() -> None:
    assert str(ProblemsError([A], "c.yaml")) == (
        "config problem in c.yaml: train.steps: 0 is not positive: set train.steps=10"
    )
    assert (
        str(ProblemsError([A]))
        == "config problem: train.steps: 0 is not positive: set train.steps=10"
    )
    # no kind: the caller's line says what failed; with a source, it is still named
    assert (
        str(ProblemsError([B], kind=""))
        == "run.output_dir: runs/x is in use: wait for that job to end"
    )
    assert str(ProblemsError([B], "c.yaml", kind="")).startswith(
        "problem in c.yaml: run.output_dir:"
    )
    bare = "run.output_dir: runs/x is in use: wait for that job to end"
    assert str(ProblemsError([B], kind="launch problem")) == "launch problem: " + bare


def test_several_problems_print_a_heading_and_a_line_each() -> None:
    assert str(ProblemsError([A, B], "c.yaml")) == (
        "2 config problems in c.yaml:\n"
        "  - train.steps: 0 is not positive: set train.steps=10\n"
        "  - run.output_dir: runs/x is in use: wait for that job to end"
    )
    assert str(ProblemsError([A, B], kind="")).startswith("2 problems:\n  - train.steps:")


def test_fix_values_are_written_as_the_command_line_reads_them() -> None:
    fix = as_fix({"a": True, "b": None, "c": [3, 2], "d": 1e-5, "e": "runs/x", "f": {"k": 1}})
    assert fix_overrides(fix) == ["a=true", "b=null", "c=[3,2]", "d=1e-05", "e=runs/x",
                                  'f={"k":1}']  # fmt: skip


def test_one_line_joins_a_message_s_lines() -> None:
    assert one_line("  first\n\n  second  \nthird\n") == "first; second; third"


def test_a_note_is_appended_to_where_the_value_came_from() -> None:
    noted = with_note(with_note(A, " [set on the command line: train.steps=0]"), " [again]")
    assert noted.note == " [set on the command line: train.steps=0] [again]" and A.note == ""
    assert str(noted).endswith(
        "set train.steps=10 [set on the command line: train.steps=0] [again]"
    )
