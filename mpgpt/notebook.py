"""Helpers for running the chapters in Jupyter where part of the stack is missing (chapter 6).

`skip_cells_needing` lets a chapter run top to bottom without Triton (macOS, Windows): every later
cell that uses one of the named things — or something a skipped cell defined — prints one line
saying it was skipped, instead of failing with a NameError. The cells that only read recorded
results still run, so the chapter's numbers stay visible.
"""
from __future__ import annotations

import ast


def _names(tree: ast.AST) -> tuple[set, set]:
    """(names read, names bound) anywhere in a parsed cell."""
    read, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.Attribute):
            read.add(node.attr)  # so a method name (model.to_triton) can be named as missing
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return read, bound


class CellSkipper:
    """Decides, cell by cell, whether a cell's code can run; `transform` is an IPython input
    transformer (a list of source lines in, a list out)."""

    def __init__(self, names, reason: str):
        self.missing = set(names)
        self.message = f"[skipped: {reason}]"

    def needs_missing(self, source: str) -> bool:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return False  # let Python report it
        read, bound = _names(tree)
        if (read - bound) & self.missing:  # a name the cell binds itself is not taken from elsewhere
            self.missing |= bound          # what this cell would have defined is missing too
            return True
        self.missing -= bound              # redefined by a cell that runs: available again
        return False

    def transform(self, lines: list[str]) -> list[str]:
        if self.needs_missing("".join(lines)):
            return [f"print({self.message!r})\n"]
        return lines


def skip_cells_needing(names, reason: str) -> CellSkipper:
    """From the next cell on, replace every cell that uses any of `names` (or a name such a cell
    defines) by a one-line message. Only in IPython/Jupyter; a plain script gets a RuntimeError."""
    try:
        ip = get_ipython()  # noqa: F821 (defined by IPython)
    except NameError:
        raise RuntimeError("skip_cells_needing works inside Jupyter/IPython only") from None
    skipper = CellSkipper(names, reason)
    ip.input_transformers_post.append(skipper.transform)
    return skipper
