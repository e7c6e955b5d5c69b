"""Installed as `sitecustomize.py` into the fresh environment of tests/test_fresh_install.py, so it
runs first in every Python process there, Jupyter kernels included. Two switches:

MPGPT_FORBID_READS_UNDER=<folder>   any open() of a file under <folder> raises PermissionError,
                                    except under the folders in MPGPT_ALLOW_READS_UNDER
                                    (os.pathsep-separated): a chapter must not need the checkout.
MPGPT_BLOCK_TRITON=1                `import triton` fails, as on macOS and Windows.
"""
import os
import sys

_ROOT = os.environ.get("MPGPT_FORBID_READS_UNDER")
if _ROOT:
    _ROOT = os.path.abspath(_ROOT) + os.sep
    _ALLOWED = tuple(os.path.abspath(p) + os.sep for p in os.environ.get("MPGPT_ALLOW_READS_UNDER", "").split(os.pathsep) if p)

    def _forbid_repository_reads(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(args[0]))
            if path.startswith(_ROOT) and not path.startswith(_ALLOWED):
                raise PermissionError(f"read from the repository tree: {path} (a chapter must run without the checkout)")

    sys.addaudithook(_forbid_repository_reads)

if os.environ.get("MPGPT_BLOCK_TRITON"):
    class _NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError(f"No module named {name!r} (blocked: rehearsing a machine without Triton)")
            return None

    sys.meta_path.insert(0, _NoTriton())
