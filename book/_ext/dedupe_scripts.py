"""Sphinx extension: drop duplicate <script> tags from every HTML page.

Sphinx 7.4 registers an inline script (one with a body and no file) that an extension adds after
the builder started twice: once with filename None and once with filename '' (see
sphinx/builders/html/__init__.py, where registry entries are re-added as `js_filename or ''`).
sphinx-thebe adds such a script, `const THEBE_JS_URL = ...`, so every page declared that const
twice and the browser raised "Identifier 'THEBE_JS_URL' has already been declared".
This keeps the first of any scripts that are equal up to None vs ''.
"""


def _dedupe(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for js in scripts:
        attributes = getattr(js, "attributes", {}) or {}
        key = (getattr(js, "filename", js) or "", getattr(js, "priority", 0),
               tuple(sorted((k, str(v)) for k, v in attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique


def setup(app):
    app.connect("html-page-context", _dedupe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
