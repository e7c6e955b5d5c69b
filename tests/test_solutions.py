"""Every exercise solution of the book runs, and the results it states are checked.

A solution is a `{solution}` block in a chapter's markdown. Its ```python blocks run in a fresh
kernel after the chapter's own code cells that come before the exercises, so they see the same
state the reader's notebook has there (the model, the data, the helper functions). What a
solution's code states about its result is checked, in one of two ways:

- `EXPR  # -> VALUE` on one line: the repr of EXPR (or, for a statement such as `print(...)`,
  what it prints) must read VALUE, where `...` stands for further characters, as in `0.4498...`.
- `assert CONDITION` for a result that is a bound or a trend rather than one exact value.

A block whose first line is `# not run: REASON` is shown in the book but not executed (it needs
several processes or a GPU, say); every solution still needs at least one block that runs, and
every block that runs at least one check.

Executing the chapters again is what this costs (about as long as nbval's run of each), so the
module is marked slow. Run one chapter with `pytest tests/test_solutions.py -k 04_static`.
"""
import re
import textwrap
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

SOLUTION = re.compile(r"^(?P<fence>`{3,}|:{3,})\{solution\}[ \t]*(?P<label>\S+)[ \t]*\n", re.MULTILINE)
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(?P<code>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
STATED = re.compile(r"^(?P<indent>[ \t]*)(?P<stmt>\S.*?)[ \t]+# -> (?P<want>.+?)[ \t]*$")
NOT_RUN = re.compile(r"^# not run: \S")

# Defined in the kernel before the solutions run: checks one stated result.
HELPERS = r'''
import contextlib as _contextlib, io as _io, re as _re

def _stated_pattern(want):
    return "".join(".*?" if part == "..." else _re.escape(part) for part in _re.split(r"(\.\.\.)", want))

def _check_stated(stmt, want, where, namespace):
    """Evaluate (or execute) one line of a solution and compare the result with what it states."""
    try:
        code, mode = compile(stmt, where, "eval"), "eval"
    except SyntaxError:
        code, mode = compile(stmt, where, "exec"), "exec"
    out = _io.StringIO()
    with _contextlib.redirect_stdout(out):
        value = eval(code, namespace) if mode == "eval" else exec(code, namespace)
    got = repr(value) if mode == "eval" and value is not None else out.getvalue().strip()
    print(out.getvalue(), end="")
    if mode == "eval" and value is not None:
        print(got)
    if not _re.fullmatch(_stated_pattern(want), got, _re.DOTALL):
        raise AssertionError(f"{where}: the solution states {want!r}, the code gives {got!r}")
'''


def solutions(path: Path) -> list[tuple[str, str]]:
    """(label, body) of every {solution} block in a notebook's markdown cells."""
    found = []
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for match in SOLUTION.finditer(cell.source):
            close = re.compile(rf"^{re.escape(match['fence'])}[ \t]*$", re.MULTILINE).search(cell.source, match.end())
            found.append((match["label"], cell.source[match.end(): close.start() if close else None]))
    return found


def python_blocks(body: str) -> list[str]:
    return [m["code"] for m in PYTHON_BLOCK.finditer(body)]


def checked_code(code: str, where: str) -> tuple[str, int]:
    """The block with every `STMT  # -> VALUE` line turned into a check; (code, number of checks)."""
    lines, checks = [], len(re.findall(r"^\s*assert\b", code, re.MULTILINE))
    for number, line in enumerate(code.splitlines(), start=1):
        match = STATED.match(line)
        if match:
            checks += 1
            line = (f"{match['indent']}_check_stated({match['stmt']!r}, {match['want']!r}, "
                    f"{f'{where}, line {number}'!r}, globals())")
        lines.append(line)
    return "\n".join(lines), checks


def exercises_cell(nb) -> int:
    return next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and "{exercise}" in c.source)


def solution_notebook(path: Path):
    """The chapter's code cells before its exercises, then one cell per solution block that runs.

    Returns (notebook, {cell index: where}) or raises AssertionError naming a solution that
    states nothing or runs nothing."""
    nb = nbformat.read(path, as_version=4)
    first = exercises_cell(nb)
    cells = [nbformat.v4.new_code_cell(c.source) for c in nb.cells[:first] if c.cell_type == "code"]
    cells.append(nbformat.v4.new_code_cell(HELPERS))
    where_of, problems = {}, []
    for label, body in solutions(path):
        runnable = 0
        for k, code in enumerate(python_blocks(body), start=1):
            if NOT_RUN.match(code):
                continue
            where = f"{path.stem} {label} block {k}"
            code, checks = checked_code(textwrap.dedent(code), where)
            if checks == 0:
                problems.append(f"{where} runs but checks nothing: state a result with `# -> VALUE` or an assert")
            where_of[len(cells)] = where
            cells.append(nbformat.v4.new_code_cell(code))
            runnable += 1
        if runnable == 0:
            problems.append(f"{path.stem} {label}: no ```python block that runs (only `# not run:` ones or none)")
    assert not problems, "\n".join(problems)
    out = nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata)
    return out, where_of


def test_checked_code_turns_stated_results_into_checks():
    code, checks = checked_code("x = 2\nx + 1   # -> 3\nprint(x, 0.12345)  # -> 2 0.12...\nassert x == 2", "t")
    assert checks == 3
    namespace = {}
    exec(HELPERS, namespace)
    exec(code, namespace)  # the stated results hold
    bad, _ = checked_code("1 + 1  # -> 3", "t")
    with pytest.raises(AssertionError, match="states '3'"):
        exec(bad, namespace)
    wild, _ = checked_code("0.4498123  # -> 0.44...", "t")
    exec(wild, namespace)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_solutions_run_and_their_stated_results_hold(path):
    from nbclient import NotebookClient

    nb, where_of = solution_notebook(path)
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    problems = []
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.output_type != "error":
                continue
            if index in where_of:
                problems.append(f"{where_of[index]}: {out.ename}: {out.evalue}")
            else:
                problems.append(f"{path.stem}: the chapter's own code cell failed before the solutions ran: "
                                f"{out.ename}: {out.evalue}")
    assert not problems, "\n".join(problems)
