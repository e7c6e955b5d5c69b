"""What a learner's file may do while it is graded, and how the grader tells it uses the package.

Two halves:

- :func:`own_use_in_source` reads the file's text in the grader's own process, before anything of
  it runs, and names the package's own implementation of the component (or the reference the
  checks compare with) if the file imports or names it.
- :func:`install` runs in the child process, after the grader's own imports and before the
  learner's file is imported. It adds an audit hook (:func:`sys.addaudithook`: Python offers no
  way to remove one) that refuses, with a PermissionError or an ImportError the learner's code
  sees, to

    * write, create, rename, delete or chmod anything outside the grading folder, or chdir out
      of it (for every caller: the grader's child writes only its result file, opened before);
    * import a module of the package that implements the component, or read its source;
    * start processes, load C libraries with ctypes, signal other processes, walk the garbage
      collector's objects or the stack, set a trace or profile function, or reassign attributes of
      the grader's or torch's functions and classes, when the learner's code asks for it directly.

  and it replaces, in the child only, the package's own implementation and torch's reference
  (``torch.amp.GradScaler`` for ch5-scaler) with tripwires that raise when used.

The audit hook is a speed bump for a learner who wants a pass without the work, not a security
boundary: the child runs as the same user, and the verdict never depends on it (the grader's
process computes the expected results before the file is imported and judges plain data).
"""
from __future__ import annotations

import ast
import os
import re
import sys
import threading
from pathlib import Path
from types import ModuleType

# Modules whose functions merely pass a request on: the request is the caller's.
_WRAPPERS = ("subprocess", "os", "shutil", "pathlib", "ctypes", "tempfile", "io", "codecs", "posixpath",
             "genericpath", "multiprocessing", "asyncio", "pty", "platform")

# Audit events that change the file system, and the positions of their path arguments.
_PATH_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
    "os.chflags": (0,), "os.lchflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
    "shutil.copyfile": (1,), "shutil.copymode": (1,), "shutil.copystat": (1,), "shutil.copytree": (1,),
    "shutil.move": (0, 1), "shutil.rmtree": (0,), "shutil.make_archive": (0,), "shutil.unpack_archive": (1,),
}
_PROCESS_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "pty.spawn", "os.startfile")
_INTROSPECTION_EVENTS = ("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._getframe",
                         "sys._current_frames", "sys.settrace", "sys.setprofile", "sys._getframemodulename",
                         "object.__setattr__", "object.__delattr__", "ctypes.dlopen", "ctypes.dlsym",
                         "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata", "ctypes.cdata/buffer",
                         "ctypes.addressof", "ctypes.string_at", "ctypes.wstring_at", "ctypes.get_errno",
                         "code.__new__", "function.__new__", "marshal.loads", "marshal.load")


class Refused(PermissionError):
    """What the learner's code sees when it asks for something grading does not allow."""


class OwnImplementation(ImportError):
    """What the learner's code sees when it imports (or reads) the package's own implementation."""


def _used_names(tree: ast.AST) -> dict[str, set[str]]:
    """What a file's syntax names: "modules" it imports, "from" (module.name of from-imports),
    "attrs" (attribute names and dotted chains like torch.amp.GradScaler), "names" (plain names)
    and "strings" (short string constants, e.g. a module name built for importlib)."""
    used = {key: set() for key in ("modules", "from", "attrs", "names", "strings")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            used["modules"].update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            used["modules"].add(node.module)
            used["from"].update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Attribute):
            used["attrs"].add(node.attr)
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name):
                used["attrs"].add(".".join([base.id, *reversed(chain)]))
        elif isinstance(node, ast.Name):
            used["names"].add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 100:
            used["strings"].add(node.value.strip())
    return used


def own_use_in_source(source: str, graded: ModuleType) -> str | None:
    """What of the package's own implementation (or of the reference) the file's text uses, as the
    end of a sentence ("imports mpgpt.scaling"), or None. ``graded``: the component's module, with
    OWN (module names), and optionally OWN_NAMES (names of mpgpt.kernels that lead to OWN),
    REFERENCE_NAMES (names the file may not use at all) and REFERENCE_ATTRS (names the file may
    not take from a module: attributes, from-imports, strings)."""
    used = _used_names(ast.parse(source))
    own = getattr(graded, "OWN", ())
    dotted = used["modules"] | used["from"] | used["attrs"] | used["strings"]
    for name in sorted(dotted):
        if any(name == m or name.startswith(m + ".") for m in own):
            return f"imports {name}"
    for name in sorted(dotted):  # `from mpgpt import scaling` as mpgpt.scaling, `kernels.grouped`
        for m in own:
            package, _, last = m.rpartition(".")
            if name.endswith(f"{package.rpartition('.')[2]}.{last}"):
                return f"uses {name}"
    for name in getattr(graded, "OWN_NAMES", ()):
        if f"mpgpt.kernels.{name}" in used["from"]:
            return f"imports mpgpt.kernels.{name}"
    last_parts = {n.rpartition(".")[2] for n in used["from"] | used["attrs"]}
    for name in getattr(graded, "REFERENCE_NAMES", ()):
        if name in last_parts or name in used["names"] or name in used["strings"]:
            return f"uses {name}"
    for name in getattr(graded, "REFERENCE_ATTRS", ()):
        if name in last_parts:
            return f"uses {name}"
        if name in used["strings"]:
            return f"uses the string {name!r}"
    return None


