"""Train the course GPT with fp16 autocast, a dynamic loss scaler and gradient clipping at norm 1.

    python -m mpgpt.labs.broken_clipping            # the script as written
    python -m mpgpt.labs.broken_clipping --fixed    # with the repaired step (mpgpt/labs/repaired.py: a spoiler)

Plain SGD, so that the gradients it applies are easy to reason about. It prints the loss and the
gradient norm (as clip_grad_norm_ reports it) every 10 steps, then the loss before and after.
Something is wrong with it: what, and why?
"""
import argparse

import torch

from mpgpt.data import TextDataset, default_corpus
from mpgpt.labs import repaired
from mpgpt.model import GPT, GPTConfig


def train_step(model, optimizer, scaler, x, y, device):
    """One step: forward in fp16, scaled backward, clip, step, update. Returns (loss, grad norm)."""
    with torch.autocast(device, dtype=torch.float16):
        _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    return loss.item(), norm.item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="use the repaired training step")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: one thread is as fast, and the run repeats exactly
    torch.manual_seed(0)
    data = TextDataset(default_corpus())
    config = GPTConfig.preset("tiny", vocab_size=data.tokenizer.vocab_size, n_embd=64, block_size=32)
    model = GPT(config).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
    step_fn = repaired.clipping_train_step if args.fixed else train_step
    gen = torch.Generator().manual_seed(0)
    losses = []
    for step in range(args.steps):
        x, y = data.get_batch("train", 8, 32, generator=gen, device=device)
        loss, norm = step_fn(model, optimizer, scaler, x, y, device)
        losses.append(loss)
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss:.3f}  grad norm {norm:.4g}")
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"loss, mean of the first 5 steps {first:.3f}, of the last 5 {last:.3f}")


if __name__ == "__main__":
    main()
