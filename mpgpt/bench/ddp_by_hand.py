"""``python -m mpgpt.bench ddp-by-hand``: the hand-built data parallelism against PyTorch's DDP (chapter 8).

Per-step time of one training step (forward, backward, gradient averaging, AdamW) on N ranks for:

* ``local``          no gradient averaging at all: the compute-only floor (not a correct run);
* ``ddp``            torch.nn.parallel.DistributedDataParallel, ``bucket_cap_mb`` = ``--bucket-mb``;
* ``per-parameter``  mpgpt.ddp_by_hand.DDPPerParameter: one all-reduce per parameter after backward;
* ``bucketed``       mpgpt.ddp_by_hand.DDPBucketed: one all-reduce per bucket after backward;
* ``overlapped``     mpgpt.ddp_by_hand.DDPOverlapped: the buckets all-reduced during backward.

With two or more GPUs it runs one rank per GPU over NCCL, GPT-2 small under bf16 autocast (the
gradients, and so what is all-reduced, stay fp32). Otherwise it runs 2 CPU processes over gloo
with the tiny model in fp32. ``exposed_comm_ms`` = a variant's step time minus ``local``'s: the
communication the backward pass did not hide. One JSON result (mpgpt.results.write_result).

    python -m mpgpt.bench ddp-by-hand                       # all GPUs, or 2 CPU ranks without 2 GPUs
    python -m mpgpt.bench ddp-by-hand --device cpu --steps 5
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mpgpt import ddp_by_hand as hand
from mpgpt.distributed import first_failure, init_distributed, launch
from mpgpt.model import GPT, GPTConfig
from mpgpt.results import check_tag, write_result

__all__ = ["VARIANTS", "defaults", "bench", "worker", "main"]

VARIANTS = ["local", "ddp", "per-parameter", "bucketed", "overlapped"]


def defaults(device: str) -> dict:
    """The benchmark's sizes: GPT-2 small in bf16 on GPUs, the tiny model in fp32 on CPU processes."""
    if device == "cuda":
        return dict(preset="gpt2", batch_size=12, block_size=None, precision="bf16", warmup=5, steps=20)
    return dict(preset="tiny", batch_size=8, block_size=None, precision="fp32", warmup=2, steps=8)


def _wrap(variant: str, model, bucket_mb: float, device):
    if variant == "local":
        hand.broadcast_parameters(model)  # the same start as the others, then no averaging
        return model
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb)
    if variant == "per-parameter":
        return hand.DDPPerParameter(model)
    if variant == "bucketed":
        return hand.DDPBucketed(model, bucket_mb=bucket_mb)
    if variant == "overlapped":
        return hand.DDPOverlapped(model, bucket_mb=bucket_mb)
    raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


