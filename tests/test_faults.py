"""Divergence stops a run loudly and keeps the last good checkpoint; killed and resumed runs end bit-exact.

The acceptance test at the bottom runs tests/fault_driver.py in subprocesses: inf/nan injected into
random gradients on random steps, SIGKILL at random points of random checkpoint writes, a resume after
each kill; the final weights must equal an uninterrupted run's bit for bit, with no temporary files left.
The subprocesses run with OMP_NUM_THREADS=1: bit-exact CPU results hold at a fixed thread count
(see test_resume_with_two_threads_is_bit_identical_and_records_the_thread_count for 2 threads).
"""
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpgpt import checkpoint
from mpgpt.model import GPT, GPTConfig
from mpgpt.precision import resolve_precision
from mpgpt.train import TrainConfig, Trainer, main
from mpgpt.trainer import STALL_STEPS, DivergenceError, usable_static_scales

SMALL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}
DRIVER = Path(__file__).with_name("fault_driver.py")


def _cfg(**kw):
    base = dict(preset="tiny", steps=12, batch_size=4, progress=False, sample_tokens=0, eval_interval=6,
                eval_batches=2, warmup_steps=3, model_overrides=dict(SMALL), seed=1234, log_interval=4)
    base.update(kw)
    return TrainConfig(**base)


def _all_finite(state):
    return all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_nonfinite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    def poison_weights(step, model):  # after step 6's backward: from step 7 on every loss is nan
        if step == 6:
            with torch.no_grad():
                model.transformer.wte.weight[0, 0] = float("nan")

    t = Trainer(_cfg(precision="fp32", out_dir=str(tmp_path), checkpoint_interval=2, sample_tokens=20))
    with pytest.raises(DivergenceError, match="diverged at step 7: the loss is nan; the last good checkpoint"):
        t.run(after_backward=poison_weights)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["step"] == 6 and _all_finite(state["model"])  # the one before, not a nan one
    assert checkpoint.temporary_files(tmp_path / "ckpt.pt") == []
    assert t.history.sample == ""  # no sample of a diverged model


def test_unchecked_nonfinite_gradient_stops_the_run(tmp_path):
    # fp32 has no loss scaler, so nothing skips an inf gradient: the update writes nan into the weights.
    def inf_grad(step, model):
        if step == 3:
            model.transformer.wte.weight.grad[0, 0] = float("inf")

    t = Trainer(_cfg(precision="fp32", out_dir=str(tmp_path), checkpoint_interval=3))
    with pytest.raises(DivergenceError, match="step 3: the gradient norm is (inf|nan)"):
        t.run(after_backward=inf_grad)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["step"] == 3 and _all_finite(state["model"])


def test_trainer_dynamic_scaler_has_a_floor_and_a_collapse_stops_the_run(tmp_path):
    assert Trainer(_cfg(precision="fp16")).scaler.min_scale == 1.0  # the default floor

    def overflow_always(step, model):
        model.transformer.wte.weight.grad[0, 0] = float("inf")

    # 2**4 -> 2**3 ... -> 2**0 = min_scale after 4 overflows; the 5th wants 0.5: diverged.
    t = Trainer(_cfg(precision="fp16", init_scale=16.0, out_dir=str(tmp_path), checkpoint_interval=2))
    with pytest.raises(DivergenceError, match="step 4: gradients still overflow at the loss scale's floor"):
        t.run(after_backward=overflow_always)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 4
    assert t.scaler.get_scale() == 1.0  # clamped, never 0


