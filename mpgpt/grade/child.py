"""The child process that imports a learner's file and observes it: ``python -m mpgpt.grade.child TASK``.

Started by :mod:`mpgpt.grade.sandbox` in a fresh grading folder (its working directory), in a
process group of its own. TASK is a JSON file the grader wrote: the component, the learner's
file and its text, the seed, the memory limit, the result file, and for each behaviour to observe
its index and its inputs (never the expected results: those stay in the grader's process).

The child writes one JSON line per event to the result file, which it opens before the learner's
file is imported (the audit hook refuses any later write outside the grading folder):

    {"importing": true}, {"imported": true, "own": null, "tampered": null}   or   {"import_failed": "..."}
    {"start": i}, {"result": i, "data": {...}}              for each behaviour
    {"done": true}

each line preceded by its HMAC under a key the grader sends on the child's standard input (read
before the learner's file is imported), and then ends with ``os._exit(0)``: no atexit hook, no
non-daemon thread and no buffered output of the learner's file runs after it. The grader reads
these lines as data; the exit status and whatever the process prints are not part of the verdict.
"""
from __future__ import annotations

import hmac
import importlib.util
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
    for kind, value in ((kind, limit), (resource.RLIMIT_FSIZE, FILE_LIMIT)):  # no file (nor output) past it
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):  # lower than what is in use already, or not supported here
            pass


FILE_LIMIT = 256 * 2**20
KEY_BYTES = 32


def _namespaces(torch, *grader) -> dict:
    """The namespaces whose functions the grader's observations call (torch's, Python's, the
    grader's own modules ``grader``): their contents, by identity."""
    import builtins
    import json as json_module

    spaces = {"torch": torch, "torch.nn": torch.nn, "torch.nn.functional": torch.nn.functional,
              "torch.optim": torch.optim, "torch.autograd": torch.autograd, "builtins": builtins,
              "json": json_module, "os": os, "torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module,
              "torch.optim.Optimizer": torch.optim.Optimizer, "torch.optim.SGD": torch.optim.SGD,
              **{module.__name__: module for module in grader}}
    return {name: (space, {k: id(v) for k, v in list(vars(space).items())}) for name, space in spaces.items()}


def _tampered(snapshot: dict, torch) -> str | None:
    """What the learner's code changed that the grader's observations rely on, or None."""
    for name, (space, ids) in snapshot.items():
        now = vars(space)
        for key, ident in ids.items():
            if key in now and id(now[key]) != ident or key not in now:
                return f"replaced {name}.{key}"
    if torch._C._is_torch_function_mode_enabled() and torch.overrides._get_current_function_mode_stack():
        return "left a torch function mode on"
    if torch._C._len_torch_dispatch_stack():
        return "left a torch dispatch mode on"
    return None


def main(task_path: str) -> None:
    with open(task_path, encoding="utf-8") as f:
        task = json.load(f)
    _limit_memory(task["memory_mb"])
    key = sys.stdin.buffer.read(KEY_BYTES)  # from the grader's pipe, before any learner code runs
    results = open(task["results"], "a", encoding="utf-8", buffering=1)
    dumps, write, flush, exit_now, sign = json.dumps, results.write, results.flush, os._exit, hmac.new

    def send(**message) -> None:
        """One line to the grader: the message and its HMAC under the key only this function holds,
        so a line written into the result file by the learner's code (os.write on a guessed file
        descriptor, say) is ignored."""
        line = dumps(message)
        write(sign(key, line.encode(), "sha256").hexdigest() + " " + line + "\n")
        flush()

    import torch

    import mpgpt  # noqa: F401  (first: without a GPU it switches Triton to its interpreter)
    from mpgpt.grade import component, guard
    from mpgpt.grade import core
    from mpgpt.grade.core import load_module, observation, seen_of

    graded = component(task["component"])
    checks = graded.checks()
    seed = task["seed"]
    own = tuple(getattr(graded, "OWN", ()))
    getattr(graded, "warm_up", lambda: None)()
    guard.disarm(own, tuple(getattr(graded, "REFERENCES", ())))
    snapshot = _namespaces(torch, graded, core, guard)
    if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.realpath(os.getcwd()):
        del sys.path[0]  # the grading folder: a file written there must not shadow a module
    compilers = None
    if torch.cuda.is_available() and importlib.util.find_spec("triton"):
        compilers = os.path.dirname(importlib.util.find_spec("triton").origin)  # compiles kernels on a GPU
    guard.install(os.getcwd(), task["path"], own,
                  tuple(filter(None, map(guard.source_of, getattr(graded, "REFERENCE_FILES", ())))), compilers)
    # bound before the learner's code runs (it may reassign the modules' attributes)
    manual_seed, own_use, own_implementation = torch.manual_seed, guard.own_use_in_module, guard.OwnImplementation
    tampered = _tampered

    send(importing=True)
    try:
        module = load_module(task["path"], task["source"])
    except own_implementation as exc:
        send(imported=True, own=str(exc))
        exit_now(0)
    except BaseException as exc:  # whatever importing raises (SystemExit, KeyboardInterrupt too)
        send(import_failed=seen_of(exc, task["path"]))
        exit_now(0)
    send(imported=True, own=own_use(module, graded), tampered=tampered(snapshot, torch))
    for index, inputs in task["checks"]:
        send(start=index)
        random.seed(seed)
        manual_seed(seed)
        data = observation(checks[index], module, inputs)
        changed = tampered(snapshot, torch)
        if changed:
            data = {"failed": f"your code {changed} while this behaviour was checked", "hint":
                    "do not patch torch or Python's built-ins; the grader relies on them"}
        send(result=index, data=data)
    send(done=True)
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1])
