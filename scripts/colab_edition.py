"""Write the Colab edition of the chapter notebooks: the same notebooks in plain Markdown.

The chapters under notebooks/ are written in MyST, which the book renders but Colab and plain
Jupyter show as raw text. The Colab edition is what a learner opens from a Colab link or a Colab
launch button, and what the book's download button gives:

    colab/NAME.ipynb            every chapter, each solution folded in a <details> block
    colab/student/NAME.ipynb    the same without the solutions (the student edition's links)

In both, citations become author-year links with a References list at the end (from
book/references.bib), exercises become "Exercise N.k" paragraphs, other directives and roles become
ordinary Markdown, and the "Open in Colab" link opens the edition itself. Code cells and their
outputs are copied unchanged. The folders are generated: edit notebooks/, then run

    python scripts/colab_edition.py           # rewrite colab/ from notebooks/
    python scripts/colab_edition.py --check   # change nothing; exit 1 and list what is out of step

(tests/test_colab_edition.py runs the check; scripts/sync_repo_url.py owns the links' form.)
"""
import argparse
import copy
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import sync_repo_url  # noqa: E402

README = """# The Colab edition of the chapters

Generated from `notebooks/` by `python scripts/colab_edition.py`: do not edit these files; edit the
chapter under `notebooks/` and run the script again. The chapters' Colab links and the book's Colab
launch buttons open these notebooks, in which the book's MyST markup is plain Markdown:

- `colab/NAME.ipynb`: every chapter, with each exercise's solution folded in a `<details>` block;
- `colab/student/NAME.ipynb`: the same without the solutions (the student edition of the book,
  `python scripts/build_book.py --student`, links here).
"""

ADMONITIONS = {"note", "tip", "hint", "important", "warning", "caution", "attention", "danger",
               "error", "seealso", "admonition", "margin", "sidebar", "topic", "epigraph", "dropdown"}
DROPPED = {"glossary", "toctree", "tableofcontents", "bibliography", "raw", "only", "meta"}
CODE = {"code", "code-block", "sourcecode", "code-cell", "literalinclude"}

