"""``python -m mpgpt.grade``: list the components, write a stub, grade a learner's file.

    python -m mpgpt.grade --list
    python -m mpgpt.grade --stub ch5-scaler -o my_scaler.py
    python -m mpgpt.grade ch5-scaler my_scaler.py [--seed N] [--time-limit S] [--memory-limit MB]

The file is imported and run in a child process, in a fresh folder, with a time limit per
behaviour and a memory limit; the verdict is decided here (mpgpt.grade.sandbox).

Exit status: 0 when every behaviour passes, 1 when any fails or the file uses the package's own
implementation, 2 for a usage error or a file that cannot be imported (one line on stderr says what
to do), 130 when interrupted.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpgpt.grade import COMPONENTS, component
from mpgpt.grade.sandbox import Report, UsageError, grade_file


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the usage block
        raise UsageError(f"{message} (python -m mpgpt.grade --help shows the options)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m mpgpt.grade",
                description="Grade your implementation of a course component with the course's checks.")
    p.add_argument("component", nargs="?", help="what to grade, e.g. ch5-scaler (see --list)")
    p.add_argument("path", nargs="?", help="your .py file")
    p.add_argument("--list", action="store_true", help="list the components and exit")
    p.add_argument("--stub", metavar="COMPONENT", help="write the stub of COMPONENT (to stdout, or -o FILE)")
    p.add_argument("-o", "--output", metavar="FILE", help="with --stub: write it to FILE (never overwrites)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random cases (default 0: the same file gives the same report)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                   help="seconds allowed for importing the file and for each behaviour (default 60)")
    p.add_argument("--memory-limit", type=int, default=8192, metavar="MB",
                   help="memory the child process may use, in MB (default 8192)")
    p.add_argument("--show-output", action="store_true", help="also show what your file printed")
    return p


def _write_stub(name: str, output: str | None) -> int:
    try:
        stub = component(name).STUB
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not output:
        sys.stdout.write(stub)
        return 0
    out = Path(output)
    if out.exists():
        raise UsageError(f"{out} exists already; pass another -o FILE or delete it first")
    if not out.parent.is_dir():
        raise UsageError(f"cannot write {out}: the folder {out.parent} does not exist; create it or pass "
                         "another -o FILE")
    try:
        with open(out, "x", encoding="utf-8") as f:
            f.write(stub)
    except OSError as exc:
        raise UsageError(f"cannot write {out} ({exc.strerror or exc}); pass -o with a file in a folder you can "
                         "write to") from None
    print(f"wrote the {name} stub to {out}; grade it with: python -m mpgpt.grade {name} {out}")
    return 0


def printable(text: str) -> str:
    """Text from the learner's file (an exception's message, what it printed) as it may be shown:
    control characters escaped, so a carriage return or a terminal escape cannot dress a FAIL line
    up as a PASS."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def legend(report: Report) -> list[str]:
    """Lines that explain the notation of the failure lines, when one uses it."""
    text = getattr(component(report.component), "LEGEND", "")
    failed = [o for o in report.outcomes if not o.passed]
    return [text] if text and any("flags" in o.seen for o in failed) else []


def print_report(report: Report, show_output: bool = False) -> int:
    """Print the report; the exit status it calls for."""
    if report.problem and not report.refused:
        raise UsageError(printable(report.problem).replace("\n", " "))
    print(f"grading {report.path} as {report.component}, seed {report.seed} "
          f"(--seed N draws other random cases)")
    if report.refused:
        print(f"NOT GRADED  {printable(report.problem)}")
        print(f"{report.component}: not graded (0 of {len(component(report.component).checks())} behaviours pass)")
        return 1
    for outcome in report.outcomes:
        print(printable(outcome.line()).replace("\n", " "))
    for line in legend(report):
        print(line)
    failed = sum(not o.passed for o in report.outcomes)
    if show_output and report.output.strip():
        print("--- what your file printed (not part of the grade) ---")
        print(printable(report.output.rstrip()))
    print(f"{report.component}: {len(report.outcomes) - failed} of {len(report.outcomes)} behaviours pass")
    return 0 if report.passed else 1


def _run(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for name, (_, summary) in COMPONENTS.items():
            print(f"{name:16} {summary}")
        return 0
    if args.stub:
        return _write_stub(args.stub, args.output)
    if args.output:
        raise UsageError("-o FILE goes with --stub COMPONENT")
    if not args.component or not args.path:
        raise UsageError("give a component and your file, e.g. `python -m mpgpt.grade ch5-scaler my_scaler.py` "
                         "(--list shows the components)")
    if not args.time_limit > 0 or not args.memory_limit > 0:
        raise UsageError("--time-limit and --memory-limit must be positive")
    report = grade_file(args.component, args.path, seed=args.seed, seconds=args.time_limit,
                        memory_mb=args.memory_limit)
    return print_report(report, args.show_output)


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except UsageError as exc:
        print(f"mpgpt.grade: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mpgpt.grade: interrupted; nothing was graded", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (e.g. `| head -1`)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1


if __name__ == "__main__":
    sys.exit(main())
