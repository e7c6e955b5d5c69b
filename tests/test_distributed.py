"""DDP and FSDP2 on 2 CPU processes (gloo, 127.0.0.1 only) against the single-process trainer.

One 2-rank launch (``mpgpt.distributed.launch``: torchrun's environment, a store bound to 127.0.0.1)
runs this file as a script; each scenario writes its per-rank results to a folder that the tests
read. The single-process references run in the pytest process.

Tolerance for "DDP equals one process on the same global batch": the two compute the same sums in a
different order. One process averages the per-token losses of all 2B rows at once; DDP averages B
rows on each rank and then averages the two ranks' gradients in an all-reduce. In fp32 each
reordering moves a result by about one unit in the last place (~6e-8 relative), and a few Adam steps
(which divide by sqrt(v)) carry that into the weights. Measured: the losses of 8 steps agree to
~1e-7 relative and the weights to ~1e-6 absolute; we allow 1e-5 relative on losses and 1e-4
absolute on weights (initial weights are ~0.02, updates ~2e-3 a step). A bug — a rank training on
the wrong rows, a missing all-reduce, no_sync on the last micro-batch — moves the loss by 1e-3 or more.
"""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from mpgpt import data
from mpgpt.train import TrainConfig, Trainer

SMALL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}
B, STEPS, RESUME_AT, ACCUM = 3, 8, 4, 2   # per-rank batch; the single process uses 2 * B
INJECT_STEP, INJECT_RANK = 3, 1


def _cfg(**kw):
    base = dict(preset="tiny", steps=STEPS, batch_size=B, grad_accum=ACCUM, progress=False, sample_tokens=0,
                eval_interval=STEPS, eval_batches=1, warmup_steps=2, model_overrides=dict(SMALL), seed=4321,
                precision="fp32", lr=3e-3, device=os.environ.get("MPGPT_TEST_DEVICE", "cpu"))
    base.update(kw)
    return TrainConfig(**base)


def _dataset():
    return data.TextDataset(data.generate_corpus(40_000, seed=7))


def _flat(trainer_or_state):
    sd = trainer_or_state if isinstance(trainer_or_state, dict) else trainer_or_state.model.state_dict()
    return torch.cat([v.detach().float().reshape(-1).cpu() for v in sd.values()])


# ------------------------------------------------------------------------------------------------
# The 2-rank side (runs as `python tests/test_distributed.py OUT_DIR` under mpgpt.distributed.launch)
# ------------------------------------------------------------------------------------------------
def _worker(out: Path) -> None:
    from mpgpt.distributed import DistributedTrainer

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    ds = _dataset()
    results = {}

    def record(name, trainer, **extra):
        results[name] = {"loss": trainer.history.loss, "scale": trainer.history.scale,
                         "skipped": trainer.history.skipped, **extra}
        torch.save(trainer.state_dict()["model"], out / f"{name}_rank{rank}.pt")  # full tensors (FSDP gathers)

    # DDP, fp32, gradient accumulation: a checkpoint at RESUME_AT, then on to STEPS.
    t = DistributedTrainer(_cfg(out_dir=str(out / "from2")), dataset=ds)
    t.run(until=RESUME_AT)
    t.cfg.out_dir = None
    t.run()
    record("ddp", t)
    # DDP resuming a checkpoint written by one process.
    t = DistributedTrainer(_cfg(), dataset=ds)
    t.load(out / "from1" / "ckpt.pt")
    t.run()
    record("ddp_resumed", t)

    # fp16 with the dynamic scaler: an inf on ONE rank's gradient, written after DDP's all-reduce.
    def inject(step, model):
        if step == INJECT_STEP and rank == INJECT_RANK:
            next(model.parameters()).grad.view(-1)[0] = float("inf")

    fp16 = dict(precision="fp16", scaler="dynamic", init_scale=2.0**8, growth_interval=1000)
    t = DistributedTrainer(_cfg(**fp16), dataset=ds)
    t.run(after_backward=inject)
    record("agreed", t)
    t = DistributedTrainer(_cfg(**fp16), dataset=ds)
    t.scaler.found_inf_reducer = None  # the control: each rank decides alone
    t.run(after_backward=inject)
    record("alone", t)

    # FSDP2 in fp32 (checkpoint at RESUME_AT), FSDP2 resuming the 1-process checkpoint, FSDP2 in bf16.
    t = DistributedTrainer(_cfg(fsdp=True, out_dir=str(out / "fsdp")), dataset=ds)
    t.run(until=RESUME_AT)
    t.cfg.out_dir = None
    t.run()
    record("fsdp", t)
    t = DistributedTrainer(_cfg(fsdp=True), dataset=ds)
    t.load(out / "from1" / "ckpt.pt")
    t.run()
    record("fsdp_resumed", t)
    t = DistributedTrainer(_cfg(fsdp=True, precision="bf16"), dataset=ds)
    w = t.model.transformer.h[0].mlp.c_fc.weight
    shard = {"dtype": str(w.dtype), "local_dtype": str(w.to_local().dtype), "local_rows": w.to_local().shape[0],
             "rows": w.shape[0], "placements": str(w.placements)}
    t.run()
    record("fsdp_bf16", t, shard=shard)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def runs(request, tmp_path_factory):
    """Single-process references, then one 2-rank launch of every scenario; returns what they wrote.

    "cpu": gloo between two CPU processes (CI). "cuda": NCCL between two GPUs, the same assertions.
    """
    from mpgpt.distributed import launch

    device = request.param
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs for the NCCL variant; run on the 2-GPU machine")
    os.environ["MPGPT_TEST_DEVICE"] = device  # read by _cfg here and in the ranks
    out = tmp_path_factory.mktemp(f"dist_{device}")
    ds = _dataset()
    refs = {}
    for name, kw in [("fp32", {}), ("bf16", {"precision": "bf16"})]:
        ref = Trainer(_cfg(batch_size=2 * B, **kw), dataset=ds)  # the same global batch in one process
        ref.run()
        refs[name] = ref
    Trainer(_cfg(batch_size=2 * B, out_dir=str(out / "from1")), dataset=ds).run(until=RESUME_AT)
    results = launch([__file__, str(out)], 2, timeout=240)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.stderr[-3000:]}"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    weights = {name: [torch.load(out / f"{name}_rank{r}.pt", map_location="cpu") for r in range(2)]
               for name in ranks[0]}
    yield {"out": out, "refs": refs, "ranks": ranks, "weights": weights, "ds": ds}
    os.environ.pop("MPGPT_TEST_DEVICE", None)