FENCE = re.compile(r"^(?P<indent>[ \t]{0,3})(?P<fence>`{3,}|~{3,}|:{3,})(?P<info>.*)$")
DIRECTIVE_INFO = re.compile(r"^\{(?P<name>[A-Za-z][\w:-]*)\}[ \t]*(?P<arg>.*?)[ \t]*$")
ROLE = re.compile(r"\{(?P<name>[A-Za-z][\w:+-]*)\}`(?P<content>[^`]*)`")
TARGET = re.compile(r"^\([\w.:-]+\)=[ \t]*$")           # (label)=
OPTION = re.compile(r"^:(?P<key>[\w-]+):(?:[ \t]+(?P<value>.*))?$")
TITLED = re.compile(r"^(?P<text>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)  # `text <target>`
CHAPTER = re.compile(r"^(\d\d)([a-z]?)_")


class EditionError(ValueError):
    """The source uses something the Colab edition cannot render (an unknown citation key...)."""


# --- the bibliography ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Reference:
    key: str
    names: str       # "Goldberg", "Tillet et al.", "Loshchilov and Hutter", "IEEE"
    year: str
    url: str | None
    entry: str       # the full entry, one Markdown line


def _plain(text: str) -> str:
    """BibTeX text as plain text: braces gone, a few escapes resolved."""
    text = text.replace("\\&", "&").replace("\\_", "_").replace("\\%", "%").replace("--", "–")
    return re.sub(r"\s+", " ", text.replace("{", "").replace("}", "")).strip()


def _reference(key: str, entry) -> Reference:
    fields = entry.fields
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    last = [_plain(" ".join(p.prelast_names + p.last_names)) for p in people]
    if not last:
        names = _plain(fields.get("organization") or fields.get("institution") or fields.get("title", key))
    elif len(last) == 1:
        names = last[0]
    elif len(last) == 2:
        names = f"{last[0]} and {last[1]}"
    else:
        names = f"{last[0]} et al."
    year = _plain(fields.get("year", "")) or "n.d."
    url = fields.get("url")
    if not url and fields.get("doi"):
        url = f"https://doi.org/{fields['doi']}"
    if not url:
        arxiv = re.search(r"arXiv:\s*(\d{4}\.\d{4,5})", fields.get("note", "") + " " + fields.get("eprint", ""))
        url = f"https://arxiv.org/abs/{arxiv.group(1)}" if arxiv else None
    authors = [_plain(" ".join(p.first_names + p.middle_names + p.prelast_names + p.last_names)) for p in people]
    if len(authors) > 6:
        authors = authors[:6] + ["et al."]
    venue = next((_plain(fields[k]) for k in ("journal", "booktitle", "institution", "publisher", "howpublished")
                  if fields.get(k)), "")
    parts = [", ".join(authors) or names, f"*{_plain(fields.get('title', key))}*"]
    parts += [venue] if venue else []
    parts += [fields["number"]] if fields.get("number") and entry.type == "techreport" else []
    parts.append(year)
    text = ". ".join(p.rstrip(".") for p in parts) + "."
    if url:
        text += f" <{url}>"
    return Reference(key, names, year, url, text)


@lru_cache(maxsize=4)
def bibliography(path: Path) -> dict[str, Reference]:
    from pybtex.database import parse_file
    return {key: _reference(key, entry) for key, entry in parse_file(str(path)).entries.items()}


# --- MyST to Markdown ---------------------------------------------------------------------------

@dataclass
class Context:
    """What converting one notebook needs, and what it collects on the way."""
    name: str                        # the notebook's file name, 01_number_formats.ipynb
    student: bool
    settings: tuple                  # (url, owner, repo, branch) from _config.yml
    references: dict                 # key -> Reference
    root: Path = ROOT
    exercises: dict = field(default_factory=dict)   # label -> "1.2"
    cited: list = field(default_factory=list)       # keys in order of first citation

    @property
    def chapter(self) -> str:
        match = CHAPTER.match(self.name)
        return f"{int(match.group(1))}{match.group(2)}" if match else ""


def _cite(kind: str, keys: str, ctx: Context) -> str:
    refs = []
    for key in (k.strip() for k in keys.split(",")):
        if key not in ctx.references:
            raise EditionError(f"{ctx.name}: {{cite}} names {key!r}, which book/references.bib does not have")
        if key not in ctx.cited:
            ctx.cited.append(key)
        refs.append(ctx.references[key])

    def link(text, ref):
        return f"[{text}]({ref.url})" if ref.url else text
    if kind in ("t", "ts"):      # textual: Goldberg (1991)
        return "; ".join(f"{ref.names} ({link(ref.year, ref)})" for ref in refs)
    inner = "; ".join(link(f"{ref.names}, {ref.year}", ref) for ref in refs)
    return inner if kind in ("alp", "yearpar") else f"({inner})"


def _page_link(target: str, text: str | None, ctx: Context) -> str:
    """A {doc} link: another chapter opens its Colab edition; a book page its source on GitHub."""
    url, owner, repo, branch = ctx.settings
    path = (Path("notebooks") / target).as_posix() if not target.startswith("/") else target.lstrip("/")
    parts = []
    for part in path.split("/"):
        if part == "..":
            parts = parts[:-1]
        elif part not in ("", "."):
            parts.append(part)
    path = "/".join(parts)
    if (ctx.root / f"{path}.ipynb").exists():
        name = Path(path).name + ".ipynb"
        title = text or _first_heading(ctx.root / f"{path}.ipynb") or name
        return f"[{title}]({sync_repo_url.colab_url(owner, repo, branch, name, student=ctx.student)})"
    for suffix in (".md", ""):
        if (ctx.root / f"{path}{suffix}").is_file():
            title = text or _first_heading(ctx.root / f"{path}{suffix}") or path
            return f"[{title}]({url}/blob/{branch}/{path}{suffix})"
    raise EditionError(f"{ctx.name}: {{doc}} names {target!r}, which is not a page of the book")


def _first_heading(path: Path) -> str | None:
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        text = nb.cells[0].source if nb.cells else ""
    else:
        text = path.read_text(encoding="utf-8")
    match = re.search(r"^# (.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else None


def _role(match: re.Match, ctx: Context) -> str:
    name, content = match["name"], match["content"]
    titled = TITLED.match(content)
    text, target = (titled["text"].strip(), titled["target"].strip()) if titled else (None, content.strip())
    if name == "cite" or name.startswith("cite:"):
        return _cite(name.partition(":")[2] or "p", content, ctx)
    if name == "doc":
        return _page_link(target, text, ctx)
    if name in ("math", "m"):
        return f"${content}$"
    if name in ("eq",):
        return f"({target})"
    if name in ("ref", "numref", "term", "abbr", "sub-ref", "any", "download", "guilabel", "menuselection"):
        if name == "ref" and target in ctx.exercises and not text:
            return f"Exercise {ctx.exercises[target]}"
        if name == "abbr" and titled:
            return f"{text} ({target})"
        return text or target
    if name in ("code", "samp", "file", "kbd", "command", "envvar", "py:func", "func", "class", "meth",
                "attr", "mod", "obj", "data", "exc"):
        return f"`{text or target}`"
    return text or target  # an unknown role: its text, without the markup


def _split_options(body: list[str]) -> tuple[dict, list[str]]:
    """A directive's leading `:key: value` lines (or a `---` YAML block) and the rest of its body."""
    options, i = {}, 0
    if body and body[0].strip() == "---":
        end = next((j for j in range(1, len(body)) if body[j].strip() == "---"), None)
        if end is not None:
            import yaml
            options = yaml.safe_load("\n".join(body[1:end])) or {}
            i = end + 1
    while i < len(body):
        match = OPTION.match(body[i].strip())
        if not match:
            break
        options[match["key"]] = (match["value"] or "").strip()
        i += 1
    while i < len(body) and not body[i].strip():
        i += 1
    return options, body[i:]


def _directive(name: str, arg: str, body: list[str], ctx: Context) -> list[str]:
    options, content = _split_options(body)
    text = convert_markdown("\n".join(content), ctx).strip("\n")
    if name == "exercise":
        number = ctx.exercises.get(options.get("label", ""), "")
        head = f"**Exercise {number}**" if number else "**Exercise**"
        head += f" ({convert_markdown(arg, ctx)})" if arg else ""
        return [head, "", *text.splitlines()]
    if name == "solution":
        if ctx.student:
            return []
        number = ctx.exercises.get(arg)
        if number is None:
            raise EditionError(f"{ctx.name}: {{solution}} {arg!r} refers to no exercise")
        return ["<details>", f"<summary>Solution to Exercise {number}</summary>", "", *text.splitlines(), "",
                "</details>"]
    if name in CODE:
        language = arg.split()[0] if arg else ""
        fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`{3,}", "\n".join(content))), default=0))
        return [f"{fence}{language}", *content, fence]
    if name in ("math",):
        return ["$$", *content, "$$"]
    if name in ("figure", "image"):
        caption = text or options.get("alt", "")
        return [f"![{caption}]({arg})"]
    if name in DROPPED:
        return []
    if name in ADMONITIONS:
        title = convert_markdown(arg, ctx) if arg else name.capitalize()
        if name == "dropdown" or "dropdown" in str(options.get("class", "")):
            return ["<details>", f"<summary>{title}</summary>", "", *text.splitlines(), "", "</details>"]
        lines = [f"**{title}**", "", *text.splitlines()]
        return [f"> {line}" if line else ">" for line in lines]
    return text.splitlines()  # an unknown directive: its content, without the markup


def convert_markdown(text: str, ctx: Context) -> str:
    """One markdown text (a cell, or a directive's body) from MyST to plain Markdown."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        match = FENCE.match(line)
        if match:
            fence = match["fence"]
            close = re.compile(rf"^[ \t]{{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
            end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), len(lines))
            body = lines[i + 1:end]
            directive = DIRECTIVE_INFO.match(match["info"].strip())
            if directive:
                out += [match["indent"] + b if b else b
                        for b in _directive(directive["name"], directive["arg"], body, ctx)]
            elif fence[0] == ":":  # a bare ::: block (colon_fence): its content
                out += convert_markdown("\n".join(body), ctx).split("\n")
            else:  # an ordinary code block: unchanged
                out += lines[i:end + 1]
            i = end + 1
            continue
        if TARGET.match(line.strip()) or re.match(r"^%", line) or line.strip() == "+++":
            i += 1  # a MyST target, comment or block break: nothing to show
            continue
        out.append(_inline(line, ctx))
        i += 1
    return "\n".join(out)


INLINE = re.compile(ROLE.pattern + r"|(?P<span>(?P<ticks>`+)[^`].*?(?P=ticks)(?!`))")


