"""What every graded component shares: a behaviour check in three parts, the report.

A component (one module of this package per chapter piece) provides

    NAME        "ch5-scaler"
    STUB        the file a learner starts from: docstrings, ``raise NotImplementedError``
    OWN         the modules of this package that implement the component (a file that uses them
                is not graded: it would be grading the package, not the learner)
    LEGEND      one line explaining the notation of its failure lines (or "")
    checks()    the behaviours, in the order they are graded: a list of :class:`Check`

A check has three parts, so that the learner's code never runs where the verdict is decided:

    prepare(rng)              in the grader's own process, before the learner's file is imported:
                              the random inputs (from a seeded rng) and the expected results,
                              computed with torch or from known answers -> Case(inputs, expected)
    observe(module, inputs)   in a child process with the learner's file imported: run the
                              learner's code on the inputs and return what it did, as plain data
                              (numbers, strings, lists, dicts: whatever survives JSON)
    judge(case, observed)     back in the grader's process: compare what was observed with what
                              was expected; raise :class:`Failed` (with the hint for the behaviour
                              that went wrong) or return

``observe`` checks exact types (``type(x) is int``, a real tensor of the expected dtype and shape)
before it converts anything, so an int subclass whose ``==`` is always True, or a proxy object,
is reported as the wrong type instead of compared. ``judge`` only ever sees JSON data.

:func:`grade` runs all three parts in the calling process: for trusted code (the package's own
implementations, the tests of the checks). ``python -m mpgpt.grade`` runs ``observe`` in a
child process with limits (:mod:`mpgpt.grade.sandbox`).
"""
from __future__ import annotations

import base64
import json
import random
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, NamedTuple


class Failed(Exception):
    """A behaviour is wrong: ``seen`` says what was seen (one line); ``hint`` replaces the check's
    own hint when the failure says which part of the behaviour went wrong."""

    def __init__(self, seen: str, hint: str | None = None):
        super().__init__(seen)
        self.seen = seen
        self.hint = hint


class Case(NamedTuple):
    """What prepare() draws: the inputs the learner's code gets, and what the grader expects."""

    inputs: Any = None
    expected: Any = None


def _no_case(rng: random.Random) -> Case:
    return Case()


def _no_judge(case: Case, observed: Any) -> None:
    """For checks whose observe() raises Failed itself (a behaviour with no reference result)."""


@dataclass(frozen=True)
class Check:
    """One graded behaviour (see the module docstring for the three parts)."""

    name: str
    hint: str
    observe: Callable[[ModuleType, Any], Any]
    judge: Callable[[Case, Any], None] = _no_judge
    prepare: Callable[[random.Random], Case] = field(default=_no_case)


def expect(condition: bool, seen: str, hint: str | None = None) -> None:
    """Raise Failed(seen, hint) unless condition holds."""
    if not condition:
        raise Failed(seen, hint)


def exact(value: Any, *types: type, what: str) -> Any:
    """``value`` if its type is exactly one of ``types`` (not a subclass, not a proxy); else Failed."""
    if type(value) not in types:
        names = " or ".join(t.__name__ if t is not type(None) else "None" for t in types)
        raise Failed(f"{what} returned {_type_name(value)}, not {names}",
                     f"return a plain {names}; the grader accepts no subclass or wrapper")
    return value


def _type_name(value: Any) -> str:
    kind = type(value)
    module = getattr(kind, "__module__", "") or ""
    if module in ("builtins", "") or module.startswith("mpgpt_graded_"):  # a class of the learner's file
        return kind.__name__
    return f"{module}.{kind.__name__}"


# --- plain data for tensors: the child sends raw bytes, the grader's process decides dtype and shape


def tensor_data(t) -> dict:
    """A real torch.Tensor as plain data: its dtype, shape and bytes (base64)."""
    import torch

    if type(t) is not torch.Tensor:
        raise Failed(f"got {_type_name(t)}, not a torch.Tensor")
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    return {"dtype": str(t.dtype), "shape": list(t.shape),
            "bytes": base64.b64encode(raw.numpy().tobytes()).decode("ascii")}


