"""Atomic checkpoint save and verified load (chapter 5).

A checkpoint is one ``torch.save`` file holding everything needed to continue a run exactly:
model (and fp32 master) weights, optimizer state, loss-scaler state, RNG states, the step and the
configs. Two promises:

* **Never half-written.** We write to a temporary file in the same folder, flush and fsync it, then
  ``os.replace`` it over the target. ``os.replace`` is atomic on POSIX and Windows when both paths
  are on one filesystem, so a crash leaves either the old checkpoint or the new one, never a torn mix.
  The folder is fsynced after the rename so the new name survives a power cut. A process killed
  mid-write (SIGKILL, OOM killer) cannot clean up after itself: the next save in that folder removes
  such leftover temporary files (one writer per folder is assumed).
* **Never partly loaded.** :func:`load_checkpoint` reads the whole file with ``weights_only=True``
  (no arbitrary pickles) and checks that it is an mpgpt checkpoint of a known version;
  :func:`check_structure` that it holds every part a resume needs, each of the right type; and
  :func:`check_compatible` compares the model config and every tensor's name and shape *before*
  anything is copied into a live model or optimizer.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["FORMAT", "VERSION", "CheckpointError", "save_checkpoint", "load_checkpoint", "check_structure",
           "check_compatible", "check_global_batch", "check_rng", "check_optimizer", "first_nonfinite",
           "check_out_dir", "folder_lock", "temporary_files"]

FORMAT = "mpgpt-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: truncated, foreign, or made for a different model."""


def save_checkpoint(path, state: dict) -> Path:
    """Write ``state`` (plus format tags) to ``path`` atomically and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, **state}
    for stale in temporary_files(path):  # left by a writer that was killed before it could clean up
        stale.unlink(missing_ok=True)
    with _ctrl_c_deferred():
        _write_atomically(path, payload)
    return path


@contextlib.contextmanager
def _ctrl_c_deferred():
    """Hold a Ctrl-C (SIGINT) or SIGTERM that arrives during the write and deliver it after it.

    Raised inside torch's C++ writer, a KeyboardInterrupt comes out as a RuntimeError, so an
    interrupted save looked like a failed one; and a SIGTERM with its default action ended the
    process mid-write, leaving a temporary file. A write takes a moment, so we finish it (or clean
    it up) first and then raise the signal again for the handler that was there before: Ctrl-C
    becomes a KeyboardInterrupt, SIGTERM ends the process (or runs the handler the program set).
    Only the main thread can own signal handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)


def _write_atomically(path: Path, payload: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        # Whatever went wrong (disk full, Ctrl-C), the target is untouched and no debris stays behind.
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, (OSError, RuntimeError)):  # torch's zip writer reports a full disk as RuntimeError
            cause, remedy = _write_cause(e, path.parent)
            kept = "the previous checkpoint is untouched" if path.is_file() else "no checkpoint was there before"
            raise CheckpointError(f"could not write checkpoint {path} ({cause}); {kept}; {remedy}") from e
        raise


def _write_cause(error: BaseException, folder: Path) -> tuple[str, str]:
    """The likely cause of a failed write in a few words (torch's own text is a C++ assertion), and
    what to do about it."""
    code, text = getattr(error, "errno", None), str(error)
    if code == errno.EFBIG:
        return "the file size limit (ulimit -f) was reached", "raise the limit or pass another --out-dir"
    # torch's zip writer reports a short write as "file write failed" or "unexpected pos A vs B"
    if code in (errno.ENOSPC, errno.EDQUOT) or any(w in text for w in ("No space", "file write failed",
                                                                       "unexpected pos")):
        return f"the disk holding {folder} is full", "free space or pass another --out-dir"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{folder} is not writable", "pass another --out-dir"
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return first, "pass another --out-dir"


