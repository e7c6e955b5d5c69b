"""What does our from-scratch DynamicLossScaler cost, next to torch.amp.GradScaler? (chapter 5)

Times whole training steps (zero_grad, forward, scaled backward, unscale_, step, update) of the same
model fed the same batches, once with mpgpt.scaling.DynamicLossScaler and once with
torch.amp.GradScaler, interleaving the two step by step so clock drift and thermal changes hit both
alike. Reports medians after a warm-up, their ratio (ours / torch), and the median time of the scaler
part alone (unscale_ + step + update, the optimizer step included), and checks that the two scalers
made the same decisions (same scale after every step).

    python benchmarks/scaler_overhead.py                                 # CPU: a small MLP stack
    python benchmarks/scaler_overhead.py --device cuda --preset gpt2     # GPU: GPT-2 small, fp16 autocast

Writes ``scaler-overhead_<machine>_<date>[_<tag>].json`` into ``--out-dir`` (default: the current
folder) through mpgpt.results.write_result, whose ``environment`` holds the GPU or CPU, the torch,
CUDA and triton versions, the date, the command and the code commit; compare it with the records
``scaler-overhead-cpu`` and ``scaler-overhead-h200`` (mpgpt.results.load_record).
``--preset gpt2|small|tiny`` uses mpgpt.model.GPT when it imports; otherwise (or with the default
``--preset mlp``) a stack of MLP blocks of similar width stands in.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if importlib.util.find_spec("mpgpt") is None:  # not installed: run from a checkout as it is
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpgpt.results import write_result  # noqa: E402
from mpgpt.scaling import DynamicLossScaler  # noqa: E402

MLP_WIDTH = {"mlp": (256, 4), "tiny": (128, 4), "small": (384, 6), "gpt2": (768, 12)}  # (width, blocks)


class MLPStack(nn.Module):
    """Residual MLP blocks (LayerNorm, Linear 4x, GELU, Linear): the GPT's parameter shapes without attention."""

    def __init__(self, width: int, n_blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"),
                          nn.Linear(4 * width, width))
            for _ in range(n_blocks))
        self.head = nn.Linear(width, width)

    def forward(self, x, y):  # x, y: (B, width)
        for block in self.blocks:
            x = x + block(x)
        return F.mse_loss(self.head(x).float(), y)


