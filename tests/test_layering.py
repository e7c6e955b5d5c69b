"""The package's modules form layers: each imports only from the layers below it, and nothing imports
in a cycle. A learner can then read mpgpt bottom-up, one module at a time.

The test reads every module's import statements (it does not import anything) and checks three rules:

1. the graph of all imports between mpgpt modules has no cycle;
2. a module-level import goes to a strictly lower layer, or within the module's own package
   (mpgpt.kernels.* among themselves, mpgpt.bench.* among themselves);
3. an import inside a function is allowed only across an optional boundary (fp8 -> kernels,
   where Triton may be missing); any other one would hide a cycle or an upward dependency.

And the reference model (mpgpt/model.py) imports nothing of the fast path, at any level: speed is
applied to it from outside (mpgpt.fast.convert).
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mpgpt"

# module (or package) -> layer; lower layers know nothing of higher ones.
LAYERS = {
    "runtime": 0,
    "formats": 1, "data": 1, "precision": 1, "checkpoint": 1, "fused_loss": 1, "scaling": 1, "results": 1,
    "optim16": 1,
    "ddp_by_hand": 1,
    "graph_step": 1,
    "model": 2, "fp8": 2,
    "kernels": 3,
    "fast": 3.5,      # the converter and the fast forward passes, on top of the kernels
    "recipe": 3.75,   # recipe names -> settings; builds through the converter
    "trainer": 4,
    "distributed": 5,
    "train": 6,
    "bench": 7, "plots": 7, "notebook": 7,
    "labs": 7, "grade": 7,
}
# function-level imports that cross an optional dependency: (importer, imported) by layer name
OPTIONAL_BOUNDARIES = {("fp8", "kernels")}  # Fp8Linear's fused cast
OPTIONAL_BOUNDARIES.add(("recipe", "fast"))  # a recipe's fast-path switches: Triton is optional for chapters 1-5
OPTIONAL_BOUNDARIES.add(("trainer", "kernels"))  # optim16: the fused Triton AdamW on a GPU, the reference elsewhere


def unit_of(module: str) -> str:
    """'mpgpt.kernels.matmul' -> 'kernels'; 'mpgpt' -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def lazy_exports() -> dict:
    """mpgpt/__init__.py's _EXPORTS: a name importable from mpgpt -> the module that defines it."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def resolve(target: str, name: str) -> str:
    """``from target import name``: the module meant, 'mpgpt.kernels.env' for a submodule, the
    defining module for a lazily exported name of mpgpt, else target itself."""
    candidate = PACKAGE.parent / (target.replace(".", "/") + "/" + name)
    if candidate.with_suffix(".py").exists() or (candidate / "__init__.py").exists():
        return f"{target}.{name}"
    if target == "mpgpt" and name in lazy_exports():
        return f"mpgpt.{lazy_exports()[name]}"
    return target


def imports_of(path: Path, module: str):
    """(imported mpgpt module, line, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []

    def visit(node, top):
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend([(a.name, child.lineno, top) for a in child.names if a.name.split(".")[0] == "mpgpt"])
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against this module's package
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] == "mpgpt":
                    found.extend([(resolve(target, a.name), child.lineno, top) for a in child.names])
            visit(child, inner)

    visit(tree, True)
    return found


def graph():
    edges = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        edges[module] = (path, imports_of(path, module))
    return edges


def problems(edges) -> list[str]:
    found = []
    for module, (path, imports) in edges.items():
        here = unit_of(module)
        if here and here not in LAYERS:
            found.append(f"{module}: not in the layer table of tests/test_layering.py")
            continue
        for target, line, top in imports:
            there = unit_of(target)
            where0 = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            if not here:
                if top and there:  # mpgpt/__init__.py runs first for every module: it must stay lazy
                    found.append(f"{where0} at module level: mpgpt/__init__.py must not import the package")
                continue
            if there and there not in LAYERS:
                found.append(f"{where0}: {there!r} is not a module in the layer table")
                continue
            if not there:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            if here == there:
                continue  # within one package
            if top and LAYERS[there] >= LAYERS[here]:
                found.append(f"{where}: layer {LAYERS[there]} from layer {LAYERS[here]} (upward or sideways)")
            if not top and (here, there) not in OPTIONAL_BOUNDARIES:
                found.append(f"{where} inside a function: move it to the top, or it hides a layering problem")
    # cycles over every import, module-level or not, between whole units
    # (a function-level import across an optional boundary runs at call time, when both modules
    # are loaded, so it closes no cycle: the kernels it reaches may import its module at the top)
    units = {}
    for module, (_, imports) in edges.items():
        for target, _, top in imports:
            a, b = unit_of(module), unit_of(target)
            if a and b and a != b and (top or (a, b) not in OPTIONAL_BOUNDARIES):
                units.setdefault(a, set()).add(b)
    state = {}

    def dfs(node, stack):
        state[node] = "open"
        for nxt in sorted(units.get(node, ())):
            if state.get(nxt) == "open":
                found.append("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                dfs(nxt, stack + [nxt])
        state[node] = "done"

    for unit in sorted(units):
        if unit not in state:
            dfs(unit, [unit])
    # and between single modules, which catches cycles inside mpgpt.kernels or mpgpt.bench too
    modules = {m: {t for t, _, top in imports if t != m and t in edges
                   and (top or (unit_of(m), unit_of(t)) not in OPTIONAL_BOUNDARIES)} for m, (_, imports) in edges.items()}
    state.clear()

    def dfs_modules(node, stack):
        state[node] = "open"
        for nxt in sorted(modules.get(node, ())):
            if state.get(nxt) == "open":
                found.append("module import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                dfs_modules(nxt, stack + [nxt])
        state[node] = "done"

    for m in sorted(modules):
        if m not in state:
            dfs_modules(m, [m])
    return found


def test_the_package_is_layered_without_cycles():
    found = problems(graph())
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from mpgpt.trainer import Trainer", "layer 4 from layer 1"),
    ("from mpgpt import Trainer", "layer 4 from layer 1"),           # a lazy re-export of mpgpt
    ("import mpgpt.train as t", "layer 6 from layer 1"),
    ("def f():\n    from mpgpt import model", "inside a function"),
])
def test_the_parser_sees_every_form_of_import(tmp_path, source, expected):
    # Parsed from source, as the real check does: a leaf (precision) with one planted import.
    fake = PACKAGE / "precision.py"
    planted = tmp_path / "precision.py"
    planted.write_text(fake.read_text(encoding="utf-8") + "\n" + source + "\n", encoding="utf-8")
    edges = dict(graph())
    edges["mpgpt.precision"] = (fake, imports_of(planted, "mpgpt.precision"))
    found = "\n".join(problems(edges))
    assert expected in found, found


