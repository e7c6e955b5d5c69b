"""The fused linear + cross-entropy (mpgpt.fast.cross_entropy) against float64 references.

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set by mpgpt), so the
sizes are small. The tolerances are derived from the rounding the fused path does, not tuned:
u is the compute dtype's unit roundoff (half its epsilon: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32), and

* the logits: x and W are rounded to the compute dtype (the bound takes that rounding as it
  happened, from the rounded copies), the products summed in fp32 (at most C * 2^-24 of
  sum |x||w|), the sum rounded once more (u);
* the loss of a row, lse - z_t, moves by at most max_j |dz_j| + |dz_t| (logsumexp is 1-Lipschitz
  in the max norm);
* a softmax entry moves by at most p (exp(2 max|dz|) - 1), g = softmax - onehot is rounded once
  (u |g|), and the two gradient GEMMs add the rounding of W or x (u) and fp32 summation;
* the kernel's own fp32 sums, exp and log add a few 2^-24 per tree level and per block.

Each element of each gradient is checked against its own bound, and each bound is checked to be
small against the gradient itself, so the test would catch a wrong scale, sign or index.
"""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from mpgpt import runtime
from mpgpt.fast import cross_entropy as ce
from mpgpt.fast.cross_entropy import cross_entropy_rows_, fused_linear_cross_entropy, linear_cross_entropy_op
from mpgpt.fast import convert
from mpgpt.model import GPT, GPTConfig
from mpgpt.recipe import parse

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter without a GPU
# bf16 where the kernels have it (the CPU interpreter, sm_80 and later); fp16 on a T4.
LOW = torch.bfloat16 if DEVICE == "cpu" or runtime.capability() >= (8, 0) else torch.float16
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
FP32_SUM = 2.0**-24  # relative error per term of an fp32 sum


def _inputs(N=29, C=24, V=301, device=DEVICE):
    """Logits of order 1 (std ~1); V = 301 is 2 blocks of 128 and a masked 45 in the interpreter;
    every 4th row is ignored."""
    x = (torch.randn(N, C, device=device) * 0.5).requires_grad_(True)
    w = (torch.randn(V, C, device=device) * 0.4 * (24 / C) ** 0.5).requires_grad_(True)
    t = torch.randint(0, V, (N,), device=device)
    t[::4] = -1
    return x, w, t


def _reference_and_bounds(x, w, t, dtype, grad_out):
    """float64 loss and gradients of grad_out * mean CE(x @ w.T, t), and elementwise error bounds."""
    u = UNIT_ROUNDOFF[dtype]
    N, C = x.shape
    V = w.shape[0]
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    z = x64 @ w64.t()                                              # (N, V)
    ref = F.cross_entropy(z, t, ignore_index=-1)
    rx, rw = torch.autograd.grad(ref * grad_out, (x64, w64))
    z, x64, w64 = z.detach(), x64.detach(), w64.detach()
    valid = (t != -1)
    n_valid = valid.sum().item()

    xq, wq = x.detach().to(dtype).double(), w.detach().to(dtype).double()  # what the matmul multiplies
    A = xq.abs() @ wq.abs().t()                                    # sum_k |x_ik| |w_jk|, (N, V)
    e = (xq - x64).abs() @ w64.abs().t() + xq.abs() @ (wq - w64).abs().t()  # the inputs' rounding, exactly
    e = e + C * FP32_SUM * A                                       # ... the fp32 sum
    e = e + u * (z.abs() + e)                                      # ... the logits' rounding: per-logit bound (N, V)
    E = e.max(dim=1).values                                        # (N,)
    tt = t.clamp_min(0)
    lse = torch.logsumexp(z, dim=1)
    # The kernel's own fp32 arithmetic: the sum of exp (a tree within a block, then block after block)
    # and exp/log (a few ulp each, fast approximations on a GPU), relative to s and to each exponent.
    block = ce._INTERPRET_BLOCK_V if ce.env.interpreting() else ce._BLOCK_V
    k = (math.log2(block) + math.ceil(V / block) + 8) * FP32_SUM
    row = E + e.gather(1, tt[:, None])[:, 0] + k * (1 + lse.abs() + z.gather(1, tt[:, None])[:, 0].abs())
    loss_bound = (row * valid).sum().item() / n_valid

    p = torch.softmax(z, dim=1)
    g = p - F.one_hot(tt, V).to(p.dtype)
    D = p * (torch.exp(2 * E)[:, None] - 1) + p * k * (1 + (z - lse[:, None]).abs())  # softmax entries
    tiny = torch.finfo(dtype).smallest_normal * u                  # absolute rounding among subnormals
    D = (D + u * (g.abs() + D) + tiny) * valid[:, None]             # ... and g's rounding, (N, V)
    G = (g.abs() + D) * valid[:, None]
    scale = abs(grad_out) / n_valid
    # g' @ wq - g @ w = (g' - g) @ wq + g @ (wq - w), summed in fp32; likewise g'^T @ xq - g^T @ x.
    bx = (D @ wq.abs() + G @ (wq - w64).abs() + V * FP32_SUM * G @ wq.abs()) * scale * (1 + 1e-6)  # (N, C)
    bw = (D.t() @ xq.abs() + G.t() @ (xq - x64).abs() + N * FP32_SUM * G.t() @ xq.abs()) * scale * (1 + 1e-6)
    return ref.item(), rx, rw, loss_bound, bx, bw