def test_cli_divergence_is_one_line_and_exits_nonzero(tmp_path, capsys):
    code = main(["--steps", "6", "--batch-size", "2", "--lr", "1e30", "--no-progress", "--sample-tokens", "20",
                 "--eval-interval", "100", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "diverged at step" in err and "lower --lr" in err, err
    assert not (tmp_path / "ckpt.pt").exists()  # no checkpoint of the diverged weights
    assert checkpoint.temporary_files(tmp_path / "ckpt.pt") == []


def _start(out_dir, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.Popen([sys.executable, str(DRIVER), str(out_dir), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _drive(out_dir, *args):
    proc = _start(out_dir, *args)
    _, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


def test_sigkill_during_checkpoint_writes_with_injected_faults_resumes_bit_exact(tmp_path):
    reference = _start(tmp_path / "reference")  # the uninterrupted run, beside the killed ones
    run, rng, kills = tmp_path / "killed", random.Random(2024), 0
    for _ in range(3):  # bounded: three kills at random saves and random points of the write
        phase = rng.choice(["write", "write", "replace", "dirsync"])
        out = _drive(run, "--kill-at-save", str(rng.randint(1, 4)), "--kill-phase", phase,
                     "--kill-fraction", f"{rng.uniform(0.05, 0.95):.3f}")
        assert out.returncode == -9, (phase, out.returncode, out.stderr)  # SIGKILLed, not a Python error
        kills += 1
        ckpt = run / "ckpt.pt"
        if ckpt.exists():
            checkpoint.load_checkpoint(ckpt)  # whatever survived a kill is a whole, loadable checkpoint
    final = _drive(run)  # the last resume runs to the end
    assert final.returncode == 0, final.stderr
    _, stderr = reference.communicate(timeout=120)
    assert reference.returncode == 0, stderr
    expected = torch.load(tmp_path / "reference" / "final.pt", weights_only=True)
    expected_hist = torch.load(tmp_path / "reference" / "history.pt", weights_only=True)
    assert any(expected_hist["skipped"]) and not all(expected_hist["skipped"])  # faults were injected
    got = torch.load(run / "final.pt", weights_only=True)
    assert kills == 3 and got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    hist = torch.load(run / "history.pt", weights_only=True)
    assert hist["loss"] == expected_hist["loss"] and hist["scale"] == expected_hist["scale"]
    assert hist["skipped"] == expected_hist["skipped"]
    assert checkpoint.temporary_files(run / "ckpt.pt") == []
    assert sorted(p.name for p in run.iterdir()) == ["ckpt.pt", "final.pt", "history.pt"]


# ------------------------------------------------------------------------------------------------
# A checkpoint only from a good state; a run that cannot learn stops; SIGTERM is handled like Ctrl-C
# ------------------------------------------------------------------------------------------------
def test_an_update_that_wrecks_finite_weights_is_never_saved_as_the_last_good_checkpoint(tmp_path):
    def blow_up(step, model):  # step 3's update leaves huge but finite weights: step 4's loss is nan
        if step == 3:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(1e30)

    t = Trainer(_cfg(precision="fp32", out_dir=str(tmp_path), checkpoint_interval=2))
    with pytest.raises(DivergenceError, match=r"diverged at step 4: the loss after the update is nan; the last "
                                              r"good checkpoint \(step 2\) is kept at"):
        t.run(after_backward=blow_up)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["step"] == 2 and _all_finite(state["model"])
    resumed = Trainer(_cfg(precision="fp32", lr=1e-4))
    resumed.load(tmp_path / "ckpt.pt")
    assert all(math.isfinite(v) for v in resumed.run().loss)  # "lower --lr and resume from it" works


def test_cli_huge_lr_with_a_checkpoint_every_step_keeps_no_diverged_checkpoint(tmp_path, capsys):
    code = main(["--steps", "6", "--batch-size", "4", "--block-size", "32", "--lr", "1e30", "--no-progress",
                 "--sample-tokens", "0", "--eval-interval", "1000", "--out-dir", str(tmp_path),
                 "--checkpoint-interval", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "diverged at step 1" in err, err
    assert "no checkpoint of this run was written" in err and not (tmp_path / "ckpt.pt").exists()


@pytest.mark.parametrize("part", ["weight", "moment", "scale"])
def test_check_state_refuses_a_nonfinite_weight_moment_or_scale(part):
    t = Trainer(_cfg(precision="fp16", steps=4))
    t.run(until=2)
    t.check_state()  # a healthy state passes
    with torch.no_grad():
        if part == "weight":
            t.model.lm_head.weight[0, 0] = float("inf")
        elif part == "moment":
            next(iter(t.optimizer.state.values()))["exp_avg"].view(-1)[0] = float("nan")
        else:
            t.scaler._scale.fill_(float("nan"))
    with pytest.raises(DivergenceError, match={"weight": "model weight .* is not finite", "moment":
                                               "optimizer state is not finite", "scale": "loss scale is nan"}[part]):
        t.check_state()


def test_a_run_whose_steps_are_all_skipped_stops(tmp_path):
    def overflow(step, model):
        model.transformer.wte.weight.grad[0, 0] = float("inf")

    t = Trainer(_cfg(precision="fp32", scaler="static", steps=6))
    with pytest.raises(DivergenceError, match="stalled at step 5: the last 6 steps were all skipped.*lower "
                                              "--static-scale"):
        t.run(after_backward=overflow)


def test_a_run_whose_gradients_are_all_zero_stops():
    def zero(step, model):
        for p in model.parameters():
            p.grad.zero_()

    t = Trainer(_cfg(precision="fp32", scaler="static", steps=40))
    with pytest.raises(DivergenceError, match=f"stalled at step {STALL_STEPS - 1}: the last {STALL_STEPS} steps "
                                              "all had gradients that are exactly zero"):
        t.run(after_backward=zero)


@pytest.mark.parametrize("scale, precision, why", [(1e-30, "fp16", "every gradient would be zero"),
                                                   (3e38, "fp32", "every step would overflow"),
                                                   (1e7, "fp16", "every step would overflow")])
def test_static_scales_that_cannot_train_are_refused_at_the_start(scale, precision, why):
    with pytest.raises(ValueError, match=f"--static-scale .* cannot train in {precision}: {why}.*use a scale in"):
        Trainer(_cfg(precision=precision, scaler="static", static_scale=scale))
    Trainer(_cfg(precision=precision, scaler="static", static_scale=1024.0))  # a usable one is taken


def test_the_lowest_usable_static_scale_is_exact():
    # Below the bound the loss's gradient at the logits rounds to 0 in fp16 and so does every gradient.
    low, _ = usable_static_scales(resolve_precision("fp16", "cpu"), 4 * 32, 65)
    for factor, zero in [(0.95, True), (1.05, False)]:
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", **SMALL, vocab_size=65))
        t = Trainer(_cfg(precision="fp16", scaler="static", static_scale=low * factor, steps=1), model=model)
        assert (t.train_step()[1].item() == 0) == zero


def test_sigterm_during_a_checkpoint_write_finishes_it_then_ends_the_run(tmp_path):
    script = (
        "import os, signal, sys, torch\n"
        "from mpgpt.train import main\n"
        "real = torch.save\n"
        "def save(obj, f, *a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # arrives while the checkpoint is being written\n"
        "    return real(obj, f, *a, **k)\n"
        "torch.save = save\n"
        f"sys.exit(main(['--steps', '6', '--batch-size', '2', '--block-size', '16', '--no-progress', "
        f"'--sample-tokens', '0', '--out-dir', {str(tmp_path)!r}, '--checkpoint-interval', '2']))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 143, out.stderr
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "terminated (SIGTERM)" in err and "is whole; resume with --resume" in err
    assert checkpoint.load_checkpoint(tmp_path / "ckpt.pt")["step"] == 2  # the write in flight was finished
    assert checkpoint.temporary_files(tmp_path / "ckpt.pt") == []
