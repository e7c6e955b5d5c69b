"""AdamW with 16-bit weights and state in one fused Triton pass (chapter 10).

    from mpgpt.kernels.adamw16 import adamw16_fused
    adamw16_fused(w, g, state, "bf16-sr", c, key64)   # w, g flat; state from mpgpt.optim16.new_state

`FusedAdamW16`, the optimizer, updates all of a group's parameters in one launch
(`adamw16_many`): each block of elements finds its parameter in a small table of addresses.

One program reads a block of weights, gradients, both moments and the variant's extra buffer,
does the whole AdamW update in fp32 registers, rounds the results into their storage and writes
them back: every byte of state crosses memory once per step, which is all an optimizer step
costs (it does almost no arithmetic per byte). The CPU reference is
`mpgpt.optim16.adamw16_update`; this kernel follows its order of operations and its integer
rounding, and uses the correctly rounded sqrt_rn and div_rn, so the two agree bit for bit
(tests/test_optim16.py). On a GPU that needs one more thing: by default Triton fuses a multiply
and an add into one FMA, which rounds once instead of twice, so the kernel is launched with
``enable_fp_fusion=False``. It costs nothing measurable: the step waits on memory, not arithmetic.

bf16 tensors are passed as their int16 bit patterns and converted with integer shifts, because
the interpreter mishandles bf16 arithmetic (it stores bf16 as raw uint16); on a GPU the shifts
cost nothing next to the memory traffic. Random bits come from ``tl.randint4x`` (Philox4x32-10)
with the element's flat index as the counter and the step's key, the numbers
`mpgpt.optim16.random_bits` computes on the CPU.
"""
from __future__ import annotations

import torch

from mpgpt.optim16 import VARIANTS, AdamW16, Coefficients

from . import env as kenv
from .env import tl, triton

__all__ = ["adamw16_fused", "FusedAdamW16", "WEIGHT_CODES", "MOMENT_CODES"]

WEIGHT_CODES = {"fp32-master": 0, "nearest": 1, "stochastic": 2, "kahan": 3, "mantissa": 4}
MOMENT_CODES = {"fp32": 0, "nearest": 1, "stochastic": 2}


@triton.jit
def _bf16_to_f32(bits16):
    # int16 bit pattern -> the fp32 value of that bf16 number (exact)
    return (bits16.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round_nearest(x):
    # fp32 -> bf16 bits (in an int32), to nearest, ties to even; NaN -> quiet NaN
    u = x.to(tl.int32, bitcast=True)
    hi = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, hi)


@triton.jit
def _round_stochastic(x, r16):
    # fp32 -> bf16 bits, rounded up in magnitude with probability (cut-off bits) / 2^16
    u = x.to(tl.int32, bitcast=True)
    return tl.where(x != x, 0x7FC0, (u + r16) >> 16)


