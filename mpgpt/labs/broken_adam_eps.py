"""Train the course GPT with its weights in fp16 to halve their memory, with Adam's defaults.

    python -m mpgpt.labs.broken_adam_eps            # the script as written
    python -m mpgpt.labs.broken_adam_eps --fixed    # the repaired recipe (mpgpt/labs/repaired.py)

model.half() puts the weights, the gradients and Adam's two moment buffers in fp16. The script
stops at the first step whose loss is not finite, as a guarded training loop should.
Why does it stop, and what is the smallest change that makes it train?
"""
import argparse
import math
import sys

import torch

from mpgpt.data import TextDataset, default_corpus
from mpgpt.labs import repaired
from mpgpt.model import GPT, GPTConfig


def build(config, device):
    """The model and its optimizer: weights in fp16, torch.optim.Adam with its default eps (1e-8)."""
    model = GPT(config).to(device).half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optimizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="use the repaired model and optimizer")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: one thread is as fast, and the run repeats exactly
    torch.manual_seed(0)
    data = TextDataset(default_corpus())
    config = GPTConfig.preset("tiny", vocab_size=data.tokenizer.vocab_size, n_embd=64, block_size=32)
    model, optimizer = (repaired.adam_eps_build if args.fixed else build)(config, device)
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        x, y = data.get_batch("train", 8, 32, generator=gen, device=device)
        _, loss = model(x, y)
        if not math.isfinite(loss.item()):
            sys.exit(f"step {step}: the loss is {loss.item()}; stopping")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
