"""Only what a chapter uses ships: every record inside the package is loaded by a chapter's code (a
notebook's code cells, or package code a chapter calls), and every record that is not lives in
benchmarks/records/, outside the wheel, listed in benchmarks/README.md."""
import re
from pathlib import Path

import nbformat

from mpgpt import results

ROOT = Path(__file__).resolve().parents[1]


def chapter_code() -> str:
    """The code the chapters run: the notebooks' code cells and the package's modules (less the
    table of records itself, which names every record without loading one)."""
    parts = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        parts += [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    for path in sorted((ROOT / "mpgpt").rglob("*.py")):
        if path.name != "results.py":
            parts.append(path.read_text(encoding="utf-8"))
    return "\n".join(parts)


def test_every_shipped_record_is_loaded_by_a_chapters_code():
    code = chapter_code()
    unused = [name for name in sorted(results.RECORDS) if not re.search(rf"[\"']{re.escape(name)}[\"']", code)]
    assert not unused, f"shipped but loaded by no chapter: {unused}; move them to benchmarks/records/"


def test_the_records_outside_the_package_are_listed_in_the_benchmarks_readme():
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    outside = sorted(p.stem for p in (ROOT / "benchmarks" / "records").glob("*.json"))
    assert outside and not set(outside) & set(results.RECORDS)
    missing = [name for name in outside if f"`{name}`" not in readme]
    assert not missing, missing
