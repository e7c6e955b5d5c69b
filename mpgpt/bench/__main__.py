"""``python -m mpgpt.bench train|kernels|ddp [options]``: hands the options to that benchmark."""
import sys

COMMANDS = {"train": "mpgpt.bench.training", "kernels": "mpgpt.bench.kernels", "ddp": "mpgpt.bench.ddp"}
COMMANDS["fp8"] = "mpgpt.bench.fp8"  # chapter 9: fp8 GEMMs, the crossover map, accumulation
COMMANDS["optim16"] = "mpgpt.bench.optim16"  # chapter 10: one AdamW step, 16-bit variants vs torch fused
COMMANDS["ddp-by-hand"] = "mpgpt.bench.ddp_by_hand"  # chapter 8: hand-built data parallelism vs DDP


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        if argv[:1] in (["-h"], ["--help"]):
            print(f"usage: python -m mpgpt.bench {{{','.join(COMMANDS)}}} [options]\n\n{__import__('mpgpt.bench').bench.__doc__}")
            return 0
        got = f"unknown benchmark {argv[0]!r}" if argv else "no benchmark named"
        print(f"python -m mpgpt.bench: error: {got}; choose one of {', '.join(COMMANDS)} (see --help)", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
