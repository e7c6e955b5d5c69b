"""The scaling benchmark: ``python -m mpgpt.bench ddp`` (chapter 8).

tokens/s of the real trainer on 1 GPU and on N GPUs (DDP, and FSDP2 unless ``--no-fsdp``), each
world size launched as its own set of processes (mpgpt.distributed.launch), the per-GPU batch fixed
(weak scaling). Efficiency = tokens/s on N ÷ (N × tokens/s on 1). One JSON result with a row per
run; a run that fails is recorded with its error, not dropped.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mpgpt.bench.training import SyntheticTokens, check_counts
from mpgpt.distributed import DistributedTrainer, dist_env, first_failure, launch
from mpgpt.model import GPT, GPTConfig
from mpgpt.recipe import parse
from mpgpt.results import check_out_dir, check_tag, write_result
from mpgpt.trainer import Trainer, TrainConfig

__all__ = ["bench", "worker", "main"]


def check_supported(config: str) -> None:
    """The benchmark runs a TrainConfig with GPT-2's default model; refuse configurations whose other
    options (biases, attention, clipping, checkpointing, chunked or fused loss, fused clip, inductor settings,
    a recorded step,
    Triton, GradScaler, CUDA graphs)
    it would silently drop."""
    spec, plain = parse(config).settings(), parse("bf16").settings()
    dropped = [k for k in ("bias", "attention", "clip", "checkpointing", "chunked_loss", "triton", "fused_loss")
               if spec[k] != plain[k]]
    dropped += [k for k in ("fused_clip", "inductor", "cuda_graph") if spec.get(k)]
    if spec["scaler"] == "gradscaler" or spec["compile"] not in (None, "default"):
        dropped.append("scaler" if spec["scaler"] == "gradscaler" else "compile mode")
    if dropped:
        raise ValueError(f"configuration {config} sets {', '.join(dropped)}, which the distributed benchmark does not "
                         "apply; use one of fp32, tf32, fp16, bf16, fp16+compile, bf16+compile")


def worker(args) -> None:
    """One rank of the scaling benchmark: median step time of the real trainer on synthetic tokens."""
    env = dist_env()
    distributed = env.world_size > 1
    device = torch.device(f"cuda:{env.local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    check_supported(args.config)
    spec = parse(args.config).settings()
    cfg = TrainConfig(preset=args.preset, precision=spec["precision"], scaler=spec["scaler"],
                      batch_size=args.batch_size, device=str(device), progress=False, sample_tokens=0,
                      steps=10**9, warmup_steps=10, lr=6e-4, fsdp=args.fsdp, compile=spec["compile"] is not None,
                      ddp_bucket_mb=args.bucket_mb)
    if args.whole_graph:
        # One compiled graph for the whole model instead of Dynamo's DDPOptimizer split at every DDP
        # bucket: the all-reduces then start only after the whole backward (no overlap), but the
        # compiler sees the full graph.
        torch._dynamo.config.optimize_ddp = False
    overrides = {"block_size": args.block_size} if args.block_size else {}
    model = GPT(GPTConfig.preset(args.preset, **overrides))
    # The same global batch on every rank; each keeps its own rows (see DistributedTrainer.batch).
    data = SyntheticTokens(model.config.vocab_size, args.batch_size * env.world_size, model.config.block_size,
                            device)
    trainer = (DistributedTrainer if distributed else Trainer)(cfg, model=model, dataset=data)
    for _ in range(args.warmup):
        trainer.train_step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
        events[0].record()
        for i in range(args.steps):
            trainer.train_step()
            events[i + 1].record()
        torch.cuda.synchronize()
        times = [events[i].elapsed_time(events[i + 1]) for i in range(args.steps)]
    else:
        for _ in range(args.steps):
            t = time.perf_counter()
            trainer.train_step()
            times.append((time.perf_counter() - t) * 1e3)
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if env.is_main:
        ms_v = ms.item()
        tokens = args.batch_size * trainer.block_size * env.world_size
        row = {"world_size": env.world_size, "mode": ("fsdp" if args.fsdp else "ddp") if distributed else "single",
               "config": args.config, "preset": args.preset, "batch_size_per_gpu": args.batch_size,
               "block_size": trainer.block_size, "tokens_per_step": tokens, "ms_per_step_median": round(ms_v, 3),
               "ms_per_step_min": round(min(times), 3), "ms_per_step_max": round(max(times), 3),
               "tokens_per_s": round(tokens / (ms_v / 1e3)),
               "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
               "timed_steps": args.steps, "warmup_steps": args.warmup,
               "ddp_bucket_mb": getattr(trainer, "bucket_mb", None),
               "compiled_graph": (("whole" if args.whole_graph else "split at DDP buckets")
                                  if spec["compile"] else None)}
        Path(args.json).write_text(json.dumps(row))


def bench(preset="gpt2", config="bf16", batch_size=12, block_size=None, nproc=None, warmup=10, steps=30,
          fsdp=True, out_dir=".", tag=None, bucket_mb=None, whole_graph=False, command=None) -> dict:
    """tokens/s on 1 GPU and on ``nproc`` GPUs (DDP, and FSDP2 if ``fsdp``); scaling efficiency; a JSON file.

    ``command`` is what the result records as its command line; by default the equivalent
    ``python -m mpgpt.bench ddp ...`` of these arguments."""
    check_supported(config)
    if tag is not None:
        check_tag(tag)
    nproc = nproc or max(1, torch.cuda.device_count())
    if command is None:
        command = shlex.join(["python", "-m", "mpgpt.bench", "ddp", "--preset", preset, "--config", config,
                              "--batch-size", str(batch_size), "--nproc", str(nproc), "--warmup", str(warmup),
                              "--steps", str(steps)] + ([] if fsdp else ["--no-fsdp"])
                             + (["--block-size", str(block_size)] if block_size else [])
                             + (["--bucket-mb", str(bucket_mb)] if bucket_mb else [])
                             + (["--whole-graph"] if whole_graph else []))
    rows = []
    runs = [(1, False)] + ([(nproc, False)] + ([(nproc, True)] if fsdp else []) if nproc > 1 else [])
    for world, use_fsdp in runs:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            cmd = ["-m", "mpgpt.bench.ddp", "_worker", "--preset", preset, "--config", config,
                   "--batch-size", str(batch_size), "--warmup", str(warmup), "--steps", str(steps), "--json", str(out)]
            cmd += ["--block-size", str(block_size)] if block_size else []
            cmd += ["--fsdp"] if use_fsdp else []
            cmd += (["--bucket-mb", str(bucket_mb)] if bucket_mb else []) + (["--whole-graph"] if whole_graph else [])
            results = launch(cmd, world)
            label = f"{world} GPU{'s' if world > 1 else ''} {'fsdp' if use_fsdp else 'ddp' if world > 1 else ''}"
            failure = first_failure(results)
            if failure is not None:
                err = failure[1].stderr.strip().splitlines()
                rows.append({"world_size": world, "mode": "fsdp" if use_fsdp else "ddp", "error": err[-1] if err else "?"})
                print(f"{label:>14}: failed: {rows[-1]['error']}", flush=True)
                continue
            rows.append(json.loads(out.read_text()))
        r = rows[-1]
        print(f"{label:>14}: {r['ms_per_step_median']:8.2f} ms/step  {r['tokens_per_s'] / 1e3:8.1f}k tok/s  "
              f"mem {r['peak_memory_gib']} GiB", flush=True)
    single = next((r for r in rows if r.get("mode") == "single" and "tokens_per_s" in r), None)
    for r in rows:
        if single and "tokens_per_s" in r:
            # Efficiency = throughput on N GPUs / (N x throughput on 1): 1.0 is perfect linear scaling.
            r["scaling_efficiency"] = round(r["tokens_per_s"] / (r["world_size"] * single["tokens_per_s"]), 4)
            r["speedup"] = round(r["tokens_per_s"] / single["tokens_per_s"], 4)
            print(f"{r['world_size']} {r['mode']:>6}: speedup {r['speedup']:.3f}x, efficiency "
                  f"{r['scaling_efficiency']:.3f}")
    payload = {"benchmark": "distributed_scaling", "definition": "scaling_efficiency = tokens/s on N GPUs / "
               "(N x tokens/s on 1 GPU); per-GPU batch fixed (weak scaling)", "rows": rows,
               "nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM_"))}}
    path = write_result("ddp", payload, out_dir, tag=tag, command=command)
    print(f"wrote {path}")
    return {"path": str(path), **payload}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_worker"]:
        w = argparse.ArgumentParser(prog="python -m mpgpt.bench.ddp _worker")
        for name, kind, default in [("--preset", str, "gpt2"), ("--config", str, "bf16"), ("--batch-size", int, 12),
                                    ("--block-size", int, None), ("--warmup", int, 10), ("--steps", int, 30),
                                    ("--json", str, None)]:
            w.add_argument(name, type=kind, default=default)
        w.add_argument("--fsdp", action="store_true")
        w.add_argument("--bucket-mb", type=float, default=None)
        w.add_argument("--whole-graph", action="store_true")
        torch.set_float32_matmul_precision("high")
        worker(w.parse_args(argv[1:]))
        return 0
    b = argparse.ArgumentParser(prog="python -m mpgpt.bench ddp",
                                description="tokens/s on 1 and N GPUs, scaling efficiency, JSON result file")
    b.add_argument("--preset", default="gpt2")
    b.add_argument("--config", default="bf16", help="a recipe (mpgpt.recipe) of precision and compile only, e.g. bf16+compile")
    b.add_argument("--batch-size", type=int, default=12, help="sequences per GPU")
    b.add_argument("--block-size", type=int, default=None)
    b.add_argument("--nproc", type=int, default=None, help="GPUs for the multi-GPU runs (default: all)")
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--steps", type=int, default=30)
    b.add_argument("--no-fsdp", action="store_true", help="measure DDP only")
    b.add_argument("--out-dir", default=".", help="where the JSON result goes (default: the current folder)")
    b.add_argument("--tag", default=None, type=check_tag, help="appended to the file name")
    b.add_argument("--bucket-mb", type=float, default=None,
                   help="DDP's all-reduce bucket size in MB (default: the trainer's, 25 eager / 100 compiled)")
    b.add_argument("--whole-graph", action="store_true",
                   help="with compile: one graph, not Dynamo's split at DDP buckets (optimize_ddp=False)")
    args = b.parse_args(argv)
    try:
        if not torch.cuda.is_available():
            raise ValueError("the distributed benchmark measures GPUs and this machine has none; run it on a "
                             "machine with CUDA GPUs")
        check_supported(args.config)
        problem = (check_counts(args, "batch_size", "steps", positive=True) or check_counts(args, "warmup")
                   or (args.nproc is not None and args.nproc < 1 and f"--nproc must be a positive integer, got {args.nproc}"))
        if problem:
            raise ValueError(problem)
        check_out_dir(args.out_dir)  # a folder that cannot take the result fails now, not after the run
    except ValueError as error:
        print(f"{b.prog}: error: {error}", file=sys.stderr)
        return 2
    bench(args.preset, args.config, args.batch_size, args.block_size, args.nproc, args.warmup, args.steps,
          not args.no_fsdp, args.out_dir, args.tag, args.bucket_mb, args.whole_graph,
          command=shlex.join(["python", "-m", "mpgpt.bench", "ddp", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
