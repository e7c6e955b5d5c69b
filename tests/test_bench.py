"""The benchmark command lines refuse what they cannot honour before any measurement starts."""
import pytest
import torch

from mpgpt.bench import ddp, training
from mpgpt.recipe import parse
from recipe_signature import old_rows


def test_a_bad_tag_is_refused_before_the_run(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        training.main(["--configs", "fp32", "--tag", "my_run", "--out-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--tag" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_unknown_configuration_names_are_refused_up_front(capsys, tmp_path):
    assert training.main(["--configs", "fp32", "--real-run-config", "bf16-typo", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'bf16-typo'" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("config", ["bf16-nobias", "bf16+checkpointing", "fp16-gradscaler", "bf16+compile+cudagraphs",
                                    "bf16+triton"])
def test_the_distributed_benchmark_refuses_options_it_would_drop(config):
    with pytest.raises(ValueError, match="does not apply"):
        ddp.check_supported(config)


@pytest.mark.parametrize("config", ["fp32", "bf16", "fp16", "bf16+compile", "fp16+compile"])
def test_the_distributed_benchmark_takes_the_plain_configurations(config):
    ddp.check_supported(config)  # no error



def test_a_profiled_row_keeps_the_profilers_table():
    """--profile CONFIG stores the profiler's table in that row (sorted by CPU time on a CPU)."""
    rows = training.bench_train(["fp32"], preset="tiny", batch_size=2, block_size=16, warmup=1, steps=2,
                                profile="fp32")
    (row,) = rows
    assert "Self CPU" in row["profile"] and "aten::" in row["profile"]


def test_matrix_products_are_listed_per_shape_and_per_call():
    """ops_by_shape keeps the matrix operators (torch's and the package's), divides by the steps and
    the calls, drops operators without device time, and puts the largest total first."""
    from types import SimpleNamespace as Event

    averages = [
        Event(key="aten::mm", input_shapes=[[12288, 768], [768, 3072]], count=24, device_time_total=2400.0),
        Event(key="mpgpt::matmul", input_shapes=[[3072, 12288], [12288, 768], [], []], count=36,
              device_time_total=3834.0),
        Event(key="aten::add", input_shapes=[[4], [4]], count=99, device_time_total=9999.0),  # not a product
        Event(key="aten::addmm", input_shapes=[[3], [2, 4], [4, 3]], count=3, device_time_total=0.0),  # CPU only
    ]
    rows = training.ops_by_shape(averages, steps=3)
    assert [r["op"] for r in rows] == ["mpgpt::matmul", "aten::mm"]
    assert rows[0] == {"op": "mpgpt::matmul", "input_shapes": [[3072, 12288], [12288, 768], [], []],
                       "calls_per_step": 12.0, "device_us_per_call": 106.5, "device_us_per_step": 1278.0}
    assert rows[1]["calls_per_step"] == 8.0 and rows[1]["device_us_per_call"] == 100.0


def test_profile_takes_a_list_and_refuses_an_unknown_name(capsys):
    assert training.main(["--configs", "fp32", "--profile", "fp32,no-such-config"]) == 2
    assert "'no-such-config'" in capsys.readouterr().err


def test_every_row_compiles_afresh_and_inductor_settings_bypass_the_graph_cache(monkeypatch):
    """Dynamo would hand a row the code compiled for an earlier row of the same model structure,
    so a row that differs only in its Inductor settings would time the earlier row's kernels.
    Each row starts from a reset, and a row with settings builds and runs its trainer with them
    in force and the graph cache off."""
    import torch
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config.triton, "mix_order_reduction_split_size"):
        pytest.skip("this torch's Inductor has no mix-order reduction settings")
    # Whatever the environment says; patched through the config module, which restores it (monkeypatch
    # would delete the entry on undo, since it is not in the module's __dict__).
    with inductor_config.patch(fx_graph_cache=True):
        events = []
        monkeypatch.setattr(torch._dynamo, "reset", lambda: events.append("reset"))
        split = "triton.mix_order_reduction_split_size"

        def settings():
            return inductor_config.triton.mix_order_reduction_split_size, inductor_config.fx_graph_cache

        def fake_trainer(name, *args, **kwargs):
            events.append(("build", name, settings()))
            return object()

        def fake_steps(trainer, warmup, steps):   # the steps compile: the settings must hold here too
            events.append(("steps", settings()))
            raise RuntimeError("stop here: no step is needed")

        monkeypatch.setattr(training, "make_trainer", fake_trainer)
        monkeypatch.setattr(training, "_time_steps", fake_steps)
        base = "bf16+compile+fused-ce+fused-clip+step-graph"
        assert parse(base + "+ln-split64").settings()["inductor"] == {split: 64}
        rows = training.bench_train([base, base + "+ln-split64", base])
        assert all("stop here" in row["error"] for row in rows)
        plain, tuned = (None, True), (64, False)
        assert events == ["reset", ("build", base, plain), ("steps", plain),
                          "reset", ("build", base + "+ln-split64", tuned), ("steps", tuned),
                          "reset", ("build", base, plain), ("steps", plain)]


def test_the_fastest_list_is_the_aliases_and_the_baseline():
    # `--configs fastest`: the last rung and its bias-free twin, each with the tied embedding's
    # gradient in place, the baseline, and the first row again; GELU's backward in the epilogue is
    # withdrawn (fast/mlp.py says why)
    fastest = training.expand_configs("fastest")
    assert fastest[0] == fastest[-1] == training.LADDER[8].replace("+fused-ln+step-graph", "+fused-ln+fused-emb+step-graph")
    assert training.LADDER[9].replace("+step-graph", "+fused-emb+step-graph") in fastest
    assert "bf16+compile" in fastest and all(parse(name) for name in fastest)
    assert not any("gelu-epilogue" in name for name in fastest)
    assert fastest[:2] == [parse("fastest").name, parse("fastest-nobias").name]


def test_the_gelu_epilogue_rows_still_parse_and_are_refused_in_one_line_when_built():
    """The records' "+gelu-epilogue" rows parse (the name says what was measured), but building one
    is refused: GELU's backward in the epilogue is withdrawn."""
    rows = [name for name in old_rows() if "+gelu-epilogue" in name]
    assert len(rows) >= 2 and any("nobias" in name for name in rows), rows
    for name in rows:
        assert parse(name).settings()["gelu_epilogue"]
    with pytest.raises(ValueError, match="is withdrawn") as info:
        training.make_trainer(rows[0], preset="tiny", batch_size=2, block_size=16, device="cpu", compile=False,
                              cuda_graph=False, optim16=None, precision="fp32", steps=1)
    assert "\n" not in str(info.value)


def test_the_bias_in_add_row_differs_from_its_twin_only_there_and_moves_every_c_proj_bias():
    """The "+bias-in-add" row is the fastest row with biases plus c_proj's biases added in the fused
    residual add, and the trainer it builds moves all of them there (every residual add after the
    first LayerNorm gets one)."""
    rows = [name for name in old_rows() if "+bias-in-add" in name]
    assert len(rows) == 1
    twin = parse(rows[0].replace("+bias-in-add", "")).settings()
    assert parse(rows[0]).settings() == {**twin, "bias_in_add": True}
    # built without +gelu-epilogue, which is withdrawn (fast/mlp.py says why)
    built = training.make_trainer(rows[0].replace("+gelu-epilogue", ""), preset="tiny", batch_size=2, block_size=16,
                                  device="cpu", compile=False, cuda_graph=False, optim16=None, precision="fp32", steps=1)
    model, seen = built.model, []
    add_ln = model.fused_layer_norm
    model.fused_layer_norm = lambda *a, branch_bias=None, **k: seen.append(branch_bias) or add_ln(
        *a, branch_bias=branch_bias, **k)
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx)
    biases = [m.c_proj.bias for b in model.transformer.h for m in (b.attn, b.mlp)]
    assert seen[0] is None and len(seen) == 1 + len(biases) and all(a is b for a, b in zip(seen[1:], biases))


def test_the_ladder_is_one_change_per_rung_and_expands_from_its_name():
    """`--configs ladder` stands for LADDER. Its rungs up to the last one with biases each change one
    setting of the rung before, except where the 16-bit AdamW comes in and takes over the clip."""
    assert training.expand_configs("ladder") == training.LADDER
    assert training.expand_configs("fp32, ladder,") == ["fp32"] + training.LADDER
    assert all(parse(name) for name in training.LADDER)
    last = training.LADDER.index("bf16+compile+fused-ce+optim16-mantissa+triton-mlp-qkv+fused-ln+step-graph+no-mix-order")
    for before, after in zip(training.LADDER[:last], training.LADDER[1:last + 1]):
        old, new = parse(before).settings(), parse(after).settings()
        changed = {k for k in set(old) | set(new) if old.get(k) != new.get(k)}
        assert len(changed) == 1 or changed == {"optim16", "fused_clip"}, f"{before} -> {after} changes {sorted(changed)}"


def test_an_unknown_name_beside_the_ladder_is_still_refused_up_front(capsys, tmp_path):
    assert training.main(["--configs", "ladder,bf16+nonsense", "--out-dir", str(tmp_path)]) == 2
    assert "bf16+nonsense" in capsys.readouterr().err


def test_every_swept_tile_configuration_computes_the_right_result():
    """The kernel bench times these configurations on a GPU and a sweep may make one the default:
    each must be a valid configuration that computes the right thing. Here in the interpreter, on
    small fresh inputs with edges in both dimensions (rows not a multiple of ROWS, columns not a
    multiple of the column block), against torch's ops in fp32."""
    from mpgpt.bench import kernels as kb
    from mpgpt.kernels import gelu
    from mpgpt.fast import heads, layernorm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g, z = torch.randn(150, 1100, device=device), 3 * torch.randn(150, 1100, device=device)
    ref_dz = torch.ops.aten.gelu_backward(g, z, approximate="tanh")
    for config in kb.GELU_BACKWARD_CONFIGS:
        dz, db = gelu.gelu_backward_bias(g, z, config=config)
        assert torch.allclose(dz, ref_dz, rtol=1e-4, atol=1e-5), config
        assert torch.allclose(db, ref_dz.sum(0), rtol=1e-4, atol=1e-3), config

    dq, dk, dv = (torch.randn(2, 3, 70, 40, device=device) for _ in range(3))
    ref_qkv, ref_db = heads.merge_heads_reference(dq, dk, dv)
    for config in kb.MERGE_HEADS_CONFIGS:
        d_qkv, db = heads.merge_heads_bias(dq, dk, dv, config=config)
        assert torch.equal(d_qkv, ref_qkv), config
        assert torch.allclose(db, ref_db, rtol=1e-5, atol=1e-4), config

    x, dy, dres = (torch.randn(150, 300, device=device) for _ in range(3))
    w = 1 + 0.2 * torch.randn(300, device=device)
    var, mean = torch.var_mean(x, dim=1, correction=0)
    rstd = torch.rsqrt(var + 1e-5)
    ref = layernorm.layer_norm_backward_reference(dy, x, mean, rstd, w, dres)
    for config in kb.LAYER_NORM_CONFIGS:
        got = layernorm.layer_norm_backward(dy, x, mean, rstd, w, dres, config=config)
        for a, b in zip(got, ref):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), config