def own_use_in_module(module: ModuleType, graded: ModuleType) -> str | None:
    """The same question asked of the imported module's objects (for a name built at run time)."""
    own = getattr(graded, "OWN", ())

    def is_own(obj) -> bool:
        name = getattr(obj, "__name__", "") if isinstance(obj, ModuleType) else getattr(obj, "__module__", "")
        return isinstance(name, str) and any(name == m or name.startswith(m + ".") for m in own)
    for key, value in list(vars(module).items()):
        try:
            if getattr(value, "tripwire", None) or (isinstance(value, type) and any(
                    getattr(base, "tripwire", None) for base in value.__mro__)):
                return value.tripwire
            if is_own(value):
                return f"uses {key}, from the package's own {getattr(value, '__module__', None) or value.__name__}"
            if isinstance(value, type) and any(is_own(base) for base in value.__mro__[1:]):
                return f"subclasses the package's own implementation in {key}"
        except Exception:  # an object that fails to describe itself is not the package's
            continue
    return None


def _inside(path, folder: str) -> bool:
    if isinstance(path, int):  # a file descriptor: its file was opened already
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return real == folder or real.startswith(folder + os.sep) or real == os.devnull


def install(folder: str, learner_file: str, own_modules: tuple[str, ...], reference_files: tuple[str, ...] = (),
            compilers: str | None = None) -> None:
    """Add the audit hook (see the module docstring). ``folder``: the grading folder;
    ``reference_files``: more files the learner's code may not read (the reference's source);
    ``compilers``: the folder of the one package allowed to start processes and write shared
    libraries (Triton, which compiles kernels on a GPU), or None."""
    folder = os.path.realpath(folder)
    learner_file = os.path.realpath(learner_file)
    blocked = set(filter(None, (source_of(name) for name in own_modules)))
    blocked.update(os.path.realpath(f) for f in reference_files)
    compiled = {(os.path.dirname(f) + os.sep + "__pycache__", Path(f).stem + ".") for f in blocked}
    own_pid = os.getpid()
    busy = threading.local()
    stdlib = os.path.dirname(os.__file__)
    wrappers = tuple(os.path.join(stdlib, w) for w in _WRAPPERS)
    inspectors = tuple(os.path.join(stdlib, w) for w in ("inspect", "traceback"))
    compilers = os.path.realpath(compilers) + os.sep if compilers else None

    def is_learner(filename: str) -> bool:
        """Code of the learner's file, code it compiled itself, or code it wrote into the folder."""
        return (filename == learner_file or filename.startswith(folder + os.sep)
                or (filename.startswith("<") and not filename.startswith("<frozen")))

    def requester(skip: tuple[str, ...] | None) -> str:
        """The file of the code that made the request, past the library functions that only pass
        a request on (``skip``, and the import system's frozen modules); None: the direct caller."""
        frame = sys._getframe(3)  # 0 here, 1 _check, 2 hook, 3 the code that made the request
        if skip is None:
            return frame.f_code.co_filename if frame is not None else ""
        while frame is not None:
            name = frame.f_code.co_filename
            if not (name.startswith(skip) or name.startswith("<frozen")):
                return name
            frame = frame.f_back
        return ""

    def compiler_asks() -> bool:
        return compilers is not None and requester(wrappers).startswith(compilers)

    def reads_reference(path) -> bool:
        real = os.path.realpath(os.fsdecode(path))
        folder_name, name = os.path.split(real)
        return real in blocked or any(folder_name == d and name.startswith(stem) for d, stem in compiled)

    def hook(event: str, args: tuple) -> None:
        if getattr(busy, "on", False):
            return
        busy.on = True
        try:
            _check(event, args)
        finally:
            busy.on = False

    def _check(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            if writes and not _inside(path, folder):
                raise Refused(f"writing {os.fsdecode(path)} is not allowed while grading: write only inside the "
                              "current folder")
            if writes and os.fsdecode(path).endswith((".so", ".pyd", ".dylib")) and not compiler_asks():
                raise Refused("writing a shared library is not allowed while grading")
            if re.fullmatch(r"/proc/[^/]+/(task/[^/]+/)?mem", os.path.realpath(os.fsdecode(path))):
                raise Refused("reading a process's memory is not allowed while grading")
            if reads_reference(path):
                raise OwnImplementation(f"reads {os.path.realpath(os.fsdecode(path))}, the package's own "
                                        "implementation or the reference")
        elif event in _PATH_EVENTS:
            for i in _PATH_EVENTS[event]:
                if i < len(args) and args[i] is not None and not _inside(args[i], folder):
                    raise Refused(f"{event} on {os.fsdecode(args[i])} is not allowed while grading: only inside "
                                  "the current folder")
            libraries = [a for a in args[:2] if isinstance(a, (str, bytes))
                         and os.fsdecode(a).endswith((".so", ".pyd", ".dylib"))]
            if event in ("os.rename", "os.link", "os.symlink") and libraries and not compiler_asks():
                raise Refused("making a shared library is not allowed while grading")
        elif event == "os.chdir":
            if not _inside(args[0], folder):
                raise Refused("changing to another folder is not allowed while grading")
        elif event == "import":
            name = args[0]
            if any(name == m or name.startswith(m + ".") for m in own_modules):
                raise OwnImplementation(f"imports {name}, the package's own implementation")
        elif event in ("os.kill", "os.killpg"):
            if args[0] not in (own_pid, 0):
                raise Refused("signalling another process is not allowed while grading")
        elif event.startswith(_PROCESS_EVENTS):
            if not compiler_asks():
                raise Refused(f"{event} is not allowed while grading: your code must run in this process")
        elif event == "compile":
            filename = args[1] if len(args) > 1 else None
            if isinstance(filename, bytes):
                filename = os.fsdecode(filename)
            if isinstance(filename, str) and not is_learner(os.path.realpath(filename) if not filename.startswith("<")
                                                            else filename) and is_learner(requester(None)):
                raise Refused("compiling code under another file's name is not allowed while grading")
        elif event.startswith("ctypes."):
            if is_learner(requester(wrappers)):
                raise Refused(f"{event} is not allowed while grading")
        elif event in _INTROSPECTION_EVENTS or event == "object.__getattr__":
            if event in ("object.__setattr__", "object.__delattr__") and not _guarded_target(args[0]):
                return
            if is_learner(requester(inspectors)):
                raise Refused(f"{event} is not allowed while grading")

    sys.addaudithook(hook)


def _guarded_target(obj) -> bool:
    """A function or class of the grader, of the package or of torch (reassigning its attributes
    could change what the grader observes)."""
    module = getattr(obj, "__module__", "") if callable(obj) else ""
    return isinstance(module, str) and (module.split(".")[0] in ("mpgpt", "torch", "builtins", "triton"))


def source_of(module_name: str) -> str | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    return os.path.realpath(spec.origin) if spec and spec.origin and Path(spec.origin).is_file() else None


def tripwire(what: str, instead: str):
    """A stand-in for a reference the learner's code must not use: it raises when called or built."""
    message = f"uses {what}, {instead}"

    class Tripwire:
        def __init__(self, *args, **kwargs):
            raise OwnImplementation(message)

        def __init_subclass__(cls, **kwargs):
            raise OwnImplementation(message)

        def __call__(self, *args, **kwargs):
            raise OwnImplementation(message)

    Tripwire.__name__ = Tripwire.__qualname__ = what.rpartition(".")[2]
    Tripwire.tripwire = message
    return Tripwire


def _resolve(dotted: str):
    """(object holding the last attribute, its name) for a dotted path from a loaded module, or None."""
    parts = dotted.split(".")
    obj = sys.modules.get(parts[0])
    for part in parts[1:-1]:
        obj = getattr(obj, part, None)
    return (obj, parts[-1]) if obj is not None and hasattr(obj, parts[-1]) else None


def disarm(own_modules: tuple[str, ...], references: tuple[str, ...]) -> None:
    """In the child only: replace the functions and classes of the package's own implementation
    that are loaded already (and every package attribute that points at them), and the references
    named by dotted path, with tripwires."""
    def own(obj) -> bool:
        module = getattr(obj, "__module__", None)
        return isinstance(module, str) and module in own_modules
    for name, module in list(sys.modules.items()):
        if not (name == "mpgpt" or name.startswith("mpgpt.")) or name.startswith("mpgpt.grade"):
            continue
        for key, value in list(vars(module).items()):
            if not key.startswith("__") and (callable(value) or isinstance(value, type)) and own(value):
                setattr(module, key, tripwire(f"{value.__module__}.{key}", "the package's own implementation"))
    for dotted in references:
        found = _resolve(dotted)
        if found:
            setattr(found[0], found[1], tripwire(dotted, "the reference the grader compares with"))
