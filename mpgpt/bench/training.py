"""Training throughput: ``python -m mpgpt.bench train`` (chapters 3, 5 and 7).

Throughput is measured on synthetic tokens (random ids, never zeros) with the real trainer step
(``mpgpt.trainer.Trainer.train_step``): the median step time over ``--steps`` timed steps after
``--warmup`` steps. MFU = flops_per_token × tokens/s ÷ peak, with flops_per_token from
``GPT.flops_per_token`` (6N + 12·L·H·Q·T, PaLM appendix B) and peak the GPU's dense bf16 rate
(mpgpt.model.PEAK_BF16). Each row is a recipe (mpgpt.recipe): a TrainConfig, a reference model and
the converter's options (mpgpt.fast.convert); nothing is patched into the trainer after it is built.
"""
from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch._dynamo

from mpgpt.bench.timeline import timeline_summary
from mpgpt.data import TextDataset, default_corpus
from mpgpt.model import GPT, PEAK_BF16, GPTConfig, mfu, peak_flops
from mpgpt.recipe import ALIASES, parse
from mpgpt.results import check_out_dir, check_tag, write_result
from mpgpt.trainer import Trainer, TrainConfig

__all__ = ["TRAIN_CONFIGS", "SyntheticTokens", "make_trainer", "bench_train", "real_run", "largest_batch", "main"]

# One fixed yardstick for the mfu_vs_989T column: the H100/H200 dense bf16 peak, whatever GPU ran.
REFERENCE_PEAK = PEAK_BF16["H200"]


# ------------------------------------------------------------------------------------------------
# Training throughput
# ------------------------------------------------------------------------------------------------
# Each row is a recipe (mpgpt.recipe): its name says how the step runs, token by token, and
# `python -m mpgpt.recipe NAME` explains it. make_trainer builds the row from it and nothing else.


class _RecipeSettings(Mapping):
    """name -> mpgpt.recipe.parse(name).settings(), read-only, for code written against the table of
    rows this module once held; any recipe name is a key. Use mpgpt.recipe.parse instead."""

    def __getitem__(self, name):
        try:
            return parse(name).settings()
        except ValueError:
            raise KeyError(name) from None

    def __iter__(self):
        return iter(dict.fromkeys(LADDER + FASTEST))

    def __len__(self):
        return len(dict.fromkeys(LADDER + FASTEST))


TRAIN_CONFIGS = _RecipeSettings()


# The compiled ladder as chapter 7 tells it, one change per rung, each row adding one thing to the
# row before it (the 16-bit AdamW replaces the fused clip: it clips by itself). After the last rung:
# the same step on nanoGPT's bias-free model, and the last rung fp16 can take (an fp32 model under
# autocast; the 16-bit AdamW trains bf16 models only) in bf16 and fp16, as is fp16 beside the first.
# `--configs ladder` runs these rows in this order.
LADDER = [
    "bf16+compile",
    "bf16+compile+fused-ce",
    "bf16+compile+fused-ce+fused-clip",
    "bf16+compile+fused-ce+fused-clip+step-graph",
    "bf16+compile+fused-ce+fused-clip+step-graph+no-mix-order",
    "bf16+compile+fused-ce+optim16-mantissa+step-graph+no-mix-order",
    "bf16+compile+fused-ce+optim16-mantissa+triton-mlp+step-graph+no-mix-order",
    "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+step-graph+no-mix-order",
    "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+step-graph+no-mix-order",
    "bf16+compile-nobias+fused-ce+optim16-mantissa+triton-mlp+fused-ln+step-graph+no-mix-order",
    "fp16+compile",
    "bf16+compile+fused-ce+fused-clip+triton-mlp-qkv+fused-ln+step-graph+no-mix-order",
    "fp16+compile+fused-ce+fused-clip+triton-mlp-qkv+fused-ln+step-graph+no-mix-order",
]
# The fastest steps, as measured beside llm.c and nanoGPT: with GPT-2's biases and without (nanoGPT's
# model), the compiled baseline, and the first row once more, so the two times of one configuration
# show how far the run drifted. mpgpt.recipe's table gives each token's measured effect.
FASTEST = [ALIASES["fastest"], ALIASES["fastest-nobias"], "bf16+compile", ALIASES["fastest"]]
NAMED_LISTS = {"ladder": LADDER, "fastest": FASTEST}