def _inline(line: str, ctx: Context) -> str:
    """Roles become Markdown; inline code spans (`...`) stay as they are, roles in them included."""
    return INLINE.sub(lambda m: m.group(0) if m["span"] else _role(m, ctx), line)


# --- notebooks ----------------------------------------------------------------------------------

def _exercise_numbers(nb, ctx: Context) -> dict:
    """label -> "N.k" for the notebook's exercises, k counting from 1 in page order (as the book does)."""
    labels = []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for match in re.finditer(r"^[ \t]*(`{3,}|:{3,})\{exercise\}[^\n]*\n", cell.source, re.MULTILINE):
            options, _ = _split_options(cell.source[match.end():].split("\n"))
            labels.append(options.get("label"))
    return {label: f"{ctx.chapter}.{k}" if ctx.chapter else str(k)
            for k, label in enumerate(labels, start=1) if label}


def edition(source, name: str, *, student: bool, settings, references, root: Path = ROOT):
    """The Colab edition of one chapter notebook (a new NotebookNode; the source is not changed)."""
    nb = copy.deepcopy(source)
    ctx = Context(name=name, student=student, settings=settings, references=references, root=root)
    ctx.exercises = _exercise_numbers(nb, ctx)
    _, owner, repo, branch = settings
    own = sync_repo_url.colab_url(owner, repo, branch, name, student=student)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            text = convert_markdown(cell.source, ctx)
            text = sync_repo_url.COLAB_NOTEBOOK_LINK.sub(
                lambda m: sync_repo_url.colab_url(owner, repo, branch, m["name"], student=student), text)
            cell.source = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    nb.cells = [c for c in nb.cells if c.cell_type != "markdown" or c.source.strip()]
    if ctx.cited:
        refs = "\n".join(f"- {ctx.references[key].entry}" for key in ctx.cited)
        cell = nbformat.v4.new_markdown_cell(f"## References\n\n{refs}")
        cell.id = "references"
        nb.cells.append(cell)
    nb.metadata["mpgpt"] = {
        "edition": "colab-student" if student else "colab",
        "source": f"notebooks/{name}",
        "note": "generated by scripts/colab_edition.py; edit the source notebook, not this file",
        "colab_url": own,
    }
    return nb


