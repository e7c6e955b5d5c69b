"""Launching a compiled Triton kernel again without Triton's Python launch path (chapter 6).

Every `kernel[grid](...)` call does, in Python, before the GPU sees anything: bind the arguments
to the kernel's parameters, build the autotuner's key and look up its best configuration, bind
again, build the *specialisation* key (each tensor's dtype and whether its address is 16-byte
aligned; each integer's value if it is 1, whether it divides by 16), find the compiled binary
for that key, check that no global it read has changed, and only then call the small C function
that launches it. On the H200 machine that path cost 68-151 us of host time per `matmul()`
(benchmarks/NOTES-kernels.md), more than the 34 us the GPU spends on a 12288 x 768 x 768 product:
the GPU sat idle waiting for Python.

For a given call signature (shapes, strides, dtypes, alignments, flags) every one of those steps
gives the same answer each time. So the first call goes the long way, and we keep what it
decided: the compiled kernel, the grid, and every argument except the tensors. Later calls with
the same signature hand the new tensors straight to the compiled kernel's launcher
(`CompiledKernel.run`, the call `JITFunction.run` itself ends with).

This leans on Triton internals (`CompiledKernel.run/function/packed_metadata`, checked against
triton 3.6 and 3.9); if they are missing, `compiled_launch` returns None and the caller keeps the
ordinary path. MPGPT_LEAN_LAUNCH=0 turns it off, and so does a launch hook (profilers such as
proton install one, and this path does not call it).

What lives here:
* `signature(...)` and `CACHE`: call signature -> (the Plan that matmul.plan chose, a replay
  function that repeats the launch with new tensors). The kernel modules build the replay
  functions (`grouped.launch`, `tma.launch`, `ws.launch` return one);
* `compiled_launch` / `CompiledLaunch`: the remembered launch of one compiled kernel;
* the two switches, read at every call (so setting them in a running process takes effect):
  `lean_launch_enabled()` (MPGPT_LEAN_LAUNCH) and `autotune_enabled()` (MPGPT_AUTOTUNE=0 launches
  one fixed configuration per kernel instead of autotuning: fast tests).
"""
from __future__ import annotations

import os

from . import env
from .env import triton


def lean_launch_enabled() -> bool:
    """True unless MPGPT_LEAN_LAUNCH=0 or a Triton launch hook is installed (a profiler's)."""
    if env.TRITON_IMPORT_ERROR is not None or os.environ.get("MPGPT_LEAN_LAUNCH", "1") == "0":
        return False
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(runtime, name, None)
        # None, or (triton >= 3.6) an empty HookChain: nothing to call. Anything else: a hook.
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def autotune_enabled() -> bool:
    """False when MPGPT_AUTOTUNE=0: each kernel then launches one fixed configuration.

    Autotuning compiles every configuration for every new specialisation of a shape (about 3 s
    each on an H200 machine's CPUs), which dominates a test run over many odd shapes."""
    return os.environ.get("MPGPT_AUTOTUNE", "1") != "0"


# Call signature -> (Plan, replay(a, b, c, bias, z)). Filled by the first call with a signature
# (matmul._matmul_2d), used by every later one.
CACHE: dict = {}


def _aligned16(t) -> bool:
    return t.data_ptr() % 16 == 0


def signature(a, b, c, bias, z, activation, kernel, split_k) -> tuple:
    """Everything that decides how a call is launched: the plan's inputs (device and its
    capability, dtypes, shapes, strides, 16-byte alignment of each address, the epilogue, the
    `kernel` and `split_k` asked for) and the autotuning switch. Shapes and strides are in it
    exactly, so the integers passed to the kernel are too."""
    return (a.device.index, env.capability(a.device), a.dtype, c.dtype, a.shape, b.shape, a.stride(), b.stride(),
            c.stride(), _aligned16(a), _aligned16(b), _aligned16(c),
            None if bias is None else (bias.dtype, bias.stride(), _aligned16(bias)),
            None if z is None else (z.dtype, z.stride(), _aligned16(z)),
            activation, kernel, split_k, autotune_enabled())


class CompiledLaunch:
    """One remembered launch: compiled kernel + grid + the non-tensor arguments, in order.

    Calling it with the tensor arguments (the kernel's first parameters) launches the kernel on
    the current CUDA stream."""

    __slots__ = ("kernel", "grid", "tail", "_stream")

    def __init__(self, kernel, grid, tail, get_stream):
        self.kernel = kernel            # triton CompiledKernel (its binary is already loaded)
        self.grid = grid                # (x, y, z) program counts
        self.tail = tail                # every argument after the tensors, constexprs included
        self._stream = get_stream       # device index -> raw CUDA stream (torch's current one)

    def __call__(self, device_index: int, *tensors):
        k = self.kernel
        gx, gy, gz = self.grid
        # The same call JITFunction.run makes last: grid, stream, the loaded function, packed
        # metadata, launch metadata and enter/exit hooks (none: lean_launch_enabled checked), args.
        k.run(gx, gy, gz, self._stream(device_index), k.function, k.packed_metadata, None, None, None,
              *tensors, *self.tail)


def compiled_launch(jit_fn, compiled, grid, args, kwargs, n_tensors, get_stream=None):
    """A CompiledLaunch that repeats `jit_fn[grid](*args, **kwargs)`, or None if Triton's objects
    do not look as expected.

    jit_fn: the JITFunction that was launched (for an autotuned kernel, `autotuner.fn`);
    compiled: what the launch returned (a CompiledKernel); grid: a tuple or a callable of the
    meta-parameters; args/kwargs: exactly what was passed, kwargs including the chosen config's
    meta-parameters; n_tensors: how many leading arguments change from call to call;
    get_stream: device index -> raw stream (default: Triton's driver, i.e. torch's current stream)."""
    names = getattr(jit_fn, "arg_names", None)
    if names is None or compiled is None or hasattr(compiled, "result"):
        return None  # not a plain JITFunction, or an asynchronous compile
    if not all(hasattr(compiled, attr) for attr in ("run", "function", "packed_metadata")):
        return None
    if compiled.function is None:
        return None
    values = dict(zip(names, args))
    values.update(kwargs)
    if any(n not in values for n in names):
        return None  # a parameter left to its default: keep the ordinary path
    if callable(grid):
        grid = grid(values)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    if get_stream is None:
        try:
            get_stream = triton.runtime.driver.active.get_current_stream
        except Exception:  # no GPU driver (the interpreter) or a different Triton: no lean path
            return None
    return CompiledLaunch(compiled, grid, tuple(values[n] for n in names[n_tensors:]), get_stream)
