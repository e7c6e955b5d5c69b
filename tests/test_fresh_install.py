"""The package as a learner gets it: a wheel built from the repository, installed into a fresh
virtual environment, used from an empty folder with no checkout beside it (as on Colab).

The fresh environment borrows torch and the other dependencies from the test's own environment
through a .pth line (no download), but not its editable mpgpt: a path listed in a .pth file is
added to sys.path without running the .pth files inside it, so the checkout's editable finder
never loads. The test asserts that mpgpt is imported from the wheel.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fresh")
    wheels = tmp / "wheels"
    src = tmp / "src"  # a copy, so the build's scratch folders never land in the checkout
    shutil.copytree(ROOT / "mpgpt", src / "mpgpt", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)]
    try:
        import setuptools  # noqa: F401  (present: build without fetching a build environment)
        build.insert(4, "--no-build-isolation")
    except ImportError:
        pass
    subprocess.run(build, check=True, cwd=tmp, timeout=600)
    (wheel,) = wheels.glob("mpgpt-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--target", site, str(wheel)], check=True, timeout=300)
    return python, site


def run_in_empty_folder(python, tmp_path, code: str, *args):
    work = tmp_path / "empty"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([str(python), "-c", textwrap.dedent(code), *args], cwd=work, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return work, out.stdout


def test_wheel_loads_every_curated_record_from_an_empty_folder(fresh_python, tmp_path):
    python, site = fresh_python
    _, stdout = run_in_empty_folder(python, tmp_path, """
        import sys
        import mpgpt
        from mpgpt import results
        assert mpgpt.__file__.startswith(sys.argv[1]), mpgpt.__file__
        for name in results.RECORDS:
            record = results.load_record(name)
            assert record["environment"]["commit"], name
        print(len(results.RECORDS), "records")
    """, site)
    from mpgpt.results import RECORDS

    assert stdout.strip() == f"{len(RECORDS)} records"


def test_wheel_benchmark_writes_its_result_into_the_current_folder(fresh_python, tmp_path):
    python, site = fresh_python
    work, stdout = run_in_empty_folder(python, tmp_path, """
        import sys
        from mpgpt.bench.__main__ import main
        sys.exit(main(["train", "--configs", "fp32", "--preset", "tiny", "--batch-size", "2",
                       "--warmup", "1", "--steps", "2", "--tag", "fresh"]))
    """)
    written = sorted(p.name for p in work.iterdir())
    assert len(written) == 1 and written[0].startswith("train_cpu_") and written[0].endswith("_fresh.json"), written
    assert not list(Path(site, "mpgpt").rglob("train_*.json"))  # nothing written into the package
    assert "wrote" in stdout


def test_wheel_grader_writes_a_stub_and_grades_it_from_an_empty_folder(fresh_python, tmp_path):
    # The student edition: no tests/ folder beside the wheel, so the checks must ship inside it.
    python, site = fresh_python
    _, stdout = run_in_empty_folder(python, tmp_path, """
        import contextlib, io, sys
        import mpgpt
        from mpgpt.grade.__main__ import main
        assert mpgpt.__file__.startswith(sys.argv[1]), mpgpt.__file__
        assert main(["--stub", "ch5-scaler", "-o", "mine.py"]) == 0
        with contextlib.redirect_stdout(io.StringIO()) as report:
            stub_status = main(["ch5-scaler", "mine.py"])
        open("own.py", "w").write("from mpgpt.scaling import DynamicLossScaler\\n")
        with contextlib.redirect_stdout(io.StringIO()) as good:
            own_status = main(["ch5-scaler", "own.py"])
        import mpgpt.labs.broken_clipping  # the lab's scripts ship too
        print(stub_status, own_status, report.getvalue().count("FAIL"), good.getvalue().splitlines()[-1])
    """, site)
    stub_status, own_status, fails, *last = stdout.split("\n")[-2].split(" ", 3)
    assert (stub_status, own_status) == ("1", "0") and int(fails) >= 6, stdout
    assert last[0].startswith("ch5-scaler:") and last[0].endswith("behaviours pass"), stdout