def render(nb) -> str:
    """A notebook as nbformat.write writes it (the repository's formatting)."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def expected_files(root: Path = ROOT) -> dict[str, str]:
    """Every file of the Colab edition (path relative to root -> content), generated in memory."""
    settings = sync_repo_url.repository_settings(root / "_config.yml")
    references = bibliography(root / "book" / "references.bib")
    files = {f"{sync_repo_url.COLAB_FOLDER}/README.md": README}
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        source = nbformat.read(path, as_version=4)
        for student, folder in ((False, sync_repo_url.COLAB_FOLDER), (True, sync_repo_url.STUDENT_FOLDER)):
            nb = edition(source, path.name, student=student, settings=settings, references=references, root=root)
            files[f"{folder}/{path.name}"] = render(nb)
    return files


def out_of_step(root: Path = ROOT) -> tuple[dict[str, str], list[str]]:
    """(files to write: missing or different, stale files under colab/ to delete)."""
    wanted = expected_files(root)
    changed = {rel: text for rel, text in wanted.items()
               if not (root / rel).is_file() or (root / rel).read_text(encoding="utf-8") != text}
    folder = root / sync_repo_url.COLAB_FOLDER
    present = [p.relative_to(root).as_posix() for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
    stale = sorted(rel for rel in present if rel not in wanted)
    return changed, stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if colab/ is out of step")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    try:
        changed, stale = out_of_step(args.root)
    except EditionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for rel in sorted(changed):
        print(f"{rel}: {'out of step with notebooks/' if args.check else 'written'}")
    for rel in stale:
        print(f"{rel}: {'has no source notebook' if args.check else 'deleted (no source notebook)'}")
    if args.check:
        if changed or stale:
            print("Run `python scripts/colab_edition.py` to regenerate the Colab edition.", file=sys.stderr)
            return 1
        return 0
    for rel, text in changed.items():
        (args.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (args.root / rel).write_text(text, encoding="utf-8")
    for rel in stale:
        (args.root / rel).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
