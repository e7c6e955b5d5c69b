"""What the machine under the course can do: the one place the package asks about the GPU (all chapters).

A learner opens a chapter on whatever runtime they get: Colab's free T4 (sm_75: fp16 tensor cores,
no bf16, no fp8), an L4 (sm_89: bf16 and fp8, no Hopper TMA), an A100 (sm_80), an H100/H200
(sm_90), or a laptop without a GPU, where macOS and Windows also lack Triton. Every decision
that depends on the hardware — which precision policies run, whether the Triton kernels compile,
how large a batch fits — is made from the four questions below, asked at call time:

    capability(device)     compute capability (major, minor), None on a CPU
    device_name(device)    "Tesla T4", "NVIDIA H200", or "CPU"
    total_memory(device)   bytes of GPU memory, None on a CPU
    triton_version()       the installed Triton's version, None if it cannot be imported

Because the package calls these through this module (``runtime.capability(...)``, never a copy of
the name), a test can make all of mpgpt believe it runs on a T4 by patching them here, while
Triton's compiler still targets the real GPU (patching ``torch.cuda.get_device_capability``
instead would make Triton build code for the fake GPU, which the real one cannot run).

`current()` gathers the answers into a `Runtime`, and `about()` prints the one line each chapter's
setup cell shows.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

_CAPABILITY: dict = {}


def _cuda_index(device) -> int | None:
    """The CUDA index meant by a torch.device / string / int, or None for a non-CUDA device."""
    if isinstance(device, int):
        return device
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def capability(device=None) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, e.g. (7, 5) T4, (8, 0) A100, (8, 9) L4, (9, 0) H100/H200;
    None for a CPU (or when no GPU is present and `device` is None). Cached per device."""
    idx = _cuda_index(device)
    if idx is None:
        return None
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = tuple(torch.cuda.get_device_capability(idx))
    return _CAPABILITY[idx]


def device_name(device=None) -> str:
    """The GPU's marketing name ("Tesla T4", "NVIDIA H200"), or "CPU"."""
    idx = _cuda_index(device)
    return "CPU" if idx is None else torch.cuda.get_device_name(idx)


def total_memory(device=None) -> int | None:
    """Bytes of memory on a CUDA device (a T4 has about 15 GiB usable), None on a CPU."""
    idx = _cuda_index(device)
    return None if idx is None else torch.cuda.get_device_properties(idx).total_memory


def triton_version() -> str | None:
    """The version of an importable Triton, or None (macOS and Windows have no Triton wheels)."""
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", "unknown")


@dataclass(frozen=True)
class Runtime:
    """What one device offers the course. ``bf16``/``fp8``/``tma`` mean *native* support: a T4
    emulates bf16 in software (``torch.cuda.is_bf16_supported()`` still answers True there), which
    is correct but slow, so the course treats it as absent."""

    device: str                   # "cuda" or "cpu"
    name: str
    capability: tuple[int, int] | None
    memory_bytes: int | None
    triton: str | None            # Triton's version, or None

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def bf16(self) -> bool:
        """bf16 tensor cores (sm_80+). On a CPU, autocast runs bf16 too (for numerics, not speed)."""
        return self.capability is None or self.capability >= (8, 0)

    @property
    def fp8(self) -> bool:
        """fp8 tensor cores: Ada (sm_89, L4) and Hopper (sm_90)."""
        return self.capability is not None and self.capability >= (8, 9)

    @property
    def tma(self) -> bool:
        """Hopper's tensor memory accelerator and wgmma (sm_90): the TMA and warp-specialised kernels."""
        return self.capability is not None and self.capability >= (9, 0)

    @property
    def half_dtype(self) -> torch.dtype:
        """The 16-bit format training should use here: bf16 where it is native, else fp16."""
        return torch.bfloat16 if self.bf16 else torch.float16

    @property
    def memory_gib(self) -> float | None:
        return None if self.memory_bytes is None else self.memory_bytes / 2**30

    def summary(self) -> str:
        if self.on_gpu:
            major, minor = self.capability
            where = f"{self.name} (sm_{major}{minor}, {self.memory_gib:.0f} GiB)"
        else:
            where = f"CPU ({platform.machine() or 'unknown'}, {torch.get_num_threads()} threads)"
        triton = f"triton {self.triton}" if self.triton else "no triton"
        return f"torch {torch.__version__} · {triton} · {where}"


def current(device=None) -> Runtime:
    """The `Runtime` of `device` (default: the current GPU if there is one, else the CPU)."""
    idx = _cuda_index(device)
    if idx is None:
        return Runtime("cpu", "CPU", None, None, triton_version())
    return Runtime("cuda", device_name(idx), capability(idx), total_memory(idx), triton_version())


def about(expected_version: str | None = None) -> str:
    """One line for a chapter's setup cell: the package version, torch, Triton and the device.

    ``expected_version`` is the course release the chapter was written for; a different installed
    version is named so the learner knows why outputs may differ."""
    from mpgpt import __version__

    line = f"mpgpt {__version__} · {current().summary()}"
    if expected_version is not None and expected_version != __version__:
        line += (f" — this chapter was written for mpgpt {expected_version}, so some outputs may differ; "
                 "uninstall mpgpt, restart the runtime and rerun this cell to get that version")
    return line
