"""Recipes: one name for how a training step runs, as ``+``-joined tokens (chapters 3-10).

    bf16+compile+fused-ce+optim16-mantissa+step-graph

A recipe is a precision token, then any tokens of TOKENS in any order; each token switches one
thing on (a precision policy, torch.compile, a fused kernel, the recorded step...). ``parse`` turns
the name into a frozen :class:`Recipe`; the benchmark, the trainer and the command lines all build a
run from it, so a row of a record is a run anyone can repeat:

    python -m mpgpt.recipe fastest                 # what each token switches on, and where the code is
    python -m mpgpt.train --recipe fastest --preset gpt2

TOKENS is the one table of what a token does: what it switches, the file that implements it, the
chapter that teaches it, what it needs of the device, and its measured effect with the record that
shows it (empty where no record isolates it). ALIASES names whole recipes (``fastest``).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import sys
from dataclasses import dataclass

import torch

from mpgpt import runtime

from mpgpt.results import find_record

__all__ = ["Recipe", "Token", "TOKENS", "ALIASES", "parse", "explain", "main"]


@dataclass(frozen=True)
class Token:
    """One token of the recipe language: the settings it sets, and where to read about it."""

    sets: dict            # Recipe fields this token sets (a later token overrides an earlier one)
    what: str             # what it switches on, in a line
    file: str             # the code that implements it
    chapter: str          # the chapter that teaches it
    needs: str = ""       # "", "cuda" (a CUDA GPU), "triton" (Triton's kernels on a CUDA GPU), "sm90" (Hopper)
    # (record, row with the token, row without it): the record whose two rows, run together, show the
    # token's effect ("record:section" where the rows are not the record's top-level ones). The
    # effect is read from the record when asked for (Token.effect), never copied here.
    measured: tuple = ()

    @property
    def record(self) -> str:
        return self.measured[0].split(":")[0] if self.measured else ""

    def effect(self) -> str:
        """The step-speed ratio of the two rows (> 1: the token makes the step faster), as the
        record shows it; empty where no record isolates the token."""
        if not self.measured:
            return ""
        where, row, against = self.measured
        name, _, section = where.partition(":")
        record = find_record(name)
        if record is None:
            return f"record {name} (in the repository's benchmarks/records)"
        ms = _median_ms(record.get(section, record) if section else record)
        return f"{ms[against] / ms[row]:.3f}x the step speed of {against} (record {name})"


def _median_ms(record: dict) -> dict:
    """config -> the median of its rows' median step times (a record may time a row more than once)."""
    times = {}
    for row in record.get("rows", []):
        if "error" not in row and row.get("ms_per_step_median"):
            times.setdefault(row["config"], []).append(row["ms_per_step_median"])
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


# Inductor settings some tokens put in force while the step compiles and runs (torch._inductor.config).
CD_TUNING = {"coordinate_descent_tuning": True}
NO_MIX_ORDER = {"triton.mix_order_reduction": False}


def ln_split(rows: int) -> dict:
    """Inductor's LayerNorm-backward partial sums: one row of partials per ``rows`` rows."""
    return {"triton.mix_order_reduction_split_size": rows}


_PRECISIONS = {
    "fp32": Token({"precision": "fp32"}, "fp32 weights and math", "mpgpt/precision.py", "3"),
    "tf32": Token({"precision": "tf32"}, "fp32 with TF32 tensor-core matmuls (sm_80+)", "mpgpt/precision.py", "3",
                  needs="cuda",
        measured=("train-h200", "tf32",
                  "fp32")),
    "bf16": Token({"precision": "bf16"}, "bf16 autocast, fp32 weights", "mpgpt/precision.py", "3",
        measured=("train-h200", "bf16",
                  "fp32")),
    "fp16": Token({"precision": "fp16", "scaler": "dynamic"}, "fp16 autocast with the package's dynamic loss scaler",
                  "mpgpt/scaling.py", "5",
        measured=("train-h200", "fp16",
                  "fp32")),
    "fp16-gradscaler": Token({"precision": "fp16", "scaler": "gradscaler"}, "fp16 autocast with torch's GradScaler",
                             "mpgpt/scaling.py", "5",
        measured=("train-h200", "fp16-gradscaler",
                  "fp32")),
    "bf16-master": Token({"precision": "bf16-master"}, "a bf16 model with fp32 master weights (O2)",
                         "mpgpt/precision.py", "3",
        measured=("train-peers-optim16-h200", "bf16-master+compile+fused-ce+fused-clip+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+fused-clip+step-graph+no-mix-order")),
    "bf16-nobias": Token({"precision": "bf16", "bias": False}, "bf16 on a model without biases (= bf16+nobias)",
                         "mpgpt/model.py", "7",
        measured=("train-h200", "bf16+compile-nobias",
                  "bf16+compile")),
    "bf16-nobias-noclip": Token({"precision": "bf16", "bias": False, "clip": False},
                                "nanoGPT's bench.py step: bf16, no biases, no clipping (= bf16+nobias+noclip)",
                                "mpgpt/model.py", "7"),
}

