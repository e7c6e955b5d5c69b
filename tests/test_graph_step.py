"""The whole step recorded as a CUDA graph (TrainConfig.cuda_graph): it trains exactly as the
step it records, resumes from a checkpoint, and is refused where it cannot work."""
import pytest
import torch

from mpgpt.graph_step import GraphedStep
from mpgpt.train import TrainConfig, Trainer

SMALL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}


def _cfg(**kw):
    # warmup_steps=6 changes the learning rate at every step of the first six: a recorded step that
    # kept the rate it was recorded with would train differently from the eager one.
    base = dict(preset="tiny", steps=12, batch_size=8, progress=False, sample_tokens=0, eval_interval=100,
                eval_batches=2, warmup_steps=6, model_overrides=dict(SMALL), seed=4321, log_interval=5)
    base.update(kw)
    return TrainConfig(**base)


# ------------------------------------------------------------------------------------ refused
def test_cuda_graph_on_the_cpu_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device.*leave cuda_graph off"):
        Trainer(_cfg(cuda_graph=True, device="cpu"))


def test_cuda_graph_with_compile_cudagraphs_is_refused():
    with pytest.raises(ValueError, match="use compile_mode 'default' with it"):
        _cfg(cuda_graph=True, compile=True, compile_mode="reduce-overhead").validate()


def test_cuda_graph_under_torchrun_is_refused_before_any_process_group():
    from mpgpt.distributed import DistributedTrainer

    with pytest.raises(ValueError, match="leave it off under torchrun"):
        DistributedTrainer(_cfg(cuda_graph=True, device="cpu"))


def test_graphed_step_needs_a_warmup():
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        GraphedStep(lambda batches: (), warmup=0)


class _FakeGraph:
    """Stands in for a recorded torch.cuda.CUDAGraph on the CPU: counts replays."""
    replays = 0

    def replay(self):
        self.replays += 1


def test_a_recorded_step_refuses_a_batch_of_another_shape():
    step = GraphedStep(lambda batches: (torch.zeros(()),))
    step.graph = _FakeGraph()
    step.inputs = [(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))]
    step.outputs = (torch.ones(()),)
    x = torch.randint(0, 9, (4, 8))
    out = step([(x, x)])  # the right shape: copied into the buffers, replayed, outputs copied out
    assert step.graph.replays == 1 and torch.equal(step.inputs[0][0], x) and out[0] is not step.outputs[0]
    with pytest.raises(ValueError, match="batches of shape \\(4, 8\\), got \\(2, 8\\); a CUDA-graph step needs a fixed"):
        step([(x[:2], x[:2])])
    with pytest.raises(ValueError, match="takes 1 micro-batches, got 2"):
        step([(x, x), (x, x)])
    assert step.graph.replays == 1  # nothing replayed on refused input


def test_after_backward_hooks_are_refused_in_a_recorded_step():
    t = Trainer(_cfg(device="cpu"))
    t.graphed = GraphedStep(t._step_body)  # as cuda_graph=True would set it on a GPU
    with pytest.raises(ValueError, match="after_backward cannot run inside a step recorded as a CUDA graph"):
        t.train_step(after_backward=lambda step, model: None)


def test_distributed_bench_refuses_the_recorded_step():
    from mpgpt.bench.ddp import check_supported

    with pytest.raises(ValueError, match="cuda_graph"):
        check_supported("bf16+compile+step-graph")


# ------------------------------------------------------------------------------------ on the GPU
def _losses(trainer):
    return torch.tensor(trainer.run().loss)


@pytest.mark.gpu
def test_gpu_recorded_step_rejects_torchs_gradscaler():
    with pytest.raises(ValueError, match="cannot record a step with GradScalerAdapter.*--scaler dynamic"):
        Trainer(_cfg(cuda_graph=True, device="cuda", precision="fp16", scaler="gradscaler"))


