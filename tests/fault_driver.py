"""A training run for tests/test_faults.py: inf/nan injected into gradients, SIGKILL during checkpoint writes.

    python tests/fault_driver.py OUT_DIR [--kill-at-save N --kill-phase PHASE --kill-fraction F]

Trains a tiny fp16 model with dynamic loss scaling and a checkpoint after every step, resuming from
OUT_DIR/ckpt.pt when it exists. On steps picked by a generator seeded by the step number (so a resumed
run injects exactly what an uninterrupted one does) an inf or nan is written into one element of a
randomly chosen gradient. With --kill-at-save N the process SIGKILLs itself during its N-th
checkpoint write, at PHASE: "write" (after the first F of the file's bytes reached the temporary
file), "replace" (whole file written and fsynced, not yet renamed) or "dirsync" (renamed, folder
not yet fsynced). At the end it writes the final weights to OUT_DIR/final.pt (not through
mpgpt.checkpoint, so no kill can hit it) and the History to OUT_DIR/history.pt.
"""
import argparse
import io
import os
import random
import signal
from pathlib import Path

import torch

import mpgpt.checkpoint
from mpgpt.train import TrainConfig, Trainer

STEPS = 10


def config(out_dir: str) -> TrainConfig:
    return TrainConfig(preset="tiny", precision="fp16", scaler="dynamic", init_scale=2.0 ** 12, growth_interval=3,
                       steps=STEPS, batch_size=4, warmup_steps=2, eval_interval=5, eval_batches=1, sample_tokens=0,
                       progress=False, log_interval=3, out_dir=out_dir, checkpoint_interval=1, seed=7,
                       model_overrides={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32})


def inject(step: int, model) -> None:
    rng = random.Random(1000 + step)
    if rng.random() < 0.3:  # about one step in three overflows
        params = [p for p in model.parameters() if p.grad is not None]
        grad = params[rng.randrange(len(params))].grad.view(-1)
        grad[rng.randrange(grad.numel())] = rng.choice([float("inf"), float("-inf"), float("nan")])


def arm_kill(at_save: int, phase: str, fraction: float) -> None:
    saves = {"n": 0}
    real_save, real_replace, real_dirsync = torch.save, os.replace, mpgpt.checkpoint._fsync_dir

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def save(obj, f, *a, **k):
        saves["n"] += 1
        if saves["n"] == at_save and phase == "write":
            buf = io.BytesIO()
            real_save(obj, buf, *a, **k)
            data = buf.getvalue()
            f.write(data[: int(len(data) * fraction)])
            f.flush()
            die()
        return real_save(obj, f, *a, **k)

    def replace(src, dst):
        if saves["n"] == at_save and phase == "replace":
            die()
        return real_replace(src, dst)

    def dirsync(folder):
        if saves["n"] == at_save and phase == "dirsync":
            die()
        return real_dirsync(folder)

    torch.save = save  # mpgpt.checkpoint calls torch.save and os.replace through the modules
    os.replace = replace
    mpgpt.checkpoint._fsync_dir = dirsync


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--kill-at-save", type=int, default=0)
    p.add_argument("--kill-phase", default="write", choices=["write", "replace", "dirsync"])
    p.add_argument("--kill-fraction", type=float, default=0.5)
    args = p.parse_args()
    trainer = Trainer(config(args.out_dir))
    ckpt = Path(args.out_dir) / "ckpt.pt"
    if ckpt.exists():
        trainer.load(ckpt)
    if args.kill_at_save:
        arm_kill(args.kill_at_save, args.kill_phase, args.kill_fraction)
    hist = trainer.run(after_backward=inject)
    final = {k: v for k, v in trainer.model.state_dict().items()}
    with open(Path(args.out_dir) / "final.pt", "wb") as f:
        torch.serialization.save(final, f)
    with open(Path(args.out_dir) / "history.pt", "wb") as f:
        torch.serialization.save(hist.to_dict(), f)


if __name__ == "__main__":
    main()
