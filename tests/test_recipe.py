"""Tests for mpgpt/recipe.py: every recipe name parses, rebuilds the rows the benchmark's old table
spelled out (settings and converted model alike), explains itself, and trains through mpgpt.train."""
import json
import re
import shlex
from pathlib import Path

import nbformat
import pytest
import torch

from mpgpt import recipe
from mpgpt.model import GPT, GPTConfig
from mpgpt.recipe import ALIASES, TOKENS, parse
from recipe_signature import old_rows, signature

ROOT = Path(__file__).resolve().parents[1]


def record_names() -> set:
    """Every configuration name a record holds: rows' "config" and the names its command passed."""
    names = set()

    def walk(value):
        if isinstance(value, dict):
            for key, inner in value.items():
                if key == "config" and isinstance(inner, str):
                    names.add(inner)
                walk(inner)
        elif isinstance(value, list):
            for inner in value:
                walk(inner)

    for path in list((ROOT / "mpgpt" / "records").glob("*.json")) + list((ROOT / "benchmarks" / "records").glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        walk(record)
        words = shlex.split(record.get("command", "") or "")
        if "train" in words:
            for flag in ("--configs", "--max-batch-config", "--real-run-config", "--profile"):
                if flag in words:
                    names.update(n.strip() for n in words[words.index(flag) + 1].split(",") if n.strip())
    return names - {"ladder", "fastest"}  # the benchmark's named lists


# a recipe name as the chapters and pages write it: precision, then +tokens, in backticks or quotes
_NAME = re.compile(r"[`'\"]((?:fp32|tf32|bf16|fp16)[\w-]*(?:\+[\w-]+)+|bf16-master|bf16-nobias|fp16-gradscaler)[`'\"]")


def chapter_names() -> set:
    names = set()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            names.update(_NAME.findall(cell.source))
    for path in sorted((ROOT / "book").glob("*.md")):
        names.update(_NAME.findall(path.read_text(encoding="utf-8")))
    return names


def test_every_name_in_the_records_and_the_chapters_parses():
    names = record_names() | chapter_names()
    assert len(record_names()) >= 40, "the walk found too few names: has the record format changed?"
    bad = []
    for name in sorted(names):
        try:
            assert parse(name).name == name
        except ValueError as e:
            bad.append(f"{name}: {e}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", sorted(old_rows()))
def test_each_old_row_is_rebuilt_exactly(name):
    """The row's settings as the old table spelled them, and the model the converter builds has the
    same layers, fused functions and switches as the old model methods made, in the old order."""
    want = old_rows()[name]
    if "+streamk-dw" in name:  # a token that did not pay and left: refused in one line that says so
        with pytest.raises(ValueError, match="left the package; git history keeps it; drop \\+streamk-dw"):
            parse(name)
        return
    r = parse(name)
    assert r.settings() == want["settings"]
    if r.gelu_epilogue:  # withdrawn (fast/mlp.py says why): the row parses, building it is refused
        with pytest.raises(ValueError, match="is withdrawn"):
            r.apply(GPT(GPTConfig.preset("tiny", bias=r.bias, attention=r.attention)))
        return
    fields = r.train_config()
    for key, value in want["train_config"].items():
        if key == "grad_clip":
            assert fields.get("grad_clip", 1.0) == value
        else:
            assert fields[key] == value, key
    model = GPT(GPTConfig.preset("tiny", bias=r.bias, attention=r.attention))
    assert signature(r.apply(model)) == want["model"]


def test_the_aliases_are_the_fastest_rows_of_the_records():
    assert ALIASES["fastest"] in record_names() and ALIASES["fastest-nobias"] in record_names()
    fastest, nobias = parse("fastest"), parse("fastest-nobias")
    assert fastest.bias and fastest.fused_emb and fastest.triton == "mlp+qkv"
    assert not nobias.bias and nobias.triton == "mlp" and nobias.fused_emb
    # GELU's backward in the epilogue is withdrawn, and +bias-in-add paid only beside it
    assert not (fastest.gelu_epilogue or nobias.gelu_epilogue or fastest.bias_in_add)
    assert fastest.name == ALIASES["fastest"]


def test_the_table_names_real_files_and_records():
    for token, t in TOKENS.items():
        assert (ROOT / t.file).exists(), f"{token}: {t.file}"
        assert t.chapter and t.what, token
        if t.measured:  # two rows of one record: with the token, and the row it is read against
            _, row, against = t.measured
            assert token in parse(row).tokens or token in ("nobias", "bf16-nobias"), token
            assert re.fullmatch(rf"\d\.\d{{3}}x the step speed of {re.escape(against)} \(record {t.record}\)", t.effect()), token


@pytest.mark.parametrize("text, words", [
    ("bf16+compile+foo", "unknown recipe token 'foo'"),
    ("compile+bf16", "starts with a precision"),
    ("bf16+fp16", "a precision twice"),
    ("bf16+compile+gelu-epilogue", "needs the fused MLP"),
    ("bf16+fused-ce+chunked-loss", "keep one"),
    ("bf16+bias-in-add", "add +fused-ln"),
    ("fp16+optim16", "start the recipe with bf16"),
])
def test_a_bad_recipe_is_refused_in_one_line(text, words):
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        parse(text)
    assert "\n" not in str(info.value)


def test_a_token_the_device_cannot_run_is_refused_in_one_line():
    parse("bf16+compile+chunked-loss").check_device("cpu")  # runs anywhere
    for text, token in (("bf16+fused-ce", "fused-ce"), ("bf16+compile+step-graph", "step-graph"),
                        ("bf16+triton-mlp+gelu-epilogue", "triton-mlp")):
        with pytest.raises(ValueError, match=f"'{token}' needs .* this device is a CPU; drop \\+{token}") as info:
            parse(text).check_device("cpu")
        assert "\n" not in str(info.value)


def test_the_command_line_explains_each_token_and_where_it_is(capsys):
    assert recipe.main(["fastest"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"fastest = {ALIASES['fastest']}")
    for token in parse("fastest").tokens:
        assert token in out and TOKENS[token].file in out
    assert recipe.main(["--list"]) == 0
    assert "ln-split<N>" in capsys.readouterr().out
    assert recipe.main(["bf16+nonsense"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nonsense'" in err


def test_the_inductor_tokens_hold_only_inside_their_context():
    import torch._inductor.config as inductor_config

    r = parse("bf16+compile+no-mix-order+ln-split64")
    assert dict(r.inductor) == {"triton.mix_order_reduction": False, "triton.mix_order_reduction_split_size": 64}
    before = inductor_config.triton.mix_order_reduction
    with r.inductor_settings():
        assert inductor_config.triton.mix_order_reduction is False
    assert inductor_config.triton.mix_order_reduction == before


def test_train_runs_a_recipe_on_a_cpu_with_checkpoint_and_resume(tmp_path, capsys):
    """The acceptance command: `python -m mpgpt.train --recipe bf16 --preset tiny --device cpu --steps 3`;
    the checkpoint records the recipe, and a resume continues it."""
    from mpgpt import train

    args = ["--recipe", "bf16", "--preset", "tiny", "--device", "cpu", "--no-progress", "--sample-tokens", "0",
            "--batch-size", "4", "--block-size", "32", "--eval-interval", "2"]
    assert train.main(args + ["--steps", "3", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "trained 3 steps" in out and "with bf16" in out
    state = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=False)
    assert state["train_config"]["recipe"] == "bf16" and state["train_config"]["precision"] == "bf16"
    assert train.main(args + ["--steps", "4", "--resume", str(tmp_path / "ckpt.pt")]) == 0
    assert "resumed at step 3" in capsys.readouterr().out


def test_train_refuses_a_recipe_the_device_cannot_run_and_a_flag_the_recipe_sets(capsys):
    from mpgpt import train

    assert train.main(["--recipe", "fastest", "--device", "cpu", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs" in err and "drop +" in err
    assert train.main(["--recipe", "bf16", "--precision", "fp32", "--device", "cpu"]) == 2
    assert "--recipe sets --precision itself" in capsys.readouterr().err