def temporary_files(path) -> list[Path]:
    """The temporary files :func:`save_checkpoint` writes beside ``path`` (normally none after a save)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


def _fsync_dir(folder: Path) -> None:
    if os.name != "posix":
        return  # Windows cannot open a folder for fsync; its rename is durable enough for us
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_out_dir(out_dir, name: str = "ckpt.pt") -> None:
    """Refuse, in one line and before any training, a folder that cannot take ``out_dir/name``.

    Creates the folder (and its parents) and writes and removes a probe file in it, the way the
    checkpoint's temporary file will be written: that is the only test a root user or a read-only
    mount cannot fool. Refuses a broken symbolic link, a file where a folder goes, and anything but
    a regular file where the checkpoint goes."""
    out_dir = Path(out_dir)
    hint = "pass another --out-dir"
    probe = out_dir
    while True:  # the path itself, then its parents, up to the first that exists
        if probe.is_symlink() and not probe.exists():
            raise CheckpointError(f"out_dir {out_dir}: {probe} is a broken symbolic link (to {os.readlink(probe)}); "
                                  f"remove it or {hint}")
        if probe.exists():
            break
        probe = probe.parent
    if not probe.is_dir():
        what = "is a file, not a folder" if probe == out_dir else f"cannot be made: {probe} is a file"
        raise CheckpointError(f"out_dir {out_dir} {what}; pass a folder for the checkpoints")
    target = out_dir / name
    if (target.is_symlink() and not target.exists()) or (target.exists() and not target.is_file()):
        what = "a folder" if target.is_dir() else "a broken symbolic link" if target.is_symlink() else "not a file"
        raise CheckpointError(f"{target} is {what}, where the checkpoint goes; move it away or {hint}")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise CheckpointError(f"out_dir {out_dir} is not writable ({e.strerror or e}); pass a folder you can "
                              "write to") from None


@contextlib.contextmanager
def folder_lock(folder):
    """Hold an exclusive lock on ``folder`` while the block runs; refuse if another process holds it.

    Two runs writing one folder would overwrite each other's checkpoints (and each removes the other's
    temporary file as leftover debris). The lock is ``flock`` on the folder itself: no lock file to
    leave behind, and the kernel drops it when the process dies, even by SIGKILL. Not on Windows."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock; one writer per folder is then the user's promise
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"out_dir {folder} is in use by another run (it holds the folder's lock); "
                                  "wait for that run to end or pass another --out-dir") from None
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# What a checkpoint must hold, and of which type, for a resume to succeed without a KeyError halfway.
_REQUIRED = {
    "model_config": dict, "train_config": dict, "model": dict, "master": (dict, type(None)),
    "optimizer": dict, "scaler": dict, "scaler_type": str, "precision": str, "rng": dict, "step": int,
    "history": dict,
}
_REQUIRED_RNG = {"torch": torch.Tensor, "data": torch.Tensor, "python": (list, tuple)}
# Parts a checkpoint may hold (older ones lack them): (container type, element type).
_OPTIONAL = {"tokenizer": (str, str), "resume_changes": (list, str)}


