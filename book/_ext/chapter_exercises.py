"""Sphinx extension: number the exercises of each chapter as "Exercise N.k".

sphinx-exercise numbers its exercises with Sphinx's figure numbering, which counts through the
whole book ("Exercise 25" in chapter 8). After Sphinx has assigned those numbers, this replaces
each exercise number on a chapter page `notebooks/NN_*` by the pair (NN, k), k counting from 1 in
page order, so titles and references read "Exercise 8.1". A lab placed after a chapter
(`notebooks/05b_*`) is numbered after its name: "Exercise 5b.1". Pages that are not chapters keep
the plain count.
"""
import re

CHAPTER = re.compile(r"^notebooks/(\d\d)([a-z]?)_")


def chapter_number(docname: str):
    """The chapter number of a chapter page (notebooks/NN_...): 8; of a lab (notebooks/05b_...): "5b";
    else None."""
    match = CHAPTER.match(docname)
    if not match:
        return None
    return f"{int(match.group(1))}{match.group(2)}" if match.group(2) else int(match.group(1))


def renumber(env) -> list:
    """Rewrite env.toc_fignumbers' exercise numbers per chapter; return the pages changed."""
    changed = []
    for docname, kinds in env.toc_fignumbers.items():
        chapter = chapter_number(docname)
        exercises = kinds.get("exercise")
        if chapter is None or not exercises:
            continue
        ordered = sorted(exercises, key=lambda label: exercises[label])  # the book-wide order
        new = {label: (chapter, k) for k, label in enumerate(ordered, start=1)}
        if new != exercises:
            kinds["exercise"] = new
            changed.append(docname)
    return changed


def _on_env_get_updated(app, env):
    return renumber(env)


def setup(app):
    # priority 900: after Sphinx's own toctree collector (priority 500) has numbered the figures.
    app.connect("env-get-updated", _on_env_get_updated, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
