"""The trainer: loss falls, resume is bit-identical, injected faults are skipped, the CLI fails cleanly."""
import copy
import math
import random
import subprocess
import sys
import warnings

import pytest
import torch

from mpgpt.checkpoint import CheckpointError
from mpgpt.scaling import DynamicLossScaler
from mpgpt.train import TrainConfig, Trainer, lr_at, main, train

# A model small enough that a few dozen steps take a second or two on 2 CPU cores.
SMALL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}


def _cfg(**kw):
    base = dict(preset="tiny", steps=12, batch_size=4, progress=False, sample_tokens=0, eval_interval=6,
                eval_batches=2, warmup_steps=3, model_overrides=dict(SMALL), seed=1234)
    base.update(kw)
    return TrainConfig(**base)


def test_lr_schedule_warms_up_then_decays_to_min():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, steps=110)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)       # half way through the cosine
    assert lr_at(110, cfg) == pytest.approx(0.1)


def test_short_run_learns_the_corpus():
    # The tiny preset from the embedded corpus: 150 steps bring the loss from ln(vocab) ~ 3.4 to
    # well below the unigram entropy of the text (measured ~2.2 at 150 steps; bound leaves margin).
    hist = train(TrainConfig(steps=150, batch_size=16, progress=False, sample_tokens=50, eval_interval=150,
                             eval_batches=4))
    assert hist.loss[0] > 3.0
    assert hist.val_loss[-1] < 2.6, hist.val_loss
    assert len(hist.sample) > 0 and not any(hist.skipped)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16-master"])
