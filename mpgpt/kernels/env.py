"""Where the Triton kernels can run, and what the package believes about the GPU (chapter 6).

Three situations, and what each one means for `mpgpt.kernels`:

* a CUDA GPU with compute capability >= 8.0 (A100, L4, H100, H200): kernels are compiled;
* no CUDA GPU (a laptop, CI, a free CPU notebook): Triton's interpreter runs the kernels with
  numpy. `TRITON_INTERPRET=1` must be set *before* `@triton.jit` decorates a kernel, so this
  module sets it (unless you set it yourself) and `mpgpt.kernels` imports it first;
* Triton not installed (macOS, Windows: Triton ships Linux wheels only): `import mpgpt` still
  works; the kernel entry points raise a RuntimeError that says why.

A GPU below compute capability 8.0 (Colab's free T4 is sm_75) has no bf16 tensor cores: older
Tritons fail in ptxas on bf16 code (`Feature '.bf16' requires .target sm_80`), Triton 3.9 compiles
it to emulation, so `check_device` refuses bf16 there with a clear error, whatever the version,
and the kernels run in fp16. Since Triton 3.2, tl.dot below sm_80 compiles to FMA instructions
rather than tensor cores (tests/test_aot_compile.py checks the PTX): correct, but slow.

The public functions, each the one place the package asks its question:

    interpreting()        does Triton run kernels in its numpy interpreter?
    kernels_available()   (ok, one line saying how or why not)
    check_device(t)       raise a one-line RuntimeError if the kernels cannot run on t
    capability(device)    the compute capability, e.g. (9, 0) on an H100/H200
    num_sms(device)       the number of multiprocessors (the persistent kernels' grid)
    device_name(device)   the GPU's name, for error messages

Every decision in `mpgpt.kernels` that depends on the GPU generation (which kernel `matmul`
takes, which autotuning configurations are tried, which errors are raised) calls `capability`
through this module, at call time. So a test can make the package believe it runs on another
GPU by patching `mpgpt.kernels.env.capability` (and `num_sms`) alone; what Triton's compiler
targets is untouched. The other modules call `env.capability(...)`, never a copy of the name,
so that such a patch reaches them.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from mpgpt import runtime

# Must happen before `import triton` decorates anything (grouped.py, tma.py, gelu.py, ...). setdefault: a user who
# exported TRITON_INTERPRET themselves (0 or 1) keeps their choice.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except ImportError as exc:  # macOS / Windows, or a Linux box without the wheel
    TRITON_IMPORT_ERROR = (
        f"Triton is not installed ({exc.__class__.__name__}: {exc}); it supports Linux only. "
        "Use torch.nn.Linear / torch.matmul instead, or run on Linux (e.g. Colab)."
    )

    def _not_available(*args, **kwargs):
        raise RuntimeError(TRITON_IMPORT_ERROR)

    class _Stub:
        """Stands in for a jitted kernel so the module body still defines its functions."""

        def __init__(self, fn=None, **kwargs):
            self.fn = fn

        def __getitem__(self, grid):
            return _not_available

        def __call__(self, *args, **kwargs):
            return _not_available()

    def _decorator(fn=None, **kwargs):
        return _Stub(fn) if callable(fn) else (lambda f: _Stub(f))

    triton = SimpleNamespace(  # only the names the kernel modules use at import time
        jit=_decorator,
        autotune=lambda *a, **k: (lambda f: f),
        Config=lambda *a, **k: None,
        cdiv=lambda a, b: -(-a // b),
    )
    tl = SimpleNamespace(constexpr=object)


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter instead of compiling them."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _numpy_refuses_int_of_1d_array() -> bool:
    import warnings

    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NumPy 1.25-2.3 only warn (DeprecationWarning)
        try:
            int(np.zeros(1))
        except TypeError:
            return True
    return False


def interpreter_problem() -> str | None:
    """Why this Triton's interpreter cannot run here, or None.

    Before Triton 3.7 the interpreter turns a loop bound such as ``tl.cdiv(K, BLOCK_K)`` into a
    Python int with ``int()`` of a 1-element array; newer NumPy refuses that (seen: Triton 3.6 with
    NumPy 2.4.6, "only 0-dimensional arrays can be converted to Python scalars"). Triton 3.7 squeezes
    the array first.
    """
    if TRITON_IMPORT_ERROR is not None or not interpreting():
        return None
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if version >= (3, 7) or not _numpy_refuses_int_of_1d_array():
        return None
    import numpy as np

    return (f"Triton {triton.__version__}'s CPU interpreter cannot run with NumPy {np.__version__}; "
            "pip install 'triton>=3.7' (or 'numpy<2.4') to run the kernels on the CPU")


def kernels_available(dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """Can `mpgpt.kernels` run here (on ``dtype`` inputs, if given)? Returns (ok, one line saying how
    or why not). A T4 (sm_75) runs the fp16 kernels but not the bf16 ones."""
    if TRITON_IMPORT_ERROR is not None:
        return False, TRITON_IMPORT_ERROR
    if interpreting():
        problem = interpreter_problem()
        if problem is not None:
            return False, problem
        return True, f"Triton {triton.__version__} interpreter on the CPU (TRITON_INTERPRET=1; slow, for learning and tests)"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU and TRITON_INTERPRET is not 1: set TRITON_INTERPRET=1 before importing mpgpt"
    device = torch.device("cuda", torch.cuda.current_device())
    name = device_name(device)
    cc = capability(device)
    if cc < (7, 0):
        return False, f"{name} is sm_{cc[0]}{cc[1]}: Triton's matrix kernels need compute capability >= 7.0"
    if cc < (8, 0) and dtype == torch.bfloat16:
        return False, (f"bf16 Triton kernels need compute capability >= 8.0 (sm_80, e.g. A100/L4/H100); {name} "
                       f"is sm_{cc[0]}{cc[1]}")
    if cc < (8, 0):
        return True, (f"Triton {triton.__version__} compiled for {name} (sm_{cc[0]}{cc[1]}): fp16 only, and "
                      "tl.dot runs on FMA units, not tensor cores, below sm_80")
    return True, f"Triton {triton.__version__} compiled for {name} (sm_{cc[0]}{cc[1]})"


_NUM_SMS: dict = {}


def _index(device) -> int:
    """The CUDA device index of a torch.device, a "cuda:N" string or an int (None: the current one)."""
    if isinstance(device, int):
        return device
    device = torch.device("cuda") if device is None else torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device=None) -> tuple[int, int]:
    """The compute capability (major, minor) of a CUDA device, e.g. (8, 0) A100, (8, 9) L4,
    (9, 0) H100/H200. Cached per device: `matmul` asks on every call.

    The one function the kernels package consults for the GPU generation (see the module
    docstring). It asks `mpgpt.runtime.capability`, so patching either makes the kernels plan
    for another GPU."""
    return runtime.capability(_index(device))


def num_sms(device=None) -> int:
    """The number of multiprocessors of a CUDA device (132 on an H100 SXM / H200), cached."""
    idx = _index(device)
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def device_name(device=None) -> str:
    """The GPU's name, e.g. "NVIDIA H200" (only error messages and reports use it)."""
    return runtime.device_name(_index(device))


