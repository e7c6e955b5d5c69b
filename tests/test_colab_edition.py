"""The Colab edition (colab/, written by scripts/colab_edition.py) reads well on Colab and is in step
with the chapters under notebooks/.

Colab shows MyST as raw text, so what a Colab link opens must be plain Markdown: citations as
links, exercises as paragraphs, solutions folded in <details> (and absent from colab/student/).
Fast: nothing is executed and no book is built.
"""
import re
import sys
from pathlib import Path

import nbformat
import pytest

# The citations are read with pybtex, which comes with the book's tools (requirements.txt).
pytest.importorskip("pybtex", reason="pybtex is not installed: pip install -r requirements.txt")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "book" / "_ext"))
import colab_edition  # noqa: E402
import colab_edition_links  # noqa: E402
import sync_repo_url  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SETTINGS = sync_repo_url.repository_settings(ROOT / "_config.yml")
URL, OWNER, REPO, BRANCH = SETTINGS
REFERENCES = colab_edition.bibliography(ROOT / "book" / "references.bib")

RAW_ROLE = re.compile(r"\{[A-Za-z][\w:+-]*\}`")
RAW_DIRECTIVE = re.compile(r"^[ \t]*(`{3,}|~{3,}|:{3,})[ \t]*\{[A-Za-z][\w:-]*\}", re.MULTILINE)
RAW_TARGET = re.compile(r"^\([\w.:-]+\)=[ \t]*$", re.MULTILINE)
REGENERATE = "run `python scripts/colab_edition.py` and commit colab/"


def markdown(path: Path) -> list[str]:
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"]


def solution_bodies(path: Path) -> list[str]:
    """The body (options removed) of every {solution} block of a source notebook."""
    bodies = []
    for text in markdown(path):
        for match in re.finditer(r"^(?P<fence>`{3,}|:{3,})\{solution\}[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$",
                                 text, re.MULTILINE | re.DOTALL):
            _, body = colab_edition._split_options(match["body"].split("\n"))
            bodies.append("\n".join(body).strip())
    return bodies


def solution_lines(path: Path) -> list[str]:
    """Distinctive lines of a notebook's solutions, ones that appear nowhere else in the notebook
    (a solution may repeat a line of the chapter's code): a student edition must contain none."""
    bodies = solution_bodies(path)
    rest = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
    for body in bodies:
        rest = rest.replace(body, "")
    lines = []
    for body in bodies:
        lines += [line.strip() for line in body.splitlines() if len(line.strip()) >= 25
                  and not line.strip().startswith("```") and line.strip() not in rest
                  and not re.search(r"\{\w+\}`", line)]  # a line with a role is rewritten in the edition
    return lines


def leaks(edition_text: str, source: Path) -> list[str]:
    """Solution lines of `source` found in a notebook's text (its JSON, so outputs count too)."""
    import json
    cells = json.loads(edition_text)["cells"]
    text = "\n".join("".join(c["source"]) for c in cells)
    return [line for line in solution_lines(source) if line in text]


# --- the committed edition ----------------------------------------------------------------------

