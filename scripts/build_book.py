"""Build the course book (Jupyter Book 1.x) with warnings as errors.

    python scripts/build_book.py             # the book          -> _build/html/index.html
    python scripts/build_book.py --student   # without solutions -> _build/student/_build/html/index.html

The normal build is exactly `jupyter-book build . -W -n --keep-going`: every Sphinx warning
(broken reference, missing citation, unknown directive, bad notebook) fails it, and --keep-going
reports all of them before failing. Notebooks are not executed (`execute_notebooks: "off"` in
_config.yml); the book shows the outputs committed with them.

The student build is the same book with sphinx-exercise's `hide_solutions: true` and
`mpgpt_student_edition: true` (its Colab links and launch buttons open colab/student/, the Colab
edition without solutions, and its download button gives that notebook): it writes a temporary
copy of _config.yml with those settings changed and passes it with `--config`, so _config.yml
stays the single source of configuration. Both builds serve the Colab edition of each chapter as
its download (book/_ext/colab_edition_links.py); `python scripts/colab_edition.py` regenerates the
committed colab/ folder that Colab opens.

Options: --path-output DIR puts the build under DIR/_build/html instead; --all rebuilds every
page (no incremental build); extra arguments after `--` go to jupyter-book unchanged.
"""
import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def jupyter_book_executable() -> str:
    """The jupyter-book next to this Python (the venv's), else the one on PATH."""
    candidate = Path(sys.executable).with_name("jupyter-book")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("jupyter-book")
    if found is None:
        raise RuntimeError("jupyter-book is not installed: run `pip install -r requirements.txt` first")
    return found


def student_config(source: Path, folder: Path) -> Path:
    """Write _config.yml with hide_solutions switched on into folder; return its path."""
    config = yaml.safe_load((source / "_config.yml").read_text(encoding="utf-8"))
    sphinx = config.setdefault("sphinx", {}) or {}
    config["sphinx"] = sphinx
    sphinx_config = sphinx.get("config") or {}
    sphinx_config["hide_solutions"] = True
    # Colab buttons, "Open in Colab" links and downloads give colab/student/ (book/_ext/colab_edition_links.py).
    sphinx_config["mpgpt_student_edition"] = True
    sphinx["config"] = sphinx_config
    # local_extensions paths are relative to the config file, which now lives elsewhere.
    local = sphinx.get("local_extensions") or {}
    sphinx["local_extensions"] = {name: str((source / rel).resolve()) for name, rel in local.items()}
    config["title"] = f"{config.get('title', 'mpgpt')} (student edition)"
    path = folder / "_config_student.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def build(student: bool = False, path_output: Path | None = None, fresh: bool = False,
          source: Path = ROOT, extra: list[str] | None = None) -> Path:
    """Build the book; return the HTML folder. Raises CalledProcessError when the build fails."""
    if path_output is None:
        path_output = source / "_build" / "student" if student else source
    cmd = [jupyter_book_executable(), "build", str(source), "-W", "-n", "--keep-going",
           "--path-output", str(path_output)]
    if fresh:
        cmd.append("--all")
    cmd += extra or []
    with tempfile.TemporaryDirectory(prefix="mpgpt-book-") as tmp:
        if student:
            cmd += ["--config", str(student_config(source, Path(tmp)))]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=source)
    return Path(path_output) / "_build" / "html"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the mpgpt book with warnings as errors.")
    parser.add_argument("--student", action="store_true", help="hide the exercise solutions (student edition)")
    parser.add_argument("--path-output", type=Path, default=None, help="build under DIR/_build/html")
    parser.add_argument("--all", dest="fresh", action="store_true", help="rebuild every page")
    parser.add_argument("extra", nargs="*", help="extra jupyter-book arguments (after --)")
    args = parser.parse_args(argv)
    try:
        html = build(student=args.student, path_output=args.path_output, fresh=args.fresh, extra=args.extra)
    except subprocess.CalledProcessError as exc:
        print(f"Book build failed (exit {exc.returncode}); the warnings above say what to fix.", file=sys.stderr)
        return exc.returncode or 1
    print(f"Built: {html / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