# What each row after the climb is read against: not the row before it, but its twin.
_LAST_RUNG = "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+step-graph+no-mix-order"
_FP32_MODEL_LAST = "bf16+compile+fused-ce+fused-clip+triton-mlp-qkv+fused-ln+step-graph+no-mix-order"
LADDER_TWINS = {
    "bf16+compile-nobias+fused-ce+optim16-mantissa+triton-mlp+fused-ln+step-graph+no-mix-order": _LAST_RUNG,
    "fp16+compile": "bf16+compile",
    _FP32_MODEL_LAST: _LAST_RUNG,
    "fp16" + _FP32_MODEL_LAST[len("bf16"):]: _FP32_MODEL_LAST,
}


def _changes(old: str, new: str) -> str:
    """The settings in which configuration ``new`` differs from ``old``, as `key=value` words."""
    a, b = parse(old).settings(), parse(new).settings()
    return ", ".join(f"{k}={b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def ladder_steps(rows: list[dict], order=LADDER) -> list[dict]:
    """The ladder read rung by rung from one run's rows (a train result's ``rows``): for each row of
    ``order`` that ran, the row it is read against (the rung before it, or for the rows after the
    climb their twin in LADDER_TWINS), the settings that differ, its step time and the ratio of
    the two step times (> 1: faster), its peak memory, and whether it was slower. Rows that failed
    or did not run are left out, and so is a comparison with one of them."""
    ran = {r["config"]: r for r in rows if "error" not in r and r.get("ms_per_step_median")}
    steps, previous = [], None
    for name in order:
        against = LADDER_TWINS.get(name, previous)
        if name not in LADDER_TWINS:
            previous = name
        row = ran.get(name)
        if row is None:
            continue
        base = ran.get(against) if against else None
        steps.append({
            "config": name, "against": against if base else None,
            "changes": _changes(against, name) if base else "",
            "ms_per_step": row["ms_per_step_median"], "tokens_per_s": row["tokens_per_s"],
            "peak_memory_gib": row.get("peak_memory_gib"),
            "speedup": base["ms_per_step_median"] / row["ms_per_step_median"] if base else None,
            "slower": bool(base) and row["ms_per_step_median"] > base["ms_per_step_median"],
        })
    return steps


def print_ladder(rows: list[dict], order=LADDER) -> None:
    """ladder_steps as a table: each rung against the row it is read against."""
    steps = ladder_steps(rows, order)
    if not steps:
        return
    print(f"\n{'ms/step':>8} | {'x':>6} | {'GiB':>5} | what changed (against the row it is read against)")
    print("-" * 90)
    for s in steps:
        ratio = f"{s['speedup']:.3f}" if s["speedup"] else "-"
        print(f"{s['ms_per_step']:>8.2f} | {ratio:>6} | {s['peak_memory_gib']!s:>5} | "
              f"{s['changes'] or s['config']}{'  (slower)' if s['slower'] else ''}")


def expand_configs(text: str) -> list[str]:
    """The --configs value as configuration names: comma-separated, each a recipe (mpgpt.recipe) or a
    NAMED_LISTS name ("ladder", "fastest") that stands for its list."""
    names = []
    for n in (n.strip() for n in text.split(",")):
        names += NAMED_LISTS.get(n, [n] if n else [])
    return names


class SyntheticTokens:
    """Random token batches already on the device, rotated so no step re-reads the same batch."""

    class _Tok:
        def __init__(self, vocab_size):
            self.vocab_size = vocab_size

    def __init__(self, vocab_size, batch_size, block_size, device, pool=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.tokenizer = self._Tok(vocab_size)
        # GPT-2 has 50257 real tokens; the padded rows of a 50304 vocabulary are never targets.
        data = torch.randint(0, min(vocab_size, 50257), (pool, batch_size, block_size + 1), generator=g)
        self.batches = [(d[:, :-1].to(device), d[:, 1:].to(device)) for d in data]
        self.i = 0

    def get_batch(self, split, batch_size, block_size, generator=None, device=None):
        self.i = (self.i + 1) % len(self.batches)
        return self.batches[self.i]


def make_trainer(name, preset="gpt2", batch_size=12, block_size=None, device=None, checkpointing=False,
                 dataset=None, **config):
    """The trainer for recipe ``name`` (mpgpt.recipe) on synthetic tokens (or ``dataset``); ``config``
    overrides TrainConfig fields (e.g. fsdp=True)."""
    recipe = parse(name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    fields = recipe.train_config()
    del fields["model_overrides"]  # the model is built here, with the preset's vocabulary
    fields = dict(fields, preset=preset, batch_size=batch_size, block_size=block_size, device=str(device),
                  progress=False, sample_tokens=0, steps=10**9, warmup_steps=10, lr=6e-4,
                  grad_clip=1.0 if recipe.clip else 0.0)
    cfg = TrainConfig(**{**fields, **config})
    overrides = {"block_size": block_size} if block_size else {}
    model = GPT(GPTConfig.preset(preset, bias=recipe.bias, attention=recipe.attention, **overrides))
    recipe.apply(model)
    if checkpointing:
        model.set_activation_checkpointing(True)
    data = dataset if dataset is not None else SyntheticTokens(model.config.vocab_size, batch_size,
                                                               model.config.block_size, device)
    return Trainer(cfg, model=model, dataset=data)


class NonFiniteStep(RuntimeError):
    """A timed step's loss or gradient norm was not finite: the row's numbers time a broken run."""


def _check_finite(results, what: str) -> None:
    """Raise NonFiniteStep unless every (loss, grad_norm) of ``results`` is finite (one host sync)."""
    if not results:
        return
    values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=results[0][0].device).reshape(())
                          for pair in results for v in pair])
    bad = (~torch.isfinite(values)).view(-1, 2).any(1).nonzero().flatten().tolist()
    if bad:
        raise NonFiniteStep(f"{len(bad)} of {len(results)} {what} steps had a non-finite loss or gradient norm "
                            f"(first: step {bad[0] + 1}); the row's timing would be of a broken run")


