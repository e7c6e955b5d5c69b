"""mpgpt.runtime is the one place the package asks about the device, so patching it makes the whole
package decide as if on another GPU (the capability rehearsal relies on that)."""
import re
from pathlib import Path

import pytest
import torch

import mpgpt
from mpgpt import runtime
from mpgpt.kernels import env
from mpgpt.precision import default_precision, resolve_precision, supported_precisions

PACKAGE = Path(mpgpt.__file__).parent
# Recording the real hardware in a result file's environment is allowed, and so is the SM count
# (the persistent kernels' grid size); deciding from anything else is not.
ALLOWED = ("results.py", "bench/kernels.py")
DEVICE_QUERIES = re.compile(r"torch\.cuda\.(get_device_capability|get_device_name|get_device_properties)\(")


def fake(monkeypatch, capability, name, memory_gib):
    monkeypatch.setattr(runtime, "capability", lambda device=None: capability)
    monkeypatch.setattr(runtime, "device_name", lambda device=None: name)
    monkeypatch.setattr(runtime, "total_memory", lambda device=None: int(memory_gib * 2**30))
    monkeypatch.setattr(runtime, "_cuda_index", lambda device=None: 0)


def test_no_module_but_runtime_asks_torch_about_the_device():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "runtime.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            allowed = str(path.relative_to(PACKAGE)) in ALLOWED or "multi_processor_count" in line
            if DEVICE_QUERIES.search(line) and not allowed:
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "ask mpgpt.runtime instead:\n" + "\n".join(offenders)


def test_the_checker_sees_a_planted_query():
    assert DEVICE_QUERIES.search("    cc = torch.cuda.get_device_capability(0)")
    assert DEVICE_QUERIES.search("name = torch.cuda.get_device_name(device)")


def test_cpu_runtime():
    rt = runtime.current("cpu")
    assert rt.device == "cpu" and rt.capability is None and not rt.fp8 and not rt.tma
    assert rt.bf16 and rt.half_dtype is torch.bfloat16  # CPU autocast runs bf16 (for the numerics)
    assert "CPU" in rt.summary() and torch.__version__ in rt.summary()


@pytest.mark.parametrize("cap, name, bf16, fp8, tma, policies", [
    ((7, 5), "Tesla T4", False, False, False, ("fp32", "fp16", "fp16-master")),
    ((8, 0), "NVIDIA A100-SXM4-40GB", True, False, False, None),
    ((8, 9), "NVIDIA L4", True, True, False, None),
    ((9, 0), "NVIDIA H200", True, True, True, None),
])
def test_a_patched_runtime_reaches_every_decision(monkeypatch, cap, name, bf16, fp8, tma, policies):
    fake(monkeypatch, cap, name, 15)
    rt = runtime.current("cuda")
    assert (rt.capability, rt.name, rt.bf16, rt.fp8, rt.tma) == (cap, name, bf16, fp8, tma)
    assert round(rt.memory_gib) == 15 and f"sm_{cap[0]}{cap[1]}" in rt.summary()
    assert env.capability(0) == cap                      # the kernels package
    assert default_precision("cuda") == ("bf16" if bf16 else "fp16")
    if policies:
        assert supported_precisions("cuda") == policies
        with pytest.raises(ValueError, match=f"{name} is sm_75"):
            resolve_precision("bf16", "cuda")
    else:
        assert "bf16-master" in supported_precisions("cuda")
    for policy in supported_precisions("cuda"):          # everything offered is accepted
        resolve_precision(policy, "cuda")


def test_about_names_the_version_and_a_mismatch():
    line = mpgpt.about()
    assert line.startswith(f"mpgpt {mpgpt.__version__} · torch {torch.__version__}") and "\n" not in line
    assert "written for mpgpt 0.0.1" in mpgpt.about("0.0.1")
    assert "written for" not in mpgpt.about(mpgpt.__version__)


def test_no_triton_is_reported(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def blocked(name, *args, **kwargs):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)
    assert runtime.triton_version() is None
    assert "no triton" in runtime.current("cpu").summary()


def test_cell_skipper_follows_what_skipped_cells_define():
    from mpgpt.notebook import CellSkipper
    skipper = CellSkipper({"triton", "tl"}, reason="needs Triton")
    kernel_cell = "@triton.jit\ndef k(x_ptr, B: tl.constexpr):\n    pass\n\ndef helper(a):\n    return a\n"
    assert skipper.transform(kernel_cell.splitlines(True)) == ["print('[skipped: needs Triton]')\n"]
    assert skipper.needs_missing("k[(1,)](x)")               # uses what the skipped cell defined
    assert skipper.needs_missing("y = helper(3)")
    assert not skipper.needs_missing("import torch\nz = torch.ones(3).sum()")
    assert not skipper.needs_missing("print(z)")             # z was defined by a cell that ran
    assert skipper.needs_missing("print(y)")                 # y by one that was skipped
    assert not skipper.needs_missing("y = 4\nprint(y)")      # a cell that defines y itself runs
    assert not skipper.needs_missing("print(y)")             # and y is available from then on
