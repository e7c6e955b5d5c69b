"""Keep every notebook's install cell and links in step with _config.yml.

_config.yml's `repository.url` and `repository.branch` are the one setting for where the course
lives and which release the book was rendered from: `branch` is a release tag `vX.Y.Z`, equal to
the package's version (tests/test_notebook_conventions.py checks that). The Colab launch buttons of
the book read them directly; this script copies them into
  - each notebook's install cell (its first code cell, rewritten whole from `install_cell`),
  - each notebook's "Open in Colab" links, which open the notebook's Colab edition
    (https://colab.research.google.com/github/OWNER/REPO/blob/BRANCH/colab/NAME.ipynb, written by
    scripts/colab_edition.py: plain Markdown instead of MyST),
  - the `git clone URL` and `git+URL` commands in book/*.md.

Usage (from the repository root):
    python scripts/sync_repo_url.py           # rewrite whatever is out of step
    python scripts/sync_repo_url.py --check   # change nothing; exit 1 and list what is out of step
"""
import argparse
import re
import sys
from pathlib import Path

import nbformat
import yaml

ROOT = Path(__file__).resolve().parents[1]

COLAB_LINK = re.compile(
    r"https://colab\.research\.google\.com/github/(?P<owner>[^/\s)\"']+)/(?P<repo>[^/\s)\"']+)"
    r"/blob/(?P<branch>[^/\s)\"']+)/")
# A link that opens a chapter on Colab, at notebooks/NAME.ipynb (the MyST source) or colab/NAME.ipynb.
COLAB_NOTEBOOK_LINK = re.compile(COLAB_LINK.pattern + r"(?:notebooks|colab)/(?P<name>[\w.-]+\.ipynb)")
GIT_URL_IN_PROSE = re.compile(r"(?P<head>git clone |git\+)https://github\.com/[^/\s)\"'`]+/[^/\s)\"'`]+")


# Where Colab opens a chapter: its Colab edition (scripts/colab_edition.py writes both folders).
COLAB_FOLDER = "colab"            # colab/NAME.ipynb: plain Markdown, solutions folded in <details>
STUDENT_FOLDER = "colab/student"  # colab/student/NAME.ipynb: the same without the solutions


def colab_url(owner: str, repo: str, branch: str, name: str, student: bool = False) -> str:
    """The Colab link that opens notebooks/NAME's Colab edition (the student one with student=True)."""
    folder = STUDENT_FOLDER if student else COLAB_FOLDER
    return f"https://colab.research.google.com/github/{owner}/{repo}/blob/{branch}/{folder}/{name}"


def repository_settings(config_path: Path = ROOT / "_config.yml") -> tuple[str, str, str, str]:
    """Return (url, owner, repo, branch) from _config.yml, or raise ValueError saying what to fix."""
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    repo = (config or {}).get("repository") or {}
    url = str(repo.get("url", "")).rstrip("/")
    url = url[:-4] if url.endswith(".git") else url
    match = re.fullmatch(r"https://github\.com/([^/\s]+)/([^/\s]+)", url)
    if not match:
        raise ValueError(f"{config_path}: repository.url must look like https://github.com/OWNER/REPO, got {url!r}")
    branch = str(repo.get("branch") or "main")
    return url, match.group(1), match.group(2), branch


def install_cell(url: str, branch: str) -> str:
    """The first code cell of every chapter: installs the course package at the book's release if
    it is missing, then prints in one line what is installed and where it runs. When pip fails
    (no network, or the release is not published), it shows pip's output and ends with one line
    that says what failed and what to do instead; IPython shows that line without a traceback."""
    version = branch[1:] if re.fullmatch(r"v\d+\.\d+\.\d+", branch) else branch
    return f'''# Installs the course package at the release this book was written for, if it is missing (Colab).
COURSE_VERSION = "{version}"
COURSE_REPOSITORY = "{url}"
try:
    import mpgpt
except ImportError:
    import subprocess, sys
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                          f"mpgpt[notebooks] @ git+{{COURSE_REPOSITORY}}@v{{COURSE_VERSION}}"],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        print(pip.stdout + pip.stderr, file=sys.stderr)

        class InstallFailed(Exception):
            def _render_traceback_(self):  # IPython shows this one line instead of a traceback
                return [f"InstallFailed: {{self}}"]

        raise InstallFailed(
            f"pip could not install mpgpt {{COURSE_VERSION}} from {{COURSE_REPOSITORY}} (tag v{{COURSE_VERSION}}; "
            f"pip's output is above). Instead, clone the repository (git clone {{COURSE_REPOSITORY}}), run "
            f"pip install -e '.[notebooks]' in the clone, restart the kernel and run this cell again; or, "
            f"once the release is on PyPI, pip install 'mpgpt[notebooks]=={{COURSE_VERSION}}'.")
    import mpgpt
print(mpgpt.about(COURSE_VERSION))'''


INSTALL_TAGS = ["remove-cell"]  # hidden in the rendered book: it is plumbing, not the lesson


def sync_text(text: str, url: str, owner: str, repo: str, branch: str, *, code: bool) -> str:
    """Rewrite the repository URL pieces in one cell's (or page's) text."""
    text = COLAB_NOTEBOOK_LINK.sub(lambda m: colab_url(owner, repo, branch, m["name"]), text)
    text = COLAB_LINK.sub(f"https://colab.research.google.com/github/{owner}/{repo}/blob/{branch}/", text)
    if code:  # the install cell is rewritten whole by sync_notebook
        return text
    return GIT_URL_IN_PROSE.sub(lambda m: f"{m['head']}{url}", text)


def sync_notebook(path: Path, settings, write: bool) -> bool:
    """Return True when the notebook was (or, without write, would be) changed."""
    nb = nbformat.read(path, as_version=4)
    changed = False
    code = [c for c in nb.cells if c.cell_type == "code"]
    if code:
        url, _, _, branch = settings
        wanted = install_cell(url, branch)
        if code[0].source != wanted or code[0].metadata.get("tags") != INSTALL_TAGS:
            code[0].source = wanted
            code[0].metadata["tags"] = list(INSTALL_TAGS)
            changed = True
    for cell in nb.cells:
        new = sync_text(cell.source, *settings, code=cell.cell_type == "code")
        if new != cell.source:
            cell.source = new
            changed = True
    if changed and write:
        nbformat.write(nb, path)
    return changed


def sync_page(path: Path, settings, write: bool) -> bool:
    text = path.read_text(encoding="utf-8")
    new = sync_text(text, *settings, code=False)
    if new != text and write:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything is out of step")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    settings = repository_settings(args.root / "_config.yml")
    out_of_step = []
    for path in sorted((args.root / "notebooks").glob("*.ipynb")):
        if sync_notebook(path, settings, write=not args.check):
            out_of_step.append(path)
    for path in sorted((args.root / "book").glob("*.md")):
        if sync_page(path, settings, write=not args.check):
            out_of_step.append(path)
    for path in out_of_step:
        rel = path.relative_to(args.root)
        print(f"{rel}: {'out of step with' if args.check else 'updated from'} _config.yml repository.url = {settings[0]}")
    if args.check and out_of_step:
        print("Run `python scripts/sync_repo_url.py` to update them.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