def _assert_within(got, ref, bound, name, max_relative_bound):
    err = (got.double() - ref).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert worst <= 1.0, f"{name}: an element is {worst:.2f}x its rounding bound"
    # The bound must be small next to the gradient, or this check says nothing.
    assert bound.norm() <= max_relative_bound * ref.norm(), f"{name}: bound {bound.norm():.3g} vs {ref.norm():.3g}"


@contextlib.contextmanager
def _exact_matmuls():
    """cuBLAS may round split-K partial sums to 16 bits, or fp32 inputs to TF32, unless told not to;
    the bounds count neither (a trainer built earlier in this process may have allowed TF32)."""
    matmul = torch.backends.cuda.matmul
    flags = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    saved = [getattr(matmul, f) for f in flags], torch.get_float32_matmul_precision()
    for f in flags:
        setattr(matmul, f, False)
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        for f, value in zip(flags, saved[0]):
            setattr(matmul, f, value)
        torch.set_float32_matmul_precision(saved[1])


def _check_against_float64(x, w, t, dtype):
    if x.is_cuda and dtype is torch.bfloat16 and runtime.capability() < (8, 0):
        pytest.skip("bf16 Triton kernels need compute capability >= 8.0")
    with _exact_matmuls():
        _check_bounds(x, w, t, dtype)


def _check_bounds(x, w, t, dtype):
    grad_out = 3.0  # an upstream gradient other than 1, as a loss scale gives
    ref, rx, rw, loss_bound, bx, bw = _reference_and_bounds(x, w, t, dtype, grad_out)
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not torch.float32):
        out = fused_linear_cross_entropy(x, w, t)
    gx, gw = torch.autograd.grad(out * grad_out, (x, w))
    assert out.dtype is torch.float32 and gx.dtype is torch.float32 and gw.dtype is torch.float32
    assert abs(out.item() - ref) <= loss_bound, (out.item(), ref, loss_bound)
    assert loss_bound < 0.05 * ref
    _assert_within(gx, rx, bx, "grad_x", 0.1)
    _assert_within(gw, rw, bw, "grad_w", 0.1)
    assert torch.all(gx[t == -1] == 0)  # ignored rows pass no gradient


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_loss_and_gradients_match_float64_within_the_rounding_bound(dtype):
    _check_against_float64(*_inputs(), dtype)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_a_model_held_in_bf16_gets_the_gradients_of_the_mean_within_the_rounding_bound(x_dtype):
    """A bf16 W (a model cast to bf16, as the trainer's 16-bit AdamW keeps it), with bf16 hidden
    states, or fp32 ones under bf16 autocast (ln_f's output there): the kernel writes g / n and
    cuBLAS writes W's gradient in bf16. The bound is the one above plus two roundings to bf16 for
    grad_w (the product's, and its product with the upstream gradient, 3.0, not a power of two)
    and one for a bf16 grad_x. A 1/n applied twice or not at all, or a lost upstream gradient, is
    off by factors of 3 to n."""
    if DEVICE == "cuda" and runtime.capability() < (8, 0):
        pytest.skip("bf16 Triton kernels need compute capability >= 8.0")
    x, w, t = _inputs()
    x, w = x.detach().to(torch.bfloat16).to(x_dtype).requires_grad_(True), w.detach().to(torch.bfloat16).requires_grad_(True)
    u = UNIT_ROUNDOFF[torch.bfloat16]
    with _exact_matmuls():
        ref, rx, rw, loss_bound, bx, bw = _reference_and_bounds(x, w, t, torch.bfloat16, 3.0)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=x_dtype is torch.float32):
            out = fused_linear_cross_entropy(x, w, t)
        gx, gw = torch.autograd.grad(out * 3.0, (x, w))
    assert out.dtype is torch.float32 and gx.dtype is x_dtype and gw.dtype is torch.bfloat16
    assert abs(out.item() - ref) <= loss_bound, (out.item(), ref, loss_bound)
    roundings = {"grad_x": int(x_dtype is torch.bfloat16), "grad_w": 2}
    for got, r, bound, name in ((gx, rx, bx, "grad_x"), (gw, rw, bw, "grad_w")):
        for _ in range(roundings[name]):
            bound = bound + u * (r.abs() + bound)
        _assert_within(got, r, bound, name, 0.1)
    assert torch.all(gx[t == -1] == 0)
    with pytest.raises(ValueError, match="need bf16 x and w"):
        linear_cross_entropy_op(x.detach().half(), w.detach().half(), t, True, torch.ones(1, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.sm80), torch.float16])