def test_resume_is_bit_identical(tmp_path, precision):
    full = Trainer(_cfg(precision=precision))
    full.run()
    first = Trainer(_cfg(precision=precision, out_dir=str(tmp_path)))
    first.run(until=5)  # as if killed after step 5
    second = Trainer(_cfg(precision=precision, resume=str(tmp_path / "ckpt.pt")))
    second.load(tmp_path / "ckpt.pt")
    assert second.step == 5
    hist = second.run()
    assert hist.loss == full.history.loss  # exact float equality, step by step
    assert hist.scale == full.history.scale
    for (name, a), b in zip(full.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    if full.master is not None:
        for a, b in zip(full.master.params, second.master.params):
            assert torch.equal(a, b)


def test_resume_refuses_a_different_model_without_touching_it(tmp_path):
    Trainer(_cfg(steps=2, out_dir=str(tmp_path))).run()
    other = Trainer(_cfg(model_overrides={**SMALL, "n_embd": 64}))
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(CheckpointError, match="n_embd"):
        other.load(tmp_path / "ckpt.pt")
    assert all(torch.equal(before[k], v) for k, v in other.model.state_dict().items())
    with pytest.raises(CheckpointError, match="precision"):
        Trainer(_cfg(precision="fp16")).load(tmp_path / "ckpt.pt")


@pytest.mark.parametrize("fused_clip", [False, True])
def test_injected_faults_are_skipped_and_the_scale_follows_the_rules(fused_clip, monkeypatch):
    """inf/nan written into random gradients on random steps of a real fp16 run.

    Each such step must be skipped with the weights untouched, every other step taken, and the scale
    must follow GradScaler's rule: halve on an overflow, double after `growth_interval` clean steps.
    init_scale 2^8 keeps this small model far from real fp16 overflow, so only our faults trip it.
    With the clip inside torch's fused AdamW the gradients are never unscaled in place: the check is
    their norm, and the optimizer skips on the device.
    """
    unscaled = []
    if fused_clip:
        _fused_adamw(Trainer, monkeypatch)
        real_unscale = DynamicLossScaler.unscale_
        monkeypatch.setattr(DynamicLossScaler, "unscale_", lambda self, opt: unscaled.append(1) or real_unscale(self, opt))
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    steps, growth_interval, init = 40, 4, 2.0 ** 8
    faulty = set(rng.sample(range(steps), 8))
    snapshots = {}

    def inject(step, model):
        snapshots[step] = [p.detach().clone() for p in model.parameters()]
        if step in faulty:
            params = [p for p in model.parameters() if p.grad is not None]
            p = rng.choice(params)
            flat = p.grad.view(-1)
            flat[rng.randrange(flat.numel())] = rng.choice([math.inf, -math.inf, math.nan])

    trainer = Trainer(_cfg(precision="fp16", steps=steps, init_scale=init, growth_interval=growth_interval,
                           fused_clip=fused_clip, grad_clip=1.0))
    assert trainer.clips_in_optimizer == fused_clip
    hist = trainer.run(after_backward=inject)
    assert unscaled == []  # the fused path never called unscale_ (the other path is not spied on)
    snapshots[steps] = [p.detach().clone() for p in trainer.model.parameters()]

    assert [s for s, k in zip(hist.step, hist.skipped) if k] == sorted(faulty), f"seed {seed}"
    for s in range(steps):
        unchanged = all(torch.equal(a, b) for a, b in zip(snapshots[s], snapshots[s + 1]))
        assert unchanged == (s in faulty), f"step {s}, seed {seed}"
    scale, tracker, expected = init, 0, []
    for s in range(steps):
        if s in faulty:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == growth_interval:
                scale, tracker = scale * 2.0, 0
        expected.append(scale)
    assert hist.scale == expected, f"seed {seed}"


def test_gradient_accumulation_matches_one_big_batch():
    # Two micro-batches of 4 give the same gradient as one batch of 8 over the same rows, up to
    # fp32 summation order (~1e-6 relative); the first step's weights must agree to that.
    # fp32 on the CPU: on a GPU the default policy is bf16, whose rounding is far above 1e-6.
    a = Trainer(_cfg(steps=1, batch_size=8, grad_accum=1, precision="fp32", device="cpu"))
    b = Trainer(_cfg(steps=1, batch_size=4, grad_accum=2, precision="fp32", device="cpu"))
    x, y = a.data.get_batch("train", 8, a.block_size, generator=torch.Generator().manual_seed(0))
    x, y = x.to(a.device), y.to(a.device)  # the trainers run on the GPU where there is one
    a.batch = lambda split: (x, y)
    halves = iter([(x[:4], y[:4]), (x[4:], y[4:])])
    b.batch = lambda split: next(halves)
    a.run(), b.run()
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--precision", "fp8"], "unknown precision 'fp8'"),
    (["--steps", "-3"], "steps must be a positive integer"),
    (["--block-size", "4096"], "exceeds the tiny preset"),
    (["--data", "/no/such/file.txt"], "does not exist"),
    (["--precision", "tf32", "--device", "cpu"], "use fp32"),
    (["--preset", "huge"], "invalid choice"),
    (["--resume", "/no/such/ckpt.pt", "--steps", "1"], "does not exist"),
    (["--min-scale", "0"], "min_scale must be a finite number > 0"),
    (["--lr", "inf"], "lr must be a finite number > 0"),
    (["--ddp-bucket-mb", "inf"], "ddp_bucket_mb must be > 0 and at most 1e6 MB"),
    (["--out-dir", ""], "out_dir is empty; pass a folder"),
    (["--checkpoint-interval", "5"], "checkpoint_interval needs out_dir; pass --out-dir too"),
    (["--seed", str(2 ** 70)], "seed must lie in [0, 2**63)"),
    (["--device", "meta"], "use --device cpu or cuda"),
    (["--static-scale", "512"], "--static-scale only applies with --scaler static"),
    (["--resume", "."], "is a folder; pass the checkpoint file in it"),
    (["--cuda-graph", "--device", "cpu"], "cuda_graph needs a CUDA device"),
])
def test_cli_errors_are_one_line(capsys, argv, message):
    try:
        code = main(argv + ["--no-progress"])
    except SystemExit as e:  # argparse's own checks (choices, types) exit through our one-line error()
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_cli_subprocess_error_has_no_traceback_and_help_reads_well():
    out = subprocess.run([sys.executable, "-m", "mpgpt.train", "--precision", "fp9"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith("python -m mpgpt.train: error: unknown precision")
    helptext = subprocess.run([sys.executable, "-m", "mpgpt.train", "--help"], capture_output=True, text=True)
    assert helptext.returncode == 0
    for flag in ["--preset", "--precision", "--scaler", "--steps", "--batch-size", "--compile", "--out-dir",
                 "--resume"]:
        assert flag in helptext.stdout


def test_cli_short_run_prints_a_sample(tmp_path, capsys):
    code = main(["--steps", "3", "--batch-size", "2", "--no-progress", "--sample-tokens", "20",
                 "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "--- sample ---" in out and "trained 3 steps" in out
    assert (tmp_path / "ckpt.pt").is_file()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [None, "fp16", "fp16-master", "bf16", "bf16-master", "tf32"])
def test_gpu_policies_train_the_tiny_model(precision):
    """Every policy the GPU supports learns the corpus about as well as the CPU's fp32 reference.

    Same bound as test_short_run_learns_the_corpus: lower precision must not cost the tiny model
    its learning. Policies the GPU cannot run (bf16 below sm_80) must be refused, not run.
    """
    from mpgpt.precision import resolve_precision

    try:
        resolve_precision(precision, "cuda")
    except ValueError:
        pytest.skip(f"{precision} not supported on {torch.cuda.get_device_name()}")
    hist = train(TrainConfig(steps=150, batch_size=16, progress=False, sample_tokens=20, eval_interval=150,
                             eval_batches=4, precision=precision, device="cuda"))
    assert hist.val_loss[-1] < 2.6, (precision, hist.val_loss)
    assert sum(hist.skipped) <= 20, hist.skipped  # only the dynamic scaler's first overflows from 2^16


@pytest.mark.gpu
def test_gpu_autocast_logits_match_fp32_reference():
    # Relative error of the logits against the fp32 model: autocast rounds matmul inputs to 16 bits
    # (bf16: 8 significant bits, eps 2^-8; fp16: 11 bits, eps 2^-11) and the errors add over layers.
    from mpgpt.model import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tiny", vocab_size=64)).cuda()
    idx = torch.randint(0, 64, (4, 64), device="cuda")
    with torch.no_grad():
        torch.backends.cuda.matmul.allow_tf32 = False
        ref, _ = model(idx)
        for dtype, tol in [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)]:
            if dtype is torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
                continue
            with torch.autocast("cuda", dtype=dtype):
                out, _ = model(idx)
            rel = (out.float() - ref).norm() / ref.norm()
            assert rel < tol, (dtype, rel.item())


def test_resume_refuses_a_different_batch_size(tmp_path):
    # A different batch size would silently change the data stream instead of continuing it.
    Trainer(_cfg(steps=2, out_dir=str(tmp_path))).run()
    with pytest.raises(CheckpointError, match="global batch of 4 sequences.*use --batch-size 4"):
        Trainer(_cfg(batch_size=8)).load(tmp_path / "ckpt.pt")


def test_gradient_norm_is_reported_and_clipping_applies_only_when_asked():
    # One step with clipping to a tiny max norm and one without. Both report the pre-clipping norm
    # (checked against a float64 computation); what AdamW received shows in its first moment,
    # exp_avg = (1 - beta1) * gradient after step 1: clipped to 1e-3 only when asked.
    for clip in (0.0, 1e-3):
        t = Trainer(_cfg(grad_clip=clip, lr=1e-2, warmup_steps=0))
        grads = {}
        _, grad_norm, _ = t.train_step(after_backward=lambda step, model: grads.update(
            g=[p.grad.detach().double().clone() for p in t.params]))
        expected = torch.sqrt(sum((g ** 2).sum() for g in grads["g"])).item()
        assert expected > 1e-2  # so that clipping to 1e-3 does something
        assert math.isclose(grad_norm.item(), expected, rel_tol=1e-5)
        m = torch.sqrt(sum((t.optimizer.state[p]["exp_avg"].double() ** 2).sum() for p in t.params)).item()
        received = m / (1 - t.cfg.beta1)
        assert math.isclose(received, clip if clip else expected, rel_tol=1e-4), (clip, received)



def _fused_adamw(trainer_cls, monkeypatch):
    """Make Trainer build torch's fused AdamW on the CPU too (torch has a CPU fused kernel), so the
    clip-in-the-optimizer path runs here; on CUDA the trainer builds it itself."""
    def build(self, named_params):
        from mpgpt.trainer import param_groups
        return torch.optim.AdamW(param_groups(named_params, self.cfg.weight_decay), lr=self.cfg.lr,
                                 betas=(self.cfg.beta1, self.cfg.beta2), fused=True)
    monkeypatch.setattr(trainer_cls, "build_optimizer", build)


@pytest.mark.parametrize("precision,scaler", [("fp32", "none"), ("fp32", "dynamic")])
def test_clipping_inside_the_fused_optimizer_matches_clip_grad_norm(monkeypatch, precision, scaler):
    # Eight steps clipped to 1e-2 (the gradients' norm is far above it, so every step clips) with
    # clip_grad_norm_ and with the factor handed to the fused AdamW kernel. The two differ only in
    # rounding (a division instead of a multiplication by the reciprocal): after 8 steps of lr 1e-2
    # that is far below 1e-5 of a weight, while skipping the clip moves the weights by ~1e-2.
    _fused_adamw(Trainer, monkeypatch)
    weights, norms = {}, {}
    for fused, clip in ((False, 1e-2), (True, 1e-2), (True, 0.0)):
        torch.manual_seed(0)
        t = Trainer(_cfg(grad_clip=clip, fused_clip=fused, lr=1e-2, warmup_steps=0, precision=precision, scaler=scaler))
        assert t.clips_in_optimizer == (fused and clip > 0)
        norms[fused, clip] = [t.train_step()[1].item() for _ in range(8)]
        assert not hasattr(t.optimizer, "grad_scale")           # the factor does not outlive its step
        weights[fused, clip] = torch.cat([p.detach().flatten() for p in t.params])
    assert min(norms[True, 1e-2]) > 10 * 1e-2                     # every step clipped, by 10x or more
    assert torch.allclose(weights[True, 1e-2], weights[False, 1e-2], rtol=0, atol=1e-5)
    assert (weights[True, 0.0] - weights[False, 1e-2]).abs().max() > 1e-3   # the clip did something


def test_clipping_stays_outside_optimizers_that_cannot_take_it(monkeypatch):
    # The CPU trainer builds the foreach AdamW, which ignores grad_scale: fused_clip must fall back
    # to clip_grad_norm_ there, not silently drop the clip. So must torch's GradScaler, which
    # overwrites grad_scale.
    t = Trainer(_cfg(grad_clip=1e-2, fused_clip=True, device="cpu"))
    assert not t.clips_in_optimizer
    _fused_adamw(Trainer, monkeypatch)
    t = Trainer(_cfg(grad_clip=1e-2, fused_clip=True, precision="fp32", scaler="gradscaler"))
    assert not t.clips_in_optimizer

# ------------------------------------------------------------------------------------------------
# Resume refusals: every check runs before anything is touched
# ------------------------------------------------------------------------------------------------
def _weights(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def _unchanged(trainer, before):
    return all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("optimizer"), "no 'optimizer'"),
    (lambda s: s.pop("rng"), "no 'rng'"),
    (lambda s: s.update(history=[]), "'history' is a list"),
    (lambda s: s["optimizer"]["param_groups"].pop(), "optimizer state does not match"),
    (lambda s: s["history"].update(bogus=[]), "unknown fields"),
], ids=["no-optimizer", "no-rng", "history-list", "optimizer-groups", "history-fields"])
def test_resume_refuses_an_incomplete_checkpoint_without_touching_the_model(tmp_path, damage, message):
    Trainer(_cfg(steps=2, out_dir=str(tmp_path))).run()
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    damage(state)
    fresh = Trainer(_cfg(seed=99))
    before, step = _weights(fresh), fresh.step
    with pytest.raises(CheckpointError, match=message):
        fresh.load_state_dict(state)
    assert _unchanged(fresh, before) and fresh.step == step