def build(args, device):
    """(model, make_batch, description): a GPT preset when mpgpt.model imports, else the MLP stack."""
    gen = torch.Generator().manual_seed(0)
    if args.preset != "mlp":
        try:
            from mpgpt.model import GPT, GPTConfig
            cfg = GPTConfig.preset(args.preset)
            model = GPT(cfg).to(device)
            T = min(args.block_size or cfg.block_size, cfg.block_size)

            def make_batch():
                idx = torch.randint(cfg.vocab_size, (args.batch_size, T + 1), generator=gen).to(device)
                return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()  # (B, T) inputs, next-token targets

            def loss_fn(m, batch):
                return m(*batch)[1]
            return model, make_batch, loss_fn, f"GPT preset {args.preset!r} (B={args.batch_size}, T={T})"
        except (ImportError, AttributeError, TypeError, ValueError) as err:
            print(f"mpgpt.model unavailable ({err!r}); using the MLP stack instead")
    width, n_blocks = MLP_WIDTH[args.preset]
    model = MLPStack(width, n_blocks).to(device)

    def make_batch():
        return (torch.randn(args.batch_size, width, generator=gen).to(device),
                torch.randn(args.batch_size, width, generator=gen).to(device))

    def loss_fn(m, batch):
        return m(*batch)
    return model, make_batch, loss_fn, f"MLP stack width={width} blocks={n_blocks} (B={args.batch_size})"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(model, optimizer, scaler, batch, loss_fn, autocast_dtype, device):
    """One training step; returns (whole step seconds, scaler-part seconds, scale after update)."""
    sync(device)
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = loss_fn(model, batch)
    scaler.scale(loss).backward()
    sync(device)
    t1 = time.perf_counter()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    sync(device)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1, scaler.get_scale()  # get_scale() (a sync) after the clock stops


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="mlp", choices=sorted(MLP_WIDTH))
    p.add_argument("--steps", type=int, default=60, help="timed steps per scaler")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None, help="sequence length for GPT presets")
    p.add_argument("--autocast", choices=["none", "fp16", "bf16"], default=None,
                   help="default: fp16 on cuda (the case loss scaling exists for), none on cpu")
    p.add_argument("--out-dir", default=".", help="where the JSON result goes (default: the current folder)")
    p.add_argument("--tag", default=None, help="appended to the file name, so two runs on one day both stay")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.batch_size is None:
        args.batch_size = 8 if args.preset != "mlp" and device.type == "cuda" else 64
    autocast = args.autocast or ("fp16" if device.type == "cuda" else "none")
    autocast_dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[autocast]

    torch.manual_seed(0)
    model, make_batch, loss_fn, description = build(args, device)
    arms = {}
    for name, make_scaler in [("mpgpt", lambda: DynamicLossScaler()),
                              ("torch", lambda: torch.amp.GradScaler(device.type))]:
        m = copy.deepcopy(model)
        arms[name] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4), make_scaler())
    del model
    times = {name: {"step": [], "scaler": [], "scales": []} for name in arms}
    for i in range(args.warmup + args.steps):
        batch = make_batch()
        order = list(arms) if i % 2 == 0 else list(reversed(arms))  # alternate who goes first
        for name in order:
            model, opt, scaler = arms[name]
            step_s, scaler_s, scale = timed_step(model, opt, scaler, batch, loss_fn, autocast_dtype, device)
            times[name]["scales"].append(scale)
            if i >= args.warmup:
                times[name]["step"].append(step_s)
                times[name]["scaler"].append(scaler_s)

    med = {name: {"step_ms": 1e3 * statistics.median(t["step"]), "scaler_ms": 1e3 * statistics.median(t["scaler"])}
           for name, t in times.items()}
    ratio_step = med["mpgpt"]["step_ms"] / med["torch"]["step_ms"]
    ratio_scaler = med["mpgpt"]["scaler_ms"] / med["torch"]["scaler_ms"]
    same = times["mpgpt"]["scales"] == times["torch"]["scales"]
    print(f"{description} on {device_name(device)}, autocast {autocast}, {args.steps} steps after {args.warmup}")
    print(f"{'scaler':8s} {'step ms (median)':>18s} {'unscale+step+update ms':>24s}")
    for name in arms:
        print(f"{name:8s} {med[name]['step_ms']:18.3f} {med[name]['scaler_ms']:24.3f}")
    print(f"ratio mpgpt/torch: whole step {ratio_step:.3f}, scaler part {ratio_scaler:.3f}; "
          f"same scale every step: {same} (final {times['mpgpt']['scales'][-1]:g})")

    payload = {
        "benchmark": "scaler_overhead",
        "preset": args.preset,
        "model": description,
        "autocast": autocast,
        "optimizer": "AdamW",
        "steps": args.steps,
        "warmup": args.warmup,
        "median_ms": med,
        "ratio_step": ratio_step,
        "ratio_scaler_part": ratio_scaler,
        "same_scale_every_step": same,
        "final_scale": times["mpgpt"]["scales"][-1],
    }
    command = shlex.join(["python", "benchmarks/scaler_overhead.py", *(sys.argv[1:] if argv is None else argv)])
    machine = {"device": device.type, "device_name": device_name(device),
               "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}  # other work on the box
    out = write_result("scaler-overhead", payload, out_dir=args.out_dir, tag=args.tag, command=command,
                       environment_extra=machine)
    print(f"wrote {out}")
    result = {"path": str(out), **payload}
    return result


if __name__ == "__main__":
    main()
