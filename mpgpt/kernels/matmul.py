"""The public matmul of chapter 6, and `plan`, which says which kernel it runs and why.

    out = act(a @ b + bias)      a: (..., K)   b: (K, N)   bias: (N,)   out: (..., N)

* Inputs are bf16 or fp16 (both the same); every product is accumulated in fp32 and the
  epilogue (bias, activation) runs in fp32; the result is rounded once, to the input dtype
  (or written in fp32 to an fp32 `out`).
* `activation`: None, "relu", or "gelu" = the **tanh approximation**
  0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), what nn.GELU(approximate="tanh") and GPT-2
  use. The kernels evaluate it as z * sigmoid(2 sqrt(2/pi) (z + 0.044715 z^3)), the same
  function (0.5 (1 + tanh(u)) = sigmoid(2u)) written with an op that both the compiler and the
  interpreter have (epilogue.py).
* Any M, N, K >= 1 (edges are masked), leading batch dimensions of `a` are flattened, and
  strided or transposed operands are read in place: the kernels take the strides, so
  `matmul(x, w.t())` reads nn.Linear's weight without a copy.

Three kernels, one file each:

1. grouped.py — the teaching kernel: one program per output tile, tiles in grouped order,
   optional split-K. Runs everywhere: Ampere, Ada, Hopper, and the CPU interpreter.
2. tma.py — Hopper (sm_90 and later): a persistent grid and TMA descriptors. Needs operands a
   TMA descriptor can address (16-byte aligned, one unit stride each), any of the layouts a
   linear layer's forward and backward products use.
3. ws.py — sm_90 only, written in Gluon: warp-specialised, 128 x 192 tiles, without
   activation, for the forward layout a @ w.t() and a row-major B, as dX = dY @ W reads W;
   and for a transposed A, as dW = dY.t() @ X reads dY, with K split into fp32 planes.

Which one runs is decided by `plan(...)` (a pure function: it launches nothing), and `matmul`
runs what `plan` says, so the two cannot disagree. `kernel="auto"` (the default) means:

* Triton's CPU interpreter: the grouped kernel;
* below sm_90 (A100 sm_80, L4 sm_89, T4 sm_75): the grouped kernel;
* sm_90, A transposed (a weight gradient), no split_k given: the warp-specialised kernel with K
  in slices (ws.split_eligible) where a cost model fitted to an H100 predicts it faster than the
  TMA kernel unsplit (ws.split_preferred: ws.split_cost below ws.tma_cost; the slices from
  ws.split_for; the tile from ws.split_tile). For GPT-2's layers that is attn.c_proj's dW (5
  slices) and the MLP's (1, on 128 x 160 tiles), not c_attn's;
* sm_90 otherwise: the warp-specialised kernel where it can run (ws.ws_eligible: the forward layout or a
  row-major B) and its tiles fill the GPU's waves about as well as the TMA kernel's (ws.ws_preferred);
  otherwise the TMA kernel wherever it can read the operands, except a product whose automatic
  split-K is 4 or more, which stays on the grouped kernel (it can split K, the TMA kernel
  cannot); otherwise the grouped kernel. Later GPUs (sm_100) take the TMA kernel the same way,
  never the ws kernel.

`kernel="grouped"`, `"tma"` or `"ws"` forces one (to compare them); forcing one that cannot run
here raises a ValueError that says why (except in the interpreter, which runs the grouped kernel
for "tma" and "ws"). The GPU generation
is read through `env.capability`, so a test can make `plan` plan for another GPU by patching
that one function.

Host time. A Triton launch costs tens of microseconds of Python before the GPU starts, more than
a 12288 x 768 x 768 product takes on an H200. After the first call with a given signature,
`matmul` repeats the remembered launch directly (launch.py; MPGPT_LEAN_LAUNCH=0 turns it off).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import env, grouped, launch
from .hopper import tma, ws

ACTIVATIONS = (None, "gelu", "relu")
KERNELS = ("auto", "grouped", "tma", "ws")
_LOW_PRECISION = (torch.bfloat16, torch.float16)

# kernel="auto": a product whose automatic split-K is at least this stays on the grouped kernel,
# which can split K; below it the TMA kernel runs unsplit. Chosen by measurement on Hopper
# (benchmarks/linear_probe.py, graph replay, GPT-2's layers at 12288 tokens): the TMA kernel wins
# every dX and the weight gradients split fewer than 4 ways; the grouped kernel wins attn.c_proj's
# 768 x 768 weight gradient, split 8 ways.
SPLIT_K_OVER_TMA = 4


@dataclass(frozen=True)
class Plan:
    """Which kernel `matmul` runs for a call, and why.

    kernel: "grouped", "tma" or "ws"; split_k: slices of K per output tile (1: unsplit;
    the grouped kernel runs a program per slice, the ws kernel, for a transposed A, a work unit
    per slice); interpreted: Triton's CPU interpreter runs it; reason: one line for humans, e.g.
    "sm_90, forward layout a @ w.t(), no activation: 128x192 tiles fill the waves better
    (ws_preferred)"."""

    kernel: str
    split_k: int
    interpreted: bool
    reason: str


