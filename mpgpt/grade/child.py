"""The child process that imports a learner's file and observes it: ``python -m mpgpt.grade.child TASK``.

Started by :mod:`mpgpt.grade.sandbox` in a fresh grading folder (its working directory), in a
process group of its own. TASK is a JSON file the grader wrote: the component, the learner's
file and its text, the seed, the memory limit, the result file, and for each behaviour to observe
its index and its inputs (never the expected results: those stay in the grader's process).

The child writes one JSON line per event to the result file, which it opens before the learner's
file is imported (the audit hook refuses any later write outside the grading folder):

    {"importing": true}, {"imported": true, "own": null}   or   {"import_failed": "..."}
    {"start": i}, {"result": i, "data": {...}}              for each behaviour
    {"done": true}

and then ends with ``os._exit(0)``: no atexit hook, no non-daemon thread and no buffered output of
the learner's file runs after it. The grader reads these lines as data; the exit status and
whatever the process prints are not part of the verdict.
"""
from __future__ import annotations

import json
import os
import random
import sys


def _limit_memory(megabytes: int) -> None:
    """Cap the address space (the data segment where a GPU driver needs a large address space)."""
    try:
        import resource
    except ImportError:  # not on this platform (Windows): the time limit still holds
        return
    limit = megabytes * 2**20
    kind = resource.RLIMIT_DATA if os.environ.get("MPGPT_GRADE_GPU") == "1" else resource.RLIMIT_AS
    try:
        resource.setrlimit(kind, (limit, limit))
    except (ValueError, OSError):  # lower than what is in use already, or not supported here
        pass


def main(task_path: str) -> None:
    with open(task_path, encoding="utf-8") as f:
        task = json.load(f)
    _limit_memory(task["memory_mb"])
    results = open(task["results"], "a", encoding="utf-8", buffering=1)
    dumps, write, flush, exit_now = json.dumps, results.write, results.flush, os._exit

    def send(**message) -> None:
        write(dumps(message) + "\n")
        flush()

    import torch

    import mpgpt  # noqa: F401  (first: without a GPU it switches Triton to its interpreter)
    from mpgpt.grade import component, guard
    from mpgpt.grade.core import load_module, observation, seen_of

    graded = component(task["component"])
    checks = graded.checks()
    seed = task["seed"]
    own = tuple(getattr(graded, "OWN", ()))
    getattr(graded, "warm_up", lambda: None)()
    guard.disarm(own, tuple(getattr(graded, "REFERENCES", ())))
    guard.install(os.getcwd(), task["path"], own)
    # bound before the learner's code runs (it may reassign the modules' attributes)
    manual_seed, own_use, own_implementation = torch.manual_seed, guard.own_use_in_module, guard.OwnImplementation

    send(importing=True)
    try:
        module = load_module(task["path"], task["source"])
    except own_implementation as exc:
        send(imported=True, own=str(exc))
        exit_now(0)
    except BaseException as exc:  # whatever importing raises (SystemExit, KeyboardInterrupt too)
        send(import_failed=seen_of(exc, task["path"]))
        exit_now(0)
    send(imported=True, own=own_use(module, graded))
    for index, inputs in task["checks"]:
        send(start=index)
        random.seed(seed)
        manual_seed(seed)
        send(result=index, data=observation(checks[index], module, inputs))
    send(done=True)
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1])
