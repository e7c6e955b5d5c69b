"""Divergence stops a run loudly and keeps the last good checkpoint; killed and resumed runs end bit-exact.

The acceptance test at the bottom runs tests/fault_driver.py in subprocesses: inf/nan injected into
random gradients on random steps, SIGKILL at random points of random checkpoint writes, a resume after
each kill; the final weights must equal an uninterrupted run's bit for bit, with no temporary files left.
The subprocesses run with OMP_NUM_THREADS=1: bit-exact CPU results hold at a fixed thread count
(see test_resume_with_two_threads_is_bit_identical_and_records_the_thread_count for 2 threads).
"""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpgpt import checkpoint
from mpgpt.train import TrainConfig, Trainer, main
from mpgpt.trainer import DivergenceError

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
