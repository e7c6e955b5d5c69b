"""Mixed precision on several processes with torch.distributed: DDP and FSDP2 (chapter 8).

Launch the ordinary trainer with torchrun; it notices the environment torchrun sets up::

    torchrun --nproc_per_node=2 -m mpgpt.train --precision bf16 --batch-size 8          # DDP
    torchrun --nproc_per_node=2 -m mpgpt.train --precision bf16 --batch-size 8 --fsdp   # FSDP2

What changes against one process (:class:`DistributedTrainer`, a subclass of ``mpgpt.trainer.Trainer``):

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
    python -m mpgpt.bench ddp --preset gpt2 --batch-size 12                  # 1 vs N GPUs (mpgpt.bench.ddp)
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import datetime
import inspect
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mpgpt.checkpoint import check_global_batch, save_checkpoint
from mpgpt.scaling import GradScalerAdapter
from mpgpt.trainer import Trainer, TrainConfig

__all__ = ["DistEnv", "dist_env", "init_distributed", "agree_found_inf", "DistributedTrainer",
           "fsdp_mixed_precision", "launch", "first_failure", "launched_by_torchrun", "main"]



def launched_by_torchrun() -> bool:
    """True in a process started by torchrun (or mpgpt.distributed.launch) with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


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
    at every bucket boundary, so small buckets cost fusion (measured: record ddp-h200x2-variants)."""
    if cfg.ddp_bucket_mb is not None:
        return float(cfg.ddp_bucket_mb)
    return 100.0 if cfg.compile else 25.0


class DistributedTrainer(Trainer):
    """The trainer on one rank of a DDP or FSDP2 run; see the module docstring for what differs."""

    def __init__(self, cfg: TrainConfig, model=None, dataset=None):
        if cfg.cuda_graph:
            raise ValueError("cuda_graph records one process's step; leave it off under torchrun "
                             "(the gradient all-reduce and FSDP's gathers are not recorded)")
        device_type = "cuda" if (cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") \
            else "cpu"
        self.env = init_distributed(device_type)
        # One device per rank; only rank 0 shows a progress bar.
        device = f"cuda:{self.env.local_rank}" if device_type == "cuda" else "cpu"
        cfg = dataclasses.replace(cfg, device=device, progress=cfg.progress and self.env.is_main)
        super().__init__(cfg, model=model, dataset=dataset)  # same seed on every rank: same initial weights
        if isinstance(self.scaler, GradScalerAdapter):
            # torch.amp.GradScaler decides skips per rank: with FSDP's shards the ranks would drift apart.
            raise ValueError("scaler 'gradscaler' cannot agree on overflows across ranks; use --scaler dynamic "
                             "(or auto) under torchrun")
        if hasattr(self.scaler, "found_inf_reducer"):  # our scalers; NullScaler never skips
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
            self.forward = self.compiled(self.ddp)

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
        # The same builder as the single-GPU trainer (fused on CUDA: one kernel over the local shards).
        self.optimizer = self.build_optimizer(named)
        self.forward = self.compiled(self.model)

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
# Command line
# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpgpt.distributed", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    ln = sub.add_parser("launch", help="run `python ARGS` as N ranks, like torchrun, bound to 127.0.0.1")
    ln.add_argument("--nproc", type=int, default=2)
    ln.add_argument("rest", nargs=argparse.REMAINDER, help="what python runs, e.g. -m mpgpt.train --steps 20")
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
    parser.parse_args(argv)  # --help, or an error naming the one command there is
    return 2


if __name__ == "__main__":
    sys.exit(main())
