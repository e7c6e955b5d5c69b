"""The CPU path of ``python -m mpgpt.bench ddp-by-hand`` (2 gloo ranks); the NCCL path needs 2 GPUs.

The timings themselves are not checked (a shared CI machine makes them noise); what is checked is
that every variant ran on every rank, that the record says what it measured, and what each
variant's report counts, which do not depend on the machine.
"""
import json

import pytest
import torch

from mpgpt.bench import ddp_by_hand as bench_mod


def test_a_small_cpu_run_writes_a_record_with_every_variant(tmp_path, capsys):
    result = bench_mod.bench(device="cpu", nproc=2, preset="tiny", batch_size=2, block_size=16, bucket_mb=0.05,
                             warmup=0, steps=1, out_dir=tmp_path, tag="test")
    record = json.loads(open(result["path"]).read())
    assert result["path"].endswith("_test.json") and record["environment"]["command"].startswith(
        "python -m mpgpt.bench ddp-by-hand --device cpu --nproc 2")
    assert record["settings"]["backend"] == "gloo" and record["settings"]["world_size"] == 2
    rows = {r["variant"]: r for r in record["rows"]}
    assert list(rows) == bench_mod.VARIANTS
    for r in rows.values():
        assert r["ms_per_step_median"] > 0 and r["tokens_per_s"] > 0
    # Counted from the model, not assumed: one all-reduce per parameter tensor, or per bucket.
    from mpgpt.model import GPT, GPTConfig

    params = list(GPT(GPTConfig.preset("tiny", block_size=16)).parameters())
    nbytes = sum(p.numel() * 4 for p in params)
    n_buckets = len(bench_mod.hand.plan_buckets(params, 0.05))
    assert rows["per-parameter"]["collectives_per_step"] == len(params)
    assert rows["bucketed"]["collectives_per_step"] == rows["overlapped"]["collectives_per_step"] == n_buckets > 1
    assert rows["overlapped"]["launched_in_backward"] == n_buckets and rows["bucketed"]["launched_in_backward"] == 0
    assert rows["per-parameter"]["bytes_per_step"] == rows["overlapped"]["bytes_per_step"] == nbytes
    assert "exposed_comm_ms" not in rows["local"] and "exposed_comm_ms" in rows["ddp"]
    assert "overlapped" in capsys.readouterr().out


def test_defaults_and_refusals():
    assert bench_mod.defaults("cuda")["preset"] == "gpt2" and bench_mod.defaults("cuda")["precision"] == "bf16"
    assert bench_mod.defaults("cpu")["preset"] == "tiny"
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="needs 2 or more GPUs"):
            bench_mod.bench(device="cuda")
    with pytest.raises(ValueError, match="unknown variant"):
        bench_mod.bench(device="cpu", variants=["ddp", "fast"])
    with pytest.raises(SystemExit):
        bench_mod.main(["--bucket-mb", "0"])
