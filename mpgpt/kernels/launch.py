"""Launching a compiled Triton kernel again without Triton's Python launch path (chapter 6).

Every `kernel[grid](...)` call does, in Python, before the GPU sees anything: bind the arguments
to the kernel's parameters, build the autotuner's key and look up its best configuration, bind
again, build the *specialisation* key (each tensor's dtype and whether its address is 16-byte
aligned; each integer's value if it is 1, whether it divides by 16), find the compiled binary
for that key, check that no global it read has changed, and only then call the small C function
that launches it. For GPT-2's smaller products that path takes longer on the host than the
product takes on the GPU, so the GPU sits idle waiting for Python (`python -m mpgpt.bench kernels`
reports both times).

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
* `HostDescriptor` and `CompiledLaunch.with_descriptors`: the same for a kernel whose first
  parameters are TMA descriptors built on the host (the Gluon kernels), keeping each
  descriptor's encoding for the addresses it has seen (see `DescriptorMaps`);
* the two switches, read at every call (so setting them in a running process takes effect):
  `lean_launch_enabled()` (MPGPT_LEAN_LAUNCH) and `autotune_enabled()` (MPGPT_AUTOTUNE=0 launches
  one fixed configuration per kernel instead of autotuning: fast tests).
"""
from __future__ import annotations

import os
import sys

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


