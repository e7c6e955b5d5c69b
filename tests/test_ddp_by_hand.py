"""The hand-built data parallelism of mpgpt.ddp_by_hand against PyTorch's DistributedDataParallel.

One 2-rank launch on CPU (gloo, 127.0.0.1 only: ``mpgpt.distributed.launch``) runs this file as a
script. Each rank starts its model from a *different* seed (so the broadcast from rank 0 has work to
do), draws fresh random tokens of its own (a seed from the OS, printed by the test), and trains
``STEPS`` AdamW steps with PyTorch's DDP and with each hand-built variant. The tests compare, step by
step, the averaged gradients and the weights; then a bf16 model (bf16 gradients, bf16 all-reduce),
gradient accumulation over two micro-batches (DDP's ``no_sync()`` against one ``finish()``), and the
errors a user meets.

Tolerance: none; they are compared bit for bit (torch.equal). Both sides compute this rank's local
gradient with the same ops in the same process, so those agree exactly; then both divide by N = 2
(exact: a power of two) and sum the two ranks' values, one rounding per element that does not
depend on the order of the two operands. No reordered sums remain, so any difference at all is a
bug. Control: the local gradients without the all-reduce differ from DDP's, so equality is not
vacuous (a variant that skipped a bucket, or averaged twice, would differ in those elements).
"""
import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mpgpt.ddp_by_hand import plan_buckets

STEPS, B, T, VOCAB = 3, 4, 16, 64
SMALL = dict(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, block_size=T, dropout=0.0)
BUCKET_MB = 0.02  # about 21 kB: 4 buckets for the small GPT's 112 kB of fp32 gradients
VARIANTS = ["per_parameter", "bucketed", "overlapped"]


