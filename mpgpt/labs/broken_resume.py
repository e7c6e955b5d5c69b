"""Train the course GPT with fp16 autocast and GradScaler, stop halfway, save, resume, finish.

    python -m mpgpt.labs.broken_resume            # the script as written
    python -m mpgpt.labs.broken_resume --fixed    # with the repaired save and load (mpgpt/labs/repaired.py)

The scaler starts high (2**24) so that it settles within the first steps, as a long run's would.
The script prints the loss scale and whether the step was skipped around the restart.
Something is wrong with the resumed run: what, and why?
"""
import argparse
import tempfile
from pathlib import Path

import torch

from mpgpt.data import TextDataset, default_corpus
from mpgpt.labs import repaired
from mpgpt.model import GPT, GPTConfig


def save(path, model, optimizer, scaler, step):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)


def load(path, model, optimizer, scaler):
    state = torch.load(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="use the repaired save and load")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    save_fn, load_fn = (repaired.resume_save, repaired.resume_load) if args.fixed else (save, load)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: one thread is as fast, and the run repeats exactly
    data = TextDataset(default_corpus())
    config = GPTConfig.preset("tiny", vocab_size=data.tokenizer.vocab_size, n_embd=64, block_size=32)
    gen = torch.Generator().manual_seed(0)
    batches = [data.get_batch("train", 8, 32, generator=gen, device=device) for _ in range(args.steps)]
    half = args.steps // 2
    checkpoint = Path(tempfile.mkdtemp(prefix="broken-resume-")) / "ckpt.pt"

    def fresh():  # what a new process builds before it loads the checkpoint
        torch.manual_seed(0)
        model = GPT(config).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optimizer, torch.amp.GradScaler(device, init_scale=2.0**24, growth_interval=1000)

    model, optimizer, scaler = fresh()
    start = 0
    skipped = []
    for step in range(args.steps):
        if step == half:  # the job is interrupted here and started again
            save_fn(checkpoint, model, optimizer, scaler, step)
            model, optimizer, scaler = fresh()
            start = load_fn(checkpoint, model, optimizer, scaler)
            print(f"--- resumed from the checkpoint of step {start} ---")
        x, y = batches[step]
        with torch.autocast(device, dtype=torch.float16):
            _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        was_skipped = scaler.get_scale() < scale  # GradScaler backs off exactly when it skips
        skipped.append(was_skipped)
        if step < 12 or half - 2 <= step < half + 12:
            print(f"step {step:3d}  loss {loss.item():.3f}  scale 2**{int(torch.tensor(scale).log2())}"
                  f"{'  skipped' if was_skipped else ''}")
    print(f"skipped steps: {sum(skipped[:half])} before the restart, {sum(skipped[half:])} after it")


if __name__ == "__main__":
    main()
