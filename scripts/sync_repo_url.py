"""Keep every notebook's repository URL in step with _config.yml.

_config.yml's `repository.url` (and `repository.branch`) is the one setting for where the course
lives. The Colab launch buttons of the book read it directly; this script copies it into
  - the `REPO_URL = "..."` line of each notebook's install cell,
  - each notebook's "Open in Colab" links (https://colab.research.google.com/github/OWNER/REPO/blob/BRANCH/...),
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

REPO_URL_LINE = re.compile(r'^(?P<head>\s*REPO_URL\s*=\s*)(?P<q>["\'])(?P<url>[^"\']*)(?P=q)', re.MULTILINE)
COLAB_LINK = re.compile(
    r"https://colab\.research\.google\.com/github/(?P<owner>[^/\s)\"']+)/(?P<repo>[^/\s)\"']+)"
    r"/blob/(?P<branch>[^/\s)\"']+)/")
GIT_URL_IN_PROSE = re.compile(r"(?P<head>git clone |git\+)https://github\.com/[^/\s)\"'`]+/[^/\s)\"'`]+")


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


def sync_text(text: str, url: str, owner: str, repo: str, branch: str, *, code: bool) -> str:
    """Rewrite the repository URL pieces in one cell's (or page's) text."""
    if code:
        text = REPO_URL_LINE.sub(lambda m: f"{m['head']}{m['q']}{url}{m['q']}", text)
    text = COLAB_LINK.sub(f"https://colab.research.google.com/github/{owner}/{repo}/blob/{branch}/", text)
    return GIT_URL_IN_PROSE.sub(lambda m: f"{m['head']}{url}", text)


def sync_notebook(path: Path, settings, write: bool) -> bool:
    """Return True when the notebook was (or, without write, would be) changed."""
    nb = nbformat.read(path, as_version=4)
    changed = False
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
