"""The timeline reading of a profile: busy and idle time, and which gaps the host caused."""
import pytest

from mpgpt.bench.timeline import timeline_summary


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {}}
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


def _trace():
    # Host (tid 1): op "forward" launches k1 and k2 early; op "optimizer" launches k3 late.
    # GPU: k1 [100, 200), k2 [205, 300) -> a 5 us gap, launched long before: device-side.
    #      k3 [340, 400) -> a 40 us gap, and k3's launch returned at 330, after k2 ended: host-late.
    #      m1 memcpy [390, 420) overlaps k3: busy is the union, no gap.
    return {"traceEvents": [
        _x("cpu_op", "forward", 0, 60), _x("cpu_op", "optimizer", 250, 100),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, corr=1), _x("cuda_runtime", "cudaLaunchKernel", 20, 5, corr=2),
        _x("cuda_runtime", "cudaLaunchKernel", 320, 10, corr=3), _x("cuda_runtime", "cudaMemcpyAsync", 325, 4, corr=4),
        _x("kernel", "k1", 100, 100, tid=7, corr=1), _x("kernel", "k2", 205, 95, tid=7, corr=2),
        _x("kernel", "k3", 340, 60, tid=7, corr=3), _x("gpu_memcpy", "m1", 390, 30, tid=7, corr=4),
        {"ph": "i", "name": "marker", "ts": 5},
    ]}


def test_busy_idle_and_who_waited_for_whom_over_two_steps():
    s = timeline_summary(_trace(), steps=2)
    # span 100..420 = 320 us; busy 100 + 95 + 80 (k3 and m1 together) = 275 us; idle 45 us
    assert s["span_ms_per_step"] == pytest.approx(0.160)
    assert s["busy_ms_per_step"] == pytest.approx(0.1375, abs=1e-3)
    assert s["idle_ms_per_step"] == pytest.approx(0.0225, abs=1e-3)
    assert s["host_late_ms_per_step"] == pytest.approx(0.020)
    assert s["device_side_ms_per_step"] == pytest.approx(0.0025, abs=1e-3)
    assert s["host_late_by_op_ms_per_step"] == {"optimizer": pytest.approx(0.020)}
    assert s["gpu_activities_per_step"] == 2.0


def test_a_trace_without_gpu_activity_is_refused():
    with pytest.raises(ValueError, match="no GPU activity; profile with ProfilerActivity.CUDA"):
        timeline_summary({"traceEvents": [_x("cpu_op", "forward", 0, 10)]}, steps=1)
    with pytest.raises(ValueError, match="steps must be at least 1"):
        timeline_summary(_trace(), steps=0)