def check_structure(state: dict, where: str = "checkpoint") -> None:
    """Raise CheckpointError unless ``state`` has every part a resume needs, each of the right type.

    The trainer calls it first when it resumes, so nothing is loaded from a checkpoint missing, say,
    its optimizer state after the model weights were already copied.
    """
    def fail(what):
        raise CheckpointError(f"{where} is incomplete or damaged ({what}); resume from an earlier checkpoint "
                              "or start a new run")

    for key, kind in _REQUIRED.items():
        if key not in state:
            fail(f"no {key!r}")
        if not isinstance(state[key], kind) or (kind is int and isinstance(state[key], bool)):
            fail(f"{key!r} is a {type(state[key]).__name__}")
    if state["step"] < 0:
        fail(f"step {state['step']}")
    for name, value in state["model"].items():
        if not isinstance(value, torch.Tensor):
            fail(f"model entry {name!r} is a {type(value).__name__}, not a tensor")
    if state["master"] is not None and not all(isinstance(v, torch.Tensor) for v in state["master"].values()):
        fail("a master weight is not a tensor")
    if not isinstance(state["optimizer"].get("state"), dict) or not isinstance(state["optimizer"].get("param_groups"), list):
        fail("the optimizer state has no 'state' dict and 'param_groups' list")
    for key, kind in _REQUIRED_RNG.items():
        if not isinstance(state["rng"].get(key), kind):
            fail(f"rng state {key!r} is missing")
    python = state["rng"]["python"]
    if len(python) != 3 or not isinstance(python[1], (list, tuple)):
        fail("the Python rng state is malformed")
    for key in ("step", "loss", "scale", "skipped"):
        if not isinstance(state["history"].get(key), list):
            fail(f"history has no {key!r} list")
        if len(state["history"][key]) != state["step"]:
            fail(f"history's {key!r} holds {len(state['history'][key])} steps, the checkpoint is at step {state['step']}")
    if not all(_is_number(v) for key in ("loss", "scale") for v in state["history"][key]):
        fail("history holds a loss or scale that is not a number")
    val_step, val_loss = state["history"].get("val_step", []), state["history"].get("val_loss", [])
    if not (isinstance(val_step, list) and isinstance(val_loss, list) and len(val_step) == len(val_loss)):
        fail("history's val_step and val_loss differ in length")
    for key, kind in _OPTIONAL.items():
        value = state.get(key)
        if value is not None and not (isinstance(value, kind[0]) and all(isinstance(v, kind[1]) for v in value)):
            fail(f"{key!r} is not a {kind[0].__name__} of {kind[1].__name__}")
    threads = state.get("cpu_threads")
    if threads is not None and not (isinstance(threads, int) and threads >= 1):
        fail(f"cpu_threads {threads!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # an FSDP shard (DTensor): this rank's part


def first_nonfinite(named) -> str | None:
    """The name of the first tensor in ``named`` ((name, tensor) pairs) holding an inf or nan, else None.

    One device-to-host read for all of them (a stacked flag), and a search only when one is bad."""
    floats = [(name, _local(t)) for name, t in named if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        return None
    flags = torch.stack([torch.isfinite(t).all().to(floats[0][1].device) for _, t in floats])
    if bool(flags.all()):
        return None
    return next(name for (name, _), ok in zip(floats, flags.tolist()) if not ok)


def check_rng(rng: dict, where: str = "checkpoint") -> None:
    """Refuse RNG states that would not load, by loading them into throwaway generators first."""
    import random

    try:
        for key in ("torch", "data"):
            torch.Generator().set_state(rng[key])
        version, internal, gauss = rng["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        cuda = rng.get("cuda")
        if cuda is not None and torch.cuda.is_available():
            size = torch.cuda.get_rng_state(0).shape
            if not (isinstance(cuda, (list, tuple)) and len(cuda) <= torch.cuda.device_count()
                    and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == size for t in cuda)):
                raise ValueError("the CUDA generators' states do not fit this machine's GPUs")
    except (RuntimeError, TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{where}'s random-number-generator states are damaged ({first}); resume from an "
                              "earlier checkpoint or start a new run") from None


def check_optimizer(saved: dict, optimizer, where: str = "checkpoint") -> None:
    """Refuse optimizer state that does not fit ``optimizer`` or could not train; modifies nothing.

    torch's AdamW (a moment per parameter, keyed by its position) or mpgpt.optim16's AdamW16 (flat
    buffers): every moment of its parameter's shape and finite, the second moments >= 0, the steps
    counted, and the hyperparameters in range (betas in [0, 1), eps > 0, weight decay >= 0)."""
    def fail(what):
        raise CheckpointError(f"{where}'s optimizer state is damaged ({what}); resume from an earlier checkpoint "
                              "or start a new run")

    live = optimizer.state_dict()
    groups, live_groups = saved["param_groups"], live["param_groups"]
    if (not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
            or [len(g["params"]) for g in groups] != [len(g["params"]) for g in live_groups]):
        raise CheckpointError(f"{where}'s optimizer state does not match the model's parameters; resume with "
                              "the same preset and overrides")
    for i, g in enumerate(groups):
        value = {k: (g[k].item() if isinstance(g.get(k), torch.Tensor) else g.get(k)) for k in ("lr", "eps", "weight_decay")}
        if not all(_is_number(v) and math.isfinite(v) and v >= 0 for v in value.values()) or not value["eps"] > 0:
            fail(f"group {i}: lr {value['lr']!r}, eps {value['eps']!r}, weight_decay {value['weight_decay']!r}")
        betas = g.get("betas")
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)):
            fail(f"group {i}: betas {betas!r}, each must lie in [0, 1)")
    if "flat" in live:  # AdamW16: its flat buffers, compared with the live ones
        flat = saved.get("flat")
        if not (isinstance(flat, list) and len(flat) == len(live["flat"]) and all(
                isinstance(f, dict) and f.keys() == lf.keys() and all(
                    isinstance(f[k], torch.Tensor) and f[k].shape == lf[k].shape and f[k].dtype == lf[k].dtype
                    for k in lf) for f, lf in zip(flat, live["flat"]))):
            fail("its flat buffers do not match the model's parameters")
        bad = first_nonfinite((f"{k} of group {i}", t) for i, f in enumerate(flat) for k, t in f.items())
        if bad:
            fail(f"{bad} is not finite")
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    position = {pid: k for k, pid in enumerate(pid for g in groups for pid in g["params"])}
    tensors = []
    for pid, st in saved["state"].items():
        if pid not in position or not isinstance(st, dict):
            fail(f"state for unknown parameter {pid!r}")
        shape = tuple(params[position[pid]].shape)
        for key, t in st.items():
            value = t.item() if isinstance(t, torch.Tensor) and t.numel() == 1 and key == "step" else t
            if key == "step":
                if not (_is_number(value) and math.isfinite(value) and value >= 0):
                    fail(f"parameter {pid}'s step count is {value!r}")
            elif not (isinstance(t, torch.Tensor) and t.is_floating_point() and tuple(t.shape) == shape):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                fail(f"parameter {pid}'s {key} is {got}, its parameter is {shape}")
            else:
                tensors.append((f"parameter {pid}'s {key}", t))
                if key.endswith("exp_avg_sq") and bool((_local(t) < 0).any()):
                    fail(f"parameter {pid}'s {key} has negative entries (a second moment is a mean of squares)")
    bad = first_nonfinite(tensors)
    if bad:
        fail(f"{bad} is not finite")


