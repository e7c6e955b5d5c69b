"""Every chapter notebook follows the course conventions (the instructor guide and the README describe them).

These checks read the committed .ipynb files; they do not execute anything (nbval does that).
Each notebook's problems are collected and reported together, so one run says everything to fix.
"""
import re
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sync_repo_url  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
URL, OWNER, REPO, BRANCH = sync_repo_url.repository_settings(ROOT / "_config.yml")

# The install cell, exactly (generated from _config.yml by scripts/sync_repo_url.py).
INSTALL_CELL = sync_repo_url.install_cell(URL, BRANCH)
CHECKED = "nbval-check-output"  # the cell tag nbval --nbval-lax compares (invisible in the book)

FENCE_OPEN = re.compile(r"^(?P<fence>`{3,}|:{3,})\{(?P<name>[a-z-]+)\}[ \t]*(?P<arg>\S*)[ \t]*$", re.MULTILINE)
COLAB_URL = re.compile(r"https://colab\.research\.google\.com/github/[^\s)\"'>\]]+")


def toc_notebooks() -> list[str]:
    """Paths (without extension) of the notebooks named in _toc.yml."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    found = []

    def walk(entries):
        for entry in entries or []:
            if str(entry.get("file", "")).startswith("notebooks/"):
                found.append(str(entry["file"]).removesuffix(".ipynb"))
            for key in ("chapters", "sections", "parts"):
                walk(entry.get(key))

    walk(toc.get("parts"))
    walk(toc.get("chapters"))
    return found


def test_every_toc_chapter_exists_and_every_notebook_is_in_the_toc():
    listed = toc_notebooks()
    assert listed, "_toc.yml lists no notebooks"
    missing = [name for name in listed if not (ROOT / f"{name}.ipynb").exists()]
    assert not missing, f"_toc.yml names notebooks that do not exist yet: {missing}"
    unlisted = [p.name for p in NOTEBOOKS if f"notebooks/{p.stem}" not in listed]
    assert not unlisted, f"notebooks missing from _toc.yml (the book would silently skip them): {unlisted}"


def test_the_book_release_is_the_package_version():
    import tomllib

    import mpgpt
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert mpgpt.__version__ == version, "mpgpt/__init__.py's __version__ and pyproject.toml disagree"
    assert BRANCH == f"v{version}", f"_config.yml repository.branch is {BRANCH!r}; the release tag is v{version}"
    assert f'COURSE_VERSION = "{version}"' in INSTALL_CELL


def test_repository_url_is_in_step_everywhere():
    assert sync_repo_url.main(["--check", "--root", str(ROOT)]) == 0, \
        "run `python scripts/sync_repo_url.py` to copy _config.yml's repository.url into the notebooks"


def directives(text: str) -> list[tuple[str, str, str]]:
    """(name, argument, options+body) of each MyST directive fence in a markdown text."""
    found = []
    for match in FENCE_OPEN.finditer(text):
        close = re.compile(rf"^{re.escape(match['fence'])}[ \t]*$", re.MULTILINE).search(text, match.end())
        body = text[match.end(): close.start() if close else len(text)]
        found.append((match["name"], match["arg"], body))
    return found


def problems_of(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    cells = nb.cells
    number = int(path.name[:2]) if path.name[:2].isdigit() else None
    # A letter after the two digits makes a lab (05b_...): `# Lab — Title`, labels `lab-...`.
    lab = re.match(r"\d\d[a-z]_", path.name) is not None
    problems = []
    if not cells:
        return ["the notebook is empty"]

    # 1. Title, Colab link, learning objectives.
    first = cells[0]
    if first.cell_type != "markdown" or not first.source.startswith("# "):
        problems.append("the first cell must be markdown starting with `# Chapter N — Title`")
    elif lab and not re.match(r"# Lab — \S", first.source):
        problems.append(f"a lab's title must read `# Lab — Title`, got {first.source.splitlines()[0]!r}")
    elif not lab and not re.match(rf"# Chapter {number} — \S", first.source):
        problems.append(f"the title must read `# Chapter {number} — Title`, got {first.source.splitlines()[0]!r}")
    intro = "\n".join(c.source for c in cells[: next((i for i, c in enumerate(cells) if c.cell_type == "code"), len(cells))])
    if not re.search(r"^## Learning objectives\s*\n+(\s*[-*] .+\n?)+", intro, re.MULTILINE):
        problems.append("no `## Learning objectives` heading followed by bullets before the first code cell")
    # Colab opens the notebook's Colab edition (plain Markdown; scripts/colab_edition.py).
    own = sync_repo_url.colab_url(OWNER, REPO, BRANCH, path.name)
    if f"[Open in Colab]({own})" not in intro:
        problems.append(f"no `[Open in Colab]({own})` link before the first code cell")
    for cell in cells:
        for url in COLAB_URL.findall(cell.source):
            if url != own:
                problems.append(f"Colab link {url} should be {own}")

    # 2. The install cell.
    code_cells = [c for c in cells if c.cell_type == "code"]
    if not code_cells:
        problems.append("no code cells")
    elif code_cells[0].source.strip() != INSTALL_CELL:
        problems.append(f"the first code cell must be the install cell, exactly:\n{INSTALL_CELL}")
    elif code_cells[0].metadata.get("tags") != sync_repo_url.INSTALL_TAGS:
        problems.append(f"the install cell must carry the tags {sync_repo_url.INSTALL_TAGS} (hidden in the book)")

    # 3. Device setup that shrinks sizes without a GPU.
    if not any('device = "cuda" if torch.cuda.is_available() else "cpu"' in c.source for c in code_cells):
        problems.append('no setup cell with `device = "cuda" if torch.cuda.is_available() else "cpu"`')

    # 4. Exercises with non-gated solutions.
    markdown = "\n\n".join(c.source for c in cells if c.cell_type == "markdown")
    found = directives(markdown)
    labels = []
    for name, _, body in found:
        if name == "exercise":
            label = re.search(r"^:label:\s*(\S+)", body, re.MULTILINE)
            if not label:
                problems.append("an {exercise} without a :label:")
            else:
                labels.append(label.group(1))
    if not 2 <= len(labels) <= 4:
        problems.append(f"{len(labels)} exercises; each chapter has 2-4")
    solutions = [arg for name, arg, _ in found if name == "solution"]
    for label in labels:
        if lab and not label.startswith("lab-"):
            problems.append(f"exercise label {label!r} should start with 'lab-' (labels are global to the book)")
        elif not lab and number is not None and not label.startswith(f"ch{number:02d}-"):
            problems.append(f"exercise label {label!r} should start with 'ch{number:02d}-' (labels are global to the book)")
        if solutions.count(label) != 1:
            problems.append(f"exercise {label!r} has {solutions.count(label)} {{solution}} blocks; it needs exactly one")
    problems += [f"{{solution}} {arg!r} refers to no exercise" for arg in solutions if arg not in labels]
    for name, arg, body in found:
        if name == "solution" and not re.search(r"^:class:.*\bdropdown\b", body, re.MULTILINE):
            problems.append(f"{{solution}} {arg!r} must open as a dropdown: add `:class: dropdown` under it")
        if name == "exercise" and re.search(r"^:nonumber:", body, re.MULTILINE):
            problems.append("an {exercise} with :nonumber: loses its chapter number (Exercise N.k)")
    if re.search(r"\{(solution|exercise)-(start|end)\}", markdown):
        problems.append("gated solution-start/solution-end directives crash the student build (sphinx-exercise issue 89)")

    # 5. A summary at the end.
    last = cells[-1]
    if last.cell_type != "markdown" or not last.source.lstrip().startswith("## Summary"):
        problems.append("the last cell must be markdown starting with `## Summary`")

    # 6. Executed top to bottom, without errors.
    counts = [c.execution_count for c in code_cells if c.source.strip()]
    if any(n is None for n in counts):
        problems.append(f"{counts.count(None)} code cells were never executed; run scripts/run_notebook.py")
    elif counts != sorted(counts) or len(set(counts)) != len(counts):
        problems.append(f"execution counts {counts} are not increasing: run the notebook top to bottom")
    for i, cell in enumerate(code_cells):
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                problems.append(f"code cell {i} has an error output: {out.get('ename')}: {out.get('evalue')}")

    # 7. nbval: at least one checked cell, with output and no stderr.
    checked = [c for c in code_cells if CHECKED in c.metadata.get("tags", [])]
    if not checked:
        problems.append(f"no cell is tagged `{CHECKED}`; nbval would compare nothing")
    for cell in code_cells:
        if "NBVAL_" in cell.source:
            problems.append(f"an NBVAL comment marker shows in the book; use the cell tag `{CHECKED}`: "
                            f"{cell.source.splitlines()[0]!r}")
    for cell in checked:
        if not cell.get("outputs"):
            problems.append(f"checked cell without output: {cell.source.splitlines()[1:2]}")
        if any(o.output_type == "stream" and o.name == "stderr" for o in cell.get("outputs", [])):
            problems.append(f"checked cell writes to stderr (a warning?): {cell.source.splitlines()[1:2]}")

    # 8. Widgets: saved state or none at all.
    widgets = nb.metadata.get("widgets")
    if widgets is not None:
        state = widgets.get("application/vnd.jupyter.widget-state+json", {})
        if "state" not in state:
            problems.append("metadata.widgets without `state` breaks renderers: strip it")

    # 9. No external images: the book must render offline.
    for cell in cells:
        if cell.cell_type == "markdown" and re.search(r"!\[[^\]]*\]\(https?://|<img[^>]+src=[\"']https?://", cell.source):
            problems.append("a markdown cell shows an image from the web; commit it or draw it in a cell")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_follows_conventions(path):
    problems = problems_of(path)
    assert not problems, f"{path.relative_to(ROOT)}:\n- " + "\n- ".join(problems)


def test_checker_catches_a_broken_notebook(tmp_path):
    """The checks can fail: a notebook that breaks each convention is reported for each."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("Chapter without a title\n\n[Open in Colab](https://colab.research.google.com/github/x/y/blob/main/notebooks/other.ipynb)"),
        nbformat.v4.new_code_cell('REPO_URL = "https://github.com/someone/else"'),
        nbformat.v4.new_markdown_cell("```{exercise}\n:label: ex1\n\nDo it.\n```\n\n```{solution-start} ex1\n```\nAnswer\n```{solution-end}\n```"),
        nbformat.v4.new_code_cell("1 / 0", execution_count=None),
    ], metadata={"widgets": {"application/vnd.jupyter.widget-state+json": {"version_major": 2}}})
    path = tmp_path / "01_broken.ipynb"
    nbformat.write(nb, path)
    text = "\n".join(problems_of(path))
    for expected in ["`# Chapter N — Title`", "Learning objectives", "Open in Colab", "install cell",
                     "device =", "1 exercises", "0 {solution} blocks", "gated", "## Summary",
                     "never executed", CHECKED, "metadata.widgets", "should start with 'ch01-'"]:
        assert expected in text, f"the checker missed: {expected}\n{text}"


