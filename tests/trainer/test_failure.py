"""What a run that raised leaves behind: a record where its run dir is its own, none where
the dir is another run's or the error was said in one line before the first step."""
from __future__ import annotations

import json

from omegaconf import OmegaConf

from trainer import failure
from trainer.config import ConfigError
from trainer.distributed import DistEnv


def _cfg():
    return OmegaConf.create({"trainer": {"ddp": {"timeout_s": 5}}})


def test_a_crash_before_the_first_step_is_recorded_only_in_a_dir_of_its_own(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    crash = RuntimeError("boom")
    for run_dir, own in ((ours, True), (theirs, False)):
        said = failure.left_behind(crash, _cfg(), DistEnv(), run_dir, None, None, None, own)
        assert said is None  # (the crash itself is raised, with its traceback)
    status = json.loads((ours / "status.json").read_text())
    assert (status["status"], status["exit_code"]) == ("failed", 1)
    assert status["error"] == "RuntimeError: boom"
    assert list(theirs.iterdir()) == []  # (another run's dir: nothing written)


def test_an_error_said_in_one_line_before_the_first_step_leaves_no_status(tmp_path):
    said = failure.left_behind(ConfigError("data.batch_size=0: must be >= 1"), _cfg(),
                               DistEnv(), tmp_path, None, None, None, True)
    assert said is None
    assert not (tmp_path / "status.json").exists()


def test_a_step_out_of_memory_is_one_line_saying_where_and_what_to_shrink(monkeypatch):
    """A model whose optimizer state did not fit (AdamW's first step) ended in a traceback from
    inside torch's allocator."""
    from types import SimpleNamespace

    import torch

    from trainer.windowlog import OutOfMemory

    params = [torch.nn.Parameter(torch.zeros(10, 10))]
    params[0].grad = torch.ones(10, 10)
    optimizer = torch.optim.AdamW(params, foreach=False)

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] . DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 400 bytes.")

    monkeypatch.setattr(torch, "zeros_like", no_memory)
    try:
        optimizer.step()
    except RuntimeError as e:
        raised = e
    monkeypatch.undo()
    loop = SimpleNamespace(params=params, state=SimpleNamespace(step=0), phase="training")
    said = failure.out_of_memory(raised, loop)
    assert isinstance(said, OutOfMemory)
    assert str(said).startswith("out of memory at step 0 in the optimizer's step, which "
                                "allocates its state at the first (AdamW two values a "
                                "parameter; optim=sgd one, or none without momentum), for a "
                                "model of 100 parameters ([enforce fail at alloc_cpu.cpp:127]")
    assert str(said).endswith("; a smaller data.batch_size (trainer.accumulate_grad_batches=k "
                              "keeps the global batch), trainer.precision=bf16, or a smaller "
                              "model")
    forward = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "in the forward and backward" in str(failure.out_of_memory(forward, loop))
    assert failure.out_of_memory(RuntimeError("shape mismatch"), loop) is None
    loop.phase = "sanity check"
    assert "at step 0 in the first validation batch (trainer.sanity_check), for" in \
        str(failure.out_of_memory(forward, loop))
    # a loader worker's (its traceback says where), or one while a checkpoint is written
    worker = RuntimeError("Caught RuntimeError in DataLoader worker process 0.\nOriginal "
                          "Traceback ...\nRuntimeError: can't allocate memory")
    assert failure.out_of_memory(worker, loop) is None
    loop.phase = "checkpointing"
    assert failure.out_of_memory(MemoryError(), loop) is None