@pytest.mark.gpu
def test_gpu_recorded_fp16_step_scales_and_skips_like_the_eager_one():
    """fp16 with the dynamic loss scaler, from 2^24 so that the first steps overflow and are
    skipped: the recorded step must skip the same steps, back the scale off to the same values and
    take the same losses as the eager step (tolerance as in the comparison above)."""
    kw = dict(device="cuda", precision="fp16", scaler="dynamic", init_scale=2.0 ** 24, growth_interval=4)
    eager, graphed = Trainer(_cfg(**kw)), Trainer(_cfg(cuda_graph=True, **kw))
    le, lg = _losses(eager), _losses(graphed)
    assert graphed.graphed.recorded
    assert eager.history.skipped == graphed.history.skipped and any(eager.history.skipped)
    assert not all(eager.history.skipped[4:])  # skipped early, then steps are taken again
    assert eager.history.scale == graphed.history.scale
    assert len(set(graphed.history.scale)) > 2  # the scale moved: backed off, then grew
    torch.testing.assert_close(lg, le, rtol=1e-4, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_recorded_step_trains_like_the_eager_step(precision):
    """Twelve steps recorded (3 warm-up, 1 recorded, 8 replayed) against the same twelve run eagerly.

    The replay launches the kernels the eager step launched, on the same data, so the two runs
    differ only where the GPU's own order of floating-point additions differs between launches
    (the embedding gradient's atomics) and in the learning rate's rounding: read from an fp32
    tensor instead of passed as a double. 1e-4 relative on each loss and on the weights allows for
    that; a replay that skipped the batch copy or kept a stale learning rate misses it by orders
    of magnitude (the test below of a stale rate shows how far)."""
    if precision == "bf16" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs sm_80 or newer")
    eager = Trainer(_cfg(device="cuda", precision=precision))
    graphed = Trainer(_cfg(device="cuda", precision=precision, cuda_graph=True))
    le, lg = _losses(eager), _losses(graphed)
    assert graphed.graphed.recorded
    torch.testing.assert_close(lg, le, rtol=1e-4, atol=0)
    for pe, pg in zip(eager.params, graphed.params):
        torch.testing.assert_close(pg, pe, rtol=1e-4, atol=1e-6)
    assert lg[-1] < lg[0] - 0.3, lg  # and it learns: not two runs that both stood still


@pytest.mark.gpu
def test_gpu_a_stale_learning_rate_would_be_caught():
    """The tolerance above is meaningful: a recording that kept its first learning rate (the float
    baked into the kernel's arguments) trains measurably differently during the warm-up ramp."""
    eager = Trainer(_cfg(device="cuda", precision="fp32"))
    graphed = Trainer(_cfg(device="cuda", precision="fp32", cuda_graph=True))
    graphed._set_lr = lambda lr: None  # the rate never changes after construction
    le, lg = _losses(eager), _losses(graphed)
    assert ((lg - le).abs() / le).max() > 1e-3


@pytest.mark.gpu
def test_gpu_recorded_step_compiled_with_fused_loss_and_clip():
    """The bench's fastest configuration on a small model: compiled, the fused classifier kernel and
    the clip inside AdamW, recorded. Same tolerance and reason as the eager comparison."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs sm_80 or newer")
    from mpgpt.fast import convert
    from mpgpt.model import GPT, GPTConfig

    def build(**kw):
        cfg = _cfg(device="cuda", precision="bf16", compile=True, fused_clip=True, grad_clip=0.05, **kw)
        torch.manual_seed(0)  # the same initial weights for both trainers
        model = convert(GPT(GPTConfig.preset("tiny", vocab_size=128, **SMALL)), fused_loss=True)
        from mpgpt.data import TextDataset, default_corpus
        return Trainer(cfg, model=model, dataset=TextDataset(default_corpus()))

    eager, graphed = build(), build(cuda_graph=True)
    assert graphed.clips_in_optimizer
    le, lg = _losses(eager), _losses(graphed)
    torch.testing.assert_close(lg, le, rtol=1e-4, atol=0)
    assert max(eager.history.grad_norm) > 0.05  # the clip acted


@pytest.mark.gpu
def test_gpu_recorded_step_resumes_from_a_checkpoint(tmp_path):
    """Six steps, a checkpoint, six more in a new trainer: the same losses as twelve in one go (the
    resumed trainer records its step again, with the loaded optimizer state)."""
    whole = _losses(Trainer(_cfg(device="cuda", precision="fp32", cuda_graph=True)))
    first = Trainer(_cfg(device="cuda", precision="fp32", cuda_graph=True, out_dir=str(tmp_path)))
    first.run(until=6)
    second = Trainer(_cfg(device="cuda", precision="fp32", cuda_graph=True))
    second.load(tmp_path / "ckpt.pt")
    resumed = torch.tensor(second.run().loss)
    torch.testing.assert_close(resumed, whole, rtol=1e-4, atol=0)
    assert second.graphed.recorded and isinstance(second.optimizer.param_groups[0]["lr"], torch.Tensor)


def test_each_step_graph_row_is_its_base_row_recorded():
    """The bench's +step-graph rows change one thing against the row before them on the ladder."""
    from mpgpt.bench.training import make_trainer
    from mpgpt.recipe import parse
    from recipe_signature import old_rows

    rows = [name for name in old_rows() if name.endswith("+step-graph")]
    assert len(rows) >= 4
    for name in rows:
        base = name[: -len("+step-graph")]
        assert parse(name).settings() == {**parse(base).settings(), "cuda_graph": True}, name
    # and the bench hands the option to the trainer (which refuses it on the CPU)
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
        make_trainer("bf16+compile+step-graph", preset="tiny", batch_size=2, block_size=16, device="cpu")