def test_a_lab_needs_a_lab_title_and_lab_labels(tmp_path):
    """A notebook named with a letter after its two digits is a lab: chapter titles and labels are reported."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# Chapter 5 — Not a lab title"),
        nbformat.v4.new_markdown_cell("```{exercise}\n:label: ch05-ex1\n\nDo it.\n```"),
    ])
    path = tmp_path / "05b_some_lab.ipynb"
    nbformat.write(nb, path)
    text = "\n".join(problems_of(path))
    assert "`# Lab — Title`" in text and "should start with 'lab-'" in text, text


def test_exercises_are_numbered_per_chapter():
    """book/_ext/chapter_exercises.py turns the book-wide exercise count into "Exercise N.k"."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    assert "chapter_exercises" in (config["sphinx"].get("local_extensions") or {}), \
        "_config.yml must load book/_ext/chapter_exercises.py (sphinx.local_extensions)"
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    import chapter_exercises

    class Env:  # what Sphinx has assigned: one count through the whole book
        toc_fignumbers = {
            "notebooks/01_number_formats": {"exercise": {"ch01-ex2": (2,), "ch01-ex1": (1,)}},
            "notebooks/08_scaling_out": {"exercise": {"ch08-ex1": (25,), "ch08-ex2": (26,)}, "figure": {"f": (3,)}},
            "book/setup": {"exercise": {"x": (27,)}},
        }
    env = Env()
    changed = chapter_exercises.renumber(env)
    assert env.toc_fignumbers["notebooks/01_number_formats"]["exercise"] == {"ch01-ex1": (1, 1), "ch01-ex2": (1, 2)}
    assert env.toc_fignumbers["notebooks/08_scaling_out"]["exercise"] == {"ch08-ex1": (8, 1), "ch08-ex2": (8, 2)}
    assert env.toc_fignumbers["notebooks/08_scaling_out"]["figure"] == {"f": (3,)}, "only exercises are renumbered"
    assert env.toc_fignumbers["book/setup"]["exercise"] == {"x": (27,)}, "pages that are not chapters keep the count"
    assert sorted(changed) == ["notebooks/01_number_formats", "notebooks/08_scaling_out"]


