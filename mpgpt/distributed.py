"""Mixed precision on several processes with torch.distributed: DDP and FSDP2 (chapter 8).

Launch the ordinary trainer with torchrun; it notices the environment torchrun sets up::

    torchrun --nproc_per_node=2 -m mpgpt.train --precision bf16 --batch-size 8          # DDP
    torchrun --nproc_per_node=2 -m mpgpt.train --precision bf16 --batch-size 8 --fsdp   # FSDP2

What changes against one process (:class:`DistributedTrainer`, a subclass of ``mpgpt.train.Trainer``):

* **Data.** ``--batch-size`` is per rank; the *global* batch is ``batch_size × world_size``
  sequences. Every rank draws the same global batch from the same generator (seeded with
  ``--seed``, as in one process) and keeps its own contiguous slice of rows. So a 2-rank run with
  ``--batch-size 4`` sees exactly the batches of a 1-process run with ``--batch-size 8``, and the
  checkpoint needs only that one, global, generator state: it resumes with any number of ranks that
  divides the global batch.
* **Gradients.** DDP averages the gradients over the ranks during ``backward()`` (all-reduce in
  buckets, overlapped with the rest of the backward pass), in the gradients' dtype: fp32 under
  autocast, because autocast leaves the weights — and so their gradients — in fp32. With gradient
  accumulation, ``no_sync()`` skips the all-reduce on every micro-batch but the last. The
  ``.grad`` tensors are views into DDP's buckets (``gradient_as_bucket_view``: no copy in and out
  of the buckets); buckets are 25 MB eager and 100 MB under ``--compile`` (:func:`ddp_bucket_mb`).
  FSDP2 (``fully_shard``) instead keeps each rank's *shard* of the fp32 parameters (the master
  weights, and the optimizer state, are sharded: 1/N of the memory each), all-gathers them in
  ``param_dtype`` (bf16) just before each block runs, and reduce-scatters the gradients in
  ``reduce_dtype`` (fp32) so every rank ends with the averaged gradient of its own shard.
* **Overflow decisions.** A loss scaler skips a step when *its* gradients hold an inf or nan. With
  FSDP each rank sees only its shard, and a fault can also arise after the all-reduce on one rank
  only; if one rank skipped and another stepped the replicas would silently drift apart. So the
  found-inf flag is all-reduced with MAX (:func:`agree_found_inf`, passed to the scaler as
  ``found_inf_reducer``) before the skip decision: every rank skips the same steps and keeps the
  same scale.
* **Logging and checkpoints.** The logged loss is all-reduced (the mean over ranks, i.e. the loss of
  the global batch). Only rank 0 prints and writes checkpoints (atomically, mpgpt.checkpoint). A
  checkpoint holds plain full tensors, so one written by N ranks loads in one process and vice versa;
  under FSDP the shards are gathered for saving and re-sharded on loading.

:func:`launch` starts ranks the way torchrun does (same environment variables), but its rendezvous
store listens on 127.0.0.1 only — torchrun's store listens on every interface — and gloo talks over
the loopback interface. The tests and the chapter's notebook use it; on a GPU box use torchrun.

    python -m mpgpt.distributed launch --nproc 2 -m mpgpt.train --steps 20   # torchrun stand-in
    python -m mpgpt.distributed bench --preset gpt2 --batch-size 12          # 1 vs N GPUs, writes JSON
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import datetime
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mpgpt.checkpoint import check_global_batch, save_checkpoint
from mpgpt.train import Trainer, TrainConfig, _param_groups

__all__ = ["DistEnv", "dist_env", "init_distributed", "agree_found_inf", "DistributedTrainer",
           "fsdp_mixed_precision", "launch", "first_failure", "bench", "main"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its rank among ``world_size`` and its device index on this host."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_env() -> DistEnv:
    """Read the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK); one process without them."""
    return DistEnv(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device_type: str) -> DistEnv:
    """Join the process group torchrun prepared: NCCL between GPUs, gloo between CPU processes."""
    env = dist_env()
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise RuntimeError("no torch.distributed environment (RANK, MASTER_ADDR...); start the run with "
                           "torchrun --nproc_per_node=N -m mpgpt.train ...")
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(env.local_rank)  # before NCCL: each rank owns one GPU
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=datetime.timedelta(minutes=10))
        atexit.register(_destroy)
    return env


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree_found_inf(found_inf: torch.Tensor) -> None:
    """The loss scaler's ``found_inf_reducer``: after it, the flag is > 0 on every rank if on any."""
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)


