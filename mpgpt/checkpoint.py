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

import errno
import contextlib
import os
import signal
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["FORMAT", "VERSION", "CheckpointError", "save_checkpoint", "load_checkpoint", "check_structure",
           "check_compatible", "check_global_batch", "temporary_files"]

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
    """Hold a Ctrl-C (SIGINT) that arrives during the write and raise KeyboardInterrupt after it.

    Raised inside torch's C++ writer, a KeyboardInterrupt comes out as a RuntimeError, so an
    interrupted save looked like a failed one; a write takes a moment, so we finish it (or clean
    it up) first and then honour the interrupt. Only the main thread can own signal handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


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
            raise CheckpointError(f"could not write checkpoint {path} ({_write_cause(e, path.parent)}); the "
                                  "previous checkpoint is untouched; free space or pass another --out-dir") from e
        raise


def _write_cause(error: BaseException, folder: Path) -> str:
    """The likely cause of a failed write, in a few words (torch's own text is a C++ assertion)."""
    code = getattr(error, "errno", None)
    if code == errno.ENOSPC or "No space" in str(error) or "file write failed" in str(error):
        return f"the disk holding {folder} is full"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{folder} is not writable"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return first


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


# What a checkpoint must hold, and of which type, for a resume to succeed without a KeyError halfway.
_REQUIRED = {
    "model_config": dict, "train_config": dict, "model": dict, "master": (dict, type(None)),
    "optimizer": dict, "scaler": dict, "scaler_type": str, "precision": str, "rng": dict, "step": int,
    "history": dict,
}
_REQUIRED_RNG = {"torch": torch.Tensor, "data": torch.Tensor, "python": (list, tuple)}


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


def load_checkpoint(path) -> dict:
    """Read and validate a checkpoint file; raise CheckpointError with a one-line reason if unusable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; check the path passed to --resume")
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


def check_global_batch(state: dict, batch_size: int, world_size: int) -> None:
    """Refuse to resume with a different global batch: the data stream would not continue, it would change.

    Any number of ranks that divides the checkpoint's global batch works (``batch_size`` per rank).
    """
    saved = state.get("global_batch_size", state["train_config"]["batch_size"] * state.get("world_size", 1))
    if saved != batch_size * world_size:
        hint = (f"use --batch-size {saved // world_size}" if saved % world_size == 0
                else f"use a number of ranks that divides {saved}")
        raise CheckpointError(f"checkpoint was trained on a global batch of {saved} sequences, this run uses "
                              f"{batch_size} x {world_size} ranks = {batch_size * world_size}; {hint}")