@triton.jit
def _adamw16_block(w_ptr, g_ptr, m_ptr, v_ptr, x_ptr, coef_ptr, div_ptr, idx, mask, counter, key,
                   WEIGHTS: tl.constexpr, MOMENTS: tl.constexpr, GRAD_BF16: tl.constexpr):
    """The update of the elements ``idx`` (masked by ``mask``) of one tensor and its state; the
    pointers are the tensor's and its state's first elements, ``counter`` the elements' Philox
    counters (their flat indices)."""
    # The scalars are read from device memory, not passed by value, so that a step recorded in a
    # CUDA graph picks up each replay's learning rate, bias corrections and clipping factor.
    beta1, omb1 = tl.load(coef_ptr + 0), tl.load(coef_ptr + 1)
    beta2, omb2 = tl.load(coef_ptr + 2), tl.load(coef_ptr + 3)
    step_size, inv_sqrt_bc2 = tl.load(coef_ptr + 4), tl.load(coef_ptr + 5)
    eps, lr_wd = tl.load(coef_ptr + 6), tl.load(coef_ptr + 7)
    if GRAD_BF16:
        g = _bf16_to_f32(tl.load(g_ptr + idx, mask=mask, other=0))
    else:
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    g = g * tl.div_rn(1.0, tl.load(div_ptr))   # one division per program, not per element; exact for 1
    w_bits = tl.load(w_ptr + idx, mask=mask, other=0)
    if WEIGHTS == 2 or MOMENTS == 2:
        r_w, r_m, r_v, _ = tl.randint4x(key, counter)
        r_w = (r_w & 0xFFFF).to(tl.int32)
        r_m = (r_m & 0xFFFF).to(tl.int32)
        r_v = (r_v & 0xFFFF).to(tl.int32)

    # 1. the moments
    if MOMENTS == 0:
        m_old = tl.load(m_ptr + idx, mask=mask, other=0.0)
        v_old = tl.load(v_ptr + idx, mask=mask, other=0.0)
    else:
        m_old = _bf16_to_f32(tl.load(m_ptr + idx, mask=mask, other=0))
        v_old = _bf16_to_f32(tl.load(v_ptr + idx, mask=mask, other=0))
    m = m_old * beta1 + g * omb1
    s = v_old * beta2 + (g * g) * omb2
    if MOMENTS == 0:
        tl.store(m_ptr + idx, m, mask=mask)
        tl.store(v_ptr + idx, s, mask=mask)
    elif MOMENTS == 1:
        tl.store(m_ptr + idx, _round_nearest(m).to(tl.int16), mask=mask)
        tl.store(v_ptr + idx, _round_nearest(s).to(tl.int16), mask=mask)
    else:
        tl.store(m_ptr + idx, _round_stochastic(m, r_m).to(tl.int16), mask=mask)
        tl.store(v_ptr + idx, _round_stochastic(s, r_v).to(tl.int16), mask=mask)

    # 2. the weight's fp32 value and the update
    if WEIGHTS == 0:
        w = tl.load(x_ptr + idx, mask=mask, other=0.0)
    elif WEIGHTS == 4:
        lo = tl.load(x_ptr + idx, mask=mask, other=0).to(tl.int32)
        w = ((w_bits.to(tl.int32) << 16) + lo).to(tl.float32, bitcast=True)
    else:
        w = _bf16_to_f32(w_bits)
    denom = tl.sqrt_rn(s) * inv_sqrt_bc2 + eps
    delta = -(w * lr_wd + tl.div_rn(m, denom) * step_size)

    # 3. into storage
    if WEIGHTS == 3:
        y = delta + _bf16_to_f32(tl.load(x_ptr + idx, mask=mask, other=0))
        new16 = _round_nearest(w + y)
        comp = y - (_bf16_to_f32(new16) - w)
        tl.store(x_ptr + idx, _round_nearest(comp).to(tl.int16), mask=mask)
    else:
        x = w + delta
        if WEIGHTS == 0 or WEIGHTS == 4:
            u = x.to(tl.int32, bitcast=True)
            new16 = (u + 0x8000) >> 16          # nearest, ties away from zero
            if WEIGHTS == 0:
                tl.store(x_ptr + idx, x, mask=mask)
            else:
                tl.store(x_ptr + idx, (u - (new16 << 16)).to(tl.int16), mask=mask)
        elif WEIGHTS == 1:
            new16 = _round_nearest(x)
        else:
            new16 = _round_stochastic(x, r_w)
    tl.store(w_ptr + idx, new16.to(tl.int16), mask=mask)


