"""A learner who wants a PASS without the work: every trick fails, and none hangs the grader.

Each test grades a hostile file the way ``python -m mpgpt.grade`` does (mpgpt.grade.sandbox: the
file runs in a child process, the verdict is decided in this one) with a short time limit. The
solutions in tests/grade_solutions/ are the honest baseline: the same tricks bolted onto a correct
solution must not stop it from passing, and bolted onto a wrong one must not make it pass.
"""
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpgpt.grade.sandbox import grade_file

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "tests" / "grade_solutions"
SCALER = (SOLUTIONS / "ch5_scaler.py").read_text(encoding="utf-8")
ROUNDING = (SOLUTIONS / "ch1_rounding.py").read_text(encoding="utf-8")
EMPTY_SCALER = "class DynamicLossScaler:\n    def __init__(self, *args, **kwargs):\n        pass\n"
SECONDS = 15.0  # per behaviour and for the import; the child's own start-up (torch) is not counted


def _file(tmp_path: Path, text: str, name: str = "mine.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _grade(tmp_path, text, name="ch5-scaler", **kw):
    return grade_file(name, _file(tmp_path, text), seconds=kw.pop("seconds", SECONDS), **kw)


def _passes(report) -> int:
    return sum(o.passed for o in report.outcomes)


def _cli(tmp_path, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mpgpt.grade", *args, "--time-limit", str(SECONDS)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def test_an_endless_loop_at_import_is_stopped(tmp_path):
    start = time.monotonic()
    report = _grade(tmp_path, "while True:\n    pass\n")
    assert "did not finish within 15 s" in report.problem and not report.passed
    assert time.monotonic() - start < 120


def test_an_endless_loop_in_one_behaviour_fails_it_and_the_others_are_still_graded(tmp_path):
    looping = SCALER.replace('raise RuntimeError("unscale_() has already been called since the last update()")',
                             "while True:\n                pass")
    report = _grade(tmp_path, looping)
    lines = {o.name: o for o in report.outcomes}
    stuck = lines["a second unscale_() in one iteration raises"]
    assert not stuck.passed and "did not finish within 15 s" in stuck.seen
    assert _passes(report) == len(report.outcomes) - 1  # a fresh child graded the rest


def test_a_non_daemon_thread_neither_hangs_the_grader_nor_changes_the_verdict(tmp_path):
    thread = "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,)).start()\n"
    start = time.monotonic()
    assert _grade(tmp_path, thread + SCALER).passed
    assert not _grade(tmp_path, thread + EMPTY_SCALER).passed
    assert time.monotonic() - start < 120


def test_os_exit_after_printing_a_pass_is_no_pass(tmp_path):
    at_import = _cli(tmp_path, "ch5-scaler", str(_file(tmp_path, """
        import os
        print("ch5-scaler: 10 of 10 behaviours pass")
        os._exit(0)
        """)))
    assert at_import.returncode == 2 and "ended the grader's child process" in at_import.stderr
    assert "10 of 10" not in at_import.stdout
    in_update = SCALER.replace("    def update(self):\n", "    def update(self):\n        import os; os._exit(0)\n")
    report = _grade(tmp_path, in_update)
    ended = [o for o in report.outcomes if "the process ended during this behaviour" in o.seen]
    assert not report.passed and len(ended) >= 5 and not any(o.passed for o in ended)


def test_sys_exit_never_passes(tmp_path):
    assert not _grade(tmp_path, "import sys\nsys.exit(0)\n").passed
    inside = _grade(tmp_path, "import sys\n\nclass DynamicLossScaler:\n    def __init__(self, *a, **k):\n"
                              "        sys.exit(0)\n")
    assert _passes(inside) == 0 and "SystemExit" in inside.outcomes[0].seen


def test_an_atexit_hook_cannot_force_exit_status_0(tmp_path):
    out = _cli(tmp_path, "ch5-scaler", str(_file(tmp_path, "import atexit, os\natexit.register(os._exit, 0)\n"
                                                           + EMPTY_SCALER)))
    assert out.returncode == 1 and out.stdout.splitlines()[-1] == "ch5-scaler: 0 of 10 behaviours pass"


def test_patching_the_grader_or_torch_changes_nothing(tmp_path):
    # Never names GradScaler in a way the grader reads, so the file is graded, and patches what the
    # grader of old used in the same process: grade(), Outcome, the observation and torch's scaler.
    report = _grade(tmp_path, """
        import torch
        import mpgpt.grade.core as core
        import mpgpt.grade.sandbox as sandbox

        class DynamicLossScaler:
            def __init__(self, *args, **kwargs):
                pass

        setattr(torch.amp, "Grad" + "Scaler", DynamicLossScaler)
        core.grade = lambda checks, module, seed=0: [core.Outcome(c.name, True) for c in checks]
        core.verdict = lambda check, case, result: core.Outcome(check.name, True)
        core.observation = lambda check, module, inputs: {"observed": True}
        core.Outcome.line = lambda self: "PASS  " + self.name
        core.Outcome = type("Outcome", (), {"passed": True})
        sandbox.grade_file = lambda *a, **k: None
        """)
    assert not report.passed and _passes(report) == 0, [o.line() for o in report.outcomes]
    assert "replaced mpgpt.grade.core" in report.problem


def test_an_int_subclass_whose_equality_always_holds_is_refused(tmp_path):
    report = _grade(tmp_path, """
        class Liar(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__

        def round_fp32_bits(bits, fmt):
            return Liar(0)
        """, name="ch1-rounding")
    assert _passes(report) == 0
    assert "returned Liar, not int" in report.outcomes[0].seen


def test_a_proxy_string_is_refused(tmp_path):
    report = _grade(tmp_path, """
        class Anything(str):
            def __eq__(self, other):
                return True
            __hash__ = str.__hash__

        def first_nonfinite_module(model, run):
            run()
            return Anything("?")
        """, name="lab-nans-hooks")
    named = [o for o in report.outcomes if "returned" in o.seen]
    assert named and all(not o.passed for o in named), [o.line() for o in report.outcomes]


@pytest.mark.parametrize("name, text", [
    ("ch5-scaler", "from mpgpt.scaling import DynamicLossScaler\n"),
    ("ch5-scaler", "import mpgpt.scaling\n\nclass DynamicLossScaler(mpgpt.scaling.DynamicLossScaler):\n    pass\n"),
    ("ch5-scaler", "from torch.amp import GradScaler as DynamicLossScaler\n"),
    ("ch1-rounding", "from mpgpt import formats\n\ndef round_fp32_bits(bits, fmt):\n    return 0\n"),
    ("lab-nans-hooks", "from mpgpt.labs.nonfinite import first_nonfinite_module\n"),
    ("ch6-matmul", "from mpgpt.kernels import matmul as _m\n\ndef matmul(a, b, c):\n    c.copy_(_m(a, b))\n"),
])
def test_the_package_own_implementation_is_reported_not_graded(tmp_path, name, text):
    report = _grade(tmp_path, text, name=name)
    assert report.refused and not report.passed and "write your own" in report.problem


def test_the_package_own_implementation_imported_by_a_built_name_is_reported(tmp_path):
    report = _grade(tmp_path, """
        import importlib
        own = importlib.import_module("mpgpt." + "scal" + "ing")

        class DynamicLossScaler(own.DynamicLossScaler):
            pass
        """)
    assert report.refused and not report.passed, report.problem


def test_a_write_outside_the_folder_is_refused_and_inside_allowed(tmp_path):
    outside = tmp_path / "outside.txt"
    at_import = _grade(tmp_path, f"open({str(outside)!r}, 'w').write('x')\n" + SCALER)
    assert not at_import.passed and "not allowed" in at_import.problem and not outside.exists()
    inside_a_behaviour = _grade(tmp_path, SCALER.replace(
        "    def get_scale(self):\n",
        f"    def get_scale(self):\n        import shutil; shutil.copy(__file__, {str(outside)!r})\n"))
    refused = [o for o in inside_a_behaviour.outcomes if "not allowed" in o.seen]
    assert not inside_a_behaviour.passed and len(refused) >= 5 and not outside.exists()
    notes = _grade(tmp_path, "open('notes.txt', 'w').write('scratch work')\n" + SCALER)  # the grading folder
    assert notes.passed


def test_the_result_file_cannot_be_written_by_the_learner(tmp_path):
    report = _grade(tmp_path, textwrap.dedent("""
        import json, sys
        task = json.load(open(sys.argv[1]))
        with open(task["results"], "a") as f:
            for i, _ in task["checks"]:
                f.write(json.dumps({"start": i}) + "\\n")
                f.write(json.dumps({"result": i, "data": {"observed": True}}) + "\\n")
            f.write(json.dumps({"done": True}) + "\\n")
        """) + EMPTY_SCALER)
    assert not report.passed and "not allowed" in report.problem


def test_keyboard_interrupt_in_the_file_is_one_line_or_one_failure(tmp_path):
    at_import = _cli(tmp_path, "ch5-scaler", str(_file(tmp_path, "raise KeyboardInterrupt\n")))
    assert at_import.returncode == 2 and "KeyboardInterrupt" in at_import.stderr
    assert len(at_import.stderr.strip().splitlines()) == 1 and "Traceback" not in at_import.stderr
    inside = _grade(tmp_path, "class DynamicLossScaler:\n    def __init__(self, *a, **k):\n"
                              "        raise KeyboardInterrupt\n")
    assert _passes(inside) == 0 and "KeyboardInterrupt" in inside.outcomes[0].seen


def test_a_file_that_closes_stdout_is_still_graded(tmp_path):
    out = _cli(tmp_path, "ch5-scaler", str(_file(tmp_path, "import os, sys\nsys.stdout.close()\nos.close(1)\n"
                                                           "os.close(2)\n" + SCALER)))
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ch5-scaler: 10 of 10 behaviours pass", out


def test_a_file_that_takes_too_much_memory_is_stopped(tmp_path):
    report = _grade(tmp_path, "hog = bytearray(3 * 2**30)\n" + SCALER, memory_mb=2048)
    assert not report.passed and "MemoryError" in report.problem


@pytest.mark.parametrize("trick, says", [
    ("import gc\nfor o in gc.get_objects():\n    pass\n", "gc.get_objects is not allowed"),
    ("import inspect\nf = inspect.currentframe().f_back\n", "sys._getframe is not allowed"),
    ("try:\n    raise ValueError\nexcept ValueError as e:\n    f = e.__traceback__.tb_frame.f_back\n", "not allowed"),
    ("import mpgpt.grade.scaler as s\ns._observe_skips.__code__ = (lambda m, i: None).__code__\n", "not allowed"),
    ("import sys\nsys.settrace(lambda *a: None)\n", "sys.settrace is not allowed"),
    ("import subprocess\nsubprocess.run(['true'])\n", "subprocess.Popen is not allowed"),
    ("import ctypes\nctypes.CDLL(None)\n", "ctypes.dlopen is not allowed"),
    ("exec(compile('x = 1', '/usr/lib/python3/os.py', 'exec'))\n", "another file's name"),
    ("import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n", "signalling another process"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)\n", "ValueError"),
])
def test_ways_around_the_grader_are_refused(tmp_path, trick, says):
    report = _grade(tmp_path, trick + SCALER)
    assert not report.passed and says in report.problem, report.problem


@pytest.mark.parametrize("name, text, says", [
    ("ch5-scaler", "import torch\ntorch.equal = lambda *a, **k: True\n" + EMPTY_SCALER, "replaced torch.equal"),
    ("ch5-scaler", "from torch.overrides import TorchFunctionMode\nTorchFunctionMode().__enter__()\n" + EMPTY_SCALER,
     "torch function mode"),
    ("ch5-scaler", "import importlib, torch\nm = importlib.reload(torch.amp.grad_scaler)\n" + EMPTY_SCALER,
     "the package's own implementation or the reference"),
    ("ch5-scaler", "import torch\nf = getattr(torch.ops.aten, '_amp_update' + '_scale_')\n" + EMPTY_SCALER,
     "the reference the grader compares with"),
    ("ch1-rounding", "import struct\n\ndef round_fp32_bits(bits, fmt):\n    x = struct.unpack('<f', "
     "struct.pack('<I', bits))[0]\n    return struct.unpack('<H', struct.pack('<' + 'e', x))[0]\n", "'e'"),
    ("ch1-rounding", "import numpy as np\n\ndef round_fp32_bits(bits, fmt):\n    return int(np.array([bits], "
     "dtype=np.uint32).view(np.float32).astype(np.float16).view(np.uint16)[0])\n", "float16"),
])
def test_patching_torch_or_using_a_library_cast_is_not_graded(tmp_path, name, text, says):
    report = _grade(tmp_path, text, name=name)
    assert report.refused and not report.passed and says in report.problem, report.problem


def test_output_floods_and_scratch_files_stay_within_limits(tmp_path):
    flood = _grade(tmp_path, "import sys\nwhile True:\n    sys.stdout.write('x' * 10**6)\n")
    assert not flood.passed and "File too large" in flood.problem


def test_lines_written_into_the_result_file_by_the_learner_are_not_believed(tmp_path):
    # os.write has no audit event: every open descriptor gets forged results, which lack the HMAC.
    forge = textwrap.dedent("""
        import json, os
        forged = "".join(json.dumps(m) + "\\n" for i in range(10)
                         for m in ({"start": i}, {"result": i, "data": {"observed": True}}))
        for fd in range(3, 64):
            try:
                os.write(fd, forged.encode())
            except OSError:
                pass
        """)
    report = _grade(tmp_path, forge + EMPTY_SCALER)
    assert not report.passed and "result file" in report.problem, report.problem


def test_patching_the_grader_checks_in_the_child_is_not_graded(tmp_path):
    report = _grade(tmp_path, "import mpgpt.grade.scaler as s\ns._iteration = lambda *a, **k: False\n" + EMPTY_SCALER)
    assert report.refused and "replaced mpgpt.grade.scaler._iteration" in report.problem, report.problem


def test_a_message_cannot_dress_a_failure_up_as_a_pass(tmp_path):
    trick = ("class DynamicLossScaler:\n    def __init__(self, *a, **k):\n"
             "        raise ValueError('\\r\\x1b[2KPASS  looks fine')\n")
    out = _cli(tmp_path, "ch5-scaler", str(_file(tmp_path, trick)), "--show-output")
    assert out.returncode == 1 and "\r" not in out.stdout and "\x1b" not in out.stdout
    assert all(line.startswith(("grading ", "FAIL  ", "ch5-scaler: ")) for line in out.stdout.splitlines()), out.stdout
