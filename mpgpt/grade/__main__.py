"""``python -m mpgpt.grade``: list the components, write a stub, grade a learner's file.

    python -m mpgpt.grade --list
    python -m mpgpt.grade --stub ch5-scaler -o my_scaler.py
    python -m mpgpt.grade ch5-scaler my_scaler.py

Exit status: 0 when every behaviour passes, 1 when any fails, 2 for a usage error or a file that
cannot be imported (one line on stderr says what to do).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mpgpt  # noqa: F401  (first: without a GPU it switches Triton to its interpreter)
from mpgpt.grade import COMPONENTS, component
from mpgpt.grade.core import grade, load_module

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpgpt.grade",
                                description="Grade your implementation of a course component with the course's checks.")
    p.add_argument("component", nargs="?", help="what to grade, e.g. ch5-scaler (see --list)")
    p.add_argument("path", nargs="?", help="your .py file")
    p.add_argument("--list", action="store_true", help="list the components and exit")
    p.add_argument("--stub", metavar="COMPONENT", help="write the stub of COMPONENT (to stdout, or -o FILE)")
    p.add_argument("-o", "--output", metavar="FILE", help="with --stub: write it to FILE (never overwrites)")
    return p


def _fail(message: str) -> int:
    print(f"mpgpt.grade: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for name, (_, summary) in COMPONENTS.items():
            print(f"{name:16} {summary}")
        return 0
    if args.stub:
        try:
            stub = component(args.stub).STUB
        except ValueError as exc:
            return _fail(str(exc))
        if args.output:
            out = Path(args.output)
            if out.exists():
                return _fail(f"{out} exists already; pass another -o FILE or delete it first")
            out.write_text(stub, encoding="utf-8")
            print(f"wrote the {args.stub} stub to {out}; grade it with: python -m mpgpt.grade {args.stub} {out}")
        else:
            sys.stdout.write(stub)
        return 0
    if not args.component or not args.path:
        return _fail("give a component and your file, e.g. `python -m mpgpt.grade ch5-scaler my_scaler.py` "
                     "(--list shows the components)")
    try:
        graded = component(args.component)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        module = load_module(args.path)
    except FileNotFoundError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the file does not import (or calls sys.exit()): say where, not a traceback
        return _fail(f"importing {args.path} raised {type(exc).__name__}: {exc}; fix that first "
                     "(run `python {args.path}` to see the traceback)".replace("{args.path}", str(args.path)))
    outcomes = grade(graded.checks(), module)
    for outcome in outcomes:
        print(outcome.line())
    failed = sum(not o.passed for o in outcomes)
    print(f"{args.component}: {len(outcomes) - failed} of {len(outcomes)} behaviours pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