# ----------------------------------------------------------------------------------------------
# The public entry points
# ----------------------------------------------------------------------------------------------
def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, *, out: torch.Tensor | None = None,
           kernel: str = "auto", split_k: int | None = None) -> torch.Tensor:
    """act(a @ b + bias) with fp32 accumulation, returned in a's dtype.

    a: (..., K) bf16 or fp16; leading dimensions are flattened (no copy when they can be viewed).
    b: (K, N), same dtype as a; any strides (pass w.t() for nn.Linear's (N, K) weight).
    bias: (N,) in a's dtype or fp32, or None.
    activation: None, "relu", or "gelu" (the tanh approximation, = nn.GELU(approximate="tanh")).
    out: optional preallocated (..., N) result, a's dtype or fp32 (any strides).
    kernel: "auto" (see the module docstring, and `plan` for what it picks for a call),
        "grouped", "tma" or "ws" (to compare them). Without a GPU every choice runs the grouped
        kernel in the interpreter.
    split_k: programs that share one output tile, each summing a slice of K into an fp32
        partial that the host then adds (the grouped kernel, or with kernel="ws" the
        warp-specialised one for a transposed A; no bias or activation). None chooses
        from the shape on a GPU: more than 1 only when there are too few output tiles to fill
        the GPU and K is long, the shape of a weight gradient dW = dY^T X (out x in, K = tokens).

    Runs compiled on CUDA GPUs with compute capability >= 8.0, and through Triton's interpreter
    on CPU tensors when no GPU is present. On sm_70/75 GPUs (V100, T4) bf16 raises a RuntimeError
    that names the GPU; fp16 inputs are passed to Triton there but this project has not tested
    that path (Triton's README lists sm_80+ as supported).
    """
    if out is None:
        a2, out_shape = checked_2d(a, b, bias, activation, kernel, split_k)
        c = torch.empty((a2.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
        _matmul_2d(a2, b, c, bias=bias, activation=activation, kernel=kernel, split_k=split_k)
        return c.view(out_shape)
    a2, b, bias, c, _ = _check(a, b, bias, activation, out, kernel, split_k)
    _matmul_2d(a2, b, c, bias=bias, activation=activation, kernel=kernel, split_k=split_k)
    return out


# Keys (accepted_key) of argument combinations that _check accepted, so a repeated call skips
# _check and its meta-device stand-in, a large share of a small product's host time. The key takes
# a fraction of _check's time.
_ACCEPTED: set = set()
MAX_ACCEPTED = 4096


def _checks_can_be_skipped(a) -> bool:
    """Whether checked_2d may remember accepted metadata for a call on `a`: Triton imported, a CUDA
    tensor, compiled kernels (not the interpreter). See accepted_key."""
    return env.TRITON_IMPORT_ERROR is None and a.is_cuda and not env.interpreting()


def accepted_key(a, b, bias, activation, kernel, split_k):
    """Everything `_check` reads (without `out`), as a hashable key: the arguments' metadata and,
    from the process, whether Triton imported and the GPU's compute capability. A later call with
    an equal key would pass _check again, so it can skip it. None where no key is made: an
    argument that is not a tensor, an unhashable option, a tensor off the GPU, or Triton's CPU
    interpreter (whose checks look at the NumPy version, and where the checks' microseconds are
    nothing beside an interpreted kernel). Such calls always go through _check."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and (bias is None or isinstance(bias, torch.Tensor))):
        return None
    if not _checks_can_be_skipped(a):
        return None
    key = (env.capability(a.device), a.device, a.dtype, a.shape, a.stride(), b.device, b.dtype, b.shape,
           None if bias is None else (bias.device, bias.dtype, bias.shape), activation, kernel, split_k, type(split_k))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def checked_2d(a, b, bias, activation, kernel="auto", split_k=None):
    """`_check` for a call without `out`: returns (a as (M, K), the output's shape), or raises
    what _check raises. Where an earlier call with the same accepted_key passed, its checks are
    skipped; a key is remembered only where a's 2-D form is a itself or a view of it (a copy
    would be made again each time, so nothing is skipped for it)."""
    if torch.compiler.is_compiling():  # traced once per graph: nothing to save, and no side effects for Dynamo
        a2, _, _, _, out_shape = _check(a, b, bias, activation, None, kernel, split_k)
        return a2, out_shape
    key = accepted_key(a, b, bias, activation, kernel, split_k)
    if key is not None and key in _ACCEPTED:
        return (a if a.dim() == 2 else a.view(-1, b.shape[0])), (*a.shape[:-1], b.shape[1])
    a2, _, _, _, out_shape = _check(a, b, bias, activation, None, kernel, split_k)
    if key is not None and (a2 is a or a2._base is not None):
        if len(_ACCEPTED) >= MAX_ACCEPTED:
            _ACCEPTED.clear()
        _ACCEPTED.add(key)
    return a2, out_shape


def plan(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
         activation: str | None = None, *, out: torch.Tensor | None = None,
         kernel: str = "auto", split_k: int | None = None) -> Plan:
    """Which kernel `matmul(a, b, bias, activation, out=out, kernel=kernel, split_k=split_k)`
    would run, with what split-K, and why: a Plan. Launches nothing and raises the same errors
    `matmul` would for these arguments. It allocates nothing on the GPU either, except where a's
    batch dimensions cannot be viewed as one (`matmul` then copies a into a fresh (M, K) tensor):
    then an uninitialised (M, K) tensor stands in for that copy.

        >>> plan(x, w.t()).reason      # on an H200, x (12288, 768), w (768, 768) bf16
        'sm_90, forward layout a @ w.t(), no activation: 128x192 tiles fill the waves better (ws_preferred)'
    """
    a2, b, bias, c, _ = _check(a, b, bias, activation, out, kernel, split_k, copy=False)
    return _plan_2d(a2, b, c, bias, None, activation, kernel, split_k)


# ----------------------------------------------------------------------------------------------
# The decision
# ----------------------------------------------------------------------------------------------
_LAYOUTS = {  # (A transposed, B transposed) -> how the product reads
    (False, True): "forward layout a @ w.t()",
    (False, False): "A and B row-major (dX = dY @ W)",
    (True, False): "A transposed (dW = dY.t() @ X)",
    (True, True): "A and B transposed",
}


def _plan_2d(a, b, c, bias, z, activation, kernel, split_k) -> Plan:
    """plan() on 2-D operands: a (M, K), b (K, N), c (M, N) the output (or a stand-in with the
    layout a fresh output will have), z (M, N) the pre-activation output or None."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    for t in (a, b, c) + ((z,) if z is not None else ()):
        # Offsets are 32-bit inside the kernels: keep every element reachable.
        span = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
        if span >= 2**31:
            raise ValueError(f"tensor of shape {tuple(t.shape)} spans >= 2**31 elements; split the batch")
    M, K = a.shape
    N = b.shape[1]
    interp = env.interpreting()
    epilogue = bias is not None or activation is not None or z is not None
    if kernel in ("auto", "ws") and (split_k is None or kernel == "ws") and ws.split_eligible(a, b, c, bias,
                                                                                          activation, z):
        # A read transposed, as dW = dY.t() @ X reads dY: few output tiles and a long K
        num_sms = env.num_sms(a.device)
        where = "sm_%d%d, %s" % (*env.capability(a.device), _LAYOUTS[(True, not ws.b_row_major(b))])
        if kernel == "ws" or ws.split_preferred(M, N, K, num_sms):
            s = split_k or ws.split_for(M, N, K, num_sms)
            ws.check_split(s, K)
            how = f"each tile's K in {s} slices, summed in fp32" if s > 1 else "K unsplit, written in fp32"
            how += f", 128 x {ws.BLOCK_N + ws.split_tile(M, N, K, s, num_sms)} tiles"
            return Plan("ws", s, False, f"{where}: the warp-specialised kernel, {how}"
                                        + (", asked" if kernel == "ws" else " (split_preferred)"))
    if split_k is not None and split_k > 1:
        if epilogue:
            raise ValueError("split_k > 1 adds fp32 partial sums after the kernel: it takes no bias, activation "
                             "or z; use split_k=1")
        if kernel in ("tma", "ws"):
            raise ValueError("split_k > 1 runs on the grouped kernel, or on the ws kernel for a transposed A (a weight "
                             "gradient dY.t() @ X, 16-byte-aligned rows) on sm_90; use kernel='grouped' or 'auto'")
        where = "Triton's CPU interpreter" if interp else "sm_%d%d" % env.capability(a.device)
        return Plan("grouped", split_k, interp, f"{where}, split_k={split_k} asked: the grouped kernel sums K in "
                                                f"{split_k} fp32 slices")
    if M == 0 or N == 0:
        return Plan("grouped", 1, interp, "empty output: nothing to launch")
    if interp:
        why = "Triton's CPU interpreter (TRITON_INTERPRET=1) runs only the grouped kernel, tiles upcast to fp32"
        if kernel in ("tma", "ws"):
            why += f" (kernel={kernel!r} needs a GPU)"
        return Plan("grouped", 1, True, why)

    cc = env.capability(a.device)
    where = f"sm_{cc[0]}{cc[1]}"
    tma_layout = tma.layout(a, b)
    what = where if tma_layout is None else f"{where}, {_LAYOUTS[(tma_layout[0][0], tma_layout[1][0])]}"
    if split_k is None and not (epilogue or kernel in ("tma", "ws")):
        auto = grouped.auto_split_k(M, N, K, env.num_sms(a.device))
        if auto > 1 and kernel == "grouped":
            return Plan("grouped", auto, False, f"{where}, kernel='grouped' asked: few output tiles and a long K, "
                                                f"split-K {auto}")
        if auto >= SPLIT_K_OVER_TMA or (auto > 1 and tma_layout is None):
            also = "; the TMA kernel cannot split K" if tma_layout is not None else ""
            return Plan("grouped", auto, False, f"{what}: few output tiles and a long K, the grouped kernel "
                                                f"with split-K {auto}{also}")
        if auto > 1:
            what += f" (split-K {auto} < {SPLIT_K_OVER_TMA}: the TMA kernel unsplit measured faster)"

    if kernel in ("auto", "ws"):
        if ws.ws_eligible(a, b, c, bias, activation, z):
            if kernel == "ws":
                return Plan("ws", 1, False, f"{what}, kernel='ws' asked")
            if ws.ws_preferred(M, N, env.num_sms(a.device)):
                return Plan("ws", 1, False, f"{what}, {_epilogue_words(bias, activation)}: 128x192 tiles fill the "
                                            "waves better (ws_preferred)")
            else:
                what += f", {_epilogue_words(bias, activation)}: 128x256 tiles fill the waves better (not ws_preferred)"
        elif kernel == "auto" and tma_layout is not None and (activation is not None or z is not None):
            what += f", {_epilogue_words(bias, activation)} epilogue (the ws kernel has none)"
        elif kernel == "ws":
            raise ValueError("the warp-specialised kernel needs an sm_90 GPU (H100/H200), bf16 or fp16, B as w.t() "
                             "or row-major, 16-byte-aligned rows, no activation (and for a transposed A, as in a "
                             "weight gradient, no bias either); use kernel='auto'"
                             f" (here: {where})")
    if kernel in ("auto", "tma") and tma_layout is not None:
        return Plan("tma", 1, False, f"{what}: the persistent TMA kernel" + (", asked" if kernel == "tma" else ""))
    if kernel == "tma":
        raise ValueError("the TMA kernel needs a Hopper GPU (sm_90), 16-byte-aligned operands with a unit "
                         f"stride each, and M, N, K >= 16; use kernel='grouped' (here: {where})")
    if kernel == "grouped":
        return Plan("grouped", 1, False, f"{where}, kernel='grouped' asked")
    if cc < (9, 0):
        return Plan("grouped", 1, False, f"{where}: the TMA and warp-specialised kernels need sm_90; the grouped kernel")
    return Plan("grouped", 1, False, f"{where}: operands a TMA descriptor cannot address (16-byte-aligned base, "
                                     "one unit stride, 16-byte pitch; M, N, K >= 16): the grouped kernel")


def _epilogue_words(bias, activation) -> str:
    return ("bias, " if bias is not None else "") + (f"{activation}" if activation else "no activation")


# ----------------------------------------------------------------------------------------------
# Running a plan
# ----------------------------------------------------------------------------------------------
def _matmul_2d(a, b, c, bias=None, z=None, activation=None, kernel="auto", split_k=None):
    """c = act(a @ b + bias) on 2-D a (M, K), b (K, N) into c (M, N); z (M, N) receives the
    pre-activation. Inputs already checked (matmul, or ops.py's custom operators). Returns c."""
    key = None
    if a.is_cuda and not env.interpreting() and launch.lean_launch_enabled():
        key = launch.signature(a, b, c, bias, z, activation, kernel, split_k)
        seen = launch.CACHE.get(key)
        if seen is not None:  # seen before: plan() gave seen[0] for this signature
            seen[1](a, b, c, bias, z)
            return c
    p = _plan_2d(a, b, c, bias, z, activation, kernel, split_k)
    if c.shape[0] == 0 or c.shape[1] == 0:
        return c
    if p.kernel == "ws" and ws.a_transposed(a):
        replay = ws.launch_split(a, b, c, split_k=p.split_k)
    elif p.kernel == "ws":
        replay = ws.launch(a, b, c, bias)
    elif p.kernel == "tma":
        replay = tma.launch(a, b, c, bias, z, activation)
    else:
        replay = grouped.launch(a, b, c, bias, z, activation, split_k=p.split_k, interpreted=p.interpreted)
    if key is not None and replay is not None:
        launch.CACHE[key] = (p, replay)
    return c


# ----------------------------------------------------------------------------------------------
# Input checking
# ----------------------------------------------------------------------------------------------
def _check(a, b, bias, activation, out=None, kernel="auto", split_k=None, copy=True):
    """Validate matmul's inputs; return (a as 2-D, b, bias, c, output shape), c being `out` as
    (M, N) or, without `out`, a meta-device stand-in with the layout a fresh output will have
    (contiguous, a's dtype; the CUDA allocator's addresses are 16-byte aligned, and so is the
    stand-in's). copy=False (plan): where a must be copied to become 2-D, an uninitialised
    tensor of the copy's layout instead."""
    if env.TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(env.TRITON_IMPORT_ERROR)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"a and b must be torch.Tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.dtype not in _LOW_PRECISION:
        raise TypeError(f"matmul takes bfloat16 or float16 inputs, got a: {a.dtype}; cast with "
                        ".to(torch.bfloat16) (accumulation is fp32 inside the kernel) or use torch.matmul")
    if b.dtype != a.dtype:
        raise TypeError(f"a and b must have the same dtype, got a: {a.dtype} and b: {b.dtype}; cast one of them")
    if b.dim() != 2:
        raise ValueError(f"b must be 2-D (K, N), got shape {tuple(b.shape)}")
    if a.dim() == 0:
        raise ValueError("a must have at least one dimension (..., K)")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)} (K={a.shape[-1]}) but b is "
                         f"{tuple(b.shape)} (K={b.shape[0]})")
    if a.device != b.device:
        raise ValueError(f"a and b are on different devices ({a.device} and {b.device})")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'gelu' (tanh approximation) or 'relu', got {activation!r}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if split_k is not None and (not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1):
        raise ValueError(f"split_k must be a positive int or None (chosen from the shape), got {split_k!r}")
    N = b.shape[1]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != N:
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias must be a 1-D tensor of length N={N}, got {shape}")
        if bias.dtype not in (a.dtype, torch.float32):
            raise TypeError(f"bias must be {a.dtype} or float32, got {bias.dtype}")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device} but a is on {a.device}")
    env.check_device(a)
    K = a.shape[-1]
    out_shape = (*a.shape[:-1], N)
    if a.dim() == 2:
        a2 = a
    else:
        try:
            a2 = a.view(-1, K)  # no copy: the common case (contiguous activations)
        except RuntimeError:
            # The batch dimensions cannot be merged in place: copy (or, for plan, the copy's layout).
            a2 = a.reshape(-1, K) if copy else torch.empty((a.numel() // max(K, 1), K), dtype=a.dtype, device=a.device)
    M = a2.shape[0]
    if out is None:
        c = torch.empty((M, N), dtype=a.dtype, device="meta")
    else:
        if tuple(out.shape) != tuple(out_shape):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(out_shape)}")
        if out.dtype not in (a.dtype, torch.float32) or out.device != a.device:
            raise ValueError(f"out must be {a.dtype} or float32 on {a.device}, got {out.dtype} on {out.device}")
        c = out.view(M, N) if out.dim() != 2 else out
    return a2, b, bias, c, out_shape