def load_checkpoint(path) -> dict:
    """Read and validate a checkpoint file; raise CheckpointError with a one-line reason if unusable."""
    path = Path(path)
    if not path.is_file():
        what = ("is a broken symbolic link" if path.is_symlink() and not path.exists() else
                "is not a regular file" if path.exists() else "does not exist")
        raise CheckpointError(f"checkpoint {path} {what}; check the path passed to --resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # zip reader errors on truncation, unpickling errors on foreign files
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is truncated or not a torch file ({first_line}); "
                              "resume from an earlier checkpoint") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mpgpt checkpoint (no '{FORMAT}' tag); "
                              "pass a file written by mpgpt.train")
    if state.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {state.get('version')}, this mpgpt reads "
                              f"version {VERSION}; use the mpgpt release that wrote it")
    return state


def check_compatible(state: dict, model_config: dict, model_state: dict) -> None:
    """Raise CheckpointError unless the checkpoint was made for this exact model.

    ``model_config`` is the running model's config as a dict, ``model_state`` its ``state_dict()``.
    Names and shapes of every tensor must match, so a later ``load_state_dict`` cannot fail halfway.
    """
    saved = state.get("model_config", {})
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs requested {v!r}"
             for k, v in model_config.items() if saved.get(k) != v]
    if diffs:
        raise CheckpointError("checkpoint was made for a different model (" + "; ".join(diffs)
                              + "); resume with the same preset and overrides")
    ckpt_model = state.get("model", {})
    missing = sorted(set(model_state) - set(ckpt_model))
    extra = sorted(set(ckpt_model) - set(model_state))
    if missing or extra:
        raise CheckpointError(f"checkpoint tensors do not match the model (missing {missing[:3]}, "
                              f"unexpected {extra[:3]}); resume with the same model")
    for name, tensor in model_state.items():
        if tuple(ckpt_model[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint tensor {name} has shape {tuple(ckpt_model[name].shape)}, "
                                  f"the model expects {tuple(tensor.shape)}; resume with the same model")
        if ckpt_model[name].dtype != tensor.dtype:
            raise CheckpointError(f"checkpoint tensor {name} is {ckpt_model[name].dtype}, the model's is "
                                  f"{tensor.dtype}; resume with the same --precision")
    bad = first_nonfinite(ckpt_model.items())
    if bad:
        raise CheckpointError(f"checkpoint tensor {bad} holds inf or nan; resume from an earlier checkpoint")


def check_global_batch(state: dict, batch_size: int, world_size: int) -> None:
    """Refuse to resume with a different global batch: the data stream would not continue, it would change.

    Any number of ranks that divides the checkpoint's global batch works (``batch_size`` per rank).
    """
    saved = state.get("global_batch_size")
    if saved is None:
        per_rank, ranks = state["train_config"].get("batch_size"), state.get("world_size", 1)
        saved = per_rank * ranks if _is_number(per_rank) and _is_number(ranks) else None
    if not (isinstance(saved, int) and not isinstance(saved, bool) and saved >= 1):
        raise CheckpointError("checkpoint is incomplete or damaged (its batch size is missing or not a positive "
                              "integer); resume from an earlier checkpoint or start a new run")
    if saved != batch_size * world_size:
        hint = (f"use --batch-size {saved // world_size}" if saved % world_size == 0
                else f"use a number of ranks that divides {saved}")
        raise CheckpointError(f"checkpoint was trained on a global batch of {saved} sequences, this run uses "
                              f"{batch_size} x {world_size} ranks = {batch_size * world_size}; {hint}")