def _time_steps(trainer, warmup, steps) -> list[float]:
    """Per-step wall times in ms, measured with CUDA events (no host sync inside the timed region).
    Every step's loss and gradient norm are checked for finiteness after the timed region."""
    for _ in range(warmup):
        trainer.train_step()
    cuda = trainer.device.type == "cuda"
    results = []
    if cuda:
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            results.append(trainer.train_step()[:2])
            events[i + 1].record()
        torch.cuda.synchronize()
        _check_finite(results, "timed")
        return [events[i].elapsed_time(events[i + 1]) for i in range(steps)]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        results.append(trainer.train_step()[:2])
        times.append((time.perf_counter() - t) * 1e3)
    _check_finite(results, "timed")
    return times


def _time_steps_synced(trainer, steps) -> float:
    """Seconds for ``steps`` steps timed as llm.c and nanoGPT's bench.py time theirs: wall clock,
    the batch fetched inside the timed region (train_step fetches it) and the loss read on the host
    after every step, so nothing of the step is left running when the clock stops."""
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    results = []
    for _ in range(steps):
        loss, grad_norm = trainer.train_step()[:2]
        loss.item()
        results.append((loss, grad_norm))
    seconds = time.perf_counter() - t
    _check_finite(results, "synced")
    return seconds


def _profiled(trainer, steps, record_shapes=False):
    """A torch.profiler run over ``steps`` training steps (CPU ranges, and kernels on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        for _ in range(steps):
            trainer.train_step()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
    return prof


def _table(prof, device_type, row_limit=30) -> str:
    sort = "cuda_time_total" if device_type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=row_limit, max_name_column_width=60)


# The matrix products of a step, by operator name: torch's (the cuBLAS rows) and the package's
# operators (the rows with Triton layers; their other passes, such as GELU's backward, are listed
# with them), so the two rows' products can be compared shape by shape.
MATRIX_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mpgpt::")


def ops_by_shape(averages, steps, prefixes=MATRIX_OPS) -> list[dict]:
    """The profiler's averages grouped by input shape (``prof.key_averages(group_by_input_shape=True)``)
    reduced to the operators whose names start with one of ``prefixes``: per operator and input
    shapes, the calls per step and the device microseconds per call (the time of the kernels it
    launched), slowest total first. Operators that launched nothing on the device are left out."""
    rows = []
    for e in averages:
        if not e.key.startswith(prefixes):
            continue
        device_us = getattr(e, "device_time_total", None)
        device_us = e.cuda_time_total if device_us is None else device_us
        if device_us <= 0 or e.count <= 0:
            continue
        rows.append({"op": e.key, "input_shapes": [list(s) for s in e.input_shapes],
                     "calls_per_step": round(e.count / steps, 2),
                     "device_us_per_call": round(device_us / e.count, 1),
                     "device_us_per_step": round(device_us / steps, 1)})
    return sorted(rows, key=lambda r: -r["device_us_per_step"])


def host_ms_per_step(trainer, steps=3) -> float:
    """Host milliseconds to issue one step, nothing synchronised inside: how fast Python and the
    launch path run ahead of the GPU (a full launch queue can still block it, so when this nears
    the step time, the host is what limits the step)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    host = (time.perf_counter() - t) * 1e3 / steps
    torch.cuda.synchronize()
    return host