class HostDescriptor:
    """What Triton's launcher reads from a host-side TMA descriptor argument: base tensor, shape,
    strides, padding (the box and the swizzle come from the compiled kernel). The lean launch path
    builds these instead of TensorDescriptor objects, whose checks the first call already passed
    for the same shapes, strides and alignments."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base):
        self.base, self.shape, self.strides, self.padding = base, base.shape, base.stride(), "zero"


# How many address combinations one DescriptorMaps keeps (the oldest goes first): a training loop
# reuses a handful (the caching allocator hands a step the same blocks as the step before).
MAX_DESCRIPTOR_MAPS = 64


class DescriptorMaps:
    """A host-descriptor kernel's launch without Triton's per-launch descriptor work.

    Before each launch of a kernel with host-side TMA descriptors, Triton's launcher turns every
    descriptor into the 128-byte CUtensorMap the GPU reads (cuTensorMapEncodeTiled, from the base
    address, shape, strides, box and swizzle), in Python, one descriptor at a time: for the
    seven descriptors of ws.py's kernel, over half of that kernel's host time per call. A CUtensorMap is a pure function of
    those inputs, and for one remembered launch only the addresses, shapes and strides can change
    (box and swizzle are compiled in). So this keeps the encoded arguments per combination of
    (address, shape, strides) of the descriptors' tensors and hands them to Triton's C launcher
    directly. The encoding itself is still Triton's own function (`encode`), run on a miss.

    Built from Triton's objects by `descriptor_maps`, which returns None unless they have the
    layout this was written against (triton 3.6's CudaLauncher: a wrapper closing over the C
    launcher and the descriptors' metadata, 13 leading launcher arguments, no scratch memory);
    the caller then keeps the ordinary path."""

    __slots__ = ("launcher", "cooperative", "pdl", "encode", "metas", "maps")

    def __init__(self, launcher, cooperative, pdl, encode, metas):
        self.launcher = launcher        # the C launcher Triton compiled for this kernel
        self.cooperative, self.pdl = cooperative, pdl
        self.encode = encode            # triton's make_tensordesc_arg(descriptor, meta) -> its launcher arguments
        self.metas = metas              # one metadata dict per descriptor parameter (swizzle, box, dtype)
        self.maps: dict = {}            # ((address, shape, strides) per descriptor) -> launcher arguments

    def arguments(self, tensors) -> tuple:
        """The launcher arguments for descriptors over `tensors` (one per descriptor parameter)."""
        key = tuple((t.data_ptr(), t.shape, t.stride()) for t in tensors)
        found = self.maps.get(key)
        if found is None:
            if len(self.maps) >= MAX_DESCRIPTOR_MAPS:
                del self.maps[next(iter(self.maps))]  # the oldest entry (dicts keep insertion order)
            found = tuple(x for t, meta in zip(tensors, self.metas) for x in self.encode(HostDescriptor(t), meta))
            self.maps[key] = found
        return found


def descriptor_maps(kernel, n_descriptors: int):
    """A DescriptorMaps for a compiled kernel whose first `n_descriptors` parameters are host-side
    TMA descriptors, or None where Triton's launcher does not look as expected."""
    try:
        run = kernel.run
    except Exception:
        return None
    wrapper = getattr(run, "launch", None)
    code, cells = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or cells is None or set(code.co_freevars) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
        return None
    closed = dict(zip(code.co_freevars, (cell.cell_contents for cell in cells)))
    module = sys.modules.get(type(run).__module__)
    encode = getattr(module, "make_tensordesc_arg", None)
    metas = closed["tensordesc_meta"]
    if encode is None or getattr(module, "_BASE_ARGS_FORMAT_LEN", None) != 13:
        return None
    if closed["tensordesc_indices"] != set(range(n_descriptors)) or not metas or len(metas) != n_descriptors:
        return None
    if any(meta is None for meta in metas):  # no metadata: Triton passes the descriptor's parts, not an encoding
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    return DescriptorMaps(closed["launcher"], run.launch_cooperative_grid, run.launch_pdl, encode, tuple(metas))


class CompiledLaunch:
    """One remembered launch: compiled kernel + grid + the non-tensor arguments, in order.

    Calling it with the tensor arguments (the kernel's first parameters) launches the kernel on
    the current CUDA stream. `with_descriptors` launches a kernel whose first parameters are
    host-side TMA descriptors from the tensors behind them."""

    __slots__ = ("kernel", "grid", "tail", "_stream", "_maps")

    def __init__(self, kernel, grid, tail, get_stream):
        self.kernel = kernel            # triton CompiledKernel (its binary is already loaded)
        self.grid = grid                # (x, y, z) program counts
        self.tail = tail                # every argument after the tensors, constexprs included
        self._stream = get_stream       # device index -> raw CUDA stream (torch's current one)
        self._maps = False              # DescriptorMaps, None where it cannot be used, False: not looked for yet

    def __call__(self, device_index: int, *tensors):
        k = self.kernel
        gx, gy, gz = self.grid
        # The same call JITFunction.run makes last: grid, stream, the loaded function, packed
        # metadata, launch metadata and enter/exit hooks (none: lean_launch_enabled checked), args.
        k.run(gx, gy, gz, self._stream(device_index), k.function, k.packed_metadata, None, None, None,
              *tensors, *self.tail)

    def with_descriptors(self, device_index: int, descriptor_tensors, *tensors):
        """Launch with a host-side TMA descriptor over each of `descriptor_tensors` (the kernel's
        first parameters), then `tensors`: through DescriptorMaps where Triton allows it, else
        the ordinary call with HostDescriptor objects. Both pass the C launcher the same values."""
        maps = self._maps
        if maps is False:
            maps = self._maps = descriptor_maps(self.kernel, len(descriptor_tensors))
        if maps is None:
            self(device_index, *(HostDescriptor(t) for t in descriptor_tensors), *tensors)
            return
        k = self.kernel
        gx, gy, gz = self.grid
        # What triton 3.6's CudaLauncher.__call__ and its descriptor wrapper pass on: grid, stream,
        # function, cooperative and PDL flags, no scratch buffers, packed metadata, no launch
        # metadata or hooks, then each descriptor as its encoded arguments, then the rest.
        maps.launcher(gx, gy, gz, self._stream(device_index), k.function, maps.cooperative, maps.pdl, None, None,
                      k.packed_metadata, None, None, None, *maps.arguments(descriptor_tensors), *tensors, *self.tail)


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
