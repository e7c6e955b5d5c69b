"""Checkpoints: atomic writes, and clear refusals of truncated, foreign or mismatched files."""
import errno
import os

import pytest
import torch

from mpgpt import checkpoint
from mpgpt.checkpoint import CheckpointError, check_compatible, load_checkpoint, save_checkpoint


def _state():
    return {"model_config": {"n_layer": 2}, "model": {"w": torch.randn(3, 4)}, "step": 7}


def test_round_trip(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path / "ckpt.pt", state)
    loaded = load_checkpoint(path)
    assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["format"] == checkpoint.FORMAT
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temp files left behind


def test_failed_write_leaves_old_checkpoint_intact_and_no_debris(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "ckpt.pt", _state())
    before = path.read_bytes()

    def exploding_save(obj, f, *a, **k):
        f.write(b"PK\x03\x04 half a zip file")  # some bytes reach the temp file, then the disk "fills"
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", exploding_save)
    with pytest.raises(CheckpointError, match=f"could not write checkpoint .*the disk holding {tmp_path} is full"):
        save_checkpoint(path, _state())
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_truncated_checkpoint_is_refused(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt.pt", _state())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)


def test_foreign_files_are_refused(tmp_path):
    other = tmp_path / "other.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, other)
    with pytest.raises(CheckpointError, match="not an mpgpt checkpoint"):
        load_checkpoint(other)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(1000))
    with pytest.raises(CheckpointError):
        load_checkpoint(junk)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


def test_future_version_is_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"format": checkpoint.FORMAT, "version": checkpoint.VERSION + 1}, path)
    with pytest.raises(CheckpointError, match="version"):
        load_checkpoint(path)


def test_check_compatible_names_the_difference():
    state = {"model_config": {"n_layer": 2, "n_embd": 8}, "model": {"w": torch.zeros(8, 8)}}
    check_compatible(state, {"n_layer": 2, "n_embd": 8}, {"w": torch.empty(8, 8)})
    with pytest.raises(CheckpointError, match="n_layer: checkpoint 2 vs requested 3"):
        check_compatible(state, {"n_layer": 3, "n_embd": 8}, {"w": torch.empty(8, 8)})
    with pytest.raises(CheckpointError, match="shape"):
        check_compatible(state, {"n_layer": 2, "n_embd": 8}, {"w": torch.empty(8, 9)})
    with pytest.raises(CheckpointError, match="missing"):
        check_compatible(state, {"n_layer": 2, "n_embd": 8}, {"w": torch.empty(8, 8), "b": torch.empty(8)})


def test_save_removes_temp_files_left_by_a_killed_writer(tmp_path):
    # A writer killed by SIGKILL mid-write leaves its temporary file behind; the next save clears it.
    stale = tmp_path / ".ckpt.pt.abc123.tmp"
    stale.write_bytes(b"PK\x03\x04 half a zip file")
    other = tmp_path / ".notes.txt.tmp"  # not ours: left alone
    other.write_bytes(b"x")
    save_checkpoint(tmp_path / "ckpt.pt", _state())
    assert sorted(os.listdir(tmp_path)) == [".notes.txt.tmp", "ckpt.pt"]
    assert checkpoint.temporary_files(tmp_path / "ckpt.pt") == []


def _full_state():
    return {"model_config": {}, "train_config": {}, "model": {"w": torch.zeros(2)}, "master": None,
            "optimizer": {"state": {}, "param_groups": []}, "scaler": {}, "scaler_type": "NullScaler",
            "precision": "fp32", "rng": {"torch": torch.zeros(2, dtype=torch.uint8),
                                         "data": torch.zeros(2, dtype=torch.uint8), "python": [3, [1, 2], None]},
            "step": 3, "history": {"step": [0, 1, 2], "loss": [4.0, 3.5, 3.2], "scale": [1.0] * 3,
                                   "skipped": [False] * 3}}


