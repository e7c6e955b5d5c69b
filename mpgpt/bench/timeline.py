"""Where a GPU step's time goes on the timeline: busy, idle, and who the GPU waited for (chapter 7).

A profiler table sums each kernel's time; it cannot say whether the GPU sat idle between kernels,
nor why. This reads the profiler's trace (the Chrome-trace JSON that ``export_chrome_trace``
writes) instead:

- **busy**: the union of all kernel, memcpy and memset intervals;
- **idle**: the rest of the span from the first GPU activity to the last;
- each gap is **host-late** when the launch call of the kernel after it returned only after the
  GPU had gone idle (the GPU waited for the host), else **device-side** (the kernel had been queued
  in time; the gap is the GPU's own cost of starting the next kernel).

Host-late gaps are charged to the host operation that was launching (the innermost profiler range
around the launch call), which names the code to change.
"""
from __future__ import annotations

import collections

__all__ = ["timeline_summary"]

_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CATEGORIES = ("cpu_op", "user_annotation")


def _innermost(ranges, ts):
    """The shortest host range (sorted by start) that contains time ``ts``, or None."""
    best = None
    for r in ranges:
        if r["ts"] > ts:
            break
        if r["ts"] + r["dur"] >= ts and (best is None or r["dur"] < best["dur"]):
            best = r
    return best


def timeline_summary(trace: dict, steps: int, top: int = 8) -> dict:
    """Busy and idle milliseconds per step from a Chrome trace of ``steps`` steps.

    Returns span/busy/idle/host-late/device-side ms per step, the GPU activities per step, and
    the ``top`` host operations charged with host-late gaps (ms per step each)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in _GPU_CATEGORIES), key=lambda e: e["ts"])
    if not gpu:
        raise ValueError("the trace has no GPU activity; profile with ProfilerActivity.CUDA on a GPU")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    host = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in _HOST_CATEGORIES:
            host[e["tid"]].append(e)
    for ranges in host.values():
        ranges.sort(key=lambda e: e["ts"])

    busy = host_late = device_side = 0.0
    charged = collections.Counter()
    start, end, open_from = gpu[0]["ts"], gpu[0]["ts"] + gpu[0]["dur"], gpu[0]["ts"]
    for e in gpu[1:]:
        if e["ts"] > end:  # a gap: nothing ran from `end` to this activity's start
            gap = e["ts"] - end
            busy += end - open_from
            open_from = e["ts"]
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] + launch["dur"] > end:
                host_late += gap
                r = _innermost(host.get(launch["tid"], []), launch["ts"])
                charged[r["name"] if r else launch["name"]] += gap
            else:
                device_side += gap
        end = max(end, e["ts"] + e["dur"])
    busy += end - open_from
    ms = 1e-3 / steps  # trace times are microseconds
    span = end - start
    return {
        "steps": steps,
        "span_ms_per_step": round(span * ms, 3),
        "busy_ms_per_step": round(busy * ms, 3),
        "idle_ms_per_step": round((span - busy) * ms, 3),
        "host_late_ms_per_step": round(host_late * ms, 3),
        "device_side_ms_per_step": round(device_side * ms, 3),
        "gpu_activities_per_step": round(len(gpu) / steps, 1),
        "host_late_by_op_ms_per_step": {k[:80]: round(v * ms, 3) for k, v in charged.most_common(top)},
    }
