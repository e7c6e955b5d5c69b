"""The benchmark times only runs that train: a row whose loss or gradient norm turns non-finite is
reported as an error, and every row carries the figure timed as the peers time theirs."""
from mpgpt.bench import training


def test_a_row_whose_loss_turns_nan_is_reported_as_its_error(monkeypatch):
    real = training.Trainer.train_step

    def broken(self, *args, **kwargs):  # the loss of every step after the third is NaN
        loss, grad_norm, lr = real(self, *args, **kwargs)
        return (loss * float("nan") if self.step > 3 else loss), grad_norm, lr

    monkeypatch.setattr(training.Trainer, "train_step", broken)
    (row,) = training.bench_train(["fp32"], preset="tiny", batch_size=2, block_size=16, warmup=1, steps=4)
    assert "non-finite" in row["error"], row
    assert "tokens_per_s" not in row and "tokens_per_s_synced" not in row


def test_a_row_carries_the_wall_clock_figure_with_the_loss_read_every_step(monkeypatch):
    reads = []
    real = training.Trainer.train_step

    def counted(self, *args, **kwargs):
        loss, grad_norm, lr = real(self, *args, **kwargs)
        reads.append(loss)
        return loss, grad_norm, lr

    monkeypatch.setattr(training.Trainer, "train_step", counted)
    (row,) = training.bench_train(["fp32"], preset="tiny", batch_size=2, block_size=16, warmup=1, steps=3)
    assert len(reads) == 1 + 3 + 3  # warm-up, the event-timed steps, the synced steps
    assert 0 < row["tokens_per_s_synced"]
