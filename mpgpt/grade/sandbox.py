"""Grading a learner's file: the grader's process prepares and judges, a child process observes.

:func:`grade_file` is what ``python -m mpgpt.grade COMPONENT FILE`` runs:

1. read the file and refuse it if its text uses the package's own implementation of the component
   (or the reference the checks compare with): there would be nothing of the learner's to grade;
2. draw every behaviour's random inputs from the seed and compute the expected results, here,
   before any of the learner's code has run (so patching torch or the grader cannot change them);
3. start ``python -m mpgpt.grade.child`` in a fresh grading folder, in its own process group, with a
   memory limit; it imports the file and reports what the learner's code did, one JSON line per
   behaviour, into a result file of this process;
4. wait at most ``seconds`` for the import and for each behaviour; past that, kill the whole
   process group, fail that behaviour and start a fresh child for the ones left;
5. judge every behaviour here, from the plain data the child returned. The child's exit status
   and what it printed play no part: a behaviour passes only when its observation matches.
"""
from __future__ import annotations

import hmac
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import component, guard
from .child import KEY_BYTES
from .core import Case, Outcome, prepare_cases, verdict

STARTUP_SECONDS = 180.0  # for the child to import torch and the grader, before any learner code runs
OUTPUT_CHARS = 20_000  # of what the learner's file printed, kept for --show-output
POLL_SECONDS = 0.02


class UsageError(Exception):
    """Grading could not start: the message is the one line to show."""


@dataclass
class Report:
    component: str
    path: str
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)
    problem: str | None = None  # set when the file was not graded: why, in one line
    refused: bool = False  # not graded: the file uses the package's own implementation, or patched torch
    output: str = ""  # what the learner's file printed (not part of the grade)

    @property
    def passed(self) -> bool:
        return self.problem is None and bool(self.outcomes) and all(o.passed for o in self.outcomes)


def read_source(path: str | Path) -> str:
    """The learner's file as text, or a UsageError that says what to do."""
    path = Path(path)
    try:
        if path.is_dir():
            raise UsageError(f"{path} is a folder; pass the path of your .py file")
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file; pass the path of your .py file (write a stub with "
                         "`python -m mpgpt.grade --stub <component> -o FILE`)") from None
    except PermissionError:
        raise UsageError(f"{path} cannot be read (permission denied); check its permissions") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text; save it as UTF-8 (a .py file)") from None
    except OSError as exc:
        raise UsageError(f"{path} cannot be read ({exc.strerror or exc}); pass a readable .py file") from None


def _child_env(scratch: str) -> dict[str, str]:
    import mpgpt
    import torch

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONHOME")}
    root = str(Path(mpgpt.__file__).resolve().parents[1])  # the same package the grader runs from
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    for name in ("tmp", ".triton", ".cache"):
        os.makedirs(os.path.join(scratch, name), exist_ok=True)
    env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8",
               TMPDIR=os.path.join(scratch, "tmp"), TRITON_CACHE_DIR=os.path.join(scratch, ".triton"),
               TRITON_HOME=scratch, XDG_CACHE_HOME=os.path.join(scratch, ".cache"), MPLCONFIGDIR=scratch,
               MPGPT_GRADE_GPU="1" if torch.cuda.is_available() else "0")
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child and everything it started (its process group, where there is one)."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@dataclass
class _Run:
    """What one child process reported, read from its result file."""

    importing: bool = False
    imported: bool = False
    import_failed: str | None = None
    own: str | None = None
    tampered: str | None = None
    started: list[int] = field(default_factory=list)
    results: dict[int, object] = field(default_factory=dict)
    done: bool = False
    timed_out: bool = False
    forged: int = 0  # lines without the child's HMAC (the learner's code wrote them)
    status: int | None = None

    def read(self, line: str) -> bool:
        """Take one line; True when it starts a new stage (the time limit restarts)."""
        try:
            message = json.loads(line)
        except ValueError:
            return False
        if type(message) is not dict:
            return False
        if message.get("importing") is True and not self.importing:
            self.importing = True
            return True
        if message.get("imported") is True and not self.imported:
            self.imported = True
            own, tampered = message.get("own"), message.get("tampered")
            self.own = own if type(own) is str else None
            self.tampered = tampered if type(tampered) is str else None
            return True
        if type(message.get("import_failed")) is str and not self.imported:
            self.import_failed = message["import_failed"]
        elif type(message.get("start")) is int and message["start"] not in self.started:
            self.started.append(message["start"])
            return True
        elif type(message.get("result")) is int and message["result"] not in self.results:
            self.results[message["result"]] = message.get("data")
        elif message.get("done") is True:
            self.done = True
        return False


