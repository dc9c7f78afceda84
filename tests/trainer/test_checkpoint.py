"""Atomic writes, clear errors for bad files, refusal of a foreign model."""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import DROP, whole
from trainer import checkpoint, resumefiles, saver
from trainer.checkpoint import CheckpointError


def test_save_then_load_round_trip(tmp_path):
    path = checkpoint.save({"model": {"w": torch.ones(3)}, "step": 7}, tmp_path / "c" / "a.pt")
    state = checkpoint.load(path)
    assert state["step"] == 7 and torch.equal(state["model"]["w"], torch.ones(3))
    assert [p.name for p in path.parent.iterdir()] == ["a.pt"]  # no temp file left


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = checkpoint.save({"model": {"w": torch.zeros(2)}, "step": 1}, tmp_path / "last.pt")

    def full_disk(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match=r"last.pt: the write failed \(No space left on device\); the previous"):
        checkpoint.save({"model": {"w": torch.ones(2)}, "step": 2}, path)
    with pytest.raises(checkpoint.CheckpointWriteError,  # the first: nothing to keep
                       match=r"step-1.pt: the write failed \(No space left on device\); no "
                             r"checkpoint was written before it$"):
        checkpoint.save({"model": {}, "step": 1}, tmp_path / "new" / "step-1.pt")
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "new"]


def test_a_temp_file_that_cannot_be_removed_leaves_the_writes_own_line(tmp_path, monkeypatch):
    """An append-only (or meanwhile read-only) folder: the rename failed, then the clean-up's
    PermissionError on the temp file replaced the line, naming the hidden temp file."""
    path = checkpoint.save({"model": {"w": torch.zeros(2)}, "step": 1}, tmp_path / "last.pt")

    def refused(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(args[0]))

    monkeypatch.setattr(checkpoint.os, "replace", refused)
    monkeypatch.setattr(checkpoint.os, "unlink", refused)
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match=r"^checkpoint .*last.pt: the write failed \(.*Operation not "
                             r"permitted.*\); the previous checkpoints are kept$"):
        checkpoint.save({"model": {"w": torch.ones(2)}, "step": 2}, path)
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1