def check_device(t: torch.Tensor) -> None:
    """Raise a one-line RuntimeError if the kernels cannot run on `t`'s device in `t`'s dtype."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    if interpreting():
        problem = interpreter_problem()
        if problem is not None:
            raise RuntimeError(problem)
        return  # the interpreter runs on CPU tensors (and copies CUDA tensors to the host)
    if t.device.type != "cuda":
        raise RuntimeError(
            f"Triton kernels run on CUDA tensors (got a {t.device.type} tensor); move it with "
            ".cuda(), or set TRITON_INTERPRET=1 before importing mpgpt to use the CPU interpreter"
        )
    cc = capability(t.device)
    if cc >= (8, 0):
        return
    if t.dtype == torch.bfloat16:
        name = device_name(t.device)
        raise RuntimeError(
            f"bf16 Triton kernels need compute capability >= 8.0 (sm_80, e.g. A100/L4/H100); "
            f"{name} is sm_{cc[0]}{cc[1]}. Use fp16 inputs (torch.autocast(..., dtype=torch.float16) "
            "with a loss scaler) or torch.nn.Linear"
        )
    if cc < (7, 0):
        name = device_name(t.device)
        raise RuntimeError(
            f"Triton's matrix instructions need compute capability >= 7.0; {name} is "
            f"sm_{cc[0]}{cc[1]}. Use torch.nn.Linear"
        )


def runs_compiled(t: torch.Tensor) -> bool:
    """Whether an optional Triton pass should run on `t`: a compiled kernel on a GPU that Triton
    supports in t's dtype (bf16 needs sm_80). The modules that take an optional pass (mlp.py,
    qkv.py, layernorm.py) run torch's ops otherwise: on a CPU the interpreter would be correct but slow."""
    if TRITON_IMPORT_ERROR is not None or interpreting() or not t.is_cuda:
        return False
    return capability(t.device) >= ((8, 0) if t.dtype == torch.bfloat16 else (7, 0))


def tile_config(config, default: tuple, names: tuple[str, ...], optional: int = 0) -> tuple:
    """A kernel's tile configuration: `config` checked, or `default` when it is None.

    `names` are its fields in order, the last `optional` of which may be left out; a field named
    num_warps must be a power of two from 1 to 32 (the threads of one program). The kernels'
    benchmarks pass configs by hand, and a value in the wrong place would otherwise run another
    kernel or another layout without a word."""
    if config is None:
        return tuple(default)
    config = tuple(config)
    if not len(names) - optional <= len(config) <= len(names):
        raise ValueError(f"config must be ({', '.join(names)}), the last {optional} optional; got {config!r}")
    for name, value in zip(names, config):
        if name == "num_warps" and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 32
                                    or value & (value - 1)):
            raise ValueError(f"config: num_warps must be a power of two from 1 to 32, got {value!r} in {config!r}")
    return config