def test_ddp_on_a_global_batch_matches_one_process(runs):
    ref, (r0, r1) = runs["refs"]["fp32"], runs["ranks"]
    # The logged loss is all-reduced: both ranks log the same numbers, the global batch's loss.
    assert r0["ddp"]["loss"] == r1["ddp"]["loss"]
    torch.testing.assert_close(torch.tensor(r0["ddp"]["loss"]), torch.tensor(ref.history.loss), rtol=1e-5, atol=0)
    # Replicas stay bit-identical (same averaged gradients, same optimizer), and equal the 1-process weights.
    w0, w1 = runs["weights"]["ddp"]
    assert all(torch.equal(a, b) for a, b in zip(w0.values(), w1.values()))
    torch.testing.assert_close(_flat(w0), _flat(ref), rtol=0, atol=1e-4)
    # Control for the tolerance: a different global batch (another seed) is far outside it.
    other = Trainer(_cfg(batch_size=2 * B, seed=99, steps=2), dataset=runs["ds"])
    other.run()
    assert abs(other.history.loss[1] - ref.history.loss[1]) > 1e-3


def test_overflow_on_one_rank_is_skipped_on_every_rank(runs):
    r0, r1 = runs["ranks"]
    agreed = [r0["agreed"], r1["agreed"]]
    expected = [s == INJECT_STEP for s in range(STEPS)]
    assert agreed[0]["skipped"] == agreed[1]["skipped"] == expected
    assert agreed[0]["scale"] == agreed[1]["scale"]
    assert agreed[0]["scale"][INJECT_STEP] == agreed[0]["scale"][INJECT_STEP - 1] / 2  # backed off once
    w0, w1 = runs["weights"]["agreed"]
    assert all(torch.equal(a, b) for a, b in zip(w0.values(), w1.values()))
    # Without the all-reduced flag only the faulty rank skips: the scales and the replicas drift apart.
    alone = [r0["alone"], r1["alone"]]
    assert alone[INJECT_RANK]["skipped"] == expected and not any(alone[1 - INJECT_RANK]["skipped"])
    assert alone[0]["scale"] != alone[1]["scale"]
    w0, w1 = runs["weights"]["alone"]
    assert not torch.equal(_flat(w0), _flat(w1))


