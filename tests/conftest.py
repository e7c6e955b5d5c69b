"""Shared pytest configuration: GPU markers skip with a reason when no suitable GPU is present."""
import os

import pytest
import torch

# mpgpt first: without a GPU it sets TRITON_INTERPRET=1, which Triton reads when it decorates its own
# helpers at `import triton`. A test module that imported triton before mpgpt would leave those
# helpers compiled-mode in this process, and every interpreted kernel would then fail ("Cannot call
# @triton.jit'd outside of the scope of a kernel").
import mpgpt  # noqa: E402,F401


def _capability():
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def pytest_collection_modifyitems(config, items):
    cap = _capability()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine")
    skip_sm80 = pytest.mark.skip(reason=f"needs compute capability >= 8.0 (have {cap})")
    for item in items:
        if "gpu" in item.keywords and cap is None:
            item.add_marker(skip_gpu)
        if "sm80" in item.keywords and (cap is None or cap < (8, 0)):
            item.add_marker(skip_sm80)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs on every run: seed from the OS, and print it so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})")  # pytest shows a failing test's captured output
    yield seed
