"""Data parallelism built by hand on torch.distributed, in three steps (chapter 8).

Every rank holds a full replica of the model and computes the gradient of its own rows of the
global batch. Averaging those gradients over the N ranks gives every replica the gradient of the
whole global batch, so one identical optimizer step keeps the replicas identical. PyTorch's
DistributedDataParallel (DDP) does this with a few ideas (Li et al. 2020, "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training"); this module builds them one at a time. Each
step is a small wrapper with the same protocol::

    model = DDPOverlapped(GPT(cfg), bucket_mb=25)   # broadcasts rank 0's weights, as DDP does
    _, loss = model(x, y)                            # x, y: this rank's rows, (B, T) each
    loss.backward()
    report = model.finish()                          # now every .grad is the average over ranks
    optimizer.step()

1. :class:`DDPPerParameter` — after backward, one all-reduce per parameter: P collectives a step
   (148 for GPT-2 small), each paying the collective's fixed start-up latency, and all of them
   waiting until backward has finished.
2. :class:`DDPBucketed` — after backward, copy the gradients into flat buckets of about
   ``bucket_mb`` MiB (walking the parameters backwards), one all-reduce per bucket, copy back:
   a handful of collectives (13 for GPT-2 small's 498 MB of fp32 gradients in 25 MiB buckets: one
   block per bucket, 27 MiB each, and a last one of 150 MiB for the embeddings), at the price of
   two extra copies of every gradient. Still all after backward.
3. :class:`DDPOverlapped` — the same buckets, but each is all-reduced *asynchronously* as soon as
   its last gradient is ready, while backward computes the gradients of the earlier layers.
   ``finish()`` only waits for what is still in flight. A hook per parameter
   (``register_post_accumulate_grad_hook``, torch >= 2.1) says when its gradient is ready.

All three send the same bytes: every gradient once, in its own dtype (fp32 under autocast: 4 bytes
a parameter). A ring all-reduce sends and receives ``2 (N - 1) / N`` times the buffer on each rank.
They differ in how many collectives carry those bytes and in when the collectives run.

Averaging: each gradient is divided by N, then the ranks' gradients are summed (gloo has no
average). DDP divides first too (as it copies each gradient into its bucket), which also keeps a
sum of N large fp16 gradients from overflowing where their mean would not. For N = 2, halving is exact and the sum of two numbers is one rounding that does
not depend on the order, so the result is bit-identical to DDP's (tests/test_ddp_by_hand.py).

Every parameter that requires a gradient must receive one in every backward, or ``finish()``
raises, naming it (DDP with ``find_unused_parameters=False`` has the same rule and raises at the
next forward). :class:`DDPOverlapped` also needs ``finish()`` after every backward: a second
backward would hand its hooks the same parameters again, which it refuses. The other two average
whatever has accumulated in ``.grad``, so several backwards and one ``finish()`` is gradient
accumulation with one all-reduce per step (what DDP's ``no_sync()`` achieves).

Left out, on purpose: DDP's small first bucket (1 MiB), its re-bucketing after the first step in
the order gradients really arrived, ``gradient_as_bucket_view`` (``.grad`` as views into the
buckets: no copies), communication hooks, and buffers kept in sync at every forward. The
package's trainers use PyTorch's DDP (mpgpt.distributed); this module is there to be read and
checked against it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["broadcast_parameters", "plan_buckets", "SyncReport", "DDPPerParameter", "DDPBucketed", "DDPOverlapped"]

MiB = 1024 * 1024  # DDP's bucket_cap_mb counts mebibytes


def broadcast_parameters(module: nn.Module, src: int = 0) -> int:
    """Copy rank ``src``'s parameters and buffers to every rank, as DDP does when it is constructed.

    Without it, ranks that initialised their models from different seeds would train different
    models while averaging their gradients. One collective per tensor; returns how many."""
    tensors = list(module.parameters()) + list(module.buffers())  # parameters() lists a tied weight once
    for t in tensors:
        dist.broadcast(t.data, src=src)
    return len(tensors)


def plan_buckets(params: list[torch.Tensor], bucket_mb: float) -> list[list[int]]:
    """Indices into ``params``, grouped into buckets of about ``bucket_mb`` MiB, last parameter first.

    Backward produces the gradients of the last layers first, so walking the parameters backwards
    fills bucket 0 first. A bucket is closed as soon as it holds ``bucket_mb`` MiB or more (the
    parameter that crosses the limit stays in it), as DDP closes its buckets."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}; DDP's default is 25")
    limit = bucket_mb * MiB
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class SyncReport:
    """What one ``finish()`` did on this rank."""

    collectives: int             # all-reduces issued for this step
    bytes: int                   # gradient bytes all-reduced (each rank's buffer, not the wire traffic)
    launched_in_backward: int    # of those, how many started during backward (only DDPOverlapped)


