"""The trainer with a bf16 model and the package's 16-bit AdamW (TrainConfig.optim16): it trains as
the O2 recipe with torch's AdamW does, resumes exactly, records as a CUDA graph, and refuses what
it cannot do."""
import pytest
import torch

from mpgpt.optim16 import AdamW16
from mpgpt.train import TrainConfig, Trainer

SMALL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}


def _cfg(**kw):
    # warmup_steps=0: the full learning rate from the first step, so that a step counted wrongly
    # (bias corrections of the step after) moves each weight by about a quarter of lr differently.
    base = dict(preset="tiny", steps=8, batch_size=8, progress=False, sample_tokens=0, eval_interval=100,
                eval_batches=2, warmup_steps=0, lr=1e-3, model_overrides=dict(SMALL), seed=1234, log_interval=4,
                precision="bf16", grad_clip=0.5, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


def _losses(trainer):
    return torch.tensor(trainer.run().loss)


def _masters(trainer):
    """The fp32 weights each trainer's optimizer holds, in the model's parameter order."""
    if isinstance(trainer.optimizer, AdamW16):
        return [trainer.optimizer.fp32_weight(p).view_as(p) for p in trainer.model.parameters()]
    return [p.detach() for p in trainer.master.params]


def _apart(ours, ref, tol=2e-5):
    """The fraction of weights whose fp32 values in the two trainers differ by more than ``tol``."""
    pairs = list(zip(_masters(ours), _masters(ref)))
    return sum(((a - b).abs() > tol).sum().item() for a, b in pairs) / sum(a.numel() for a, _ in pairs)


def test_optim16_trains_like_fp32_masters_under_torchs_adamw():
    """The same model, data and initial weights: the bf16 model with fp32 masters updated by torch's
    AdamW (precision 'bf16-master') against the bf16 model updated by AdamW16 'fp32-master'.

    Both start from the same fp32 masters and read bf16 weights in the forward pass. The two
    AdamWs apply the same formula in a different order of fp32 operations (and clip by a division
    instead of a multiplication), and the bf16 copies round ties differently (away from zero here,
    to even there: a few weights of the initial ones). The gradients therefore differ in their last
    bits, and Adam's update, about lr times the sign of a gradient's running mean, flips for
    gradients that are nearly zero. Measured on this configuration: the losses agree to 4e-5
    relative over 8 steps, and 8 % of the weights end more than 2e-5 apart (they moved 1e-3 per
    step). Counting the optimizer's steps wrongly (next test) gives 1.2e-2 and 98 %."""
    torch.set_num_threads(1)
    ours = Trainer(_cfg(optim16="fp32-master"))
    ref = Trainer(_cfg(precision="bf16-master"))
    assert ours.clips_in_optimizer and next(ours.model.parameters()).dtype == torch.bfloat16
    start = [m.clone() for m in _masters(ours)]
    for a, b in zip(start, _masters(ref)):
        assert torch.equal(a, b)  # the optimizer took the fp32 weights the model had before its cast
    lo, lr_ = _losses(ours), _losses(ref)
    torch.testing.assert_close(lo, lr_, rtol=1e-3, atol=0)
    assert _apart(ours, ref) < 0.25
    moved = min((a - b).abs().max().item() for a, b in zip(_masters(ours), start))
    assert moved > 1e-3  # every tensor trained
    assert max(ours.history.grad_norm) > 0.5  # the clip acted
    assert lo[-1] < lo[0]


def test_a_step_count_off_by_one_would_be_caught():
    """The tolerances above are meaningful: the bias corrections of step t + 1 at step t."""
    torch.set_num_threads(1)
    ours = Trainer(_cfg(optim16="fp32-master"))
    prepare = ours.optimizer.prepare
    ours.optimizer.prepare = lambda step, lr=None: prepare(step + 1, lr)
    ref = Trainer(_cfg(precision="bf16-master"))
    lo, lr_ = _losses(ours), _losses(ref)
    assert ((lo - lr_).abs() / lr_).max() > 3e-3
    assert _apart(ours, ref) > 0.5


def test_the_clip_takes_the_optimizers_own_norm_where_it_covers_every_parameter():
    """On a GPU the optimizer is FusedAdamW16, whose grad_norm reads every gradient in one launch per
    group: the trainer clips with it when the optimizer holds exactly the trainer's parameters, and
    with total_norm when it does not (stand-ins here; the kernel is tested in test_optim16.py)."""
    torch.set_num_threads(1)
    trainer = Trainer(_cfg(optim16="bf16-mantissa", steps=1))
    calls = []
    trainer.optimizer.grad_norm = lambda: (calls.append(1), torch.tensor(12.5))[1]
    trainer.run()
    assert calls == [1] and trainer.history.grad_norm == [12.5]
    for p in trainer.params:
        p.grad = torch.randn(p.shape).to(p.dtype)
    trainer.params = trainer.params[:-1]  # the optimizer now holds one parameter more than the trainer
    expected = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in trainer.params]))
    # fp32 norms of each gradient, then the norm of those: within a few 1e-6 of the float64 norm
    torch.testing.assert_close(trainer._grad_norm().double(), expected, rtol=2e-5, atol=0)
    assert calls == [1]