def profile_steps(trainer, steps=5, row_limit=30) -> str:
    """A torch.profiler table (sorted by device time) of a few training steps.

    Reading it: Inductor's Triton kernels appear twice, once as the CPU range that launched them and
    once as the kernel; annotations of CPU ranges such as ``Optimizer.step`` also show device time.
    "Self CUDA time total" divided by the steps matched the busy time of the trace's timeline
    (mpgpt.bench.timeline) in record train-peers-graph-h200, so read the busy and idle time from
    the timeline, not by subtracting rows of the table."""
    return _table(_profiled(trainer, steps), trainer.device.type, row_limit)


def profile_row(trainer, steps=5) -> dict:
    """What --profile adds to a row: the profiler's table, and on a GPU the timeline summary
    (mpgpt.bench.timeline: busy, idle, and what the GPU waited for), the host's time per step and
    the device time of each matrix product by shape (ops_by_shape)."""
    # The host's time first: after a profiler run the launch path can stay slower for a while.
    host = round(host_ms_per_step(trainer), 3) if trainer.device.type == "cuda" else None
    prof = _profiled(trainer, steps, record_shapes=trainer.device.type == "cuda")
    # 60 rows: enough to name the kernels outside the GEMMs and attention, not only the largest.
    out = {"profile": _table(prof, trainer.device.type, row_limit=60)}
    if trainer.device.type == "cuda":
        out["matrix_ops_by_shape"] = ops_by_shape(prof.key_averages(group_by_input_shape=True), steps)
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.json"
            prof.export_chrome_trace(str(path))
            out["timeline"] = timeline_summary(json.loads(path.read_text()), steps)
        out["host_ms_per_step"] = host
    return out