def _run_child(task: dict, ctl: str, scratch: str, env: dict, seconds: float, number: int) -> tuple[_Run, str]:
    """Start one child on the task; (what it reported, what it printed)."""
    task_file = os.path.join(ctl, f"task-{number}.json")
    task["results"] = os.path.join(ctl, f"results-{number}.jsonl")
    Path(task["results"]).touch()
    with open(task_file, "w", encoding="utf-8") as f:
        json.dump(task, f)
    output_file = os.path.join(ctl, f"output-{number}.txt")
    run = _Run()
    with open(output_file, "wb") as out:
        popen = dict(start_new_session=True) if hasattr(os, "setsid") else {}
        proc = subprocess.Popen([sys.executable, "-m", "mpgpt.grade.child", task_file], cwd=scratch, env=env,
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, **popen)
    key = secrets.token_bytes(KEY_BYTES)
    try:
        proc.stdin.write(key)
        proc.stdin.close()
    except OSError:  # the child is gone already: what it wrote says why
        pass
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        pending = ""
        with open(task["results"], encoding="utf-8", errors="replace") as results:
            while True:
                exited = proc.poll() is not None
                chunk = results.read()
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines:
                    mac, _, message = line.partition(" ")
                    expected = hmac.new(key, message.encode(), "sha256").hexdigest()
                    if not hmac.compare_digest(mac.encode(), expected.encode()):
                        run.forged += 1  # not from the grader's code in the child
                        continue
                    if run.read(message):
                        deadline = time.monotonic() + seconds
                if exited or run.done:
                    break
                if time.monotonic() > deadline:
                    run.timed_out = True
                    break
                time.sleep(POLL_SECONDS)
    finally:
        _kill_group(proc)
    run.status = proc.returncode
    printed = Path(output_file).read_bytes()[-OUTPUT_CHARS:].decode("utf-8", errors="replace")
    return run, printed


def _ended(run: _Run) -> str:
    if run.status is not None and run.status < 0:
        try:
            return f"killed by {signal.Signals(-run.status).name}"
        except ValueError:
            return f"killed by signal {-run.status}"
    return f"exit status {run.status}"


def grade_file(name: str, path: str | Path, *, seed: int = 0, seconds: float = 60.0,
               memory_mb: int = 4096) -> Report:
    """Grade the learner's file ``path`` as component ``name`` (see the module docstring)."""
    try:
        graded = component(name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    source = read_source(path)
    report = Report(name, str(path), seed)
    run_hint = f"run `python {path}` to see the traceback"
    try:
        own = guard.own_use_in_source(source, graded)
    except SyntaxError as exc:
        report.problem = (f"importing {path} raised SyntaxError: {exc.msg} (line {exc.lineno}); "
                          f"fix that first ({run_hint})")
        return report
    except ValueError as exc:  # null bytes
        report.problem = f"{path} is not Python source ({exc}); pass your .py file"
        return report
    if own:
        report.problem, report.refused = (f"{path} {own}: that is the package's own implementation of {name}, or "
                                          "library code that does what it should do, so your own code would not be "
                                          "graded; write your own"), True
        return report

    checks = graded.checks()
    cases: list[Case] = prepare_cases(checks, seed)  # before any of the learner's code runs
    outcomes: dict[int, Outcome] = {}
    ctl = tempfile.mkdtemp(prefix="mpgpt-grade-")
    scratch = tempfile.mkdtemp(prefix="mpgpt-grade-work-")
    printed = []
    try:
        env = _child_env(scratch)
        remaining = list(range(len(checks)))
        number = 0
        while remaining:
            task = {"component": name, "path": str(Path(path).resolve()), "source": source, "seed": seed,
                    "memory_mb": memory_mb, "checks": [[i, cases[i].inputs] for i in remaining]}
            run, output = _run_child(task, ctl, scratch, env, seconds, number)
            printed.append(output)
            number += 1
            if run.import_failed is not None:
                report.problem = f"importing {path} raised {run.import_failed.removeprefix('raised ')}; " \
                                 f"fix that first ({run_hint})"
                break
            if not run.imported:
                if run.timed_out and run.importing:
                    report.problem = (f"importing {path} did not finish within {seconds:g} s, so the grader stopped "
                                      "it: remove endless loops and waits from the file's top level")
                elif run.timed_out:
                    report.problem = "the grader's child process did not start in time; try again"
                else:
                    report.problem = (f"importing {path} ended the grader's child process ({_ended(run)}) before "
                                      "any behaviour was checked: remove sys.exit(), os._exit() and the like "
                                      "from the file's top level")
                break
            if run.own:
                report.problem, report.refused = (f"{path} {run.own}: there is nothing of yours to grade; write "
                                                  "your own"), True
                break
            if run.forged:
                report.problem, report.refused = (f"{path} wrote {run.forged} line(s) into the grader's result "
                                                  "file; do not write to file descriptors you did not open"), True
                break
            if run.tampered:
                report.problem, report.refused = (f"{path} {run.tampered} when it was imported; the grader relies on "
                                                  "torch and Python's built-ins as they are: do not patch them"), True
                break
            for i in remaining:
                if i in run.results:
                    outcomes[i] = verdict(checks[i], cases[i], run.results[i])
            unfinished = [i for i in run.started if i not in run.results and i in remaining]
            for i in unfinished:
                if run.timed_out:
                    seen = f"did not finish within {seconds:g} s, so the grader stopped it"
                    hint = "look for an endless loop or a wait in this behaviour's code path"
                else:
                    seen = f"the process ended during this behaviour ({_ended(run)})"
                    hint = ("do not call sys.exit() or os._exit(), and keep memory use small "
                            f"(the limit is {memory_mb} MB)")
                outcomes[i] = Outcome(checks[i].name, False, hint, seen)
            left = [i for i in remaining if i not in outcomes]
            if left and not unfinished:  # the child ended between behaviours: no progress to build on
                for i in left:
                    outcomes[i] = Outcome(checks[i].name, False, checks[i].hint,
                                          f"the process ended before this behaviour was checked ({_ended(run)})")
                left = []
            remaining = left
    finally:
        shutil.rmtree(ctl, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    report.output = "".join(printed)[-OUTPUT_CHARS:]
    if report.problem is None:
        report.outcomes = [outcomes[i] for i in range(len(checks))]
    return report