def test_committed_colab_edition_is_in_step_with_the_notebooks():
    changed, stale = colab_edition.out_of_step(ROOT)
    assert not changed and not stale, (
        f"colab/ is out of step with notebooks/ ({REGENERATE}):\n"
        + "\n".join([f"  {rel}: differs or is missing" for rel in sorted(changed)]
                    + [f"  {rel}: has no source notebook" for rel in stale]))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_colab_edition_has_no_raw_myst_and_folds_its_solutions(path):
    full = ROOT / sync_repo_url.COLAB_FOLDER / path.name
    student = ROOT / sync_repo_url.STUDENT_FOLDER / path.name
    assert full.is_file() and student.is_file(), f"{path.name} has no Colab edition: {REGENERATE}"
    n_solutions = len(solution_bodies(path))
    assert n_solutions >= 2, f"{path.name}: expected the chapter's exercises to have solutions"
    for edition in (full, student):
        problems = []
        for text in markdown(edition):
            problems += [f"a raw role {m.group(0)!r}" for m in RAW_ROLE.finditer(text)]
            problems += [f"a raw directive {m.group(0).strip()!r}" for m in RAW_DIRECTIVE.finditer(text)]
            problems += [f"a raw target {m.group(0)!r}" for m in RAW_TARGET.finditer(text)]
        assert not problems, f"{edition.relative_to(ROOT)}:\n" + "\n".join(problems)
    # The full edition: every solution present, each folded in a <details> block under a summary.
    text = "\n\n".join(markdown(full))
    folded = re.findall(r"<details>\n<summary>Solution to Exercise [\w.]+</summary>\n(.*?)\n</details>", text, re.DOTALL)
    assert len(folded) == n_solutions, f"{full.name}: {len(folded)} folded solutions for {n_solutions}"
    for line in solution_lines(path):
        assert any(line in block for block in folded), f"{full.name}: solution text outside <details>: {line!r}"
    n_exercises = len(re.findall(r"^\*\*Exercise \w+\.\d+\*\*", text, re.MULTILINE))
    assert n_exercises == n_solutions, f"{full.name}: {n_exercises} exercises, {n_solutions} solutions"
    # The student edition: the same exercises, no solution at all.
    student_text = student.read_text(encoding="utf-8")
    assert "Solution to Exercise" not in student_text and "<details>" not in student_text
    assert leaks(student_text, path) == [], f"{student.name} leaks solutions: {leaks(student_text, path)[:3]}"
    assert len(re.findall(r"^\*\*Exercise \w+\.\d+\*\*", "\n\n".join(markdown(student)), re.MULTILINE)) == n_exercises


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_colab_links_open_the_edition_they_sit_in(path):
    """The chapter's "Open in Colab" link opens colab/NAME; in each edition, that edition's own file."""
    for student, folder in ((False, sync_repo_url.COLAB_FOLDER), (True, sync_repo_url.STUDENT_FOLDER)):
        edition = ROOT / folder / path.name
        want = sync_repo_url.colab_url(OWNER, REPO, BRANCH, path.name, student=student)
        assert want.endswith(f"/blob/{BRANCH}/{folder}/{path.name}")
        links = re.findall(r"https://colab\.research\.google\.com/[^\s)\"'>\]]+", "\n".join(markdown(edition)))
        assert links and set(links) == {want}, f"{edition.relative_to(ROOT)}: Colab links {links}, want {want}"
    source_links = re.findall(r"https://colab\.research\.google\.com/[^\s)\"'>\]]+", "\n".join(markdown(path)))
    assert set(source_links) == {sync_repo_url.colab_url(OWNER, REPO, BRANCH, path.name)}


def test_every_citation_becomes_a_link_and_a_reference():
    """Each {cite} of a chapter appears in its edition as "(Names, year)" linked, and in its References."""
    for path in NOTEBOOKS:
        keys = []
        for text in markdown(path):
            for match in re.finditer(r"\{cite(?::\w+)?\}`([^`]+)`", text):
                keys += [k.strip() for k in match.group(1).split(",") if k.strip() not in keys]
        edition = "\n\n".join(markdown(ROOT / sync_repo_url.COLAB_FOLDER / path.name))
        for key in dict.fromkeys(keys):
            ref = REFERENCES[key]
            shown = f"[{ref.names}, {ref.year}]({ref.url})" if ref.url else f"{ref.names}, {ref.year}"
            assert shown in edition, f"{path.name}: {key} is not shown as {shown!r}"
            assert f"- {ref.entry}" in edition, f"{path.name}: {key} is missing from the References cell"


# --- the converter ------------------------------------------------------------------------------

def convert(text: str, name="07_example.ipynb", student=False, extra_cells=()) -> str:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text), *extra_cells])
    out = colab_edition.edition(nb, name, student=student, settings=SETTINGS, references=REFERENCES)
    return "\n\n".join(c.source for c in out.cells if c.cell_type == "markdown")