# What the reference model may import: the leaves it is built on, nothing that makes it fast.
FAST_PATH = ("mpgpt.kernels", "mpgpt.fast", "mpgpt.fused_loss", "mpgpt.recipe")


def test_the_reference_model_imports_nothing_of_the_fast_path():
    edges = graph()
    imported = {target for target, _, _ in edges["mpgpt.model"][1]}
    assert imported <= {"mpgpt.runtime"}, sorted(imported)
    assert not [t for t in imported if t.startswith(FAST_PATH)]
    source = (PACKAGE / "model.py").read_text(encoding="utf-8")
    assert "importlib" not in source and "__import__" not in source  # no import by name either
    assert len(source.splitlines()) <= 450, "the reference model is meant to fit in a reader's head"


def test_a_fast_path_import_in_the_model_is_caught():
    edges = dict(graph())
    path, imports = edges["mpgpt.model"]
    edges["mpgpt.model"] = (path, imports + [("mpgpt.fast.mlp", 1, False)])
    assert "inside a function" in "\n".join(problems(edges))


def test_a_cycle_inside_a_package_is_found():
    edges = dict(graph())
    path, imports = edges["mpgpt.kernels.env"]
    edges["mpgpt.kernels.env"] = (path, imports + [("mpgpt.kernels.matmul", 1, True)])  # matmul imports env
    assert "module import cycle" in "\n".join(problems(edges))


@pytest.mark.parametrize("planted", ["cycle", "upward", "hidden"])
def test_the_check_catches_a_planted_problem(planted):
    edges = dict(graph())
    fake = PACKAGE / "precision.py"
    if planted == "cycle":      # a leaf that imports the trainer, which imports it: upward and a cycle
        edges["mpgpt.precision"] = (fake, edges["mpgpt.precision"][1] + [("mpgpt.trainer", 1, True)])
        expected = ["layer 4 from layer 1", "import cycle"]
    elif planted == "upward":   # the model reaching up to the trainer
        edges["mpgpt.model"] = (fake, edges["mpgpt.model"][1] + [("mpgpt.trainer", 1, True)])
        expected = ["layer 4 from layer 2"]
    else:                       # the same, hidden inside a function
        edges["mpgpt.scaling"] = (fake, edges["mpgpt.scaling"][1] + [("mpgpt.train", 1, False)])
        expected = ["inside a function"]
    found = "\n".join(problems(edges))
    for text in expected:
        assert text in found, found


def test_notebooks_use_only_public_names_of_the_package():
    # What a chapter calls is what a learner copies: private helpers may change without notice.
    import re

    import nbformat

    modules = "|".join(["mpgpt", "plots", "kernels", "bench", "results", "formats", "scaling", "data", "precision",
                        "model", "trainer", "train", "distributed", "checkpoint", "env"])
    attribute = re.compile(rf"\b({modules})\.(_[A-Za-z]\w*)")
    private_import = re.compile(r"from mpgpt[\w.]* import ([^\n]+)")
    found = []
    for path in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb")):
        for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type != "code":
                continue
            for m in attribute.finditer(cell.source):
                if not m.group(2).startswith("__"):  # mpgpt.__file__, __version__ are public
                    found.append(f"{path.name} cell {index}: {m.group(0)}")
            for m in private_import.finditer(cell.source):
                if re.search(r"(^|[\s,(])_\w", m.group(1)):
                    found.append(f"{path.name} cell {index}: {m.group(0)}")
    assert not found, "\n".join(found)
