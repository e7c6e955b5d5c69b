"""What a converted model switches on, as plain data: for comparing two ways of building a recipe's model."""
import functools


def _fn(f):
    if f is None:
        return None
    if isinstance(f, functools.partial):
        return {"func": f"{f.func.__module__.split('.')[-1]}.{f.func.__name__}", "keywords": dict(sorted(f.keywords.items()))}
    return {"func": f"{f.__module__.split('.')[-1]}.{f.__name__}", "keywords": {}}


def signature(model) -> dict:
    """The model-level switches and, for every block, each layer's class and its fused function."""
    blocks = []
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        blocks.append({
            "attn.c_attn": type(attn.c_attn).__name__, "attn.c_proj": type(attn.c_proj).__name__,
            "mlp.c_fc": type(mlp.c_fc).__name__, "mlp.c_proj": type(mlp.c_proj).__name__,
            "mlp.act": type(mlp.act).__name__,
            "mlp.c_fc.activation": getattr(mlp.c_fc, "activation", None),
            "attn.fused_qkv": _fn(getattr(attn, "fused_qkv", None)), "mlp.fused": _fn(getattr(mlp, "fused", None)),
        })
    return {
        "bias": model.config.bias, "attention": model.config.attention,
        "activation_checkpointing": model.activation_checkpointing,
        "loss_chunk_rows": getattr(model, "loss_chunk_rows", 0),
        "fused_loss": _fn(getattr(model, "fused_loss", None)),
        "fused_layer_norm": _fn(getattr(model, "fused_layer_norm", None)),
        "bias_in_add": getattr(model, "bias_in_add", False),
        "fused_embedding": _fn(getattr(model, "fused_embedding", None)),
        "blocks": blocks,
    }


def old_rows() -> dict:
    """The training benchmark's rows as the hand-written table once expanded them (tests/data), by name."""
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "data" / "train_configs_before.json").read_text(encoding="utf-8"))