class _DataParallel(nn.Module):
    """What the three variants share: the wrapped module, rank 0's weights, the parameters to sync."""

    def __init__(self, module: nn.Module):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("no process group: call torch.distributed.init_process_group first "
                               "(start the ranks with torchrun, or mpgpt.distributed.launch)")
        self.module = module
        self.world_size = dist.get_world_size()
        names = {id(p): name for name, p in module.named_parameters()}
        self.params = [p for p in module.parameters() if p.requires_grad]  # the same order on every rank
        self.param_names = [names[id(p)] for p in self.params]
        broadcast_parameters(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _check_every_gradient_arrived(self) -> None:
        missing = [name for name, p in zip(self.param_names, self.params) if p.grad is None]
        if missing:
            raise RuntimeError(f"no gradient for {', '.join(missing)} in this backward: every parameter that "
                               "requires a gradient must take part in the loss (as in DDP without "
                               "find_unused_parameters); remove it, or set requires_grad=False")


class DDPPerParameter(_DataParallel):
    """Step 1: after backward, all-reduce every parameter's gradient on its own (P collectives)."""

    def finish(self) -> SyncReport:
        """Average every ``.grad`` over the ranks; call after ``backward()``, before the optimizer step."""
        self._check_every_gradient_arrived()
        for p in self.params:  # every rank walks the same list: the collectives pair up in order
            p.grad.div_(self.world_size)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        nbytes = sum(p.grad.numel() * p.grad.element_size() for p in self.params)
        return SyncReport(collectives=len(self.params), bytes=nbytes, launched_in_backward=0)


class _Bucket:
    """A flat buffer holding the gradients of a few parameters, one after the other."""

    def __init__(self, params: list[torch.Tensor]):
        dtypes, devices = {p.dtype for p in params}, {p.device for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"a bucket packs one dtype; these parameters mix {sorted(map(str, dtypes))}: "
                             "give the model one dtype (model.float() or model.bfloat16())")
        if len(devices) > 1:
            raise ValueError(f"a bucket packs one device; these parameters lie on {sorted(map(str, devices))}: "
                             "move the whole model to this rank's device (model.to(device)) before wrapping it")
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.flat = torch.empty(self.offsets[-1], dtype=params[0].dtype, device=params[0].device)  # (numel,)
        self.ready = [False] * len(params)
        self.work = None  # the async all-reduce in flight, if any

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def view(self, i: int) -> torch.Tensor:
        """Parameter i's slice of the buffer, shaped like the parameter."""
        return self.flat[self.offsets[i]:self.offsets[i + 1]].view_as(self.params[i])

    def pack(self, i: int) -> None:
        self.view(i).copy_(self.params[i].grad)

    def unpack(self) -> None:
        for i, p in enumerate(self.params):
            p.grad.copy_(self.view(i))


class DDPBucketed(_DataParallel):
    """Step 2: after backward, one all-reduce per flat bucket of about ``bucket_mb`` MiB."""

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0):
        super().__init__(module)
        self.buckets = [_Bucket([self.params[i] for i in idx]) for idx in plan_buckets(self.params, bucket_mb)]

    def finish(self) -> SyncReport:
        """Pack, all-reduce bucket by bucket, unpack; call after ``backward()``, before the optimizer step."""
        self._check_every_gradient_arrived()
        for bucket in self.buckets:
            for i in range(len(bucket.params)):
                bucket.pack(i)
            bucket.flat.div_(self.world_size)
            dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM)
            bucket.unpack()
        return SyncReport(collectives=len(self.buckets), bytes=sum(b.nbytes for b in self.buckets),
                          launched_in_backward=0)


class DDPOverlapped(DDPBucketed):
    """Step 3: each bucket is all-reduced asynchronously during backward, as soon as it is full.

    A hook on every parameter packs its gradient into its bucket the moment autograd has finished
    accumulating it. When a bucket's last gradient arrives, its all-reduce starts
    (``async_op=True`` returns at once with a handle) while backward goes on with earlier layers.
    Buckets start strictly in order 0, 1, 2...: collectives are matched by their order on each
    rank, so if bucket 1 fills before bucket 0 it waits for bucket 0 (DDP has the same rule).
    """

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0):
        super().__init__(module, bucket_mb)
        self._next = 0                 # the next bucket to launch
        self._launched_in_backward = 0
        self.hooks = []
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self.hooks.append(p.register_post_accumulate_grad_hook(self._hook(b, i)))

    def _hook(self, b: int, i: int):
        def grad_ready(param: torch.Tensor) -> None:
            bucket = self.buckets[b]
            if bucket.ready[i]:
                raise RuntimeError(f"{self._name(bucket.params[i])} got a second gradient before finish(): call "
                                   "finish() after every backward (this wrapper has no no_sync())")
            bucket.pack(i)
            bucket.ready[i] = True
            while self._next < len(self.buckets) and all(self.buckets[self._next].ready):
                self._launch(self.buckets[self._next])
                self._launched_in_backward += 1
                self._next += 1
        return grad_ready

    def _launch(self, bucket: _Bucket) -> None:
        bucket.flat.div_(self.world_size)
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, async_op=True)

    def _name(self, param: torch.Tensor) -> str:
        return next(n for n, p in zip(self.param_names, self.params) if p is param)

    def finish(self) -> SyncReport:
        """Wait for the all-reduces still in flight, then unpack; call after ``backward()``."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
        arrived = {id(p) for bucket in self.buckets for p, ready in zip(bucket.params, bucket.ready) if ready}
        missing = [name for name, p in zip(self.param_names, self.params) if id(p) not in arrived]
        launched_in_backward = self._launched_in_backward
        for bucket in self.buckets:  # ready for the next step, whatever happens below
            bucket.ready = [False] * len(bucket.params)
            bucket.work = None
        self._next = self._launched_in_backward = 0
        if missing:
            raise RuntimeError(f"no gradient for {', '.join(missing)} in this backward, so not every bucket was "
                               "all-reduced: every parameter that requires a gradient must take part in the loss "
                               "(as in DDP without find_unused_parameters); remove it, or set requires_grad=False")
        for bucket in self.buckets:
            bucket.unpack()
        return SyncReport(collectives=len(self.buckets), bytes=sum(b.nbytes for b in self.buckets),
                          launched_in_backward=launched_in_backward)