def test_the_ladder_is_read_rung_by_rung_and_the_rows_after_it_against_their_twins():
    """ladder_steps: each rung of the climb against the rung before it, each row after the climb
    against its twin, the step-time ratio the right way round, a slower rung flagged, and a rung
    that failed left out together with the comparison that would need it."""
    assert set(training.LADDER_TWINS) | set(training.LADDER_TWINS.values()) <= set(training.LADDER)
    ms = {name: 30.0 - i for i, name in enumerate(training.LADDER)}
    ms[training.LADDER[3]] = 40.0                              # a rung slower than the one before
    rows = [{"config": n, "ms_per_step_median": v, "tokens_per_s": 1, "peak_memory_gib": 6.0} for n, v in ms.items()]
    rows[5] = {"config": training.LADDER[5], "error": "out of memory"}
    steps = {s["config"]: s for s in training.ladder_steps(rows)}
    assert training.LADDER[5] not in steps
    assert steps[training.LADDER[6]]["against"] is None        # its rung failed: nothing to read it against
    assert steps[training.LADDER[0]]["against"] is None
    for before, after in zip(training.LADDER[:5], training.LADDER[1:5]):
        s = steps[after]
        assert s["against"] == before and s["speedup"] == ms[before] / ms[after]
        assert s["slower"] == (after == training.LADDER[3])
    assert steps[training.LADDER[1]]["changes"] == "fused_loss=True"
    for row, twin in training.LADDER_TWINS.items():
        assert steps[row]["against"] == twin and steps[row]["speedup"] == ms[twin] / ms[row]
    assert steps["fp16+compile"]["changes"] == "precision='fp16', scaler='dynamic'"


