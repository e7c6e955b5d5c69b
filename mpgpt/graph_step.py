"""A whole training step recorded once as a CUDA graph and replayed (``TrainConfig.cuda_graph``;
chapter 7 measures it).

Why: a compiled GPT-2 step launches several hundred kernels, plus the clip and the optimizer
from eager Python. Whenever the host falls behind, the GPU waits with nothing to run. A CUDA graph
records every launch of one step (forward, backward, clip, AdamW, zeroing the gradients), and
``replay()`` hands the whole step to the GPU in one call. The host then has almost nothing left
to do per step.

How (the "whole network capture" recipe of PyTorch's CUDA-graphs notes):
1. A few warm-up steps run normally on a side stream. They compile the model, create the
   optimizer's state and let cuBLAS and cuDNN make their workspaces: none of that may happen
   while a graph records.
2. The next step is *recorded*. Recording runs no kernel, so the step is then replayed once to
   take it for real.
3. Every later step copies its batch into the recorded input buffers, sets the learning rate in
   place, and replays.

What the recorded step needs, and the trainer arranges:
- the same tensors every step: fixed input buffers, and an optimizer built with
  ``capturable=True`` and the learning rate as a device tensor (a Python float would be baked
  into the graph);
- no host-device sync and no Python decision on a device value inside the step. The bf16/fp32
  step has neither. Nor has the package's loss-scaled fp16 step: its scaler keeps the scale, the
  overflow flag and the growth counter in device tensors, updated in place, and the fused AdamW
  skips an overflowing step on the device. torch's GradScaler is refused: its bookkeeping
  lives in its own Python state, which the recording has not been tested against;
- the step's outputs copied out after each replay, since the next replay overwrites them.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["GraphedStep"]


class GraphedStep:
    """Run ``body(batches)`` eagerly for ``warmup`` calls, then record it once and replay it.

    ``body`` takes a list of (x, y) device tensors and returns a tuple of device tensors. It must
    read nothing per step but those tensors and device state that it updates in place.
    """

    def __init__(self, body: Callable[[Sequence[tuple[torch.Tensor, torch.Tensor]]], tuple], warmup: int = 3):
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 (compiling and lazy initialisation must happen "
                             f"before recording), got {warmup}")
        self.body = body
        self.warmup = warmup
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.outputs: tuple = ()
        self.side = None

    @property
    def recorded(self) -> bool:
        return self.graph is not None

    def reset(self) -> None:
        """Forget the recording (e.g. after the optimizer's state tensors were replaced by a checkpoint
        load: the graph would still write the old ones). The next calls warm up and record again."""
        self.graph, self.inputs, self.outputs, self.calls = None, [], (), 0

    def __call__(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        if self.graph is None and self.calls < self.warmup:
            self.calls += 1
            return self._on_side_stream(batches)
        if self.graph is None:
            self._record(batches)
        else:
            if len(batches) != len(self.inputs):
                raise ValueError(f"the recorded step takes {len(self.inputs)} micro-batches, got {len(batches)}")
            for (sx, sy), (x, y) in zip(self.inputs, batches):
                if x.shape != sx.shape or y.shape != sy.shape:
                    raise ValueError(f"the recorded step takes batches of shape {tuple(sx.shape)}, got "
                                     f"{tuple(x.shape)}; a CUDA-graph step needs a fixed batch shape")
                sx.copy_(x, non_blocking=True)
                sy.copy_(y, non_blocking=True)
        self.graph.replay()
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in self.outputs)

    def _on_side_stream(self, batches) -> tuple:
        # Warm-up on a side stream, as the CUDA-graphs notes ask: some libraries set up per-stream
        # state on first use, and that must not happen while recording.
        if self.side is None:
            self.side = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            out = self.body(batches)
        current.wait_stream(self.side)
        return out

    def _record(self, batches) -> None:
        torch.cuda.synchronize()
        # batch shape: (B, T) token ids; the buffers hold this step's batch when the replay runs
        self.inputs = [(x.clone(), y.clone()) for x, y in batches]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs = tuple(self.body(self.inputs))
        self.graph = graph
