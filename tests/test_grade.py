"""The grader of the student edition (mpgpt/grade): it passes correct work and fails wrong work.

For every component: the package's own implementation passes every behaviour (graded in this
process, as trusted code); a learner-style solution (tests/grade_solutions/) passes too; the stub
fails every behaviour; and each planted bug — one line of the solution replaced, the way a learner
gets it wrong — fails the behaviour that is meant to catch it, with the hint for what went wrong.

The command line grades a file in a child process; tests/test_grade_hostile.py tries to fool it.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpgpt.grade import COMPONENTS, component
from mpgpt.grade.__main__ import main
from mpgpt.grade.core import grade, load_module
from mpgpt.kernels import env

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "tests" / "grade_solutions"
needs_triton = pytest.mark.skipif(env.TRITON_IMPORT_ERROR is not None, reason="Triton is not installed")

# The package's own implementation behind each component's interface (mpgpt.grade.reference).
from mpgpt.grade.reference import REFERENCE as OWN  # noqa: E402

SOLUTION = {"ch1-rounding": "ch1_rounding.py", "ch5-scaler": "ch5_scaler.py", "ch6-matmul": "ch6_matmul.py",
            "lab-nans-hooks": "lab_nans_hooks.py"}

# component -> bug -> (marker of the line replaced, its replacement, a behaviour that must fail)
PLANTED = {
    "ch1-rounding": {
        "truncates": ("round", "if False:", "round to nearest (random numbers)"),
        "ties away from zero": ("round", "if dropped >= half:", "ties round to even"),
        "saturates instead of inf": ("overflow", "return sign | ((top << m_bits) - 1)", "overflow rounds to infinity"),
        "flushes subnormals": ("subnormal", "e_new = e\nif e < 1 - bias:\n    return sign",
                               "fp16 subnormals and underflow to zero"),
        "drops the sign": ("sign", "sign = 0", "-0.0 keeps its sign"),
        "NaN becomes inf": ("nan", "return sign | (top << m_bits)", "infinities and NaN"),
    },
    "ch5-scaler": {
        "off-by-one growth interval": ("growth", "if self.tracker == self.growth_interval + 1:",
                                       "the scale grows after growth_interval clean steps"),
        "unscales twice": ("unscale_in_step", "if True:", "unscale_() then step() divides by S only once"),
        "no guard on a second unscale_": ("twice_guard", "if False:", "a second unscale_() in one iteration raises"),
        "never resets the unscaled flag": ("end_of_iteration", "self.found_inf = None",
                                           "unscale_() then step() divides by S only once"),
        "misses NaN": ("check", "self.found_inf = any(bool(torch.isinf(g).any()) for g in grads)",
                       "steps with inf or NaN gradients are skipped"),
        "never skips": ("skip", "if False:", "steps with inf or NaN gradients are skipped"),
        "overflow keeps the count": ("reset", "pass", "an overflow restarts the growth count"),
        "state without the tracker": ("state", 'return {"scale": self.scale_value, '
                                      '"growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,',
                                      "state_dict() resumes the run exactly"),
    },
    "ch6-matmul": {
        "missing K mask": ("mask_a", "a = tl.load(a_ptrs)", "K not a multiple of the block"),
        "missing store mask": ("store", "tl.store(c_ptrs, acc)", "M and N not multiples of the block"),
        "assumes contiguous inputs": ("strides", "matmul_kernel[grid](a, b, c, M, N, K, K, 1, N, 1,",
                                      "transposed views of a, b and c"),
        "fp16 accumulator": ("accumulator", "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float16)",
                             "fp32 accumulation over a long K"),
        "no upcast in the interpreter": ("upcast", "acc = tl.dot(a, b, acc)", "bf16 inputs"),
        "skips the last K tile": ("loop", "for k in range(0, K // BLOCK_K):", "K not a multiple of the block"),
    },
    "lab-nans-hooks": {
        "the last module, not the first": ("first", "if bad:\n    found.clear()", "the first module in the order of the pass"),
        "isnan only": ("test", "bad = any(bool(torch.isnan(t).any()) for t in _tensors(output))",
                       "names the module whose output overflows to inf"),
        "top-level modules only": ("which", "handles = [m.register_forward_hook(hook) for m in model.children()]",
                                   "finds the overflowing layer of the course GPT in fp16"),
        "hooks left behind": ("remove", "for h in []:", "hooks are removed, also when run() raises"),
        "tuples ignored": ("nested", "if False:", "tuple and dict outputs"),
    },
}


def _outcomes(name: str, source: str, tmp_path: Path, seed: int = 0):
    path = tmp_path / f"{name.replace('-', '_')}_{abs(hash(source))}.py"
    path.write_text(source, encoding="utf-8")
    return grade(component(name).checks(), load_module(path), seed=seed)


def _grade_source(name: str, source: str, tmp_path: Path) -> dict[str, bool]:
    return {o.name: o.passed for o in _outcomes(name, source, tmp_path)}


def plant(source: str, marker: str, replacement: str) -> str:
    """Replace the code of the line tagged `# PLANT: marker`, keeping its indentation."""
    pattern = re.compile(rf"^(?P<indent>[ \t]*)\S.*# PLANT: {re.escape(marker)}$", re.MULTILINE)
    match = pattern.search(source)
    assert match, f"no line tagged PLANT: {marker}"
    indent = match["indent"]
    return source[: match.start()] + indent + replacement.replace("\n", "\n" + indent) + source[match.end():]


def _marks(name):
    return [needs_triton] if name == "ch6-matmul" else []


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in COMPONENTS])
def test_the_package_own_implementation_passes(name, tmp_path):
    results = _grade_source(name, OWN[name], tmp_path)
    assert all(results.values()), [k for k, ok in results.items() if not ok]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in COMPONENTS])
def test_a_learner_solution_passes_and_the_stub_fails(name, tmp_path):
    results = _grade_source(name, (SOLUTIONS / SOLUTION[name]).read_text(encoding="utf-8"), tmp_path)
    assert all(results.values()), [k for k, ok in results.items() if not ok]
    stub = _grade_source(name, component(name).STUB, tmp_path)
    failing = [k for k, ok in stub.items() if not ok]
    # ch6's "Triton is importable" holds for a stub too: every other behaviour must fail
    assert len(failing) >= len(stub) - 1 and len(stub) >= 6, stub


@pytest.mark.parametrize("name, bug", [pytest.param(n, b, marks=_marks(n)) for n in PLANTED for b in PLANTED[n]])
def test_a_planted_bug_fails_its_behaviour(name, bug, tmp_path):
    marker, replacement, behaviour = PLANTED[name][bug]
    source = plant((SOLUTIONS / SOLUTION[name]).read_text(encoding="utf-8"), marker, replacement)
    results = _grade_source(name, source, tmp_path)
    assert behaviour in results, f"no behaviour named {behaviour!r}: {list(results)}"
    assert not results[behaviour], f"{bug!r} passed {behaviour!r}"


def test_at_least_three_planted_bugs_per_component():
    assert set(PLANTED) == set(COMPONENTS)
    assert all(len(bugs) >= 3 for bugs in PLANTED.values())


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "mpgpt.grade", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


# --- hints follow what went wrong, and the same file gives the same report


@pytest.mark.parametrize("bug, behaviour, says", [
    # a scaler that misses NaN fails the back-off check on the 'n' iteration: its hint is about NaN
    ("misses NaN", "an overflow backs the scale off", "NaN"),
    ("misses NaN", "same scales and skipped steps as torch.amp.GradScaler", "NaN"),
    ("off-by-one growth interval", "the scale grows after growth_interval clean steps", "not one later"),
    ("overflow keeps the count", "same scales and skipped steps as torch.amp.GradScaler", "resets the growth count"),
    ("never resets the unscaled flag", "unscale_() then step() divides by S only once", "reset that in update()"),
])
def test_the_hint_names_the_behaviour_that_went_wrong(bug, behaviour, says, tmp_path):
    marker, replacement, _ = PLANTED["ch5-scaler"][bug]
    source = plant((SOLUTIONS / SOLUTION["ch5-scaler"]).read_text(encoding="utf-8"), marker, replacement)
    outcome = next(o for o in _outcomes("ch5-scaler", source, tmp_path) if o.name == behaviour)
    assert not outcome.passed and says in outcome.hint, outcome.line()


@pytest.mark.parametrize("bug, says", [("truncates", "truncating"), ("ties away from zero", "ties to even"),
                                       ("NaN becomes inf", "NaN must stay a NaN")])
def test_rounding_hints_follow_the_wrong_pattern(bug, says, tmp_path):
    marker, replacement, behaviour = PLANTED["ch1-rounding"][bug]
    source = plant((SOLUTIONS / SOLUTION["ch1-rounding"]).read_text(encoding="utf-8"), marker, replacement)
    outcome = next(o for o in _outcomes("ch1-rounding", source, tmp_path) if o.name == behaviour)
    assert not outcome.passed and says in outcome.hint, outcome.line()


def test_the_same_seed_gives_the_same_report_and_another_seed_other_cases(tmp_path):
    marker, replacement, _ = PLANTED["ch5-scaler"]["misses NaN"]
    source = plant((SOLUTIONS / SOLUTION["ch5-scaler"]).read_text(encoding="utf-8"), marker, replacement)
    lines = [[o.line() for o in _outcomes("ch5-scaler", source, tmp_path, seed=s)] for s in (0, 0, 1)]
    assert lines[0] == lines[1]
    assert lines[0] != lines[2]  # the random run's flags differ


def test_command_line_lists_writes_stubs_and_exits_by_the_result(tmp_path):
    listed = _cli("--list", cwd=tmp_path)
    assert listed.returncode == 0 and [line.split()[0] for line in listed.stdout.splitlines()] == list(COMPONENTS)
    written = _cli("--stub", "ch5-scaler", "-o", "mine.py", cwd=tmp_path)
    assert written.returncode == 0 and (tmp_path / "mine.py").read_text() == component("ch5-scaler").STUB
    again = _cli("--stub", "ch5-scaler", "-o", "mine.py", cwd=tmp_path)  # never overwrites a learner's work
    assert again.returncode == 2 and "exists already" in again.stderr
    graded = _cli("ch5-scaler", "mine.py", cwd=tmp_path)
    assert graded.returncode == 1
    header, *lines, summary = graded.stdout.splitlines()
    assert header.startswith("grading mine.py as ch5-scaler, seed 0"), header
    assert all(line.startswith("FAIL  ") and "Hint: " in line for line in lines), lines
    assert summary == f"ch5-scaler: 0 of {len(lines)} behaviours pass"
    (tmp_path / "solution.py").write_text((SOLUTIONS / SOLUTION["ch5-scaler"]).read_text(encoding="utf-8"))
    good = _cli("ch5-scaler", "solution.py", "--seed", "7", cwd=tmp_path)
    assert good.returncode == 0 and good.stdout.splitlines()[-1] == "ch5-scaler: 10 of 10 behaviours pass"
    assert "seed 7" in good.stdout.splitlines()[0]
    assert all(line.startswith("PASS  ") for line in good.stdout.splitlines()[1:-1])


def test_flag_letters_are_explained_when_a_failure_uses_them(tmp_path):
    marker, replacement, _ = PLANTED["ch5-scaler"]["misses NaN"]
    path = tmp_path / "nan.py"
    path.write_text(plant((SOLUTIONS / SOLUTION["ch5-scaler"]).read_text(encoding="utf-8"), marker, replacement))
    out = _cli("ch5-scaler", "nan.py", cwd=tmp_path).stdout
    assert "flags 'xxn'" in out and "'.' clean, 'x' an inf in a gradient, 'n' a NaN" in out, out


def _one_line_error(args, capsys, cwd) -> str:
    import os

    old = os.getcwd()
    os.chdir(cwd)
    try:
        assert main(args) == 2
    finally:
        os.chdir(old)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mpgpt.grade: "), err
    assert "Traceback" not in captured.out + captured.err
    return err


@pytest.mark.parametrize("args, says", [
    (["ch9-nothing", "x.py"], "unknown component"),
    (["ch5-scaler", "missing.py"], "no such file"),
    (["ch5-scaler", "."], "is a folder"),
    (["ch5-scaler"], "give a component and your file"),
    (["--stub", "nope"], "unknown component"),
    (["--stub", "ch5-scaler", "-o", "no/such/folder/mine.py"], "does not exist"),
    (["ch5-scaler", "x.py", "--seed", "one"], "invalid int value"),
    (["ch5-scaler", "x.py", "-o", "y.py"], "goes with --stub"),
])
def test_usage_errors_are_one_line_with_exit_status_2(tmp_path, args, says, capsys):
    assert says in _one_line_error(args, capsys, tmp_path)


def _can_write(folder: Path) -> bool:
    try:
        (folder / "probe").touch()
        (folder / "probe").unlink()
        return True
    except OSError:
        return False


def test_a_stub_into_a_folder_that_cannot_be_written_is_one_line(tmp_path, capsys):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if _can_write(folder):  # root writes anywhere: use a folder the kernel refuses
            folder = Path("/sys")
            if not folder.is_dir() or _can_write(folder):
                pytest.skip("no folder this user cannot write to")
        assert "cannot write" in _one_line_error(["--stub", "ch5-scaler", "-o", str(folder / "mine.py")],
                                                 capsys, tmp_path)
    finally:
        (tmp_path / "read-only").chmod(0o700)


def test_a_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    (tmp_path / "latin.py").write_bytes(b"# caf\xe9\n")
    assert "not UTF-8" in _one_line_error(["ch5-scaler", "latin.py"], capsys, tmp_path)


def test_a_file_that_does_not_import_is_a_usage_error(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("def round_fp32_bits(bits, fmt)\n    return 0\n")
    assert "SyntaxError" in _one_line_error(["ch1-rounding", str(broken)], capsys, tmp_path)


def test_the_report_shows_no_reference_code(tmp_path, capsys):
    """No line of the reference implementations appears in what a failing learner sees."""
    references = [ROOT / "mpgpt" / p for p in ("formats.py", "scaling.py", "kernels/grouped.py", "labs/nonfinite.py")]
    code_lines = {line.strip() for p in references for line in p.read_text(encoding="utf-8").splitlines()
                  if len(line.strip()) > 25 and not line.strip().startswith(("#", '"""'))}
    for name in ("ch1-rounding", "ch5-scaler", "lab-nans-hooks"):
        bug = next(iter(PLANTED[name].values()))
        source = plant((SOLUTIONS / SOLUTION[name]).read_text(encoding="utf-8"), bug[0], bug[1])
        out = "\n".join(o.line() for o in _outcomes(name, source, tmp_path))
        leaked = [line for line in code_lines if line in out]
        assert not leaked, leaked