TOKENS = {
    **_PRECISIONS,
    "nobias": Token({"bias": False}, "no biases in Linear and LayerNorm layers (nanoGPT's bench model)",
                    "mpgpt/model.py", "7",
        measured=("train-h200", "bf16+compile-nobias",
                  "bf16+compile")),
    "noclip": Token({"clip": False}, "no gradient clipping", "mpgpt/trainer.py", "2"),
    "checkpointing": Token({"checkpointing": True}, "activation checkpointing: each block recomputed in backward",
                           "mpgpt/model.py", "7",
        measured=("train-h200", "bf16+checkpointing",
                  "bf16")),
    "compile": Token({"compile": "default"}, "torch.compile the model", "mpgpt/trainer.py", "7",
        measured=("train-h200", "bf16+compile",
                  "bf16")),
    "compile-nobias": Token({"compile": "default", "bias": False}, "= compile+nobias", "mpgpt/trainer.py", "7",
        measured=("train-h200", "bf16+compile-nobias",
                  "bf16+compile")),
    "compile-max-autotune": Token({"compile": "max-autotune-no-cudagraphs"},
                                  "torch.compile, autotuning every matmul against Inductor's templates",
                                  "mpgpt/trainer.py", "7", needs="cuda",
        measured=("train-profile-h200:max_autotune_run", "bf16+compile-max-autotune+fused-ce+fused-clip",
                  "bf16+compile+fused-ce+fused-clip")),
    "cudagraphs": Token({"compile": "reduce-overhead"}, "torch.compile's CUDA graphs (mode reduce-overhead)",
                        "mpgpt/trainer.py", "7", needs="cuda",
        measured=("train-h200", "bf16+compile+cudagraphs",
                  "bf16+compile")),
    "all-nobias": Token({"compile": "reduce-overhead", "bias": False, "chunked_loss": 2048, "attention": "cudnn"},
                        "= cudagraphs+nobias+chunked-loss+cudnn-attn", "mpgpt/trainer.py", "7", needs="cuda"),
    "cudnn-attn": Token({"attention": "cudnn"}, "SDPA with cuDNN's fused attention first", "mpgpt/model.py", "7",
        measured=("train-h200", "bf16+compile+cudnn-attn",
                  "bf16+compile")),
    "chunked-loss": Token({"chunked_loss": 2048}, "output layer + loss 2048 rows at a time, never the full logits",
                          "mpgpt/fused_loss.py", "7",
        measured=("train-h200", "bf16+compile+chunked-loss",
                  "bf16+compile")),
    "fused-ce": Token({"fused_loss": True}, "output layer + loss in one Triton pass over the bf16 logits",
                      "mpgpt/fast/cross_entropy.py", "7", needs="triton",
        measured=("train-ladder-h200", "bf16+compile+fused-ce",
                  "bf16+compile")),
    "fused-clip": Token({"fused_clip": True}, "gradient clipping inside torch's fused AdamW",
                        "mpgpt/trainer.py", "7", needs="cuda",
        measured=("train-ladder-h200", "bf16+compile+fused-ce+fused-clip",
                  "bf16+compile+fused-ce")),
    "cd-tuning": Token({"inductor": CD_TUNING}, "Inductor's coordinate-descent tuning of its kernels",
                       "mpgpt/recipe.py", "7"),
    "no-mix-order": Token({"inductor": NO_MIX_ORDER}, "Inductor's mix-order LayerNorm backward off",
                          "mpgpt/recipe.py", "7",
        measured=("train-ladder-h200", "bf16+compile+fused-ce+fused-clip+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+fused-clip+step-graph")),
    "ln-split<N>": Token({}, "Inductor's LayerNorm-backward partial sums, one row per N rows",
                         "mpgpt/recipe.py", "7"),
    "step-graph": Token({"cuda_graph": True}, "the whole step (forward, backward, clip, AdamW) as one CUDA graph",
                        "mpgpt/graph_step.py", "7", needs="cuda",
        measured=("train-ladder-h200", "bf16+compile+fused-ce+fused-clip+step-graph",
                  "bf16+compile+fused-ce+fused-clip")),
    "optim16": Token({"optim16": "fp32-master"}, "a bf16 model trained by the fused 16-bit AdamW, fp32 masters",
                     "mpgpt/optim16.py", "10",
        measured=("train-peers-optim16-h200", "bf16+compile+fused-ce+optim16+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+fused-clip+step-graph+no-mix-order")),
    "optim16-mantissa": Token({"optim16": "bf16-mantissa"},
                              "as optim16, the master kept as the bf16 weight's 16 missing bits",
                              "mpgpt/optim16.py", "10",
        measured=("train-ladder-h200", "bf16+compile+fused-ce+optim16-mantissa+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+fused-clip+step-graph+no-mix-order")),
    "triton": Token({"triton": "all"}, "the blocks' nn.Linear layers as TritonLinear, GELU in c_fc's epilogue",
                    "mpgpt/kernels/linear.py", "6", needs="triton",
        measured=("train-triton-rows-h100", "bf16+compile+triton",
                  "bf16+compile")),
    "triton-gelu": Token({"triton": "gelu"}, "only mlp.c_fc as a TritonLinear, GELU in its epilogue",
                         "mpgpt/kernels/linear.py", "6", needs="triton",
        measured=("train-triton-gelu-h200", "bf16+compile+fused-ce+optim16+triton-gelu+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+optim16+step-graph+no-mix-order")),
    "triton-mlp": Token({"triton": "mlp"}, "each MLP as one function, GELU fused into c_fc's product",
                        "mpgpt/fast/mlp.py", "7", needs="triton",
        measured=("train-ladder-h200", "bf16+compile+fused-ce+optim16-mantissa+triton-mlp+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+optim16-mantissa+step-graph+no-mix-order")),
    "triton-mlp-qkv": Token({"triton": "mlp+qkv"}, "as triton-mlp, and c_attn with the head split and its backward",
                            "mpgpt/fast/qkv.py", "7", needs="triton",
        measured=("train-ladder-h200", "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+optim16-mantissa+triton-mlp+step-graph+no-mix-order")),
    "fused-ln": Token({"fused_ln": True}, "each residual add with its LayerNorm, the backward in one pass",
                      "mpgpt/fast/layernorm.py", "7", needs="triton",
        measured=("train-ladder-h200", "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+step-graph+no-mix-order")),
    "bias-in-add": Token({"bias_in_add": True}, "c_proj's biases added in the fused residual add",
                         "mpgpt/fast/model.py", "7", needs="triton",
        measured=("train-peers-ln-pipelined-h100", "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+bias-in-add+fused-emb+gelu-epilogue+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+fused-emb+gelu-epilogue+step-graph+no-mix-order")),
    "fused-emb": Token({"fused_emb": True}, "the tied embedding's gradient added into the output layer's in place",
                       "mpgpt/fast/embedding.py", "7", needs="triton",
        measured=("train-peers-emb-h200", "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+fused-emb+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+step-graph+no-mix-order")),
    "gelu-epilogue": Token({"gelu_epilogue": True}, "GELU's backward in the epilogue of the MLP's dOut W_proj "
                           "(withdrawn: the converter refuses it, see fast/mlp.py's check_gelu_backward)",
                           "mpgpt/kernels/hopper/ws.py", "7", needs="sm90",
        measured=("train-peers-dgelu-h100", "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+fused-emb+gelu-epilogue+step-graph+no-mix-order",
                  "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+fused-emb+step-graph+no-mix-order")),
}