def bench_train(names, preset="gpt2", batch_size=12, block_size=None, warmup=10, steps=30,
                checkpointing=False, profile=None) -> list[dict]:
    """Measure each named configuration; return one row per configuration. ``profile``: names
    (a list, or one name) whose rows also get profile_row's profile."""
    profile = [profile] if isinstance(profile, str) else list(profile or ())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name in names:
        recipe = parse(name)
        gc.collect()  # whatever an earlier row left (one that failed, too) is freed before this row
        # Dynamo reuses code compiled for an earlier row's model of the same structure (the
        # parameters are inputs, not guards) and never looks at Inductor's settings: without a
        # reset, a row that differs only in `inductor` would time the earlier row's kernels.
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        row = {"config": name, "preset": preset, "batch_size": batch_size, "activation_checkpointing": checkpointing}
        try:
            with recipe.inductor_settings():
                trainer = make_trainer(name, preset, batch_size, block_size, device, checkpointing)
                t0 = time.perf_counter()
                times = _time_steps(trainer, warmup, steps)
                synced_s = _time_steps_synced(trainer, steps)
                row["wall_s"] = round(time.perf_counter() - t0, 1)
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            rows.append(row)
            print(f"{name:>22}: out of memory at batch {batch_size}", flush=True)
            continue
        except Exception as e:  # a configuration that cannot run here (e.g. Triton on CPU) is recorded, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            rows.append(row)
            print(f"{name:>22}: {row['error']}", flush=True)
            continue
        ms = statistics.median(times)
        tokens = batch_size * trainer.block_size
        tps = tokens / (ms / 1e3)
        flops = trainer.model.flops_per_token()
        peak = peak_flops(device)
        row.update({
            "block_size": trainer.block_size, "tokens_per_step": tokens,
            "ms_per_step_median": round(ms, 3), "ms_per_step_min": round(min(times), 3),
            "ms_per_step_max": round(max(times), 3), "tokens_per_s": round(tps),
            # Like the peers (llm.c, nanoGPT's bench.py): wall clock, loss read every step.
            "tokens_per_s_synced": round(tokens * steps / synced_s),
            "flops_per_token": flops,
            "mfu_vs_989T": round(mfu(flops, tps, REFERENCE_PEAK), 4) if device.type == "cuda" else None,
            "mfu_vs_datasheet_peak": round(mfu(flops, tps, peak), 4) if peak else None,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
            "skipped_steps": None,
            "timed_steps": steps, "warmup_steps": warmup,
        })
        if name in profile:
            row.update(profile_row(trainer))
            print(row["profile"], flush=True)
            if "timeline" in row:
                print(f"{name}: timeline {row['timeline']}; host {row['host_ms_per_step']} ms/step", flush=True)
            for op in row.get("matrix_ops_by_shape", [])[:24]:
                print(f"{op['device_us_per_step']:9.1f} us/step {op['calls_per_step']:5g} x {op['device_us_per_call']:7.1f} us"
                      f"  {op['op']:22} {op['input_shapes']}", flush=True)
        rows.append(row)
        print(f"{name:>22}: {ms:8.2f} ms/step  {tps/1e3:8.1f}k tok/s  "
              f"MFU {row['mfu_vs_989T'] if row['mfu_vs_989T'] is not None else '-'}  "
              f"mem {row['peak_memory_gib']} GiB", flush=True)
        # A recorded step's graph keeps its memory pool until the trainer is collected (the step
        # recorder and the trainer refer to each other): the next row's gc.collect() frees it, so
        # that row's peak is its own.
        del trainer
    return rows