def test_the_partials_part_times_the_tables_the_kernels_leave(monkeypatch):
    """bench_partials times tables of the shapes partial_tables names: the shapes the one-pass
    kernels hand to sum_partials at their GPU tiles (on the GPU, or in the interpreter without one; at
    a small size with rows that do not fill the last row group)."""
    from mpgpt.bench import kernels as kb
    from mpgpt.kernels import gelu, partials
    from mpgpt.fast import heads, layernorm

    seen = []
    real = partials.sum_partials
    monkeypatch.setattr(partials, "sum_partials", lambda part, dtype=torch.float32: seen.append(part.shape) or real(part, dtype))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, T, n_head, hs = 3, 100, 2, 24
    M, C = B * T, n_head * hs
    x, dy = torch.randn(M, C, device=device), torch.randn(M, C, device=device)
    var, mean = torch.var_mean(x, dim=1, correction=0)
    layernorm.layer_norm_backward(dy, x, mean, torch.rsqrt(var + 1e-5), torch.ones(C, device=device),
                                  config=layernorm._CONFIG)
    gelu.gelu_backward_bias(torch.randn(M, 4 * C, device=device), torch.randn(M, 4 * C, device=device),
                            config=gelu._BIAS_CONFIG)
    heads.merge_heads_bias(*(torch.randn(B, n_head, T, hs, device=device) for _ in range(3)), config=heads._CONFIG)
    tables = kb.partial_tables(M=M, C=C)
    assert seen == [tables[name][0] for name in ("layer_norm", "gelu", "merge_heads")]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--configs", ""], "names no configuration"),
    (["--configs", " , "], "names no configuration"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--out-dir", "/proc/mpgpt-bench"], "cannot hold the result"),
])
def test_train_benchmark_refuses_what_it_cannot_measure_before_the_run(capsys, tmp_path, argv, message):
    argv = ["--configs", "fp32", "--out-dir", str(tmp_path)] + argv
    assert training.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []


def test_train_benchmark_refuses_a_file_as_out_dir(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    assert training.main(["--configs", "fp32", "--out-dir", str(tmp_path / "f")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusals")
def test_benchmarks_on_a_cpu_refuse_or_fail_loudly(capsys, tmp_path):
    assert ddp.main(["--out-dir", str(tmp_path)]) == 2  # at once, not after minutes of silence
    assert "this machine has none" in capsys.readouterr().err
    # tf32 does not exist on a CPU: every row fails, so the run fails (its errors are still written down)
    assert training.main(["--configs", "tf32", "--preset", "tiny", "--steps", "1", "--warmup", "0",
                          "--out-dir", str(tmp_path)]) == 1
    assert "every configuration failed" in capsys.readouterr().err
    assert len(list(tmp_path.glob("train_*.json"))) == 1