# The fastest rows the records hold without +gelu-epilogue (withdrawn: fast/mlp.py says why); without
# it, +bias-in-add did not pay either (0.997x, record train-peers-bias-in-add-h100).
_FASTEST = "bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+fused-emb+step-graph+no-mix-order"
_FASTEST_NOBIAS = "bf16+compile-nobias+fused-ce+optim16-mantissa+triton-mlp+fused-ln+fused-emb+step-graph+no-mix-order"
# Whole recipes by a short name.
ALIASES = {
    "fastest": _FASTEST,                # the fastest step with GPT-2's biases
    "fastest-nobias": _FASTEST_NOBIAS,  # the fastest step on nanoGPT's bias-free model
}

# Tokens that left the package because they did not pay: a name that holds one still parses to a
# one-line answer that says so.
RETIRED = {
    "streamk-dw": "the stream-K kernel for the MLP's weight gradients was slower than cuBLAS (record "
                  "kernels-grads-h200) and left the package; git history keeps it",
}

_LN_SPLIT = re.compile(r"ln-split(\d+)")
_NEEDS = {"cuda": "a CUDA GPU", "triton": "Triton's kernels on a CUDA GPU", "sm90": "an sm_90 GPU (H100/H200)"}


@dataclass(frozen=True)
class Recipe:
    """What a recipe name switches on. Build one with :func:`parse`."""

    name: str
    tokens: tuple
    precision: str
    scaler: str = "none"
    compile: str | None = None        # None (eager) or a torch.compile mode
    bias: bool = True
    clip: bool = True
    attention: str = "sdpa"
    checkpointing: bool = False
    chunked_loss: int = 0
    triton: str | None = None         # mpgpt.fast.TRITON_LAYERS
    gelu_epilogue: bool = False
    fused_loss: bool = False
    fused_clip: bool = False
    fused_ln: bool = False
    bias_in_add: bool = False
    fused_emb: bool = False
    cuda_graph: bool = False
    optim16: str | None = None
    inductor: tuple = ()              # (setting, value) pairs of torch._inductor.config

    # -------------------------------------------------------------------- what it builds

    def train_config(self) -> dict:
        """The TrainConfig fields this recipe sets."""
        return dict(precision=self.precision, scaler=self.scaler, compile=self.compile is not None,
                    compile_mode=self.compile or "default", fused_clip=self.fused_clip,
                    cuda_graph=self.cuda_graph, optim16=self.optim16,
                    model_overrides={"bias": self.bias, "attention": self.attention},
                    **({} if self.clip else {"grad_clip": 0.0}), recipe=self.name)

    def convert_options(self) -> dict:
        """The keyword arguments of mpgpt.fast.convert for this recipe's model."""
        return dict(triton=self.triton,
                    gelu_backward="epilogue" if self.gelu_epilogue else "pass", chunked_loss=self.chunked_loss,
                    fused_loss=self.fused_loss, fused_ln=self.fused_ln, bias_in_add=self.bias_in_add,
                    fused_emb=self.fused_emb)

    def apply(self, model):
        """Convert ``model`` (a reference GPT built with this recipe's bias and attention) in place."""
        from mpgpt.fast import convert  # imported here: Triton is optional, and chapters 1-5 never need it

        convert(model, **self.convert_options())
        model.set_activation_checkpointing(self.checkpointing)
        return model

    def inductor_settings(self):
        """A context in which torch._inductor.config holds this recipe's settings (none: no change).
        Inductor's on-disk graph cache is off meanwhile, so the graphs are compiled under them."""
        if not self.inductor:
            return contextlib.nullcontext()
        import torch._inductor.config as inductor_config
        return inductor_config.patch({**dict(self.inductor), "fx_graph_cache": False})

    def settings(self) -> dict:
        """The settings as benchmark records describe a row (the optional ones only when set)."""
        out = dict(precision=self.precision, scaler=self.scaler, compile=self.compile,
                   triton=True if self.triton == "all" else (self.triton or False), bias=self.bias,
                   checkpointing=self.checkpointing, chunked_loss=self.chunked_loss, attention=self.attention,
                   clip=self.clip, fused_loss=self.fused_loss)
        for key, value in (("fused_clip", self.fused_clip), ("inductor", dict(self.inductor)),
                           ("cuda_graph", self.cuda_graph), ("optim16", self.optim16), ("fused_ln", self.fused_ln),
                           ("fused_emb", self.fused_emb),
                           ("gelu_epilogue", self.gelu_epilogue), ("bias_in_add", self.bias_in_add)):
            if value:
                out[key] = value
        return out

    # -------------------------------------------------------------------- where it runs

    def check_device(self, device) -> None:
        """Raise ValueError, in one line, if a token needs what ``device`` lacks."""
        device = torch.device(device)
        cap = runtime.capability(device) if device.type == "cuda" else None
        for token in self.tokens:
            need = _token(token).needs
            if need == "triton" and cap is not None and importlib.util.find_spec("triton") is None:
                raise ValueError(f"recipe token {token!r} needs Triton, which is not installed here; drop +{token}")
            lacking = ((need in ("cuda", "triton") and cap is None)
                       or (need == "sm90" and cap != (9, 0)))
            if lacking:
                here = "a CPU" if cap is None else f"sm_{cap[0]}{cap[1]}"
                raise ValueError(f"recipe token {token!r} needs {_NEEDS[need]}, and this device is {here}; "
                                 f"drop +{token} or run on such a GPU")