def test_resume_refuses_a_checkpoint_with_no_steps_left(tmp_path):
    Trainer(_cfg(steps=4, out_dir=str(tmp_path))).run()
    for steps in (4, 3):  # at the end already, or past a shorter --steps: nothing would be trained
        with pytest.raises(CheckpointError, match=f"already at step 4 .* pass a larger --steps"):
            Trainer(_cfg(steps=steps)).load(tmp_path / "ckpt.pt")
    Trainer(_cfg(steps=5)).load(tmp_path / "ckpt.pt")  # one step left: fine


def test_resume_refuses_text_with_a_different_alphabet(tmp_path):
    from mpgpt.data import TextDataset
    text = "the quick brown fox jumps over the lazy dog\n" * 40
    Trainer(_cfg(steps=2, out_dir=str(tmp_path)), dataset=TextDataset(text)).run()
    other = TextDataset(text.replace("q", "Q"))  # same vocabulary size, different characters
    assert other.tokenizer.vocab_size == TextDataset(text).tokenizer.vocab_size
    fresh = Trainer(_cfg(steps=4), dataset=other)
    before = _weights(fresh)
    with pytest.raises(CheckpointError, match="different alphabet .* same --data"):
        fresh.load(tmp_path / "ckpt.pt")
    assert _unchanged(fresh, before)