# --- the install cell when pip fails ------------------------------------------------------------

def _run_install_cell(monkeypatch, returncode: int, stderr: str = ""):
    """Execute the install cell as if mpgpt were missing, with pip faked; return (pip calls, namespace)."""
    import subprocess
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        if returncode == 0:  # the install "worked": the package becomes importable again
            monkeypatch.delitem(sys.modules, "mpgpt")
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr=stderr)

    monkeypatch.setitem(sys.modules, "mpgpt", None)  # `import mpgpt` raises ImportError
    monkeypatch.setattr(subprocess, "run", fake_run)
    namespace = {}
    exec(compile(INSTALL_CELL, "install-cell", "exec"), namespace)
    return calls, namespace


def test_install_cell_installs_the_release_it_names(monkeypatch, capsys):
    calls, _ = _run_install_cell(monkeypatch, returncode=0)
    assert len(calls) == 1 and calls[0][1:4] == ["-m", "pip", "install"], calls
    assert calls[0][-1] == f"mpgpt[notebooks] @ git+{URL}@{BRANCH}", calls
    assert "mpgpt" in capsys.readouterr().out


def test_install_cell_failure_says_what_failed_and_what_to_do(monkeypatch, capsys):
    """pip fails (no network, or the release is not published): pip's own message is shown, then one
    line naming what failed and the way out (clone + pip install -e), with no traceback in IPython."""
    with pytest.raises(Exception) as info:
        _run_install_cell(monkeypatch, returncode=1, stderr="ERROR: Repository not found.")
    assert type(info.value).__name__ == "InstallFailed", repr(info.value)
    message = str(info.value)
    assert "\n" not in message
    for part in [f"mpgpt {BRANCH[1:]}", URL, f"git clone {URL}", "pip install -e '.[notebooks]'",
                 "restart the kernel", "PyPI"]:
        assert part in message, f"{part!r} missing from: {message}"
    assert "ERROR: Repository not found." in capsys.readouterr().err, "pip's own message must be shown"
    # IPython renders an exception with _render_traceback_ as the lines it returns: one line here.
    assert info.value._render_traceback_() == [f"InstallFailed: {message}"]
