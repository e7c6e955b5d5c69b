"""mpgpt.bench.longrun: the long training runs of chapters 9 and 10 (their CPU-side logic)."""
import math

import pytest
import torch

from mpgpt.bench.longrun import RunConfig, corpus_dataset, long_run, lr_at
from mpgpt.model import GPT, GPTConfig

SMALL = dict(steps=12, batch_size=2, block_size=16, eval_every=6, eval_batches=2, warmup=2)


def test_the_schedule_warms_up_then_decays_to_the_minimum():
    cfg = RunConfig(steps=100, warmup=10, lr=1e-3, min_lr=1e-4)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_bad_run_configs_are_refused():
    with pytest.raises(ValueError, match="warmup"):
        RunConfig(steps=10, warmup=10)
    with pytest.raises(ValueError, match="steps >= 1"):
        RunConfig(steps=0)


def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", n_embd=32, n_layer=1, n_head=2, block_size=16))


def test_a_run_is_reproducible_and_learns():
    data = corpus_dataset(20_000)
    results = []
    for _ in range(2):
        model = _model()
        results.append(long_run(model, torch.optim.AdamW(model.parameters(), lr=3e-3), data,
                                RunConfig(**SMALL, lr=3e-3), device="cpu"))
    a, b = results
    assert a["train_loss"] == b["train_loss"] and a["val_loss"] == b["val_loss"]
    assert len(a["train_loss"]) == 12 and [s for s, _ in a["val_loss"]] == [6, 12]
    assert a["timed_steps"] == 2          # the first ten steps are warm-up, not timed
    assert a["train_loss"][-1] < a["train_loss"][0] - 0.2
    assert a["tokens_per_s"] > 0 and a["peak_gib"] is None


def test_a_diverging_run_stops_loudly():
    data = corpus_dataset(20_000)
    model = _model()
    with torch.no_grad():
        model.lm_head.weight.fill_(math.inf)
    with pytest.raises(FloatingPointError, match="diverged at step 1:"):   # found at the check of step 6
        long_run(model, torch.optim.SGD(model.parameters(), lr=0.1), data, RunConfig(**SMALL), device="cpu")


def test_a_nan_between_checks_is_named_by_its_step():
    data = corpus_dataset(20_000)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    real_step = opt.step

    def step_then_poison():                 # after the third update the weights become NaN
        real_step()
        opt.count = getattr(opt, "count", 0) + 1
        if opt.count == 3:
            with torch.no_grad():
                model.lm_head.weight.fill_(float("nan"))
    opt.step = step_then_poison
    with pytest.raises(FloatingPointError, match="diverged at step 4:"):
        long_run(model, opt, data, RunConfig(**SMALL), device="cpu")


def test_a_run_too_short_to_time_is_refused():
    data = corpus_dataset(20_000)
    model = _model()
    with pytest.raises(ValueError, match="more than 10 steps"):
        long_run(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                 RunConfig(**{**SMALL, "steps": 8, "eval_every": 4}), device="cpu")
