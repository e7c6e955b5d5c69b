"""The fused fp8 cast against mpgpt.fp8.quantize, alone and inside one Fp8Linear step (chapter 9).

Two parts, each on bf16 activations of 8192 tokens at GPT-2's c_fc shape (768 -> 3072):

1. cast: one cast of x (8192, 768) and of x.T (the backward pass's operand), tensorwise and
   rowwise, fused (mpgpt.kernels.fp8_cast.fused_quantize) against quantize (for x.T: quantize of
   the view, then the .contiguous() copy torch._scaled_mm needs). Event time from do_bench (CUDA
   events around each call, median: the GPU's time, or the host's where the call is host-bound)
   and host time per call (calls queued behind a busy GPU, so Python never waits).
2. layer: Fp8Linear forward + backward (tensorwise, rowwise, delayed) with the fused cast and with
   the eager one (the layer's private switch ``_fused``), against nn.Linear under bf16 autocast:
   wall time per step (20 steps back to back), host time per step, and do_bench's event time.

Each fused cast is also checked bit for bit against quantize before it is timed.
Run on a GPU with fp8 (sm_89+): python benchmarks/fp8_cast_probe.py [--out-dir DIR]
(writes fp8-cast-probe_<gpu>_<date>.json through mpgpt.results.write_result).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from mpgpt import fp8, runtime
from mpgpt.kernels.fp8_cast import fused_quantize
from mpgpt.results import write_result

TOKENS, FIN, FOUT = 8192, 768, 3072


def host_us(fn, n=50) -> float:
    """Host microseconds per call of fn, with the GPU kept busy so Python never waits for it."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))   # about a second of queued GPU work
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def wall_us(fn, n=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def gpu_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, rep=100) * 1e3


def same_bits(q, ref) -> bool:
    return (torch.equal(q.data.view(torch.uint8), ref.data.contiguous().view(torch.uint8))
            and torch.equal(q.scale, ref.scale) and torch.equal(q.amax, ref.amax))


def bench_cast():
    rows = []
    x = torch.randn(TOKENS, FIN, device="cuda", dtype=torch.bfloat16)
    for recipe in ("tensorwise", "rowwise"):
        for transpose in (False, True):
            view = x.t() if transpose else x
            fused = lambda: fused_quantize(x, fp8.E4M3, recipe, transpose=transpose)   # noqa: E731
            eager = lambda: fp8.quantize(view, fp8.E4M3, recipe).data.contiguous()   # noqa: E731
            row = {"recipe": recipe, "operand": "x.T" if transpose else "x", "shape": list(view.shape),
                   "bit_identical": same_bits(fused(), fp8.quantize(view, fp8.E4M3, recipe))}
            for name, fn in (("fused", fused), ("eager", eager)):
                row[name] = {"event_us": gpu_us(fn), "host_us": host_us(fn)}
            rows.append(row)
            print(f"cast {recipe:>10} {row['operand']:>3}: fused {row['fused']['event_us']:6.1f} us events, "
                  f"{row['fused']['host_us']:6.1f} us host | eager {row['eager']['event_us']:6.1f} us events, "
                  f"{row['eager']['host_us']:6.1f} us host | bit-identical {row['bit_identical']}", flush=True)
    return rows


def bench_layer():
    rows = []
    lin = nn.Linear(FIN, FOUT, device="cuda")
    x = torch.randn(TOKENS, FIN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(TOKENS, FOUT, device="cuda", dtype=torch.bfloat16)

    def step(layer):
        def fn():
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            y.backward(g)
        return fn

    cases = {"bf16_nn_linear": lin}
    for recipe in ("tensorwise", "rowwise", "delayed"):
        for fused in (True, False):
            layer = fp8.Fp8Linear.from_linear(lin, recipe=recipe)
            layer._fused = fused
            cases[f"fp8_{recipe}_{'fused' if fused else 'eager'}"] = layer
    for name, layer in cases.items():
        fn = step(layer)
        row = {"case": name, "wall_us": wall_us(fn), "host_us": host_us(fn, n=20), "event_us": gpu_us(fn)}
        rows.append(row)
        print(f"step {name:>24}: wall {row['wall_us']:7.0f} us | host {row['host_us']:7.0f} us | "
              f"events {row['event_us']:7.0f} us", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=None, help="where the JSON record goes (default: the current folder)")
    args = parser.parse_args(argv)
    if not runtime.current().fp8:
        raise SystemExit("this probe needs a GPU with fp8 (sm_89+, e.g. L4, H100, H200)")
    payload = {"tokens": TOKENS, "in": FIN, "out": FOUT, "cast": bench_cast(), "layer": bench_layer()}
    command = " ".join(["python", "benchmarks/fp8_cast_probe.py", *(argv if argv is not None else sys.argv[1:])])
    print("wrote", write_result("fp8-cast-probe", payload, args.out_dir, command=command))


if __name__ == "__main__":
    main()