def real_run(name, preset="gpt2", batch_size=12, steps=150) -> dict:
    """Train configuration ``name`` on the embedded corpus for ``steps`` steps: does the loss fall?

    Throughput runs use random tokens, which teach nothing; this checks that the fastest
    configuration is also a working trainer on real text.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trainer = make_trainer(name, preset, batch_size, None, device, dataset=TextDataset(default_corpus()),
                           steps=steps, warmup_steps=20)
    results = [trainer.train_step()[:2] for _ in range(steps)]
    _check_finite(results, "real-text")  # a broken run is an error, not a loss curve
    losses = torch.stack([loss for loss, _ in results]).tolist()
    result = {"config": name, "preset": preset, "batch_size": batch_size, "steps": steps,
              "data": "embedded corpus (mpgpt.data.default_corpus)",
              "loss_first5_mean": sum(losses[:5]) / 5, "loss_last5_mean": sum(losses[-5:]) / 5,
              "loss_every_10": losses[::10]}
    print(f"real run {name}: loss {result['loss_first5_mean']:.3f} -> {result['loss_last5_mean']:.3f} "
          f"over {steps} steps", flush=True)
    return result


def largest_batch(name, preset="gpt2", candidates=(16, 24, 32, 48, 64, 96), warmup=3, steps=8) -> list[dict]:
    """Throughput of ``name`` at growing batch sizes until one runs out of memory."""
    rows = []
    for bs in candidates:
        row = bench_train([name], preset, bs, None, warmup, steps)[0]
        rows.append(row)
        if "error" in row:
            break
    return rows


def _print_table(rows):
    print(f"\n{'config':>22} | {'batch':>5} | {'ms/step':>8} | {'tok/s':>9} | {'MFU':>6} | {'GiB':>6}")
    print("-" * 70)
    for r in rows:
        if "error" in r:
            print(f"{r['config']:>22} | {r['batch_size']:>5} | {r['error']}")
            continue
        mfu = f"{100 * r['mfu_vs_989T']:.1f}%" if r["mfu_vs_989T"] is not None else "-"
        print(f"{r['config']:>22} | {r['batch_size']:>5} | {r['ms_per_step_median']:>8.2f} | "
              f"{r['tokens_per_s']:>9,} | {mfu:>6} | {r['peak_memory_gib']}")


def build_parser(prog="python -m mpgpt.bench train") -> argparse.ArgumentParser:
    t = argparse.ArgumentParser(prog=prog, description="Training throughput of GPT-2 small across precisions.")
    t.add_argument("--preset", default="gpt2")
    t.add_argument("--batch-size", type=int, default=12)
    t.add_argument("--block-size", type=int, default=None)
    t.add_argument("--configs", default="fp32,tf32,fp16,bf16,fp16+compile,bf16+compile,bf16+compile+triton",
                   help="comma-separated recipes (python -m mpgpt.recipe --list shows the tokens); or 'ladder': "
                        "chapter 7's compiled ladder, rung by rung (LADDER); or 'fastest': the fastest steps with "
                        "and without biases and bf16+compile (FASTEST)")
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--activation-checkpointing", action="store_true")
    t.add_argument("--max-batch-config", default=None, help="also find the largest batch that fits for this config")
    t.add_argument("--real-run-config", default=None, help="also train this config on the embedded corpus")
    t.add_argument("--real-steps", type=int, default=150)
    t.add_argument("--profile", default=None,
                   help="comma-separated configs to profile too: the profiler's table and, on a GPU, the "
                        "timeline's busy and idle time")
    t.add_argument("--out-dir", default=".", help="where the JSON result goes (default: the current folder)")
    t.add_argument("--tag", default=None, type=check_tag,
                   help="appended to the file name, so two runs on one day both stay")
    return t


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    command = shlex.join(["python", "-m", "mpgpt.bench", "train", *argv])
    names = expand_configs(args.configs)
    problem = check_counts(args, "batch_size", "steps", "real_steps", positive=True) or check_counts(args, "warmup")
    if args.block_size is not None and args.block_size < 1:
        problem = f"--block-size must be a positive integer, got {args.block_size}"
    if not names:
        problem = f"--configs {args.configs!r} names no configuration; pass e.g. --configs fp32,bf16"
    try:
        GPTConfig.preset(args.preset)
    except ValueError as e:
        problem = f"--preset: {e}"
    if problem is None:
        try:
            check_out_dir(args.out_dir)  # a folder that cannot take the result fails now, not after the run
        except ValueError as e:
            problem = str(e)
    if problem:
        print(f"python -m mpgpt.bench train: error: {problem}", file=sys.stderr)
        return 2
    profiled = [n.strip() for n in (args.profile or "").split(",") if n.strip()]
    extra = [args.max_batch_config, args.real_run_config, *profiled]
    for n in names + [e for e in extra if e]:
        try:
            parse(n)
        except ValueError as e:
            print(f"python -m mpgpt.bench train: error: {e}", file=sys.stderr)
            return 2
    rows = bench_train(names, args.preset, args.batch_size, args.block_size, args.warmup, args.steps,
                       args.activation_checkpointing, profiled)
    payload = {"benchmark": "train", "rows": rows}
    if args.max_batch_config:
        payload["largest_batch"] = largest_batch(args.max_batch_config, args.preset)
        rows = rows + payload["largest_batch"]
    _print_table(rows)
    if set(LADDER) & set(names):
        print_ladder(payload["rows"])
    if args.real_run_config:
        try:
            payload["real_run"] = real_run(args.real_run_config, args.preset, args.batch_size, args.real_steps)
        except NonFiniteStep as e:
            payload["real_run"] = {"config": args.real_run_config, "error": str(e)}
            print(f"real run {args.real_run_config}: {e}", flush=True)
    path = write_result("train", payload, args.out_dir, tag=args.tag, command=command)
    print(f"\nwrote {path}")
    if all("error" in r for r in payload["rows"]):
        print(f"python -m mpgpt.bench train: error: every configuration failed (first: {payload['rows'][0]['error']}); "
              f"the errors are in {path}", file=sys.stderr)
        return 1
    return 0


def check_counts(args, *names, positive=False) -> str | None:
    """The first of ``args``' integer options ``names`` that is negative (or, if ``positive``, below 1), as a
    one-line complaint naming the flag; None if all are fine."""
    for name in names:
        value = getattr(args, name)
        if value < (1 if positive else 0):
            return (f"--{name.replace('_', '-')} must be {'a positive integer' if positive else '>= 0'}, "
                    f"got {value}")
    return None


if __name__ == "__main__":
    sys.exit(main())