class WithUnused(nn.Module):
    """A model with a layer the loss never touches: DDP (find_unused_parameters=False) cannot sync it."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x).square().mean()


# ------------------------------------------------------------------------------------------------
# The 2-rank side: `python tests/test_ddp_by_hand.py OUT_DIR SEED` under mpgpt.distributed.launch
# ------------------------------------------------------------------------------------------------
def _worker(out: Path, seed: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpgpt import ddp_by_hand as hand
    from mpgpt.distributed import init_distributed
    from mpgpt.model import GPT, GPTConfig

    torch.set_num_threads(1)
    env = init_distributed("cpu")
    rank = env.rank
    cfg = GPTConfig.preset("tiny", **SMALL)
    g = torch.Generator().manual_seed(seed + rank)  # this rank's own rows
    tokens = torch.randint(0, VOCAB, (STEPS, B, T + 1), generator=g)

    def own_model():
        torch.manual_seed(seed + 1000 * (rank + 1))  # a different initialisation on each rank
        return GPT(cfg)

    wrappers = {
        "ddp": lambda m: DDP(m, bucket_cap_mb=BUCKET_MB),
        "per_parameter": hand.DDPPerParameter,
        "bucketed": lambda m: hand.DDPBucketed(m, bucket_mb=BUCKET_MB),
        "overlapped": lambda m: hand.DDPOverlapped(m, bucket_mb=BUCKET_MB),
        "no_sync": lambda m: (hand.broadcast_parameters(m), m)[1],  # the control: rank 0's weights, no all-reduce
    }
    results = {}
    for name, wrap in wrappers.items():
        model = wrap(own_model())
        inner = model.module if hasattr(model, "module") else model
        params = list(inner.parameters())
        initial = torch.cat([p.detach().reshape(-1) for p in params]).clone()
        opt = torch.optim.AdamW(params, lr=1e-2)
        grads, reports = [], []
        for step in range(STEPS):
            x, y = tokens[step, :, :-1], tokens[step, :, 1:]  # (B, T) each
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            if hasattr(model, "finish"):
                reports.append(vars(model.finish()))
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())
            opt.step()
        results[name] = {"initial": initial, "grads": grads, "reports": reports,
                         "final": torch.cat([p.detach().reshape(-1) for p in params]).clone()}
        if name == "bucketed":
            results["n_buckets"] = len(model.buckets)
            results["n_params"] = len(model.params)
            results["grad_bytes"] = sum(p.numel() * p.element_size() for p in model.params)
            results["n_param_names"] = len(list(inner.named_parameters(remove_duplicate=False)))

    # What a variant must refuse, with the message a user reads.
    errors = {}

    def error_of(fn):
        try:
            fn()
        except (RuntimeError, ValueError) as e:
            return str(e)
        return None

    for name in VARIANTS:  # a parameter that never gets a gradient
        def unused_layer(name=name):
            torch.manual_seed(seed)
            model = wrappers[name](WithUnused())
            model(torch.randn(4, 8)).backward()
            model.finish()
        errors[f"unused_{name}"] = error_of(unused_layer)

    def forgotten_hook():  # a bucket whose parameter's hook was lost never launches its all-reduce
        model = wrappers["overlapped"](own_model())
        model.hooks[-1].remove()  # the hook of the first parameter (wte): it sits in the last bucket
        model(tokens[0, :, :-1], tokens[0, :, 1:])[1].backward()
        model.finish()
    errors["forgotten_hook"] = error_of(forgotten_hook)

    def two_backwards():
        model = wrappers["overlapped"](own_model())
        for _ in range(2):
            model(tokens[0, :, :-1], tokens[0, :, 1:])[1].backward()
    errors["two_backwards"] = error_of(two_backwards)

    def mixed_dtypes():
        model = own_model()
        model.transformer.ln_f.bfloat16()
        hand.DDPBucketed(model, bucket_mb=1e3)  # one bucket for everything
    errors["mixed_dtypes"] = error_of(mixed_dtypes)
    results["errors"] = errors

    # A bf16 model (O2 master weights keep such a model): gradients, and the all-reduce, are bf16.
    bf16 = {}
    for name in ["ddp", "overlapped"]:
        model = wrappers[name](own_model().bfloat16())
        model(tokens[0, :, :-1], tokens[0, :, 1:])[1].backward()
        if hasattr(model, "finish"):
            model.finish()
        inner = model.module
        bf16[name] = torch.cat([p.grad.reshape(-1) for p in inner.parameters()]).clone()
    results["bf16"] = bf16

    # Gradient accumulation: two micro-batches, one average. DDP skips its all-reduce on the first
    # with no_sync(); DDPBucketed is simply not asked to finish() until the last.
    accum = {}
    for name in ["ddp", "bucketed"]:
        model = wrappers[name](own_model())
        first = model.no_sync() if name == "ddp" else contextlib.nullcontext()
        with first:
            model(tokens[0, :, :-1], tokens[0, :, 1:])[1].backward()
        model(tokens[1, :, :-1], tokens[1, :, 1:])[1].backward()
        if hasattr(model, "finish"):
            model.finish()
        accum[name] = torch.cat([p.grad.reshape(-1) for p in model.module.parameters()]).clone()
    results["accum"] = accum
    dist.barrier()
    torch.save(results, out / f"rank{rank}.pt")


# ------------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from mpgpt.distributed import first_failure, launch

    seed = int.from_bytes(os.urandom(4), "little") % 2**31
    print(f"ddp_by_hand worker seed {seed}")
    out = tmp_path_factory.mktemp("ddp_by_hand")
    results = launch([__file__, str(out), str(seed)], 2, timeout=240)
    failure = first_failure(results)
    assert failure is None, f"rank {failure[0]} failed:\n{failure[1].stderr[-3000:]}"
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_the_broadcast_gives_every_rank_rank_0s_initial_weights(ranks):
    # Each rank initialised its model from its own seed; after construction all hold rank 0's.
    for name in ["ddp", *VARIANTS, "no_sync"]:
        assert torch.equal(ranks[0][name]["initial"], ranks[1][name]["initial"]), name
        assert torch.equal(ranks[0][name]["initial"], ranks[0]["ddp"]["initial"]), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_averages_gradients_exactly_as_ddp_does(ranks, variant):
    for rank in ranks:
        for step in range(STEPS):
            ddp, mine = rank["ddp"]["grads"][step], rank[variant]["grads"][step]
            assert torch.equal(mine, ddp), (f"step {step}: {int((mine != ddp).sum())} of {ddp.numel()} gradient "
                                            f"elements differ from DDP's, by up to {float((mine - ddp).abs().max()):.3g}")
        # The same gradients and the same optimizer: the same weights, on both ranks.
        assert torch.equal(rank[variant]["final"], rank["ddp"]["final"])
    assert torch.equal(ranks[0][variant]["final"], ranks[1][variant]["final"])


def test_bf16_gradients_are_averaged_in_bf16_exactly_as_ddp_does(ranks):
    for rank in ranks:
        mine, ddp = rank["bf16"]["overlapped"], rank["bf16"]["ddp"]
        assert mine.dtype == ddp.dtype == torch.bfloat16
        assert torch.equal(mine, ddp)
    assert torch.equal(ranks[0]["bf16"]["overlapped"], ranks[1]["bf16"]["overlapped"])


def test_several_backwards_then_one_finish_is_ddps_gradient_accumulation(ranks):
    for rank in ranks:
        assert torch.equal(rank["accum"]["bucketed"], rank["accum"]["ddp"])
    # (and the accumulated average is not one micro-batch's)
    assert not torch.equal(ranks[0]["accum"]["ddp"], ranks[0]["ddp"]["grads"][0])


def test_without_the_all_reduce_the_gradients_differ_from_ddps(ranks):
    # The control for the exact comparison: the two ranks' local gradients are far from the average.
    for rank in ranks:
        local, ddp = rank["no_sync"]["grads"][0], rank["ddp"]["grads"][0]
        assert (local - ddp).abs().max() > 1e-4 * ddp.abs().max()
        assert (local != ddp).float().mean() > 0.5  # most elements, not a few
    assert not torch.equal(ranks[0]["no_sync"]["final"], ranks[1]["no_sync"]["final"])  # the replicas drifted


def test_the_reports_count_collectives_and_bytes(ranks):
    r = ranks[0]
    n_buckets, n_params, nbytes = r["n_buckets"], r["n_params"], r["grad_bytes"]
    assert 3 <= n_buckets < n_params  # several buckets, fewer than parameters
    assert n_params == r["n_param_names"] - 1  # every parameter tensor once: lm_head shares wte's weight
    for step in range(STEPS):
        assert r["per_parameter"]["reports"][step] == {"collectives": n_params, "bytes": nbytes, "launched_in_backward": 0}
        assert r["bucketed"]["reports"][step] == {"collectives": n_buckets, "bytes": nbytes, "launched_in_backward": 0}
        # Overlap: every bucket's all-reduce started from a gradient hook, during backward, on every step.
        assert r["overlapped"]["reports"][step] == {"collectives": n_buckets, "bytes": nbytes,
                                                    "launched_in_backward": n_buckets}


def test_a_parameter_without_a_gradient_is_a_clear_error(ranks):
    errors = ranks[0]["errors"]
    for name in VARIANTS:
        message = errors[f"unused_{name}"]
        assert message is not None, f"{name} accepted a parameter that got no gradient"
        assert message.startswith("no gradient for unused.weight, unused.bias in this backward"), message
        assert "find_unused_parameters" in message and "requires_grad=False" in message
    # A lost hook leaves its bucket unlaunched: finish() must notice rather than return a stale average.
    assert errors["forgotten_hook"] is not None and "transformer.wte.weight" in errors["forgotten_hook"]
    assert "not every bucket was all-reduced" in errors["forgotten_hook"]
    assert "call finish() after every backward" in errors["two_backwards"]
    assert "one dtype" in errors["mixed_dtypes"] and "torch.bfloat16" in errors["mixed_dtypes"]


# ------------------------------------------------------------------------------------------------
# One process: the bucket plan, and the error without a process group
# ------------------------------------------------------------------------------------------------
def test_buckets_are_filled_from_the_last_parameter_and_closed_at_the_limit():
    sizes = torch.randint(1, 5000, (40,)).tolist()
    params = [torch.empty(n) for n in sizes]  # fp32: 4 bytes per element
    mb = 0.03
    limit = mb * 1024 * 1024
    buckets = plan_buckets(params, mb)
    assert [i for b in buckets for i in b] == list(reversed(range(len(params))))  # each once, last first
    for k, b in enumerate(buckets):
        nbytes = sum(4 * sizes[i] for i in b)
        assert nbytes - 4 * sizes[b[-1]] < limit  # nothing is added once the limit is reached...
        if k < len(buckets) - 1:
            assert nbytes >= limit  # ...and only the last bucket (what is left over) may hold less
    assert plan_buckets(params, 1e6) == [list(reversed(range(len(params))))]  # one big bucket
    assert len(plan_buckets(params, 1e-9)) == len(params)  # one parameter each
    with pytest.raises(ValueError, match="bucket_mb must be > 0"):
        plan_buckets(params, 0)


def test_wrapping_without_a_process_group_says_what_to_do():
    import torch.distributed as dist

    from mpgpt.ddp_by_hand import DDPOverlapped

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DDPOverlapped(nn.Linear(2, 2))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]))


def test_a_bucket_names_what_its_parameters_mix():
    from mpgpt.ddp_by_hand import _Bucket

    a = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="mix .*bfloat16.*float32"):
        _Bucket([a, torch.nn.Parameter(torch.randn(2).to(torch.bfloat16))])
    with pytest.raises(ValueError, match="lie on .*cpu.*meta"):
        _Bucket([a, torch.nn.Parameter(torch.empty(2, device="meta"))])