def tensor_from(data: Any, dtype, shape) -> "torch.Tensor":
    """The tensor of :func:`tensor_data`, refusing anything but the expected dtype and shape."""
    import torch

    if not (type(data) is dict and data.get("dtype") == str(dtype) and data.get("shape") == list(shape)
            and type(data.get("bytes")) is str):
        raise Failed("the child process returned a tensor of another dtype or shape")
    raw = base64.b64decode(data["bytes"], validate=True)
    expected_size = torch.empty(0, dtype=dtype).element_size()
    for n in shape:
        expected_size *= n
    if len(raw) != expected_size:
        raise Failed("the child process returned a tensor of the wrong size")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone() if raw else \
        torch.empty(shape, dtype=dtype)


# --- running the learner's code and describing what it raised


def seen_of(exc: BaseException, learner_file: str | None) -> str:
    """One line about what went wrong, naming the learner's own line when it raised there."""
    if isinstance(exc, Failed):
        return exc.seen
    if isinstance(exc, NotImplementedError):
        return "not implemented yet (NotImplementedError)"
    where = ""
    frames = traceback.StackSummary.extract(traceback.walk_tb(exc.__traceback__), lookup_lines=False)
    for frame in reversed(frames):
        if learner_file and frame.filename == learner_file:
            where = f" (line {frame.lineno} of {Path(learner_file).name})"
            break
    try:
        text = str(exc).strip()
    except BaseException:  # an exception whose __str__ raises says nothing more
        text = ""
    text = text.splitlines()[0] if text else ""
    return f"raised {type(exc).__name__}{': ' + text[:200] if text else ''}{where}"


def observation(check: Check, module: ModuleType, inputs: Any) -> dict:
    """Run ``check.observe`` and wrap its result for the trip to the grader's process:
    {"observed": data} or {"failed": seen, "hint": text or None}. Never raises, whatever the
    learner's code raises (SystemExit, KeyboardInterrupt and a failing __str__ included)."""
    try:
        observed = check.observe(module, inputs)
        return {"observed": json.loads(json.dumps(observed))}  # plain data only
    except BaseException as exc:  # a learner's bug may raise anything: that behaviour fails
        hint = exc.hint if isinstance(exc, Failed) else None
        return {"failed": seen_of(exc, getattr(module, "__file__", None)), "hint": hint}


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


def verdict(check: Check, case: Case, result: Any) -> Outcome:
    """The outcome of one check from what its observation returned (which may be anything: it
    came from a process the learner's code ran in)."""
    if type(result) is not dict:
        return Outcome(check.name, False, check.hint, "the child process returned no result for this behaviour")
    if "failed" in result:
        seen = result["failed"] if type(result["failed"]) is str else "failed"
        hint = result.get("hint") if type(result.get("hint")) is str else check.hint
        return Outcome(check.name, False, hint or check.hint, seen)
    if "observed" not in result:
        return Outcome(check.name, False, check.hint, "the child process returned no result for this behaviour")
    try:
        check.judge(case, result["observed"])
    except Failed as exc:
        return Outcome(check.name, False, exc.hint or check.hint, exc.seen)
    except Exception as exc:  # malformed data: whatever it is, it is not a pass
        return Outcome(check.name, False, check.hint,
                       f"the child process returned data the grader cannot read ({type(exc).__name__})")
    return Outcome(check.name, True)


def case_rng(seed: int, check: Check) -> random.Random:
    """The rng of one check: from the seed and the check's name, so every check draws the same
    cases whichever others run."""
    return random.Random(f"{seed}:{check.name}")


def prepare_cases(checks: list[Check], seed: int) -> list[Case]:
    return [check.prepare(case_rng(seed, check)) for check in checks]


def load_module(path: str | Path, source: str | None = None) -> ModuleType:
    """Import a learner's .py file as a fresh module (its own name, not cached between gradings).
    ``source``: the file's text, when it was read already."""
    path = Path(path)
    if source is None and not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; pass the path of your .py file "
                                "(write a stub with `python -m mpgpt.grade --stub <component> -o FILE`)")
    name = f"mpgpt_graded_{abs(hash(str(path.resolve())))}"
    module = ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # dataclasses and Triton look their module up by name
    if source is None:
        source = path.read_text(encoding="utf-8")
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def grade(checks: list[Check], module: ModuleType, seed: int = 0) -> list[Outcome]:
    """Run every check on a module in this process (trusted code only: the learner's files are
    graded by ``python -m mpgpt.grade``, in a child process). A failing check never stops the
    others."""
    cases = prepare_cases(checks, seed)
    return [verdict(check, case, observation(check, module, case.inputs)) for check, case in zip(checks, cases)]