# ------------------------------------------------------------------------------------------------
# What a checkpoint holds, and when it is written
# ------------------------------------------------------------------------------------------------
def test_interval_checkpoint_history_holds_every_step_before_it(tmp_path):
    # Steps are logged in batches of log_interval; a checkpoint between two batches must still hold
    # every step before it, or a resumed run's History has a hole.
    t = Trainer(_cfg(steps=12, out_dir=str(tmp_path), checkpoint_interval=5, log_interval=4))
    saved = []
    t.save = lambda path: saved.append(copy.deepcopy(t.state_dict()))
    t.run()
    assert [s["step"] for s in saved] == [5, 10, 12]
    for s in saved:
        assert s["history"]["step"] == list(range(s["step"])), s["history"]["step"]


def test_final_checkpoint_is_written_before_the_sample(tmp_path, monkeypatch):
    t = Trainer(_cfg(steps=3, out_dir=str(tmp_path), sample_tokens=10))

    def broken_sample(*a, **k):
        raise RuntimeError("sampling failed")

    monkeypatch.setattr(t, "sample", broken_sample)
    with pytest.raises(RuntimeError, match="sampling failed"):
        t.run()
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 3  # the training is kept


def test_unusable_out_dir_is_refused_before_training(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        Trainer(_cfg(out_dir=str(a_file)))
    code = main(["--steps", "2", "--batch-size", "2", "--no-progress", "--sample-tokens", "0",
                 "--out-dir", str(a_file / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "pass a folder" in err, err
    assert a_file.read_text() == "x"


def test_cli_refuses_a_device_it_does_not_support_with_what_to_use(capsys):
    code = main(["--device", "mps", "--steps", "1", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "use --device cpu or cuda" in err, err


# ------------------------------------------------------------------------------------------------
# Precision on a CPU: what the README promises
# ------------------------------------------------------------------------------------------------
def test_readme_and_cli_agree_on_which_precisions_a_cpu_runs(capsys):
    from pathlib import Path
    from mpgpt.precision import POLICIES, resolve_precision
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    refused = []
    for name in POLICIES:
        try:
            resolve_precision(name, "cpu")
        except ValueError:
            refused.append(name)
    assert refused == ["tf32"]
    assert "(`tf32` on a CPU, `bf16` on a GPU older than sm_80) is refused" in readme
    assert "on a CPU every other precision runs" in readme
    code = main(["--precision", "fp16", "--device", "cpu", "--steps", "2", "--batch-size", "2",
                 "--no-progress", "--sample-tokens", "0", "--eval-interval", "2"])
    assert code == 0 and "with fp16" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# Reproducibility on a CPU with 2 threads
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def test_resume_with_two_threads_is_bit_identical_and_records_the_thread_count(tmp_path, two_threads):
    cfg = dict(precision="fp16", model_overrides={**SMALL, "n_layer": 2}, batch_size=8, device="cpu")  # CPU threads matter on a CPU
    full = Trainer(_cfg(**cfg))
    full.run()
    Trainer(_cfg(out_dir=str(tmp_path), **cfg)).run(until=5)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["cpu_threads"] == 2
    second = Trainer(_cfg(**cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same thread count: no warning
        second.load(tmp_path / "ckpt.pt")
    second.run()
    assert second.history.loss == full.history.loss
    assert all(torch.equal(a, b) for a, b in zip(full.model.state_dict().values(), second.model.state_dict().values()))
    # LayerNorm's CPU backward sums per-thread partials: another thread count changes the last bits,
    # and resuming with one says so instead of silently breaking the bit-for-bit promise.
    torch.set_num_threads(1)
    with pytest.warns(UserWarning, match="2 CPU threads .* not be bit-identical .* OMP_NUM_THREADS=2"):
        Trainer(_cfg(**cfg)).load(tmp_path / "ckpt.pt")


def test_cli_summary_after_a_resume_counts_this_runs_steps_and_keeps_the_history(tmp_path, capsys):
    # Killed at step 7 with the last checkpoint at step 5 (log_interval 10: nothing logged yet by then).
    cfg = TrainConfig(steps=15, batch_size=2, progress=False, sample_tokens=0, eval_interval=100,
                      out_dir=str(tmp_path), checkpoint_interval=5)

    def killed(step, model):
        if step == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg).run(after_backward=killed)
    code = main(["--resume", str(tmp_path / "ckpt.pt"), "--steps", "15", "--batch-size", "2", "--no-progress",
                 "--sample-tokens", "0", "--eval-interval", "100"])
    out = capsys.readouterr().out
    assert code == 0 and "trained 10 steps (resumed at step 5; 15 in all)" in out, out


# ------------------------------------------------------------------------------------------------
# Every part of a checkpoint validated before anything is loaded; the resume policy; output paths
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp16_state(tmp_path_factory):
    """A checkpoint of a short fp16 run with dynamic loss scaling (it has scaler and Adam state)."""
    folder = tmp_path_factory.mktemp("fp16")
    Trainer(_cfg(precision="fp16", steps=3, out_dir=str(folder))).run()
    return torch.load(folder / "ckpt.pt", weights_only=True)


def _adam(state):
    return next(iter(state["optimizer"]["state"].values()))


DAMAGES = {
    "scale-nan": (lambda s: s["scaler"].update(scale=float("nan")), "scale must be a positive number"),
    "scale-inf": (lambda s: s["scaler"].update(scale=float("inf")), "scale must be a positive number"),
    "scale-negative": (lambda s: s["scaler"].update(scale=-5.0), "scale must be a positive number"),
    "scale-zero": (lambda s: s["scaler"].update(scale=0.0), "scale must be a positive number"),
    "scale-str": (lambda s: s["scaler"].update(scale="big"), "scale must be a positive number"),
    "growth-interval-0": (lambda s: s["scaler"].update(growth_interval=0), "growth_interval must be an integer"),
    "growth-interval-float": (lambda s: s["scaler"].update(growth_interval=2.7), "growth_interval must be an int"),
    "growth-factor-small": (lambda s: s["scaler"].update(growth_factor=0.1), "growth_factor must be"),
    "growth-factor-nan": (lambda s: s["scaler"].update(growth_factor=float("nan")), "growth_factor must be"),
    "backoff-3": (lambda s: s["scaler"].update(backoff_factor=3.0), "backoff_factor must lie in"),
    "hysteresis-0": (lambda s: s["scaler"].update(hysteresis=0), "hysteresis must be an integer"),
    "min-scale-above": (lambda s: s["scaler"].update(min_scale=1e9), "must lie within"),
    "max-scale-negative": (lambda s: s["scaler"].update(max_scale=-1.0), "max_scale must be a positive"),
    "tracker-negative": (lambda s: s["scaler"].update(_growth_tracker=-10 ** 6), "_growth_tracker must be"),
    "tracker-huge": (lambda s: s["scaler"].update(_growth_tracker=10 ** 12), "_growth_tracker must be"),
    "rng-torch-cut": (lambda s: s["rng"].update(torch=s["rng"]["torch"][:100]), "random-number-generator"),
    "rng-python": (lambda s: s["rng"].update(python=[3, [1, 2, 3], None]), "random-number-generator"),
    "adam-shape": (lambda s: _adam(s).update(exp_avg=torch.zeros(3)), "exp_avg is \\(3,\\)"),
    "adam-nan": (lambda s: _adam(s)["exp_avg"].view(-1).__setitem__(0, float("nan")), "exp_avg is not finite"),
    "adam-negative": (lambda s: _adam(s)["exp_avg_sq"].view(-1).__setitem__(0, -1.0), "negative entries"),
    "adam-step": (lambda s: _adam(s).update(step=torch.tensor(float("nan"))), "step count"),
    "betas": (lambda s: s["optimizer"]["param_groups"][0].update(betas=(5.0, -1.0)), "betas \\(5.0, -1.0\\)"),
    "eps": (lambda s: s["optimizer"]["param_groups"][0].update(eps=0.0), "eps 0.0"),
    "weight-nan": (lambda s: s["model"]["lm_head.weight"].view(-1).__setitem__(0, float("nan")), "inf or nan"),
    "weight-dtype": (lambda s: s["model"].update({"lm_head.weight": s["model"]["lm_head.weight"].double()}),
                     "is torch.float64"),
    "train-config-empty": (lambda s: s.update(train_config={}), "batch size is missing"),
    "train-config-str": (lambda s: s["train_config"].update(batch_size="four"), "batch size is missing"),
    "train-config-seed": (lambda s: s["train_config"].update(seed="x"), "train_config seed is 'x'"),
    "train-config-steps": (lambda s: s["train_config"].update(steps=None), "train_config steps is None"),
    "train-config-lr": (lambda s: s["train_config"].update(lr=float("inf")), "train_config: lr must be a finite"),
    "train-config-no-lr": (lambda s: s["train_config"].pop("lr"), "train_config has no lr"),
    "history-short": (lambda s: s["history"]["loss"].pop(), "history's 'loss' holds 2 steps"),
}


@pytest.mark.parametrize("name", list(DAMAGES))
def test_every_damaged_part_is_refused_in_one_line_before_anything_is_loaded(fp16_state, name):
    damage, message = DAMAGES[name]
    state = copy.deepcopy(fp16_state)
    damage(state)
    fresh = Trainer(_cfg(precision="fp16", steps=4))
    fresh.run(until=1)  # live optimizer and scaler state, so "untouched" means something
    weights, scaler = _weights(fresh), fresh.scaler.state_dict()
    adam = copy.deepcopy(fresh.optimizer.state_dict())
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=message) as info:
        fresh.load_state_dict(state)
    assert len(str(info.value).splitlines()) == 1
    assert _unchanged(fresh, weights) and fresh.scaler.state_dict() == scaler and fresh.step == 1
    moments = lambda sd: next(iter(sd["state"].values())).values()  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(moments(adam), moments(fresh.optimizer.state_dict())))
    assert torch.equal(rng, torch.get_rng_state())


def test_resume_refuses_settings_that_change_the_run_and_names_the_flags(tmp_path, capsys):
    base = ["--steps", "4", "--batch-size", "2", "--block-size", "16", "--no-progress", "--sample-tokens", "0"]
    assert main(base + ["--steps", "2", "--out-dir", str(tmp_path)]) == 0
    ckpt = tmp_path / "ckpt.pt"
    before = ckpt.read_bytes()
    capsys.readouterr()
    for flags, named in [(["--seed", "7"], "--seed 1337"), (["--grad-accum", "2"], "--grad-accum 1"),
                         (["--min-scale", "2"], "--min-scale 1.0"), (["--data", str(_text(tmp_path))], "--data")]:
        assert main(base + ["--resume", str(ckpt), "--out-dir", str(tmp_path)] + flags) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and named in err and "pass the checkpoint's values" in err, err
    fp16 = ["--precision", "fp16", "--scaler", "static"]
    assert main(base + fp16 + ["--steps", "2", "--out-dir", str(tmp_path / "s")]) == 0
    assert main(base + fp16 + ["--resume", str(tmp_path / "s" / "ckpt.pt"), "--static-scale", "64"]) == 2
    assert "--static-scale 1024.0" in capsys.readouterr().err
    assert ckpt.read_bytes() == before


def _text(folder):
    from mpgpt.data import default_corpus

    path = folder / "other.txt"
    path.write_text(default_corpus()[::-1])  # another text with the same alphabet
    return path


def test_resume_with_a_lower_lr_is_noted_and_recorded(tmp_path, capsys):
    base = ["--batch-size", "2", "--block-size", "16", "--no-progress", "--sample-tokens", "0",
            "--out-dir", str(tmp_path)]
    assert main(base + ["--steps", "2"]) == 0
    assert main(base + ["--steps", "4", "--lr", "1e-4", "--resume", str(tmp_path / "ckpt.pt")]) == 0
    err = capsys.readouterr().err
    assert "note: resuming with --lr 0.0001 (was 0.002) from step 2: the run is no longer bit-identical" in err
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["train_config"]["lr"] == 1e-4 and state["train_config"]["steps"] == 4
    assert state["resume_changes"] == ["--lr 0.0001 (was 0.002) from step 2", "--steps 4 (was 2) from step 2"]


def test_help_states_the_resume_policy():
    text = subprocess.run([sys.executable, "-m", "mpgpt.train", "--help"], capture_output=True, text=True).stdout
    flat = " ".join(text.split())
    assert "Refused: a different --preset" in flat and "--grad-accum" in flat and "--seed" in flat
    assert "Accepted with a note that the run is no longer bit-identical" in flat and "--lr" in flat


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "out").symlink_to(d / "nowhere"), "is a broken symbolic link"),
    (lambda d: (d / "out" / "ckpt.pt").mkdir(parents=True), "ckpt.pt is a folder, where the checkpoint goes"),
    (lambda d: ((d / "out").mkdir(), (d / "out" / "ckpt.pt").symlink_to(d / "nowhere")), "broken symbolic link"),
    (lambda d: (d / "out").write_text("x"), "is a file, not a folder"),
], ids=["dangling-out-dir", "ckpt-is-a-folder", "dangling-ckpt", "out-dir-is-a-file"])
def test_output_paths_that_cannot_take_a_checkpoint_are_refused_before_training(tmp_path, make, message):
    make(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        Trainer(_cfg(out_dir=str(tmp_path / "out")))


def test_an_out_dir_that_cannot_be_written_is_refused_before_training(capsys):
    code = main(["--steps", "2", "--batch-size", "2", "--no-progress", "--out-dir", "/proc/mpgpt-run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "is not writable" in err, err


def test_a_new_run_does_not_overwrite_another_runs_checkpoint(tmp_path):
    Trainer(_cfg(steps=2, out_dir=str(tmp_path))).run()
    before = (tmp_path / "ckpt.pt").read_bytes()
    with pytest.raises(CheckpointError, match="holds another run's checkpoint; continue it with --resume"):
        Trainer(_cfg(steps=2, out_dir=str(tmp_path))).run()
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    resumed = Trainer(_cfg(steps=4, out_dir=str(tmp_path)))
    resumed.load(tmp_path / "ckpt.pt")
    resumed.run()  # continuing it is fine


def test_a_folder_held_by_another_run_is_refused(tmp_path):
    from mpgpt.checkpoint import folder_lock

    with folder_lock(tmp_path):  # as another process running in it would hold it
        with pytest.raises(CheckpointError, match="is in use by another run"):
            Trainer(_cfg(steps=2, out_dir=str(tmp_path))).run()
    assert not (tmp_path / "ckpt.pt").exists()
    Trainer(_cfg(steps=2, out_dir=str(tmp_path))).run()  # free again once the holder is done


@pytest.mark.parametrize("argv, message", [
    (["--lr", "1e39"], "pass another --lr"),
    (["--sample-tokens", "100000000"], "pass a smaller --sample-tokens"),
    (["--min-scale", "1e6"], "lower --min-scale to at most 65536"),
    (["--scaler", "static", "--static-scale", "3e38"], "--static-scale 3e+38 cannot train"),
])
def test_more_cli_refusals_name_the_flag(capsys, argv, message):
    assert main(argv + ["--no-progress", "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "init-scale" not in err, err


def test_cli_resume_from_a_damaged_checkpoint_is_one_line(tmp_path, capsys):
    base = ["--batch-size", "2", "--block-size", "16", "--no-progress", "--sample-tokens", "0"]
    assert main(base + ["--steps", "2", "--out-dir", str(tmp_path)]) == 0
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    state["train_config"] = {}
    torch.save(state, tmp_path / "bad.pt")
    capsys.readouterr()
    assert main(base + ["--steps", "4", "--resume", str(tmp_path / "bad.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "incomplete or damaged" in err, err
