"""mpgpt.results: the curated records the book reads, and result files of new runs.

The records ship inside the package, so these tests read them through the package (as a wheel
install would: tests/test_fresh_install.py repeats the load from a wheel in a fresh venv).
"""
import json
import os

import pytest

from mpgpt import results


@pytest.mark.parametrize("name", sorted(results.RECORDS))
def test_every_curated_record_loads_with_its_environment(name):
    record = results.load_record(name)
    env = record["environment"]
    for key in ("date", "command", "commit", "torch"):
        assert env.get(key), f"{name}: environment.{key} is missing"
    assert len(env["commit"]) == 40 and int(env["commit"], 16) >= 0
    assert env["record"] == name
    # no machine-local path in what the book prints as the command
    assert "/root" not in env["command"] and "/work" not in env["command"]
    line = results.describe(record)
    assert env["date"][:10] in line and env["torch"] in line
    undated = results.describe(record, date=False)   # what the chapters print
    assert env["date"][:10] not in undated and env["torch"] in undated


def test_records_hold_what_the_chapters_read():
    assert results.load_record("kernels-h200")["matmul"]
    assert {r["config"] for r in results.load_record("train-h200")["rows"]} >= {"fp32", "bf16", "bf16+compile"}
    assert results.load_record("ddp-h200x2")["rows"]
    assert results.load_record("scaler-overhead-cpu")["median_ms"]
    for name in ("kernels-h200", "train-h200", "ddp-h200x2", "scaler-overhead-h200"):
        assert "H200" in results.describe(results.load_record(name))


def test_every_shipped_record_file_is_listed_and_every_listed_one_ships():
    """A record file the package ships but RECORDS does not name could not be loaded by name, and
    would escape the environment checks above."""
    shipped = {p.stem for p in results.RECORDS_DIR.glob("*.json")}
    assert shipped == set(results.RECORDS), f"unlisted: {shipped - set(results.RECORDS)}, missing: {set(results.RECORDS) - shipped}"


def test_unknown_record_names_the_ones_there_are():
    with pytest.raises(KeyError, match="kernels-h200"):
        results.load_record("kernels")


def test_write_result_goes_to_the_current_folder_whole(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = results.write_result("train", {"rows": [{"config": "fp32", "tokens_per_s": 7}]}, tag="mine")
    assert path.parent == tmp_path
    assert path.name.startswith("train_") and path.name.endswith("_mine.json")
    assert os.listdir(tmp_path) == [path.name]  # no temporary file left beside it
    back = results.load_result(path)
    assert back["rows"] == [{"config": "fp32", "tokens_per_s": 7}]
    assert back["environment"]["torch"] and back["environment"]["date"]


def test_write_result_refuses_names_that_are_not_file_names(tmp_path):
    for kind, tag in [("../x", None), ("train", "a/b"), ("", None)]:
        with pytest.raises(ValueError, match="letters, digits"):
            results.write_result(kind, {}, tmp_path, tag=tag)
    assert list(tmp_path.iterdir()) == []


def test_load_result_refuses_a_file_that_is_no_result(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not an mpgpt result"):
        results.load_result(bad)


def test_nothing_in_the_package_reads_the_repository_tree():
    # Recorded results come from the package's own records/ folder; code that names the checkout's
    # benchmarks/ folder breaks after a pip install. Docstrings may mention it; code may not.
    import ast
    from pathlib import Path

    import mpgpt

    root = Path(mpgpt.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and ("benchmarks/" in node.value or node.value == "benchmarks")):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    # Allowed: find_record's fallback to a checkout's benchmarks/records (it returns None in a wheel)
    # and the recipe's message that names where such a record lives.
    allowed = {"results.py": "REPOSITORY_RECORDS_DIR", "recipe.py": "in the repository's benchmarks/records"}
    offenders = [o for o in offenders
                 if allowed.get(o.split(":")[0]) not in (root / o.split(":")[0]).read_text(encoding="utf-8")
                 .splitlines()[int(o.split(":")[1]) - 1]]
    assert not offenders, offenders


def test_write_result_keeps_the_provenance_and_writes_standard_json(tmp_path):
    with pytest.raises(ValueError, match="key 'environment'.*provenance"):
        results.write_result("train", {"environment": {"gpu": "fake"}}, tmp_path)
    assert list(tmp_path.iterdir()) == []
    path = results.write_result("train", {"rows": [{"ms": float("nan"), "best": float("inf"), "n": [1.5, float("nan")]}]},
                                tmp_path)
    strict = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert strict["rows"] == [{"ms": None, "best": None, "n": [1.5, None]}]


def test_write_result_refuses_an_out_dir_that_cannot_hold_it(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    for out, message in [(tmp_path / "file", "is a file, not a folder"), (tmp_path / "link", "broken symbolic link"),
                         ("/proc/mpgpt-results", "cannot hold the result")]:
        with pytest.raises(ValueError, match=message):
            results.write_result("train", {"rows": []}, out)