@pytest.mark.parametrize("damage", [
    lambda s: s.pop("optimizer"),
    lambda s: s.pop("rng"),
    lambda s: s.update(step="3"),
    lambda s: s.update(step=-1),
    lambda s: s.update(model={"w": [0.0, 0.0]}),
    lambda s: s.update(optimizer={"param_groups": []}),
    lambda s: s["rng"].pop("data"),
    lambda s: s.update(history=None),
    lambda s: s["history"].pop("loss"),
    lambda s: s["history"]["loss"].pop(),
    lambda s: s["history"]["scale"].__setitem__(1, "big"),
    lambda s: s.update(tokenizer=["a", "b"]),
    lambda s: s.update(resume_changes="lr"),
    lambda s: s.update(cpu_threads=0),
], ids=["no-optimizer", "no-rng", "step-str", "step-negative", "model-not-tensor", "optimizer-no-state",
        "rng-no-data", "history-none", "history-no-loss", "history-short", "history-scale-str", "tokenizer-list",
        "changes-str", "threads-0"])
def test_check_structure_names_what_is_missing_or_mistyped(damage):
    state = _full_state()
    checkpoint.check_structure(state)  # the intact one passes
    damage(state)
    with pytest.raises(CheckpointError, match="incomplete or damaged .*; resume from an earlier checkpoint"):
        checkpoint.check_structure(state)


def test_torch_write_failure_becomes_one_line_naming_the_folder(tmp_path, monkeypatch):
    def full_disk(obj, f, *a, **k):  # what torch's zip writer raises when the disk fills
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path / "ckpt.pt", _state())
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and "enforce fail" not in msg
    assert f"the disk holding {tmp_path} is full" in msg and "pass another --out-dir" in msg
    assert os.listdir(tmp_path) == []


def test_ctrl_c_during_a_write_finishes_it_then_interrupts(tmp_path, monkeypatch):
    import signal
    real_save = torch.save

    def save_interrupted_halfway(obj, f, *a, **k):
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C while the file is being written
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_interrupted_halfway)
    with pytest.raises(KeyboardInterrupt):  # reported as an interrupt, not as a failed write
        save_checkpoint(tmp_path / "ckpt.pt", _state())
    assert load_checkpoint(tmp_path / "ckpt.pt")["step"] == 7  # and the checkpoint is whole
    assert os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.parametrize("error, cause, remedy", [
    (RuntimeError("[enforce fail at inline_container.cc:631] . unexpected pos 2262720 vs 2262612"),
     "is full", "free space or pass another --out-dir"),
    (OSError(errno.EFBIG, "File too large"), "file size limit (ulimit -f)", "raise the limit"),
    (OSError(errno.EROFS, "Read-only file system"), "is not writable", "pass another --out-dir"),
], ids=["short-write", "ulimit", "read-only"])
def test_a_failed_write_names_its_cause_and_what_was_kept(tmp_path, monkeypatch, error, cause, remedy):
    def failing(obj, f, *a, **k):
        raise error

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path / "ckpt.pt", _state())
    msg = str(info.value)
    assert cause in msg and remedy in msg and "no checkpoint was there before" in msg and "unexpected" not in msg
    monkeypatch.undo()
    save_checkpoint(tmp_path / "ckpt.pt", _state())
    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(CheckpointError, match="the previous checkpoint is untouched"):
        save_checkpoint(tmp_path / "ckpt.pt", _state())


def test_sigterm_during_a_write_finishes_it_then_reaches_the_programs_handler(tmp_path, monkeypatch):
    import signal
    real_save = torch.save

    def save_terminated_halfway(obj, f, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_save(obj, f, *a, **k)

    class Terminated(Exception):
        pass

    def handler(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        monkeypatch.setattr(torch, "save", save_terminated_halfway)
        with pytest.raises(Terminated):
            save_checkpoint(tmp_path / "ckpt.pt", _state())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert load_checkpoint(tmp_path / "ckpt.pt")["step"] == 7  # written whole before the handler ran
    assert signal.getsignal(signal.SIGTERM) is previous