def _token(token: str) -> Token:
    return TOKENS["ln-split<N>"] if _LN_SPLIT.fullmatch(token) else TOKENS[token]


def parse(text: str) -> Recipe:
    """The Recipe a name stands for: an alias of ALIASES, or a precision token then tokens of TOKENS,
    joined by '+'. Raises ValueError, in one line, on a token it does not know."""
    name = ALIASES.get(text.strip(), text.strip())
    tokens = tuple(name.split("+"))
    if tokens[0] not in _PRECISIONS:
        raise ValueError(f"a recipe starts with a precision ({', '.join(_PRECISIONS)}), got {tokens[0]!r} in "
                         f"{text!r}; e.g. bf16+compile")
    fields, inductor = {}, {}
    for i, token in enumerate(tokens):
        split = _LN_SPLIT.fullmatch(token)
        if split:
            inductor.update(ln_split(int(split.group(1))))
            continue
        if token in RETIRED:
            raise ValueError(f"recipe token {token!r} in {text!r}: {RETIRED[token]}; drop +{token}")
        if token not in TOKENS:
            raise ValueError(f"unknown recipe token {token!r} in {text!r}; python -m mpgpt.recipe --list shows them")
        if token in _PRECISIONS and i > 0:
            raise ValueError(f"recipe {text!r} names a precision twice ({tokens[0]!r}, {token!r}); keep one")
        sets = dict(TOKENS[token].sets)
        inductor.update(sets.pop("inductor", {}))
        fields.update(sets)
    recipe = Recipe(name=name, tokens=tokens, inductor=tuple(sorted(inductor.items())), **fields)
    _check(recipe, text)
    return recipe