def test_checkpoint_from_two_ranks_resumes_in_one_process_and_back(runs):
    from mpgpt.checkpoint import load_checkpoint

    ref, out = runs["refs"]["fp32"], runs["out"]
    state = load_checkpoint(out / "from2" / "ckpt.pt")
    assert state["step"] == RESUME_AT and state["world_size"] == 2 and state["global_batch_size"] == 2 * B
    for ckpt in ["from2", "fsdp"]:  # written by 2 DDP ranks / gathered from 2 FSDP shards
        one = Trainer(_cfg(batch_size=2 * B), dataset=runs["ds"])
        one.load(out / ckpt / "ckpt.pt")
        one.run()
        torch.testing.assert_close(torch.tensor(one.history.loss), torch.tensor(ref.history.loss), rtol=1e-5, atol=0)
        torch.testing.assert_close(_flat(one), _flat(ref), rtol=0, atol=1e-4)
    # The 1-process checkpoint continued on 2 ranks, by DDP and by FSDP (which re-shards it).
    for name in ["ddp_resumed", "fsdp_resumed"]:
        r0 = runs["ranks"][0][name]
        assert len(r0["loss"]) == STEPS
        torch.testing.assert_close(torch.tensor(r0["loss"]), torch.tensor(ref.history.loss), rtol=1e-5, atol=0)
        torch.testing.assert_close(_flat(runs["weights"][name][0]), _flat(ref), rtol=0, atol=1e-4)


def test_resume_needs_the_same_global_batch_with_any_number_of_ranks(runs):
    from mpgpt.checkpoint import CheckpointError, load_checkpoint
    from mpgpt.distributed import check_global_batch

    state = load_checkpoint(runs["out"] / "from2" / "ckpt.pt")  # 2 ranks x B
    for batch_size, world in [(2 * B, 1), (B, 2), (1, 2 * B)]:
        check_global_batch(state, batch_size, world)  # same global batch: fine
    with pytest.raises(CheckpointError, match=f"use --batch-size {2 * B}"):
        check_global_batch(state, B, 1)  # the per-rank batch of the 2-rank run, in one process
    with pytest.raises(CheckpointError, match=f"divides {2 * B}"):
        check_global_batch(state, 1, 4)


def test_fsdp_shards_fp32_masters_and_matches_one_process(runs):
    (r0, r1), refs = runs["ranks"], runs["refs"]
    # fp32 FSDP2 is the same arithmetic as DDP, reordered: the same tolerance.
    assert r0["fsdp"]["loss"] == r1["fsdp"]["loss"]
    torch.testing.assert_close(torch.tensor(r0["fsdp"]["loss"]), torch.tensor(refs["fp32"].history.loss),
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(_flat(runs["weights"]["fsdp"][0]), _flat(refs["fp32"]), rtol=0, atol=1e-4)
    # bf16 MixedPrecisionPolicy: the optimizer's parameters are fp32 shards (half the rows on each rank)...
    shard = r0["fsdp_bf16"]["shard"]
    assert shard["dtype"] == shard["local_dtype"] == "torch.float32"
    assert shard["local_rows"] * 2 == shard["rows"] and "Shard(dim=0)" in shard["placements"]
    # ...and the blocks compute in bf16, as autocast does in one process, but FSDP's gathered copies of
    # the embeddings and LayerNorm gains are bf16 too (autocast keeps those fp32), so the losses agree
    # to bf16 rounding, not fp32's: measured 1.2e-4 relative on CPU over 8 steps; a bf16 ulp is 7.8e-3.
    torch.testing.assert_close(torch.tensor(r0["fsdp_bf16"]["loss"]), torch.tensor(refs["bf16"].history.loss),
                               rtol=2e-3, atol=0)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


def test_first_failure_reports_the_rank_that_failed_on_its_own():
    # launch() kills the surviving ranks when one fails: their exit codes are negative and their
    # stderr says nothing. The report must name the rank with the real error, whatever its number.
    import subprocess

    from mpgpt.distributed import first_failure

    ok = subprocess.CompletedProcess([], 0, "", "")
    killed = subprocess.CompletedProcess([], -9, "", "")
    crashed = subprocess.CompletedProcess([], 1, "", "ValueError: boom")
    assert first_failure([ok, ok]) is None
    assert first_failure([killed, crashed]) == (1, crashed)
    assert first_failure([crashed, killed]) == (0, crashed)
    assert first_failure([killed, ok]) == (0, killed)


def test_ddp_bucket_size_default_follows_compile_and_bad_sizes_are_refused():
    from mpgpt.distributed import ddp_bucket_mb

    assert ddp_bucket_mb(TrainConfig()) == 25.0  # torch's default, eager
    assert ddp_bucket_mb(TrainConfig(compile=True)) == 100.0  # fewer Dynamo graph splits
    assert ddp_bucket_mb(TrainConfig(compile=True, ddp_bucket_mb=10)) == 10.0
    for bad in (0, -5.0):
        with pytest.raises(ValueError, match="ddp_bucket_mb must be > 0"):
            TrainConfig(ddp_bucket_mb=bad).validate()