def test_converter_citations():
    out = convert("See {cite}`goldberg1991floating,tillet2019triton` and {cite:t}`kahan1965summation`.")
    assert ("See ([Goldberg, 1991](https://doi.org/10.1145/103162.103163); "
            "[Tillet et al., 2019](https://doi.org/10.1145/3315508.3329973)) and "
            "Kahan ([1965](https://doi.org/10.1145/363707.363723)).") in out
    assert "## References" in out and "David Goldberg. *What Every Computer Scientist" in out
    # An arXiv id in a note becomes the link when there is no url or doi.
    assert "[Osama et al., 2023](https://arxiv.org/abs/2301.03598)" in convert("{cite}`osama2023streamk`")
    with pytest.raises(colab_edition.EditionError, match="no_such_key"):
        convert("{cite}`no_such_key`")


def test_converter_exercises_and_solutions():
    text = ("## Exercises\n\n```{exercise}\n:label: ch07-ex1\n\nFirst $x$.\n```\n\n"
            "````{solution} ch07-ex1\n:class: dropdown\n\nAnswer one.\n\n```python\nx = 1  # {cite}`not_a_role`\n```\n````\n\n"
            ":::{exercise} A title\n:label: ch07-ex2\n\nSecond.\n:::\n\n"
            "```{solution} ch07-ex2\n:class: dropdown\nAnswer two.\n```")
    full = convert(text)
    assert "**Exercise 7.1**\n\nFirst $x$." in full
    assert "**Exercise 7.2** (A title)\n\nSecond." in full
    assert ("<details>\n<summary>Solution to Exercise 7.1</summary>\n\nAnswer one.\n\n"
            "```python\nx = 1  # {cite}`not_a_role`\n```\n\n</details>") in full, full
    assert "<summary>Solution to Exercise 7.2</summary>\n\nAnswer two.\n\n</details>" in full
    assert ":label:" not in full and ":class:" not in full
    student = convert(text, student=True)
    assert "Answer" not in student and "<details>" not in student and "**Exercise 7.2**" in student
    # Options may also come as a YAML block.
    yaml_options = convert("```{exercise}\n---\nlabel: ch07-ex1\n---\nAsk.\n```\n\n```{solution} ch07-ex1\nTell.\n```")
    assert "**Exercise 7.1**\n\nAsk." in yaml_options and "Solution to Exercise 7.1" in yaml_options
    # A lab's exercises are numbered after its name, as in the book: Exercise 5b.1.
    assert "**Exercise 5b.1**" in convert(text, name="05b_lab.ipynb")
    with pytest.raises(colab_edition.EditionError, match="refers to no exercise"):
        convert("```{solution} nowhere\nx\n```")


def test_converter_other_myst():
    text = ("(my-target)=\n## Heading\n\n% a comment\n\n```{note}\nA *note* {cite}`goldberg1991floating`.\n```\n\n"
            "```{admonition} Careful\n:class: dropdown\nHidden text.\n```\n\n"
            "```{math}\na = b\n```\n\nA {term}`TF32` and a {ref}`link <my-target>`, `{doc}` in code, "
            "and {doc}`../book/kernel_history`.\n\n```{code-block} bash\necho hi\n```\n\n"
            "```{unknown-thing}\n:opt: 1\nKept text.\n```")
    out = convert(text)
    assert "(my-target)=" not in out and "% a comment" not in out
    assert "> **Note**\n>\n> A *note* ([Goldberg, 1991](https://doi.org/10.1145/103162.103163))." in out
    assert "<details>\n<summary>Careful</summary>\n\nHidden text.\n\n</details>" in out
    assert "$$\na = b\n$$" in out
    assert "A TF32 and a link, `{doc}` in code," in out
    assert f"[How the kernel got fast]({URL}/blob/{BRANCH}/book/kernel_history.md)" in out
    assert "```bash\necho hi\n```" in out
    assert "Kept text." in out and ":opt:" not in out
    assert not RAW_ROLE.search(out.replace("`{doc}`", "")) and not RAW_DIRECTIVE.search(out)


