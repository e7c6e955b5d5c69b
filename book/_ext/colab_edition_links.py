"""Sphinx extension: a chapter's Colab links and its downloadable notebook are the Colab edition.

The chapters are MyST notebooks, which Colab and plain Jupyter show as raw markup.
scripts/colab_edition.py writes their Colab edition (plain Markdown) into colab/ and, without the
solutions, into colab/student/. On every chapter page this extension
  - points the Colab launch button (sphinx-book-theme builds it from notebooks/NAME.ipynb) and the
    chapter's own "Open in Colab" link at colab/NAME.ipynb, or at colab/student/NAME.ipynb in the
    student edition (`mpgpt_student_edition: true`, which scripts/build_book.py --student sets);
  - replaces the notebook the download button serves (_sources/notebooks/NAME.ipynb) with the
    same edition, generated from the source at build time, so a student's download holds no
    solution either.
"""
import sys
from pathlib import Path


def _tools(srcdir):
    """scripts/colab_edition.py and scripts/sync_repo_url.py of the book being built."""
    scripts = str(Path(srcdir) / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import colab_edition
    import sync_repo_url
    return colab_edition, sync_repo_url


def edition_url(url: str, settings, student: bool, sync_repo_url) -> str:
    """A Colab link to a chapter (its MyST source or its Colab edition) -> the edition's link."""
    _, owner, repo, branch = settings
    return sync_repo_url.COLAB_NOTEBOOK_LINK.sub(
        lambda m: sync_repo_url.colab_url(owner, repo, branch, m["name"], student=student), url)


def rewrite_buttons(buttons, rewrite) -> None:
    """Rewrite every "url" in sphinx-book-theme's header button list (groups nest a "buttons" list)."""
    for button in buttons or []:
        if isinstance(button, dict):
            if isinstance(button.get("url"), str):
                button["url"] = rewrite(button["url"])
            rewrite_buttons(button.get("buttons"), rewrite)


def _on_page_context(app, pagename, templatename, context, doctree):
    if not pagename.startswith("notebooks/"):
        return
    _, sync_repo_url = _tools(app.srcdir)
    settings = sync_repo_url.repository_settings(Path(app.srcdir) / "_config.yml")
    student = bool(app.config.mpgpt_student_edition)

    def rewrite(text):
        return edition_url(text, settings, student, sync_repo_url)

    rewrite_buttons(context.get("header_buttons"), rewrite)
    if isinstance(context.get("body"), str):
        context["body"] = rewrite(context["body"])


def write_downloads(srcdir: Path, outdir: Path, docnames, student: bool) -> list[Path]:
    """Overwrite each chapter's downloadable notebook under outdir/_sources with its Colab edition."""
    import nbformat
    colab_edition, sync_repo_url = _tools(srcdir)
    settings = sync_repo_url.repository_settings(Path(srcdir) / "_config.yml")
    references = colab_edition.bibliography(Path(srcdir) / "book" / "references.bib")
    written = []
    for docname in sorted(docnames):
        source = Path(srcdir) / f"{docname}.ipynb"
        if not docname.startswith("notebooks/") or not source.is_file():
            continue
        folder = (Path(outdir) / "_sources" / docname).parent
        targets = sorted(folder.glob(f"{Path(docname).name}.ipynb*")) if folder.is_dir() else []
        if not targets:
            continue
        nb = colab_edition.edition(nbformat.read(source, as_version=4), source.name, student=student,
                                   settings=settings, references=references, root=Path(srcdir))
        text = colab_edition.render(nb)
        for target in targets:
            target.write_text(text, encoding="utf-8")
            written.append(target)
    return written


def _on_build_finished(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    write_downloads(Path(app.srcdir), Path(app.outdir), app.env.found_docs, bool(app.config.mpgpt_student_edition))


def setup(app):
    app.add_config_value("mpgpt_student_edition", False, "html")
    # priority 900: after sphinx-book-theme (501) has built the header buttons.
    app.connect("html-page-context", _on_page_context, priority=900)
    app.connect("build-finished", _on_build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
