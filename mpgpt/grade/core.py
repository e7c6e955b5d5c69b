"""What every graded component shares: a behaviour check, loading a learner's file, the report.

A component (one module of this package per chapter piece) provides

    NAME        "ch5-scaler"
    STUB        the file a learner starts from: docstrings, ``raise NotImplementedError``
    checks()    the behaviours, in the order they are graded: a list of :class:`Check`

A check receives the learner's module and raises :class:`Failed` (or anything else) when the
behaviour is wrong. The report says PASS or FAIL for each behaviour, and after a FAIL the short
hint of that check and what was seen: never the reference code, which is nowhere in a check.
"""
from __future__ import annotations

import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable


class Failed(Exception):
    """A behaviour is wrong; the message says what was seen (one line, no reference values in bulk)."""


@dataclass(frozen=True)
class Check:
    """One graded behaviour: ``run(module)`` returns on success and raises on failure."""

    name: str
    hint: str
    run: Callable[[ModuleType], None]


def expect(condition: bool, seen: str) -> None:
    """Raise Failed(seen) unless condition holds."""
    if not condition:
        raise Failed(seen)


def load_module(path: str | Path) -> ModuleType:
    """Import a learner's .py file as a fresh module (its own name, not cached between gradings)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; pass the path of your .py file "
                                "(write a stub with `python -m mpgpt.grade --stub <component> -o FILE`)")
    name = f"mpgpt_graded_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and Triton look their module up by name
    spec.loader.exec_module(module)
    return module


def _seen(exc: BaseException, learner_file: str | None) -> str:
    """One line about what went wrong, naming the learner's own line when it raised there."""
    if isinstance(exc, Failed):
        return str(exc)
    if isinstance(exc, NotImplementedError):
        return "not implemented yet (NotImplementedError)"
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if learner_file and frame.filename == learner_file:
            where = f" (line {frame.lineno} of {Path(learner_file).name})"
            break
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"raised {type(exc).__name__}{': ' + text if text else ''}{where}"


@dataclass(frozen=True)
class Outcome:
    name: str
    passed: bool
    hint: str = ""
    seen: str = ""

    def line(self) -> str:
        if self.passed:
            return f"PASS  {self.name}"
        return f"FAIL  {self.name}: {self.seen}. Hint: {self.hint}"


def grade(checks: list[Check], module: ModuleType) -> list[Outcome]:
    """Run every check on the module; a failing check never stops the others."""
    outcomes = []
    for check in checks:
        try:
            check.run(module)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a learner's bug may raise anything, sys.exit() too: that behaviour fails
            outcomes.append(Outcome(check.name, False, check.hint, _seen(exc, getattr(module, "__file__", None))))
        else:
            outcomes.append(Outcome(check.name, True))
    return outcomes