def test_a_file_size_limit_under_torch_s_own_message_is_named(tmp_path):
    """`ulimit -f` (a batch system's file size limit): torch said 'enforce fail ... unexpected
    pos'; the line says the limit, and the last good checkpoint stays."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    script = ("import resource, sys, torch; sys.path.insert(0, sys.argv[1])\n"
              "from trainer import checkpoint\n"
              "checkpoint.save({'model': {'w': torch.zeros(4)}, 'step': 1}, sys.argv[2])\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))\n"
              "try:\n"
              "    checkpoint.save({'model': {'w': torch.zeros(100_000)}, 'step': 2}, "
              "sys.argv[2])\n"
              "except checkpoint.CheckpointWriteError as e:\n"
              "    print(e)\n")
    path = tmp_path / "last.pt"
    out = subprocess.run([sys.executable, "-c", script, str(ROOT), str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == (f"checkpoint {path}: the write failed (file too large: this "
                                  "process may write files of 100000 bytes at most (ulimit "
                                  "-f)); the previous checkpoints are kept"), out.stdout
    assert checkpoint.load(path)["step"] == 1 and len(list(tmp_path.iterdir())) == 1


def test_a_full_disk_under_torch_s_own_message_is_named(tmp_path, monkeypatch):
    """torch reports ENOSPC as 'enforce fail ... unexpected pos': the free space tells."""
    path = checkpoint.save({"model": {"w": torch.zeros(2)}, "step": 1}, tmp_path / "last.pt")

    def torch_full_disk(obj, f, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", torch_full_disk)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                        lambda p: __import__("collections").namedtuple("U", "total used free")(
                            1 << 30, 1 << 30, 0))
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"\(no space left on device\)"):
        checkpoint.save({"model": {"w": torch.ones(2)}, "step": 2}, path)
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1 and len(list(tmp_path.iterdir())) == 1


def test_a_file_in_the_way_of_the_folder_is_an_os_error_naming_it(tmp_path):
    (tmp_path / "checkpoints").write_text("not a folder")
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match=r"checkpoints/last.pt: cannot write in .*checkpoints \(a file is in "
                             r"the way of the folder\)$"):
        checkpoint.save({"step": 1}, tmp_path / "checkpoints" / "last.pt")
    assert isinstance(checkpoint.CheckpointWriteError("x"), OSError)  # exit 1, not 2


def test_a_flipped_bit_in_a_stored_weight_is_detected(tmp_path):
    path = checkpoint.save({"model": {"w": torch.randn(1000)}, "step": 1}, tmp_path / "a.pt")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=r"a.pt: damaged \(checksum mismatch "
                                                         r"in .*data/0\)"):
        checkpoint.load(path)


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, None])
def test_damaged_file_is_one_line_naming_it(tmp_path, content):
    path = tmp_path / "bad.pt"
    if content is None:  # truncated real checkpoint
        checkpoint.save({"model": {"w": torch.randn(1000)}}, path)
        path.write_bytes(path.read_bytes()[:500])
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_foreign_pickle_is_refused(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": 1}, path)
    with pytest.raises(CheckpointError, match="not a Stoker checkpoint$"):
        checkpoint.load(path)


def test_what_is_no_checkpoint_file_says_what_would_be(tmp_path):
    weights = tmp_path / "weights.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), weights)
    with pytest.raises(CheckpointError, match=r"not a Stoker checkpoint but weights alone \(a "
                                              r"state_dict\); trainer.init_from=PATH starts"):
        checkpoint.load(weights)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=f"checkpoint {run}: a directory, not a file$"):
        checkpoint.load(run)
    torch.save({}, run / "checkpoints" / "last.pt")
    with pytest.raises(CheckpointError, match=f"a directory, not a file; it holds "
                                              f"{run}/checkpoints/last.pt$"):
        checkpoint.load(run)
    os.mkfifo(tmp_path / "pipe.pt")  # (reading it would block)
    with pytest.raises(CheckpointError, match="pipe.pt: not a regular file"):
        checkpoint.load(tmp_path / "pipe.pt")


@pytest.mark.parametrize("changes,reason", [
    (dict(format_version=99), "format_version 99, this version of Stoker reads 1"),
    (dict(rng=DROP), "incomplete, no 'rng' (a training state saved by Stoker holds it)"),
    (dict(config=DROP), "incomplete, no 'config'"),
    (dict(step=-5), "'step' is -5, not a count"),
    (dict(world_size="two"), "'world_size' is str, not int"),
    (dict(world_size=0), "'world_size' is 0, not a count"),
    (dict(epoch=True), "'epoch' is bool, not int"),
])
def test_a_checkpoint_that_is_not_a_whole_training_state_is_refused(tmp_path, changes, reason):
    """By path: refused in one line naming the field. Under auto: skipped for an older one."""
    folder = tmp_path / "checkpoints"
    good = checkpoint.save(whole(2), folder / "step-00000002.pt")
    bad = checkpoint.save(whole(4, **changes), folder / "step-00000004.pt")
    if "format_version" in changes:  # (save writes its own version first)
        state = checkpoint.load(bad)
        bad.unlink()
        torch.save({**state, **changes}, bad)
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {bad}: {reason}")):
        resumefiles.find_resume(str(bad), tmp_path)
    path, _, skipped = resumefiles.find_resume("auto", tmp_path)
    assert path == good and len(skipped) == 1 and reason in skipped[0]


def test_a_checkpoint_gets_the_mode_of_any_file_the_user_writes(tmp_path):
    path = checkpoint.save({"x": 1}, tmp_path / "a.pt")
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


def _adamw_steps(fused, steps, state=None):
    """A Linear and its AdamW after `steps` fp16-style steps (GradScaler on CPU), from `state`."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    if state is not None:
        model.load_state_dict(state["model"])
        checkpoint.load_optimizer_state(opt, state["optimizer"])
    scaler = torch.amp.GradScaler("cpu")
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(torch.randn(3, 4, generator=data)).square().sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("saved_fused, resumed_fused", [(None, True), (True, None)])
def test_a_resumed_optimizer_computes_as_this_run_says(saved_fused, resumed_fused):
    """The implementation (fused, foreach) is this run's choice, not the checkpoint's: a
    per-parameter AdamW's state resumed fused under a GradScaler steps (the checkpoint's
    fused=None made the unfused step meet the scaler's fused-path arguments: an
    AssertionError), and continues the same optimisation."""
    model, opt = _adamw_steps(saved_fused, 2)
    # as written to a file: loading shares the tensors, and the steps change them in place
    state = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    resumed, opt2 = _adamw_steps(resumed_fused, 1, copy.deepcopy(state))
    assert opt2.param_groups[0]["fused"] == resumed_fused
    assert all(s["step"].dtype == torch.float32 and s["step"].item() == 3
               for s in opt2.state.values())
    ref, _ = _adamw_steps(saved_fused, 1, state)  # the same step with the saved implementation
    for a, b in zip(resumed.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_resumed_optimizers_step_counts_are_where_its_implementation_keeps_them():
    """A per-parameter AdamW keeps its step counts in the default dtype (float64 here), the
    fused one in float32: the resumed state is made to fit this run's implementation."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model, opt = _adamw_steps(None, 2)
        assert next(iter(opt.state.values()))["step"].dtype == torch.float64
        state = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
        _, fused = _adamw_steps(True, 1, copy.deepcopy(state))
        assert all(s["step"].dtype == torch.float32 and s["step"].item() == 3
                   for s in fused.state.values())
    finally:
        torch.set_default_dtype(default)


def test_a_state_a_safe_load_would_refuse_is_named_before_it_is_saved(tmp_path):
    """Written, it could never be resumed: every save would succeed and every resume fail."""
    import numpy as np

    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1,
             "callbacks": {"Mine": {"seen": {1, 2}, "shape": torch.Size([2]), "name": "x"}}}
    checkpoint.check_loadable(state)  # tensors and plain data: taken back
    writer = saver.Checkpointer(tmp_path, keep_last=2, async_save=False, enabled=True)
    for bad, where, what in [
            (np.arange(3.0), "state['callbacks']['Mine']['stats'][0]", "a numpy.ndarray"),
            (lambda: 1, "state['callbacks']['Mine']['stats'][0]", "a builtins.function")]:
        state["callbacks"]["Mine"]["stats"] = [bad]
        with pytest.raises(CheckpointError) as info:
            writer.save(state, step=2)
        assert str(info.value).startswith(
            f"checkpoint: {where} holds {what}, which a checkpoint cannot load back"), info.value
        assert "\n" not in str(info.value)
    assert not (tmp_path / checkpoint.CHECKPOINT_DIR).exists()  # nothing written


def test_a_file_holding_what_a_safe_load_refuses_is_named_so_not_damaged(tmp_path):
    import numpy as np

    path = tmp_path / "x.pt"
    torch.save({"format_version": 1, "model": {"mean": np.arange(3.0)}}, path)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path)
    text = str(info.value)
    assert text.startswith(f"checkpoint {path}: holds numpy.") and "safe load" in text
    assert "unreadable" not in text and "\x1b" not in text and "\n" not in text


def test_a_model_whose_extra_state_cannot_be_loaded_back_is_refused_before_training(make_cfg):
    from trainer.runner import train

    cfg = make_cfg("model._target_=tests.helpers.ArrayStateMLP")
    with pytest.raises(CheckpointError, match=r"^checkpoint: state\['model'\]\['_extra_state'\]"
                                              r"\['mean'\] holds a numpy.ndarray"):
        train(cfg)
    assert not (Path(cfg.run_dir) / checkpoint.CHECKPOINT_DIR).exists()
    train(make_cfg("model._target_=tests.helpers.ArrayStateMLP",
                   "trainer.save_checkpoint=false", "trainer.max_steps=1"))  # nothing saved