@triton.jit
def _adamw16_kernel(
    w_ptr,          # (n,) int16: the bf16 weights' bits, updated in place
    g_ptr,          # (n,) gradients: int16 bits of bf16 if GRAD_BF16, else fp32
    m_ptr, v_ptr,   # (n,) moments: fp32, or int16 bits of bf16 if MOMENTS > 0
    x_ptr,          # (n,) extra buffer: fp32 master / int16 compensation bits / int16 remainder
    coef_ptr,       # (8,) fp32 on the device: the step's Coefficients, in their field order
    div_ptr,        # (1,) fp32 on the device: every gradient is multiplied by its reciprocal (clipping)
    n, offset, key,  # element count, flat index of element 0 (Philox counter), the step's Philox key
    WEIGHTS: tl.constexpr, MOMENTS: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _adamw16_block(w_ptr, g_ptr, m_ptr, v_ptr, x_ptr, coef_ptr, div_ptr, idx, idx < n, offset + idx, key,
                   WEIGHTS, MOMENTS, GRAD_BF16)


@triton.jit
def _adamw16_many_kernel(
    meta_ptr,       # (6, S) int64: per tensor its weight's and gradient's addresses, element count,
                    # first state index, first Philox counter and first block (rows in that order)
    block_ptr,      # (blocks,) int32: the tensor each block of BLOCK elements belongs to
    S,              # tensors
    m_ptr, v_ptr, x_ptr,   # the group's flat state, as in _adamw16_kernel
    coef_ptr, div_ptr, key,
    WEIGHTS: tl.constexpr, MOMENTS: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address a multiple of 16 bytes, every count and state index of 16
):
    pid = tl.program_id(0)
    t = tl.load(block_ptr + pid)
    w_addr = tl.load(meta_ptr + t)
    g_addr = tl.load(meta_ptr + S + t)
    n = tl.load(meta_ptr + 2 * S + t)
    first_state = tl.load(meta_ptr + 3 * S + t)
    first_counter = tl.load(meta_ptr + 4 * S + t)
    local = (pid - tl.load(meta_ptr + 5 * S + t)) * BLOCK + tl.arange(0, BLOCK)   # (BLOCK,) in the tensor
    w_ptr = w_addr.to(tl.pointer_type(tl.int16))
    if GRAD_BF16:
        g_ptr = g_addr.to(tl.pointer_type(tl.int16))
    else:
        g_ptr = g_addr.to(tl.pointer_type(tl.float32))
    if ALIGNED:
        # What Triton's launcher tells the compiler of pointer and size arguments, said of these
        # loaded ones: with it the loads and stores become 16-byte vectors.
        w_ptr, g_ptr = tl.multiple_of(w_ptr, 16), tl.multiple_of(g_ptr, 16)
        n, first_state = tl.multiple_of(n, 16), tl.multiple_of(first_state, 16)
    _adamw16_block(w_ptr, g_ptr, m_ptr + first_state, v_ptr + first_state, x_ptr + first_state, coef_ptr, div_ptr,
                   local, local < n, (first_counter + local).to(tl.int32), key, WEIGHTS, MOMENTS, GRAD_BF16)


@triton.jit
def _grad_sq_sum_many_kernel(
    meta_ptr, block_ptr, S,  # the tables of _adamw16_many_kernel (only the gradient rows are read)
    blocks,                  # entries in block_ptr
    out_ptr,                 # (cdiv(blocks, PER_PROGRAM),) fp32: each program's sum of squares
    GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
    PER_PROGRAM: tl.constexpr,  # blocks of BLOCK elements per program
):
    # A block of 1024 bf16 gradients is 2 KB: too little for one program to keep memory busy, so
    # each program takes PER_PROGRAM consecutive blocks (of one tensor or of several).
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(PER_PROGRAM):
        b = pid * PER_PROGRAM + j
        t = tl.load(block_ptr + tl.minimum(b, blocks - 1))
        g_addr = tl.load(meta_ptr + S + t)
        n = tl.where(b < blocks, tl.load(meta_ptr + 2 * S + t), 0)                  # past the last block: none
        local = (b - tl.load(meta_ptr + 5 * S + t)) * BLOCK + tl.arange(0, BLOCK)   # (BLOCK,) in the tensor
        if GRAD_BF16:
            g_ptr = g_addr.to(tl.pointer_type(tl.int16))
        else:
            g_ptr = g_addr.to(tl.pointer_type(tl.float32))
        if ALIGNED:  # as in _adamw16_many_kernel: 16-byte vector loads
            g_ptr, n = tl.multiple_of(g_ptr, 16), tl.multiple_of(n, 16)
        mask = local < n
        if GRAD_BF16:
            g = _bf16_to_f32(tl.load(g_ptr + local, mask=mask, other=0))
        else:
            g = tl.load(g_ptr + local, mask=mask, other=0.0)
        acc += g * g
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def adamw16_fused(w: torch.Tensor, g: torch.Tensor, state: dict, variant: str, c,
                  key64: int = 0, offset: int = 0, block: int = 1024, grad_div: torch.Tensor | None = None) -> None:
    """One AdamW step over flat, contiguous ``w`` (bf16, updated in place) with gradients ``g``
    (bf16 or fp32) and ``state`` (`mpgpt.optim16.new_state`), stored as ``variant`` says.
    The same arguments as `mpgpt.optim16.adamw16_update`, which it matches.

    ``c`` is a `Coefficients`, or the same eight numbers already in an fp32 tensor on ``w``'s
    device (``Coefficients.as_tensor``), which a recorded step reads afresh at every replay.
    ``grad_div``, a one-element fp32 tensor on the device, divides every gradient (the clipping
    factor max(1, norm / clip)): they are multiplied by its correctly rounded reciprocal, as the
    reference does. None divides by 1."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    if w.dtype != torch.bfloat16 or not w.is_contiguous() or not g.is_contiguous() or g.numel() != w.numel():
        raise ValueError("adamw16_fused needs contiguous bf16 weights and gradients of the same size; "
                         "flatten the model's parameters into one buffer (or use mpgpt.optim16.AdamW16)")
    if g.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gradients must be bf16 or fp32, got {g.dtype}")
    kenv.check_device(w)
    v = VARIANTS[variant]
    n = w.numel()
    if offset < 0 or offset + n > 2**31 - 1:
        # element indices and Philox counters are 32-bit in the kernel: past 2^31 they would wrap
        raise ValueError(f"adamw16_fused indexes at most 2^31 - 1 elements (offset {offset} + {n} elements); "
                         "update a model this large with mpgpt.optim16.AdamW16")
    extra = state.get(v.extra_buffer) if v.extra_buffer else state["exp_avg"]  # unused when no buffer
    coef = c.as_tensor(w.device) if isinstance(c, Coefficients) else c
    if coef.dtype != torch.float32 or coef.shape != (8,) or coef.device != w.device:
        raise ValueError(f"the coefficients must be an fp32 tensor of 8 on {w.device} (Coefficients.as_tensor), "
                         f"got {coef.dtype} {tuple(coef.shape)} on {coef.device}")
    div = torch.ones(1, device=w.device) if grad_div is None else grad_div
    if div.dtype != torch.float32 or div.numel() != 1 or div.device != w.device:
        raise ValueError(f"grad_div must be a one-element fp32 tensor on {w.device}, got {div.dtype} "
                         f"{tuple(div.shape)} on {div.device}")
    grid = (triton.cdiv(n, block),)
    _adamw16_kernel[grid](
        _bits(w), _bits(g), _bits(state["exp_avg"]), _bits(state["exp_avg_sq"]), _bits(extra),
        coef, div, n, offset, key64,
        WEIGHTS=WEIGHT_CODES[v.weights], MOMENTS=MOMENT_CODES[v.moments], GRAD_BF16=g.dtype == torch.bfloat16,
        BLOCK=block, **({} if kenv.interpreting() else {"enable_fp_fusion": False}),
    )


def adamw16_many(tables: "_Tables", flat: dict, variant: str, coef: torch.Tensor, key64: int,
                 grad_div: torch.Tensor) -> None:
    """One AdamW step over every tensor of ``tables`` (`_Tables.build`) in one launch: each block
    of 1024 elements looks up its tensor in the tables, then updates exactly as `adamw16_fused`
    does for that tensor at its flat offset (the same Philox counters, so bit for bit the same
    result). ``flat``: the group's flat state (`mpgpt.optim16.AdamW16.flat`); ``coef`` the group's
    coefficients and ``grad_div`` the clipping divisor, fp32 device tensors of 8 and 1 elements."""
    v = VARIANTS[variant]
    extra = flat.get(v.extra_buffer) if v.extra_buffer else flat["exp_avg"]  # unused when no buffer
    _adamw16_many_kernel[(tables.blocks,)](
        tables.meta, tables.block_map, tables.count,
        _bits(flat["exp_avg"]), _bits(flat["exp_avg_sq"]), _bits(extra), coef, grad_div, key64,
        WEIGHTS=WEIGHT_CODES[v.weights], MOMENTS=MOMENT_CODES[v.moments], GRAD_BF16=tables.grad_bf16,
        BLOCK=_BLOCK, ALIGNED=tables.aligned, **({} if kenv.interpreting() else {"enable_fp_fusion": False}),
    )


def grad_sq_sums(tables: "_Tables", out: torch.Tensor) -> None:
    """Partial sums of the squares of the gradients in ``tables`` (`_Tables.build`), in one launch:
    ``out`` (fp32, ``norm_programs(tables)`` elements) gets one sum per program, each over
    `_NORM_BLOCKS` blocks of 1024 elements in a fixed order, so the total does not change from run
    to run."""
    _grad_sq_sum_many_kernel[(norm_programs(tables),)](
        tables.meta, tables.block_map, tables.count, tables.blocks, out,
        GRAD_BF16=tables.grad_bf16, BLOCK=_BLOCK, ALIGNED=tables.aligned, PER_PROGRAM=_NORM_BLOCKS)


def norm_programs(tables: "_Tables") -> int:
    return triton.cdiv(tables.blocks, _NORM_BLOCKS)


_BLOCK = 1024  # elements per program, as adamw16_fused's default
_NORM_BLOCKS = 8  # blocks per program of the gradients' norm: 16 KB of bf16 gradients each


class _Tables:
    """Where each tensor of one step lies, for `adamw16_many`: a (6, S) int64 table ``meta``
    (weight and gradient addresses, element count, first state index, first Philox counter, first
    block) and ``block_map``, the tensor of every block, both on the parameters' device.

    The addresses are those of this step's gradients, so the tables are rebuilt when gradients
    move and reused while they stay. A step recorded as a CUDA graph allocates its gradients
    anew while it records, so the tables are rebuilt then too, under two rules. Nothing may be
    allocated in pinned memory while recording, so the new addresses go into the pinned buffer of
    the tables an eager step built before (``staging``), and the recording copies that buffer to
    the device at every replay (6 x 8 bytes per tensor); the buffer then belongs to the recording
    and is never written again, and the optimizer keeps it, and the device table it fills, for as
    long as it lives. And ``block_map`` (half a megabyte for GPT-2 small) is reused
    from those tables, which needs the same tensors to have gradients, as in the warm-up steps."""

    def __init__(self, key, sizes, meta, block_map, staging, grad_bf16, aligned):
        self.key, self.sizes, self.meta, self.block_map, self.staging = key, sizes, meta, block_map, staging
        self.count, self.blocks = meta.shape[1], block_map.numel()
        self.grad_bf16, self.aligned = grad_bf16, aligned
        self.recorded = False  # staging belongs to a recorded step: never write it again

    @staticmethod
    def key_of(params) -> tuple:
        return tuple((p.data_ptr(), p.grad.data_ptr(), p.numel(), p.grad.dtype) for p in params)

    @classmethod
    def build(cls, params, state: dict, group_offset: int, key: tuple, previous: "_Tables | None" = None,
              recording: bool = False) -> "_Tables":
        sizes = [p.numel() for p in params]
        blocks = [-(-n // _BLOCK) for n in sizes]
        firsts = [0]
        for b in blocks[:-1]:
            firsts.append(firsts[-1] + b)
        counters = [state[p]["offset"] for p in params]
        if max(c + n for c, n in zip(counters, sizes)) > 2**31 - 1:
            # element indices and Philox counters are 32-bit in the kernel: past 2^31 they would wrap
            raise ValueError("the fused AdamW16 kernels index at most 2^31 - 1 elements; "
                             "update a model this large with mpgpt.optim16.AdamW16")
        rows = [[p.data_ptr() for p in params], [p.grad.data_ptr() for p in params], sizes,
                [c - group_offset for c in counters], counters, firsts]
        grad_bf16 = params[0].grad.dtype == torch.bfloat16
        # 16-byte aligned addresses, and counts and state indices that keep every slice aligned
        aligned = all(a % 16 == 0 for a in rows[0] + rows[1]) and all(i % 16 == 0 for i in rows[2] + rows[3])
        device = params[0].device
        if recording:
            if previous is None or previous.sizes != sizes or previous.recorded:
                raise RuntimeError("a recorded FusedAdamW16 step needs an eager step before it in which the same "
                                   "parameters had gradients (a warm-up step): its tables are reused while recording")
            previous.staging.copy_(torch.tensor(rows, dtype=torch.int64))
            previous.recorded = True
            previous.meta.copy_(previous.staging, non_blocking=True)  # recorded: repeated at every replay
            tables = cls(key, sizes, previous.meta, previous.block_map, previous.staging, grad_bf16, aligned)
            tables.recorded = True
            return tables
        pinned = device.type == "cuda"  # copied from pinned memory without a sync, as the coefficients are
        staging = torch.tensor(rows, dtype=torch.int64)                                               # (6, S)
        if previous is not None and previous.sizes == sizes:
            block_map = previous.block_map
        else:
            block_map = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32), torch.tensor(blocks))
            block_map = block_map.to(device, non_blocking=False)
        if pinned:
            staging = staging.pin_memory()
        return cls(key, sizes, staging.to(device, non_blocking=pinned), block_map, staging, grad_bf16, aligned)


class FusedAdamW16(AdamW16):
    """`mpgpt.optim16.AdamW16` whose step runs the fused kernel: one launch per parameter group.

    Each parameter's state is a slice of the group's flat state and keeps its flat offset, so the
    random bits and therefore the result are the ones AdamW16 computes over the flat group, bit
    for bit. The parameters are updated where they lie: nothing is concatenated or copied. One
    launch covers them all (`adamw16_many`), because a launch per parameter leaves most of the
    GPU idle in the last wave of each: GPT-2 small has 148 parameters, 98 of them biases and
    LayerNorm weights of at most 3,072 elements, and even its 768 x 768 weights fill only a
    quarter of one wave of programs on an H100. The parameters must be bf16 tensors (the model
    cast with ``model.to(torch.bfloat16)``).

    The step's coefficients live in one small device tensor per group, rewritten before every
    step (`prepare` or `step`) and read by the kernels: a step recorded as a CUDA graph keeps
    following the learning rate and the bias corrections. Its random bits do not (the Philox
    key is a launch argument), so only the variants without stochastic rounding can be recorded."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"FusedAdamW16 updates bf16 parameters, got a {p.dtype} one: cast the "
                                    "model with model.to(torch.bfloat16), or use mpgpt.optim16.AdamW16")
                if not p.is_contiguous():
                    raise TypeError(f"FusedAdamW16 updates contiguous parameters, got one of shape {tuple(p.shape)} "
                                    f"with strides {p.stride()}: make it contiguous (p.data = p.data.contiguous()) "
                                    "before building the optimizer, or use mpgpt.optim16.AdamW16")
        device = self.param_groups[0]["params"][0].device
        self.coef = [torch.zeros(8, dtype=torch.float32, device=device) for _ in self.param_groups]
        self.one = torch.ones(1, dtype=torch.float32, device=device)
        self.tables: list[_Tables | None] = [None] * len(self.param_groups)  # per group, the last step's
        self.recorded_tables: list[_Tables] = []  # read by recorded steps' replays: never freed

    def _write_coefficients(self, coefs) -> None:
        # From pinned memory without a sync: the host runs ahead while the copy waits its turn on
        # the stream (torch keeps each pinned buffer alive until its copy has run).
        pinned = self.coef[0].is_cuda
        if pinned and torch.cuda.is_current_stream_capturing():
            # a copy recorded now would replay this step's numbers at every later step
            raise RuntimeError("a recorded FusedAdamW16 step needs its coefficients set beforehand: "
                               "call optimizer.prepare(step, lr) before recording and before every replay")
        for dst, c in zip(self.coef, coefs):
            dst.copy_(torch.tensor(c.values(), dtype=torch.float32, pin_memory=pinned), non_blocking=pinned)

    def _group_tables(self, index: int, live: list, offset: int) -> "_Tables | None":
        """Group ``index``'s tables for this step's gradients (``live``: its parameters that have
        one), built anew or the last step's; None where one launch cannot cover the group (its
        gradients differ in dtype, or one is not contiguous)."""
        dtypes = {p.grad.dtype for p in live}
        if not (len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float32}
                and all(p.grad.is_contiguous() for p in live)):
            return None  # the kernels read one gradient dtype
        recording = live[0].is_cuda and torch.cuda.is_current_stream_capturing()
        key_now = _Tables.key_of(live)
        tables = self.tables[index]
        if tables is None or tables.key != key_now:
            tables = self.tables[index] = _Tables.build(live, self.state, offset, key_now, tables, recording)
        if recording and not any(t is tables for t in self.recorded_tables):
            # The recording reads these tables at every replay: they must outlive any later rebuild,
            # and no later recording may write into them.
            tables.recorded = True
            self.recorded_tables.append(tables)
        return tables

    def _update_group(self, params, flat, offset, c, key, index=0, grad_div=None) -> None:
        """The group's step: one launch over every parameter that has a gradient (one per
        parameter where their gradients' dtypes differ)."""
        div = self.one if grad_div is None else grad_div.reshape(1).float()
        live = [p for p in params if p.grad is not None]
        if not live:
            return
        tables = self._group_tables(index, live, offset)
        if tables is None:  # adamw16_fused refuses dtypes other than bf16 and fp32
            for p in live:
                state = self.state[p]
                adamw16_fused(p.view(-1), p.grad.contiguous().view(-1), state, self.variant, self.coef[index], key,
                              state["offset"], grad_div=div)
            return
        adamw16_many(tables, flat, self.variant, self.coef[index], key, div)

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of every gradient this optimizer holds, all together: what clip_grad_norm_
        computes, as an fp32 scalar on the parameters' device, without a sync.

        One launch per group reads the gradients through the same tables as the step, so nothing
        is gathered (torch's multi-tensor norm took 7 launches for GPT-2 small's 148 gradients);
        a fixed order of sums makes the result the same from run to run. Where one launch cannot
        cover a group, torch's norm of each gradient is taken instead."""
        plans = []
        for index, (group, offset) in enumerate(zip(self.param_groups, self.group_offsets)):
            live = [p for p in group["params"] if p.grad is not None]
            if live:
                plans.append((live, self._group_tables(index, live, offset)))
        sizes = [norm_programs(t) if t is not None else 1 for _, t in plans]
        out = torch.empty(sum(sizes), dtype=torch.float32, device=self.one.device)  # sums of squares
        start = 0
        for (live, tables), size in zip(plans, sizes):
            part = out[start:start + size]
            if tables is not None:
                grad_sq_sums(tables, part)
            else:
                part.copy_(torch.stack(torch._foreach_norm([p.grad for p in live], 2, dtype=torch.float32)).square().sum())
            start += size
        return out.sum().sqrt()