def test_converter_keeps_code_cells_and_outputs():
    code = nbformat.v4.new_code_cell("print('{cite}`x`')", execution_count=3,
                                     outputs=[nbformat.v4.new_output("stream", name="stdout", text="hi\n")])
    code.metadata["tags"] = ["nbval-check-output"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# T"), code])
    out = colab_edition.edition(nb, "01_x.ipynb", student=True, settings=SETTINGS, references=REFERENCES)
    assert out.cells[1] == code and nb.cells[0].source == "# T", "the source must not change"
    assert out.metadata["mpgpt"]["edition"] == "colab-student"


def test_check_reports_a_stale_or_edited_edition(tmp_path, capsys):
    """--check fails on an edited Colab notebook and on one without a source; a rewrite fixes both."""
    import shutil
    for rel in ["_config.yml", "book/references.bib", "book/kernel_history.md", f"notebooks/{NOTEBOOKS[0].name}"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert colab_edition.main(["--root", str(tmp_path)]) == 0
    assert colab_edition.main(["--check", "--root", str(tmp_path)]) == 0
    edited = tmp_path / sync_repo_url.STUDENT_FOLDER / NOTEBOOKS[0].name
    edited.write_text(edited.read_text(encoding="utf-8").replace("Exercise", "Exercice"), encoding="utf-8")
    (tmp_path / sync_repo_url.COLAB_FOLDER / "99_gone.ipynb").write_text("{}", encoding="utf-8")
    capsys.readouterr()
    assert colab_edition.main(["--check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert f"{sync_repo_url.STUDENT_FOLDER}/{NOTEBOOKS[0].name}: out of step" in out.out
    assert "99_gone.ipynb: has no source notebook" in out.out and "python scripts/colab_edition.py" in out.err
    assert colab_edition.main(["--root", str(tmp_path)]) == 0
    assert colab_edition.main(["--check", "--root", str(tmp_path)]) == 0


# --- the book's buttons and downloads (book/_ext/colab_edition_links.py) -------------------------

def test_book_colab_buttons_point_at_the_edition():
    name = NOTEBOOKS[0].name
    source = f"https://colab.research.google.com/github/{OWNER}/{REPO}/blob/{BRANCH}/notebooks/{name}"
    full = sync_repo_url.colab_url(OWNER, REPO, BRANCH, name)
    student = sync_repo_url.colab_url(OWNER, REPO, BRANCH, name, student=True)
    buttons = [{"type": "group", "buttons": [{"text": "Colab", "url": source},
                                             {"text": "Binder", "url": "https://mybinder.org/v2/gh/x/y/main"}]},
               {"type": "link", "url": "../_sources/notebooks/x.ipynb"}]

    def rewrite(student_edition):
        return lambda text: colab_edition_links.edition_url(text, SETTINGS, student_edition, sync_repo_url)

    colab_edition_links.rewrite_buttons(buttons, rewrite(False))
    assert buttons[0]["buttons"][0]["url"] == full
    assert buttons[0]["buttons"][1]["url"] == "https://mybinder.org/v2/gh/x/y/main"
    assert buttons[1]["url"] == "../_sources/notebooks/x.ipynb"
    colab_edition_links.rewrite_buttons(buttons, rewrite(True))
    assert buttons[0]["buttons"][0]["url"] == student
    body = f'<a href="{full}">Open in Colab</a>'
    assert rewrite(True)(body) == f'<a href="{student}">Open in Colab</a>'


@pytest.mark.parametrize("student", [False, True], ids=["book", "student"])
def test_book_downloads_are_the_edition(tmp_path, student):
    """The download button's notebook is replaced by the Colab edition (without solutions for students)."""
    name = NOTEBOOKS[0].name
    target = tmp_path / "_sources" / "notebooks" / name
    target.parent.mkdir(parents=True)
    target.write_text(NOTEBOOKS[0].read_text(encoding="utf-8"), encoding="utf-8")
    written = colab_edition_links.write_downloads(ROOT, tmp_path, [f"notebooks/{NOTEBOOKS[0].stem}", "book/intro"],
                                                  student)
    assert written == [target]
    folder = sync_repo_url.STUDENT_FOLDER if student else sync_repo_url.COLAB_FOLDER
    assert target.read_text(encoding="utf-8") == (ROOT / folder / name).read_text(encoding="utf-8")
    text = target.read_text(encoding="utf-8")
    assert "{solution}" not in text and "{cite}" not in text
    assert (leaks(text, NOTEBOOKS[0]) == []) == student