@pytest.mark.parametrize("variant", ["fp32-master", "bf16-sr"])
def test_optim16_resumes_bit_for_bit(tmp_path, variant):
    """Four steps, a checkpoint, four more in a new trainer: the losses and weights of eight in one
    go, exactly (one CPU thread). The fp32 masters and moments come back as fp32, not as the
    parameters' bf16, which torch's Optimizer.load_state_dict would have made of them."""
    torch.set_num_threads(1)
    whole = Trainer(_cfg(optim16=variant))
    lw = _losses(whole)
    first = Trainer(_cfg(optim16=variant, out_dir=str(tmp_path)))
    first.run(until=4)
    second = Trainer(_cfg(optim16=variant))
    second.load(tmp_path / "ckpt.pt")
    assert second.optimizer.flat[0]["exp_avg"].dtype == torch.float32  # both variants keep fp32 moments
    ls = torch.tensor(second.run().loss)  # the history holds the first four steps too
    assert torch.equal(ls, lw), (ls, lw)
    for a, b in zip(second.model.parameters(), whole.model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(Exception, match="optim16"):
        Trainer(_cfg(optim16="bf16-mantissa")).load(tmp_path / "ckpt.pt")


def test_optim16_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="unknown optim16 variant 'bf8'; choose one of"):
        _cfg(optim16="bf8").validate()
    with pytest.raises(ValueError, match="use precision 'bf16'"):
        _cfg(optim16="fp32-master", precision="fp16").validate()
    with pytest.raises(ValueError, match="scaler 'none'"):
        _cfg(optim16="fp32-master", scaler="dynamic").validate()
    with pytest.raises(ValueError, match="random bits"):
        _cfg(optim16="bf16-sr", cuda_graph=True).validate()
    with pytest.raises(ValueError, match="FSDP2"):
        _cfg(optim16="fp32-master", fsdp=True).validate()
    with pytest.raises(ValueError, match="steps count from 1"):
        Trainer(_cfg(optim16="fp32-master")).optimizer.prepare(0)


def test_the_cli_takes_optim16(capsys):
    from mpgpt.train import main

    assert main(["--preset", "tiny", "--steps", "3", "--precision", "bf16", "--optim16", "bf16-mantissa",
                 "--batch-size", "4", "--block-size", "32", "--sample-tokens", "0", "--device", "cpu",
                 "--no-progress"]) == 0
    assert "loss" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--optim16", "bf8", "--device", "cpu"])


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_optim16_recorded_step_trains_like_the_eager_step():
    """Compiled, the fused classifier, optim16 'fp32-master' and the whole step recorded, against the
    same run eager: the fused kernel reads its coefficients and clipping factor from device tensors
    rewritten before every replay. Tolerance as for the recorded torch AdamW step (the embedding
    gradient's atomics); a recording that kept its first coefficients differs by far more."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs sm_80 or newer")
    from mpgpt.data import TextDataset, default_corpus
    from mpgpt.fast import convert
    from mpgpt.model import GPT, GPTConfig

    def build(**kw):
        cfg = _cfg(device="cuda", optim16="fp32-master", compile=True, steps=12, warmup_steps=6, **kw)
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", vocab_size=128, **SMALL))
        convert(model, fused_loss=True)
        return Trainer(cfg, model=model, dataset=TextDataset(default_corpus()))

    eager, graphed, stale = build(), build(cuda_graph=True), build(cuda_graph=True)
    prepare_lr = stale._set_lr
    stale._set_lr = lambda lr: None if stale.graphed.recorded else prepare_lr(lr)  # never again once recorded
    le, lg, ls = _losses(eager), _losses(graphed), _losses(stale)
    assert graphed.graphed.recorded and type(graphed.optimizer).__name__ == "FusedAdamW16"
    torch.testing.assert_close(lg, le, rtol=1e-4, atol=0)
    for pe, pg in zip(_masters(eager), _masters(graphed)):
        torch.testing.assert_close(pg, pe, rtol=1e-4, atol=1e-6)
    assert ((ls - le).abs() / le).max() > 1e-3
    assert lg[-1] < lg[0] - 0.3, lg


def test_the_bench_rows_change_one_thing():
    """Each optim16 row of the bench is the fastest row with biases (or without) with the optimizer
    swapped; the clip moves into the optimizer's kernel with it."""
    from mpgpt.bench.training import make_trainer
    from mpgpt.recipe import parse

    def settings(name):
        return parse(name).settings()

    for bias in ("", "-nobias"):
        base = dict(settings(f"bf16+compile{bias}+fused-ce+fused-clip+step-graph+no-mix-order"))
        base.pop("fused_clip")
        for suffix, variant in (("optim16", "fp32-master"), ("optim16-mantissa", "bf16-mantissa")):
            row = settings(f"bf16+compile{bias}+fused-ce+{suffix}+step-graph+no-mix-order")
            assert row == {**base, "optim16": variant}
    o2 = settings("bf16-master+compile+fused-ce+fused-clip+step-graph+no-mix-order")
    assert o2 == {**settings("bf16+compile+fused-ce+fused-clip+step-graph+no-mix-order"), "precision": "bf16-master"}
    # and the bench hands the variant to the trainer
    trainer = make_trainer("bf16+compile+fused-ce+optim16+step-graph+no-mix-order", preset="tiny", batch_size=2,
                           block_size=16, device="cpu", cuda_graph=False, compile=False)
    assert isinstance(trainer.optimizer, AdamW16) and trainer.optimizer.variant == "fp32-master"
    assert next(trainer.model.parameters()).dtype == torch.bfloat16 and trainer.clips_in_optimizer


@pytest.mark.gpu
def test_gpu_a_recording_without_prepared_coefficients_is_refused():
    """Recording a FusedAdamW16 step that would copy its coefficients inside the graph (the copy
    would replay one step's numbers forever) stops with what to do instead."""
    from mpgpt.kernels.adamw16 import FusedAdamW16

    p = torch.nn.Parameter(torch.randn(64, device="cuda").to(torch.bfloat16))
    p.grad = torch.randn_like(p)
    opt = FusedAdamW16([p], variant="fp32-master")
    opt.step()  # eager: fine
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="call optimizer.prepare"):
            with torch.cuda.graph(graph, stream=side):
                opt.step()