def _check(r: Recipe, text: str) -> None:
    """Combinations no run can take, refused in one line."""
    fused_mlp = r.triton in ("mlp", "mlp+qkv")
    problems = [
        (r.gelu_epilogue and not fused_mlp, "gelu-epilogue needs the fused MLP: add +triton-mlp or +triton-mlp-qkv"),
        (r.bias_in_add and not r.fused_ln, "bias-in-add adds the biases in the fused residual add: add +fused-ln"),
        (r.fused_loss and r.chunked_loss, "fused-ce and chunked-loss are two ways to compute one loss: keep one"),
        (r.optim16 and r.precision != "bf16", "optim16 trains a bf16 model: start the recipe with bf16"),
        (r.cuda_graph and r.compile not in (None, "default"), "step-graph records the step itself: use +compile, "
                                                              "not a compile mode with CUDA graphs"),
    ]
    for bad, why in problems:
        if bad:
            raise ValueError(f"recipe {text!r}: {why}")


def explain(text: str) -> str:
    """What each token of a recipe switches on, where the code is, the chapter, and what it measured."""
    recipe = parse(text)
    lines = [recipe.name if recipe.name == text else f"{text} = {recipe.name}"]
    width = max(len(t) for t in recipe.tokens)
    for token in recipe.tokens:
        t = _token(token)
        needs = f"; needs {_NEEDS[t.needs]}" if t.needs else ""
        lines.append(f"  {token:<{width}}  {t.what}{needs}")
        lines.append(f"  {'':<{width}}  {t.file}, chapter {t.chapter}")
        if t.measured:
            lines.append(f"  {'':<{width}}  measured: {t.effect()}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpgpt.recipe",
                                description="Explain a training recipe: what each +-joined token switches on, "
                                            "the file that implements it and the chapter that teaches it.")
    p.add_argument("recipe", nargs="?", help="e.g. bf16+compile+fused-ce, or an alias: " + ", ".join(ALIASES))
    p.add_argument("--list", action="store_true", help="list every token and alias")
    args = p.parse_args(argv)
    if args.list or not args.recipe:
        width = max(map(len, TOKENS))
        for token, t in TOKENS.items():
            print(f"{token:<{width}}  {t.what}  [{t.file}, chapter {t.chapter}]")
        for alias, name in ALIASES.items():
            print(f"{alias:<{width}}  = {name}")
        return 0
    try:
        print(explain(args.recipe))
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