def test_on_the_gpu_at_gpt2_size(dtype):
    """The compiled kernel (4096-wide blocks, in place) and cuBLAS's fp32-output GEMMs, at GPT-2's
    width and vocabulary. The inputs are drawn bf16-exact: the worst-case bound on their rounding
    sums 768 terms per logit and would otherwise swamp the check (13 % of the gradient's norm)."""
    x, w, t = _inputs(N=1024, C=768, V=50304)
    exact = [p.detach().bfloat16().float().requires_grad_(True) for p in (x, w)]
    _check_against_float64(*exact, t, dtype)


# Interpreter blocks are 128 wide: below one block, exactly two, a masked tail. GPU blocks are 4096
# wide: GPT-2's vocabulary is 12 of them and a masked 1152 (too slow for the interpreter).
@pytest.mark.parametrize("V", [50, 256, 301, pytest.param(50304, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_overwrites_the_logits_with_softmax_minus_onehot(V, dtype):
    if DEVICE == "cuda" and dtype is torch.bfloat16 and runtime.capability() < (8, 0):
        pytest.skip("bf16 Triton kernels need compute capability >= 8.0")
    N = 9
    logits = (torch.randn(N, V, device=DEVICE) * 3).to(dtype)
    t = torch.randint(0, V, (N,), device=DEVICE)
    t[2] = -1
    z = logits.double()
    ref_loss = F.cross_entropy(z, t, ignore_index=-1, reduction="none")
    ref_g = (torch.softmax(z, 1) - F.one_hot(t.clamp_min(0), V).to(z.dtype)) * (t != -1)[:, None]
    loss = cross_entropy_rows_(logits, t)
    assert loss.dtype is torch.float32 and logits.dtype is dtype
    # Exact inputs: only the kernel's fp32 arithmetic (as in _reference_and_bounds) and g's rounding.
    block = ce._INTERPRET_BLOCK_V if ce.env.interpreting() else ce._BLOCK_V
    k = (math.log2(block) + math.ceil(V / block) + 8) * FP32_SUM
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    zt = z.gather(1, t.clamp_min(0)[:, None])
    assert torch.all((loss.double() - ref_loss).abs() <= k * (1 + lse.abs() + zt.abs())[:, 0])
    assert loss[2] == 0 and torch.all(logits[2] == 0)
    u = UNIT_ROUNDOFF[dtype]
    err = (logits.double() - ref_g).abs()
    # p's fp32 error is relative to p, so it stays absolute where p - 1 cancels at the target.
    p = torch.softmax(z, 1)
    # Below the smallest normal the rounding is absolute: half a subnormal step (2^-25 in fp16).
    tiny = torch.finfo(dtype).smallest_normal * u
    assert torch.all(err <= u * ref_g.abs() + (1 + u) * p * k * (1 + (z - lse).abs()) + tiny), err.max()


def test_a_target_outside_the_vocabulary_gives_a_nan_loss_not_a_wild_read():
    logits = torch.randn(3, 40, device=DEVICE).to(LOW)
    loss = cross_entropy_rows_(logits, torch.tensor([1, 40, -1], device=DEVICE), write_grad=False)
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1]) and loss[2] == 0


def test_without_grad_only_the_loss_is_computed(monkeypatch):
    x, w, t = _inputs()
    with torch.autocast(DEVICE, dtype=LOW):
        train = fused_linear_cross_entropy(x, w, t)

        def no_gemm(a, b):
            raise AssertionError("a gradient GEMM ran in evaluation")

        monkeypatch.setattr(ce, "_mm_fp32", no_gemm)
        with torch.no_grad():
            evaluation = fused_linear_cross_entropy(x, w, t)
    assert not evaluation.requires_grad
    assert evaluation.item() == train.item()  # the same logits, the same pass 1
    loss_sum, gx, gw = linear_cross_entropy_op(x.detach().to(LOW), w.detach().to(LOW), t, False)
    assert gx.numel() == 0 and gw.numel() == 0
    assert abs(loss_sum.item() / (t != -1).sum().item() - train.item()) < 1e-5 * train.item()


def test_the_operator_passes_opcheck():
    x, w, t = _inputs(N=6, C=8, V=70)
    for compute_grad in (True, False):
        torch.library.opcheck(linear_cross_entropy_op, (x.detach().to(LOW), w.detach().to(LOW), t, compute_grad))
        if LOW is torch.bfloat16:
            torch.library.opcheck(linear_cross_entropy_op, (x.detach().to(LOW), w.detach().to(LOW), t, compute_grad,
                                                           torch.full((1,), 0.25, device=DEVICE)))


def test_it_compiles_in_one_graph_and_matches_eager_exactly():
    """Backend aot_eager: Dynamo and AOTAutograd trace as for inductor, then the graph runs op by op
    (also on a CPU); the custom operator is one opaque node, so there is no graph break."""
    x, w, t = _inputs(N=12, C=16, V=140)

    def loss_fn(x, w):
        with torch.autocast(DEVICE, dtype=LOW):
            return fused_linear_cross_entropy(x, w, t)

    # The whole model with the option on traces in one graph too (what the benchmark compiles).
    model = GPT(GPTConfig.preset("tiny", vocab_size=150, n_layer=1, n_embd=32, n_head=2, block_size=16))
    convert(model.to(DEVICE), fused_loss=True)
    idx = torch.randint(0, 150, (2, 16), device=DEVICE)

    def model_loss(idx):
        with torch.autocast(DEVICE, dtype=LOW):
            return model(idx, idx)[1]

    for fn, args in ((loss_fn, (x, w)), (model_loss, (idx,))):
        explained = torch._dynamo.explain(fn)(*args)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    results = []
    for fn in (loss_fn, torch.compile(loss_fn, backend="aot_eager", fullgraph=True)):
        loss = fn(x, w)
        results.append([loss.detach(), *torch.autograd.grad(loss, (x, w))])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


@pytest.fixture
def fp32_matmuls():
    """fp32 means fp32 on a GPU too: no TF32, whatever a trainer built earlier in this process allowed."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(saved)


def test_the_model_option_gives_the_default_loss_and_gradients(fp32_matmuls):
    cfg = GPTConfig.preset("tiny", vocab_size=150, n_layer=1, n_embd=32, n_head=2, block_size=16)
    model = GPT(cfg).to(DEVICE)
    idx, tgt = torch.randint(0, 150, (2, 16), device=DEVICE), torch.randint(0, 150, (2, 16), device=DEVICE)
    tgt[0, :3] = -1
    logits, loss = model(idx, tgt)
    loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits2, loss2 = convert(model, fused_loss=True)(idx, tgt)
    loss2.backward()
    assert logits is not None and logits2 is None
    # fp32 throughout: the two differ only in summation order (fp32, 150-term softmax sums).
    torch.testing.assert_close(loss2, loss, rtol=1e-6, atol=1e-6)
    for g, p in zip(ref, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    # The options exclude each other, and converting back restores the full logits.
    with pytest.raises(ValueError, match="choose one"):
        convert(model, chunked_loss=8, fused_loss=True)
    assert convert(model, chunked_loss=8).fused_loss is None
    assert convert(model, fused_loss=True).loss_chunk_rows == 0
    assert convert(model)(idx, tgt)[0] is not None


def test_without_triton_the_model_option_refuses_at_once(monkeypatch):
    import mpgpt.kernels

    why = "Triton is not installed (ImportError: no module named triton); it supports Linux only."
    monkeypatch.setattr(mpgpt.kernels, "kernels_available", lambda: (False, why))
    monkeypatch.setattr(ce.env, "TRITON_IMPORT_ERROR", why)
    model = GPT(GPTConfig.preset("tiny", n_layer=1))
    with pytest.raises(RuntimeError, match="the fused loss, LayerNorm and embedding need Triton") as info:
        convert(model, fused_loss=True)
    assert "\n" not in str(info.value) and type(model) is GPT
    x, w, t = _inputs(N=4, C=8, V=20)
    with pytest.raises(RuntimeError, match="needs Triton"):
        fused_linear_cross_entropy(x, w, t)


def test_bad_inputs_are_refused():
    x, w, t = _inputs(N=5, C=8, V=20)
    with pytest.raises(ValueError, match="expected x"):
        fused_linear_cross_entropy(x, w[:, :3], t)
    with pytest.raises(ValueError, match="int64"):
        cross_entropy_rows_(torch.randn(5, 20, device=DEVICE), t.int())
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        cross_entropy_rows_(torch.randn(5, 20, dtype=torch.float64, device=DEVICE), t)


def test_the_benchmark_configurations_train_with_the_fused_loss():
    """The CPU part of `python -m mpgpt.bench train --configs ...fused-ce`: the trainer is built with
    the fused loss on, and its step trains. compile=False here: Inductor on two CPU cores takes
    about a minute per configuration (the benchmark on a GPU compiles as usual)."""
    from mpgpt.bench import ddp, training

    plain, nobias = parse("bf16+compile").settings(), parse("bf16+compile-nobias").settings()
    assert parse("bf16+compile+fused-ce").settings() == {**plain, "fused_loss": True}
    assert parse("bf16+compile-nobias+fused-ce").settings() == {**nobias, "fused_loss": True}
    name = "bf16+compile+fused-ce"
    trainer = training.make_trainer(name, preset="tiny", batch_size=2, block_size=16, device=DEVICE,
                                    compile=False)
    assert trainer.model.fused_loss is not None and trainer.model.loss_chunk_rows == 0
    before = trainer.model.lm_head.weight.detach().clone()
    loss, _, _ = trainer.train_step()
    assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0  # ln(256) = 5.55 at initialisation
    assert not torch.equal(trainer.model.lm_head.weight, before)
    for name in ("bf16+compile+fused-ce", "bf16+compile-nobias+fused-ce"):
        with pytest.raises(ValueError, match="fused_loss"):
            ddp.check_supported(name)


def test_the_fused_clip_and_tuning_configurations_are_what_their_names_say():
    """The rungs after the fused loss: the same spec plus the clip in the optimizer, then inductor's
    coordinate-descent tuning, which is in force only inside the benchmark's context for that row."""
    import torch._inductor.config as inductor_config

    from mpgpt.bench import ddp, training

    fused = parse("bf16+compile+fused-ce").settings()
    clip = parse("bf16+compile+fused-ce+fused-clip").settings()
    tuned = parse("bf16+compile+fused-ce+fused-clip+cd-tuning").settings()
    assert clip == {**fused, "fused_clip": True}
    assert tuned == {**clip, "inductor": {"coordinate_descent_tuning": True}}
    trainer = training.make_trainer("bf16+compile+fused-ce+fused-clip", preset="tiny", batch_size=2, block_size=16,
                                    device=DEVICE, compile=False)
    assert trainer.cfg.fused_clip and trainer.cfg.grad_clip == 1.0
    # only torch's fused AdamW (built on CUDA) can take the factor; elsewhere clip_grad_norm_ clips
    assert trainer.clips_in_optimizer == (trainer.device.type == "cuda")
    before = inductor_config.coordinate_descent_tuning
    with parse("bf16+compile+fused-ce+fused-clip+cd-tuning").inductor_settings():
        assert inductor_config.coordinate_descent_tuning is True
    assert inductor_config.coordinate_descent_tuning == before
    for name in ("bf16+compile+fused-ce+fused-clip", "bf16+compile+fused-ce+fused-clip+cd-tuning"):
        with pytest.raises(ValueError, match="fused_clip"):
            ddp.check_supported(name)


def test_a_second_derivative_is_refused_not_silently_wrong():
    x = torch.randn(6, 32, device=DEVICE, requires_grad=True)
    w = torch.randn(40, 32, device=DEVICE, requires_grad=True)
    t = torch.randint(0, 40, (6,), device=DEVICE)
    loss = fused_linear_cross_entropy(x, w, t)
    with pytest.raises(RuntimeError, match=r"first derivatives only.*mpgpt\.fast\.convert\(model\)"):
        torch.autograd.grad(loss, x, create_graph=True)
