"""The fast path with the GPU shared: every custom kernel gives the same bits as when it runs alone.

A race between the warps of a kernel (a buffer handed on before every warp has finished with it, a
missing fence between the threads' stores and the copy engine) can stay hidden while the kernel
has the GPU to itself, where every warp keeps the same pace from run to run. Other work on the
GPU (a second notebook, another training job, a Colab neighbour through MPS) changes the pace,
and the race shows as a few wrong elements, which a training run turns into NaN. So each case
below is computed alone, twice (the kernel is deterministic: the same bits both times), and then
REPEATS more times while two other processes keep the GPU busy with bf16 products; every repeat
must equal the first result bit for bit (torch.equal).

The cases are GPT-2 small's shapes (12 sequences of 1024 tokens, 768 channels): the kernels of the
fast model (warp-specialised products with the GELU forward epilogue, fused LayerNorm and residual add,
the q/k/v heads, the tied embedding's gradient, the fused cross-entropy, the column sums of
partials), one step of its 16-bit AdamW, the fp8 casts and the fp8 product, each through its
public entry point; and the GELU-backward epilogue, withdrawn from the recipes because it gave
different bits under such load (in 1 to 4 of every 5 repeats), kept here as an expected failure
until it passes. REPEATS = 20 catches a race that shows that often with near certainty.

Run alone and with `-n 4` (each worker then adds its own load) on a GPU of compute capability 9.0.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

REPEATS = 20
LOAD = """
import sys, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = a @ a
torch.cuda.synchronize()
print("busy", flush=True)
while True:
    b = a @ a
    torch.cuda.synchronize()
"""


def _hopper_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mpgpt.kernels import env
    ok, why = env.kernels_available()
    if not ok:
        pytest.skip(why)
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the fast path's warp-specialised and TMA kernels need compute capability 9.0 (H100/H200)")


@contextlib.contextmanager
def gpu_load(processes: int = 2):
    """Two other processes, each looping 8192^3 bf16 products on this GPU, for the duration."""
    procs = [subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "busy", "the load process did not start"
        time.sleep(0.5)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


ROWS = 12 * 1024  # tokens a step: GPT-2 small's benchmark batch, 12 sequences of 1024


def _gelu_backward_case(rows=ROWS):
    from mpgpt.kernels.hopper import ws
    M, K, N = rows, 768, 3072
    g = torch.randn(M, K, device="cuda").bfloat16()
    w = (torch.randn(K, N, device="cuda") / K**0.5).bfloat16()
    z = (1.5 * torch.randn(M, N, device="cuda")).bfloat16()
    assert ws.gelu_backward_eligible(g, w, z)
    return lambda: ws.gelu_backward_fused(g, w, z, True, torch.float32)


def _products_case(rows=ROWS):
    """The warp-specialised kernel's plain, GELU-forward and split-K products at GPT-2's shapes."""
    from mpgpt.kernels import matmul
    x = torch.randn(rows, 768, device="cuda").bfloat16()
    w_fc = (torch.randn(3072, 768, device="cuda") / 768**0.5).bfloat16()
    b_fc = torch.randn(3072, device="cuda").bfloat16()
    w_proj = (torch.randn(768, 3072, device="cuda") / 3072**0.5).bfloat16()
    h = torch.randn(rows, 3072, device="cuda").bfloat16()

    def run():
        return (matmul(x, w_fc.t(), b_fc, kernel="ws"),
                matmul(x, w_fc.t(), b_fc, activation="gelu"),
                matmul(h, w_proj.t(), kernel="ws"),
                matmul(h.t(), x, kernel="ws", split_k=4))
    return run


def _fast_model_case(rows=ROWS):
    """Forward and backward of GPT-2 small with every custom kernel of the fastest rows switched on
    (eager: the kernels themselves, not a compiled graph), then one AdamW16 step."""
    from mpgpt.fast import convert
    from mpgpt.model import GPT, GPTConfig
    from mpgpt.optim16 import AdamW16
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2")).cuda().bfloat16()
    convert(model, triton="mlp+qkv", fused_ln=True, fused_emb=True, fused_loss=True)
    start = [p.detach().clone() for p in model.parameters()]
    idx = torch.randint(0, model.config.vocab_size, (rows // 1024, 1024), device="cuda")
    tgt = torch.randint(0, model.config.vocab_size, (rows // 1024, 1024), device="cuda")

    def run():
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), start):
                p.copy_(p0)
        opt = AdamW16(model.parameters(), lr=1e-4, variant="bf16-mantissa", seed=0)
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, tgt)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return (loss.detach(), *grads, *(p.detach().clone() for p in model.parameters()))
    return run


def _fp8_case(rows=ROWS):
    from mpgpt.fp8 import E4M3, E5M2, Fp8Linear
    from mpgpt.kernels.fp8_cast import fused_quantize
    torch.manual_seed(0)
    x = torch.randn(rows, 768, device="cuda")
    layer = Fp8Linear(768, 3072, recipe="rowwise", device="cuda")
    xb = x.bfloat16().requires_grad_()

    def run():
        q1, q2 = fused_quantize(x, E4M3, "rowwise"), fused_quantize(x, E5M2, "tensorwise", transpose=True)
        layer.zero_grad(set_to_none=True)
        xb.grad = None
        y = layer(xb)
        y.float().square().mean().backward()
        return (q1.data, q1.scale, q2.data, q2.scale, y.detach(), xb.grad, layer.weight.grad)
    return run


CASES = {
    "ws GELU-backward epilogue (withdrawn)": _gelu_backward_case,
    "ws products (plain, GELU forward, split-K)": _products_case,
    "fast GPT-2 small step (eager kernels, AdamW16)": _fast_model_case,
    "fp8 casts and product": _fp8_case,
}


def _bits(out) -> list[torch.Tensor]:
    out = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [t.detach().clone() for t in out if isinstance(t, torch.Tensor)]
    return [t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t for t in tensors]


def _differences(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[str]:
    return [f"output {i}: {(x != y).sum().item()} of {x.numel()} elements differ"
            for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]


WITHDRAWN = pytest.mark.xfail(reason="GELU's backward in the epilogue (fast/mlp.py's WITHDRAWN) gave different "
                                      "bits under load; it comes back when this passes", strict=False)


@pytest.mark.parametrize("case", [pytest.param(c, marks=WITHDRAWN) if "withdrawn" in c else c for c in CASES])
def test_gpu_kernel_gives_the_same_bits_under_load(case):
    _hopper_or_skip()
    fn = CASES[case]()
    first = _bits(fn())
    torch.cuda.synchronize()
    again = _bits(fn())
    assert not _differences(first, again), f"{case} is not deterministic alone: {_differences(first, again)}"
    with gpu_load():
        for i in range(REPEATS):
            out = _bits(fn())
            torch.cuda.synchronize()
            bad = _differences(first, out)
            assert not bad, f"{case}, repeat {i + 1} of {REPEATS} under load: {bad}"