def _time_variant(variant, args, cfg, device) -> dict:
    """Median ms of one step of ``variant`` on this rank (the slowest rank's, after an all-reduce)."""
    torch.manual_seed(0)
    model = _wrap(variant, GPT(cfg).to(device), args.bucket_mb, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=6e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(1 + dist.get_rank())  # this rank's own rows
    data = torch.randint(0, min(cfg.vocab_size, 50257), (4, args.batch_size, cfg.block_size + 1), generator=g)
    data = data.to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    report = None

    def step(i):
        nonlocal report
        x, y = data[i % 4, :, :-1], data[i % 4, :, 1:]  # (B, T) each
        opt.zero_grad(set_to_none=True)
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        if hasattr(model, "finish"):
            report = model.finish()
        opt.step()

    for i in range(args.warmup):
        step(i)
    times = []
    for i in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        step(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    for h in getattr(model, "hooks", []):
        h.remove()
    row = {"variant": variant, "ms_per_step_median": round(ms.item(), 3), "ms_per_step_min": round(min(times), 3),
           "ms_per_step_max": round(max(times), 3)}
    if report is not None:
        row.update(collectives_per_step=report.collectives, bytes_per_step=report.bytes,
                   launched_in_backward=report.launched_in_backward)
    return row


def worker(args) -> None:
    """One rank: every variant in turn, the same model, data and optimizer; rank 0 writes the rows."""
    use_cuda = args.device == "cuda"
    env = init_distributed("cuda" if use_cuda else "cpu")
    device = torch.device(f"cuda:{env.local_rank}" if use_cuda else "cpu")
    overrides = {"block_size": args.block_size} if args.block_size else {}
    cfg = GPTConfig.preset(args.preset, **overrides)
    rows = [_time_variant(v, args, cfg, device) for v in args.variants.split(",")]
    if env.is_main:
        Path(args.json).write_text(json.dumps({"rows": rows, "block_size": cfg.block_size,
                                               "backend": dist.get_backend()}))


def bench(device=None, nproc=None, preset=None, batch_size=None, block_size=None, precision=None, bucket_mb=25.0,
          warmup=None, steps=None, variants=None, out_dir=".", tag=None, command=None) -> dict:
    """Time every variant on ``nproc`` ranks, print a table, write one JSON result; returns its path and payload."""
    if tag is not None:
        check_tag(tag)
    device = device or ("cuda" if torch.cuda.device_count() >= 2 else "cpu")
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise ValueError(f"--device cuda needs 2 or more GPUs (this machine has {torch.cuda.device_count()}); "
                         "use --device cpu for gloo between CPU processes")
    d = defaults(device)
    preset, batch_size = preset or d["preset"], batch_size or d["batch_size"]
    precision, warmup, steps = precision or d["precision"], d["warmup"] if warmup is None else warmup, steps or d["steps"]
    nproc = nproc or (torch.cuda.device_count() if device == "cuda" else 2)
    variants = variants or list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or precision not in ("fp32", "bf16"):
        raise ValueError(f"unknown variant(s) {unknown} or precision {precision!r}; variants: {', '.join(VARIANTS)}; "
                         "precision: fp32 or bf16")
    settings = dict(device=device, world_size=nproc, preset=preset, batch_size_per_rank=batch_size,
                    precision=precision, bucket_mb=bucket_mb, warmup_steps=warmup, timed_steps=steps)
    if command is None:
        command = shlex.join(["python", "-m", "mpgpt.bench", "ddp-by-hand", "--device", device, "--nproc", str(nproc),
                              "--preset", preset, "--batch-size", str(batch_size), "--precision", precision,
                              "--bucket-mb", str(bucket_mb), "--warmup", str(warmup), "--steps", str(steps)]
                             + (["--block-size", str(block_size)] if block_size else []))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = ["-m", "mpgpt.bench.ddp_by_hand", "_worker", "--device", device, "--preset", preset,
               "--batch-size", str(batch_size), "--precision", precision, "--bucket-mb", str(bucket_mb),
               "--warmup", str(warmup), "--steps", str(steps), "--variants", ",".join(variants), "--json", str(out)]
        cmd += ["--block-size", str(block_size)] if block_size else []
        failure = first_failure(launch(cmd, nproc))
        if failure is not None:
            rank, r = failure
            raise RuntimeError(f"rank {rank} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        measured = json.loads(out.read_text())
    rows = measured["rows"]
    local = next((r["ms_per_step_median"] for r in rows if r["variant"] == "local"), None)
    tokens = batch_size * measured["block_size"] * nproc
    print(f"{nproc} ranks over {measured['backend']}, {preset} {precision}, batch {batch_size} x {measured['block_size']} "
          f"per rank, {bucket_mb:g} MiB buckets")
    print(f"{'variant':>14} | {'ms/step':>8} | {'tokens/s':>10} | {'exposed comm':>12} | {'collectives':>11}")
    for r in rows:
        r["tokens_per_s"] = round(tokens / (r["ms_per_step_median"] / 1e3))
        if local is not None and r["variant"] != "local":
            r["exposed_comm_ms"] = round(r["ms_per_step_median"] - local, 3)
        exposed = f"{r['exposed_comm_ms']:9.2f} ms" if "exposed_comm_ms" in r else ""
        print(f"{r['variant']:>14} | {r['ms_per_step_median']:8.2f} | {r['tokens_per_s']:>10,} | {exposed:>12} | "
              f"{r.get('collectives_per_step', ''):>11}")
    payload = {"benchmark": "ddp_by_hand", "definition": "median ms per training step (forward, backward, gradient "
               "averaging, AdamW) of the slowest rank; exposed_comm_ms = ms_per_step - local's ms_per_step",
               "settings": {**settings, "block_size": measured["block_size"], "backend": measured["backend"]},
               "rows": rows}
    path = write_result("ddp-by-hand", payload, out_dir, tag=tag, command=command)
    print(f"wrote {path}")
    return {"path": str(path), **payload}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_worker"]:
        w = argparse.ArgumentParser(prog="python -m mpgpt.bench.ddp_by_hand _worker")
        for name, kind in [("--device", str), ("--preset", str), ("--batch-size", int), ("--block-size", int),
                           ("--precision", str), ("--bucket-mb", float), ("--warmup", int), ("--steps", int),
                           ("--variants", str), ("--json", str)]:
            w.add_argument(name, type=kind, default=None)
        args = w.parse_args(argv[1:])
        torch.set_float32_matmul_precision("high")
        worker(args)
        return 0
    b = argparse.ArgumentParser(prog="python -m mpgpt.bench ddp-by-hand",
                                description="hand-built data parallelism against DDP: ms per step, JSON result")
    b.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda: one rank per GPU over NCCL (needs 2+); cpu: gloo (default: cuda with 2+ GPUs)")
    b.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU, or 2 CPU processes)")
    b.add_argument("--preset", default=None, help="model size (default gpt2 on GPUs, tiny on CPU)")
    b.add_argument("--batch-size", type=int, default=None, help="sequences per rank (default 12 on GPUs, 8 on CPU)")
    b.add_argument("--block-size", type=int, default=None)
    b.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                   help="bf16: autocast, fp32 weights and gradients (default bf16 on GPUs, fp32 on CPU)")
    b.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size in MiB, for DDP and ours (default 25)")
    b.add_argument("--warmup", type=int, default=None)
    b.add_argument("--steps", type=int, default=None)
    b.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    b.add_argument("--out-dir", default=".", help="where the JSON result goes (default: the current folder)")
    b.add_argument("--tag", default=None, type=check_tag, help="appended to the file name")
    args = b.parse_args(argv)
    if not args.bucket_mb > 0:
        b.error(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    try:
        bench(args.device, args.nproc, args.preset, args.batch_size, args.block_size, args.precision, args.bucket_mb,
              args.warmup, args.steps, args.variants.split(","), args.out_dir, args.tag,
              command=shlex.join(["python", "-m", "mpgpt.bench", "ddp-by-hand", *argv]))
    except ValueError as error:
        b.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