def fsdp_mixed_precision(policy):
    """FSDP2's MixedPrecisionPolicy for one of our precision policies.

    ``param_dtype``: the dtype parameters are all-gathered in and the blocks compute with (bf16 or
    fp16; None keeps fp32). ``reduce_dtype``: the dtype gradients are reduce-scattered in — fp32, so
    summing N ranks' gradients rounds no worse than one process. The sharded parameters themselves,
    the ones the optimizer updates, stay fp32: FSDP2's shards *are* the master weights.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy.master_weights:
        raise ValueError(f"--fsdp keeps fp32 master shards itself; use --precision "
                         f"{policy.name.replace('-master', '')} with --fsdp, not {policy.name}")
    return MixedPrecisionPolicy(param_dtype=policy.autocast_dtype, reduce_dtype=torch.float32)


def ddp_bucket_mb(cfg: TrainConfig) -> float:
    """DDP's all-reduce bucket size in MB: ``cfg.ddp_bucket_mb``, else 25 eager and 100 compiled.

    25 MB is torch's default. Under torch.compile, Dynamo's DDPOptimizer splits the compiled graph
    at every bucket boundary, so small buckets cost fusion: on two H200s 100 MB buckets gave 1.86x,
    where the first compiled run with 25 MB buckets gave 1.24x (benchmarks/NOTES-train.md)."""
    if cfg.ddp_bucket_mb is not None:
        return float(cfg.ddp_bucket_mb)
    return 100.0 if cfg.compile else 25.0


class DistributedTrainer(Trainer):
    """The trainer on one rank of a DDP or FSDP2 run; see the module docstring for what differs."""

    def __init__(self, cfg: TrainConfig, model=None, dataset=None):
        device_type = "cuda" if (cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") \
            else "cpu"
        self.env = init_distributed(device_type)
        # One device per rank; only rank 0 shows a progress bar.
        device = f"cuda:{self.env.local_rank}" if device_type == "cuda" else "cpu"
        cfg = dataclasses.replace(cfg, device=device, progress=cfg.progress and self.env.is_main)
        super().__init__(cfg, model=model, dataset=dataset)  # same seed on every rank: same initial weights
        if hasattr(self.scaler, "found_inf_reducer"):
            self.scaler.found_inf_reducer = agree_found_inf
        if cfg.fsdp:
            self._shard()
            self.ddp = None
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # No buffer broadcast before each forward: the only buffer is the constant causal mask.
            # (torch 2.13 renamed the option; 2.11 knows only the old name.)
            quiet = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                     else {"broadcast_buffers": False})
            # gradient_as_bucket_view: the .grad tensors are views into DDP's all-reduce buckets, so
            # no copy into and out of the buckets each step, and one gradient buffer less in memory.
            self.bucket_mb = ddp_bucket_mb(cfg)
            self.ddp = DDP(self.model, device_ids=[self.device.index] if device_type == "cuda" else None,
                           bucket_cap_mb=self.bucket_mb, gradient_as_bucket_view=True, **quiet)
            self.forward = torch.compile(self.ddp) if cfg.compile else self.ddp

    def _shard(self) -> None:
        """FSDP2: one shard group per transformer block, then the rest (embeddings, ln_f, tied lm_head)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mp = fsdp_mixed_precision(self.policy)
        # An explicit mesh on this run's device type: fully_shard's default mesh takes the machine's
        # accelerator, so a CPU (gloo) run on a machine that has a GPU would move its shards to cuda.
        mesh = init_device_mesh(self.device.type, (self.env.world_size,))
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(self.model, mesh=mesh, mp_policy=mp)
        # fully_shard swapped every parameter for a DTensor shard: rebuild the optimizer on those.
        named = list(self.model.named_parameters())
        self.params = [p for _, p in named]
        cfg = self.cfg
        # fused=True on CUDA, as in the single-GPU trainer (one kernel per step over the local shards).
        self.optimizer = torch.optim.AdamW(_param_groups(named, cfg.weight_decay), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2), fused=self.device.type == "cuda")
        self.forward = torch.compile(self.model) if cfg.compile else self.model

    # ---------------------------------------------------------------------------- one step
    def batch(self, split: str):
        """This rank's rows of the global batch (``batch_size × world_size`` sequences, drawn alike everywhere)."""
        b, r = self.cfg.batch_size, self.env.rank
        x, y = self.data.get_batch(split, b * self.env.world_size, self.block_size, generator=self.data_gen)
        x, y = x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]  # (B, T) each: rows r*B .. r*B+B-1
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def micro_step_context(self, last: bool):
        if last:
            return contextlib.nullcontext()
        if self.ddp is not None:
            return self.ddp.no_sync()  # gradients accumulate locally; the last micro-batch all-reduces
        return _fsdp_no_sync(self.model)

    def train_step(self, after_backward=None):
        loss, grad_norm, lr = super().train_step(after_backward)
        # Every rank computed the mean loss of its own rows; their mean is the global batch's loss.
        loss = loss.clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)  # SUM then divide: gloo has no AVG
        loss /= self.env.world_size
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a replicated DTensor, the same on every rank
            grad_norm = grad_norm.full_tensor()
        return loss, grad_norm, lr

    # ---------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Plain full tensors on every rank (FSDP: gathered), so any number of ranks can resume it."""
        state = super().state_dict()
        if self.ddp is None:
            state["model"] = {k: _full(v) for k, v in state["model"].items()}
            state["optimizer"] = _map_optimizer_tensors(state["optimizer"], lambda t, p: _full(t))
        state["world_size"] = self.env.world_size
        state["global_batch_size"] = self.cfg.batch_size * self.env.world_size
        return state

    def save(self, path) -> Path:
        state = self.state_dict()  # every rank: FSDP gathers collectively
        if self.env.is_main:
            save_checkpoint(path, state)
        dist.barrier()  # nobody goes on (or reads the file) before it exists
        return Path(path)

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def load_state_dict(self, state: dict) -> None:
        check_global_batch(state, self.cfg.batch_size, self.world_size)  # before resharding anything
        if self.ddp is None:  # FSDP: cut the full tensors into this rank's shards
            live = self.model.state_dict()  # DTensors, tied weights under both names
            state = dict(state)
            state["model"] = {k: _shard_like(v, live[k]) if k in live else v for k, v in state["model"].items()}
            in_order = [p for group in self.optimizer.param_groups for p in group["params"]]  # state's numbering
            state["optimizer"] = _map_optimizer_tensors(state["optimizer"], _shard_like, in_order)
        super().load_state_dict(state)


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _full(t):
    """A DTensor shard gathered into the full tensor (a collective: every rank must call it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shard_like(full, param):
    """A full tensor cut like ``param`` (a DTensor): this rank keeps its shard."""
    if not hasattr(param, "device_mesh") or not torch.is_tensor(full) or full.shape != param.shape:
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements)


def _map_optimizer_tensors(opt_state: dict, fn, params=None) -> dict:
    """Apply ``fn(tensor, param)`` to every per-parameter optimizer tensor (exp_avg, exp_avg_sq).

    ``params`` in the optimizer's order; without it ``param`` is None. Scalars ('step') stay as they are.
    """
    new_state = {}
    for idx, per_param in opt_state["state"].items():
        param = params[int(idx)] if params is not None else None
        new_state[idx] = {k: fn(v, param) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in per_param.items()}
    return {**opt_state, "state": new_state}


# ------------------------------------------------------------------------------------------------
# A torchrun stand-in bound to 127.0.0.1
# ------------------------------------------------------------------------------------------------
def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return "lo" if "lo" in names else ("lo0" if "lo0" in names else None)


def launch(args: list[str], nproc: int = 2, *, env: dict | None = None, timeout: float = 600,
           cwd=None) -> list[subprocess.CompletedProcess]:
    """Run ``python <args>`` as ``nproc`` ranks on this machine, the way torchrun would; return each rank's result.

    The ranks see torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, and
    TORCHELASTIC_USE_AGENT_STORE, which tells ``init_process_group`` that a store already runs). That
    store runs here, on a socket bound to 127.0.0.1; gloo and NCCL are pointed at the loopback
    interface. If one rank fails the others are stopped (they would wait in a collective until the
    timeout). Outputs are captured; rank r's is ``results[r].stdout`` / ``.stderr``.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=sock.detach(),
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout))  # owns the fd now
    base = dict(os.environ if env is None else env)
    base.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RESTART_COUNT="0", PYTHONUNBUFFERED="1")
    # As torchrun does: split the cores between the ranks rather than let each take them all.
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    lo = _loopback_interface()
    if lo:
        base.setdefault("GLOO_SOCKET_IFNAME", lo)
        base.setdefault("NCCL_SOCKET_IFNAME", lo)
    procs, files = [], []
    with tempfile.TemporaryDirectory(prefix="mpgpt-launch-") as tmp:
        for rank in range(nproc):
            out, err = open(Path(tmp) / f"{rank}.out", "w+"), open(Path(tmp) / f"{rank}.err", "w+")
            files.append((out, err))
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(subprocess.Popen([sys.executable, *args], env=rank_env, stdout=out, stderr=err, cwd=cwd))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
        results = []
        for rank, (p, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
            out.close()
            err.close()
    del store  # closes the listening socket
    return results


def first_failure(results: list[subprocess.CompletedProcess]):
    """(rank, result) of the rank that failed on its own, or None if all ranks succeeded.

    When one rank fails, :func:`launch` kills the others (negative exit codes, usually nothing on
    stderr), so the rank to report is one with a positive exit code.
    """
    failed = [(rank, r) for rank, r in enumerate(results) if r.returncode != 0]
    if not failed:
        return None
    return min(failed, key=lambda item: (item[1].returncode < 0, item[0]))


# ------------------------------------------------------------------------------------------------
# Benchmark: tokens/s on 1 and N GPUs
# ------------------------------------------------------------------------------------------------
def _bench_worker(args) -> None:
    """One rank of the scaling benchmark: median step time of the real trainer on synthetic tokens."""
    from mpgpt.bench import TRAIN_CONFIGS, _SyntheticTokens
    from mpgpt.model import GPT, GPTConfig

    env = dist_env()
    distributed = env.world_size > 1
    device = torch.device(f"cuda:{env.local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = TRAIN_CONFIGS[args.config]
    if spec["scaler"] == "torch" or spec["triton"] or spec["compile"] not in (None, "default"):
        raise ValueError(f"configuration {args.config} is not supported by the distributed benchmark")
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
    data = _SyntheticTokens(model.config.vocab_size, args.batch_size * env.world_size, model.config.block_size,
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
          fsdp=True, out_dir=None, tag="ddp", bucket_mb=None, whole_graph=False) -> dict:
    """tokens/s on 1 GPU and on ``nproc`` GPUs (DDP, and FSDP2 if ``fsdp``); scaling efficiency; a JSON file."""
    from mpgpt.bench import write_result

    nproc = nproc or max(1, torch.cuda.device_count())
    rows = []
    runs = [(1, False)] + ([(nproc, False)] + ([(nproc, True)] if fsdp else []) if nproc > 1 else [])
    for world, use_fsdp in runs:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            cmd = ["-m", "mpgpt.distributed", "_bench_worker", "--preset", preset, "--config", config,
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
    path = write_result(tag, payload, out_dir)
    print(f"wrote {path}")
    return {"path": str(path), **payload}


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpgpt.distributed", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    ln = sub.add_parser("launch", help="run `python ARGS` as N ranks, like torchrun, bound to 127.0.0.1")
    ln.add_argument("--nproc", type=int, default=2)
    ln.add_argument("rest", nargs=argparse.REMAINDER, help="what python runs, e.g. -m mpgpt.train --steps 20")
    b = sub.add_parser("bench", help="tokens/s on 1 and N GPUs, scaling efficiency, JSON result file")
    b.add_argument("--preset", default="gpt2")
    b.add_argument("--config", default="bf16", help="a name from mpgpt.bench.TRAIN_CONFIGS (default compile mode, no triton)")
    b.add_argument("--batch-size", type=int, default=12, help="sequences per GPU")
    b.add_argument("--block-size", type=int, default=None)
    b.add_argument("--nproc", type=int, default=None, help="GPUs for the multi-GPU runs (default: all)")
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--steps", type=int, default=30)
    b.add_argument("--no-fsdp", action="store_true", help="measure DDP only")
    b.add_argument("--out-dir", default=None)
    b.add_argument("--tag", default="ddp")
    b.add_argument("--bucket-mb", type=float, default=None,
                   help="DDP's all-reduce bucket size in MB (default: the trainer's, 25 eager / 100 compiled)")
    b.add_argument("--whole-graph", action="store_true",
                   help="with compile: one graph, not Dynamo's split at DDP buckets (optimize_ddp=False)")
    w = sub.add_parser("_bench_worker")
    for name, kind, default in [("--preset", str, "gpt2"), ("--config", str, "bf16"), ("--batch-size", int, 12),
                                ("--block-size", int, None), ("--warmup", int, 10), ("--steps", int, 30),
                                ("--json", str, None)]:
        w.add_argument(name, type=kind, default=default)
    w.add_argument("--fsdp", action="store_true")
    w.add_argument("--bucket-mb", type=float, default=None)
    w.add_argument("--whole-graph", action="store_true")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"] and "-h" not in argv[1:2] and "--help" not in argv[1:2]:
        # Parsed by hand: argparse cannot leave "-m mpgpt.train --flags" alone for the ranks.
        rest, nproc = argv[1:], 2
        if rest[:1] == ["--nproc"]:
            nproc, rest = int(rest[1]), rest[2:]
        rest = rest[1:] if rest[:1] == ["--"] else rest
        results = launch(rest, nproc)
        for rank, r in enumerate(results):
            if r.stdout:
                print(r.stdout, end="" if r.stdout.endswith("\n") else "\n")
            if r.returncode != 0:
                print(f"rank {rank} exited with {r.returncode}:\n{r.stderr}", file=sys.stderr)
        return max(abs(r.returncode) for r in results)
    args = parser.parse_args(argv)
    if args.what == "_bench_worker":
        torch.set_float32_matmul_precision("high")
        _bench_worker(args)
        return 0
    bench(args.preset, args.config, args.batch_size, args.block_size, args.nproc, args.warmup, args.steps,
          not args.no_fsdp, args.out_dir, args.tag, args.bucket_mb, args.whole_graph)
    return 0


if __name__ == "__main__":
    sys.exit(main())
