"""trainer/windowlog.py: a logging window's sums (the data wait it measures, told apart on a
loaded machine by relations, not times) and its one host sync at each boundary, none per
step."""
from __future__ import annotations

import sys

import pytest

import torch

from tests.helpers import ROOT
from trainer.runner import train


def test_stall_meter_tells_a_slow_dataset_from_an_in_memory_one(make_cfg, tmp_path):
    """Relations that hold on a loaded machine: the slow dataset burns 10 ms of CPU time per
    sample in the loop's own process, so the steps waited at least that long in wall time
    (wall >= CPU for one thread, however busy the machine); the in-memory run waited for
    indexing alone, a tenth of that at most: compared with the slow run's wait, which a
    busy machine stretches alike (not with a time: 0.14 s once, with four test processes
    on two cores)."""
    common = ["data=synthetic", "model=cnn", "data.dataset.num_samples=64",
              "data.input_shape=[3,16,16]", "data.batch_size=16", "trainer.max_epochs=2"]
    slow = train(make_cfg(*common, "data.dataset.cost_ms=10", run_dir=tmp_path / "slow"))
    fast = train(make_cfg(*common, "data.cache=memory", run_dir=tmp_path / "fast"))
    burned = 2 * 64 * 0.010  # two epochs of 64 samples at 10 ms each
    assert slow["run_data_wait_s"] >= burned
    assert slow["run_data_wait_s"] <= slow["run_train_s"]
    assert fast["run_data_wait_s"] < slow["run_data_wait_s"] / 10
    assert fast["run_data_wait_frac"] < slow["run_data_wait_frac"]


def count_host_syncs(monkeypatch, run) -> int:
    """Calls that copy a tensor's value to Python (a device sync on CUDA) made by the
    project's own code (trainer/, data/) while `run()` trains."""
    ours = (str(ROOT / "trainer"), str(ROOT / "data"))
    calls = []
    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__"):
        def counted(self, *args, _real=getattr(torch.Tensor, name), **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(ours):
                calls.append(1)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    run()
    monkeypatch.undo()
    return len(calls)


def test_no_host_sync_per_step_only_at_logging_boundaries(make_cfg, tmp_path, monkeypatch):
    def syncs(steps, log_every):
        cfg = make_cfg(f"trainer.max_steps={steps}", f"trainer.log_every_n_steps={log_every}",
                       "trainer.save_checkpoint=false", "trainer.tensorboard=false",
                       run_dir=tmp_path / f"{steps}-{log_every}")
        return count_host_syncs(monkeypatch, lambda: train(cfg))

    # one logging window at the end either way: 4x the steps, the same number of syncs
    assert syncs(4, 100) == syncs(16, 100) > 0
    # a window every step: the counter does see per-step syncs when there are some
    assert syncs(16, 1) > syncs(4, 1)


def test_a_run_stopped_by_losses_that_are_not_finite_says_what_its_data_holds(make_cfg,
                                                                            tmp_path):
    """NaN rows in the training data were said as a non-finite loss alone."""
    from trainer.runner import train
    from trainer.windowlog import NonFiniteLoss

    with pytest.raises(NonFiniteLoss) as e:
        train(make_cfg("data.dataset._target_=tests.helpers.NaNRowDigits",
                       "+data.dataset.rows=300", "trainer.max_bad_steps=2",
                       "trainer.log_every_n_steps=2", "trainer.max_steps=20",
                       run_dir=tmp_path / "a"))
    assert "; the training data holds 19200 NaN or inf values in its inputs: a batch holding " \
        "one has a loss that is not finite" in str(e.value), str(e.value)
    with pytest.raises(NonFiniteLoss) as e:  # the data is fine: what else it may be
        train(make_cfg("model._target_=tests.helpers.NaNAfterMLP", "+model.nan_after=2",
                       "trainer.max_bad_steps=2", "trainer.log_every_n_steps=2",
                       "trainer.max_steps=20", run_dir=tmp_path / "b"))
    assert "(the training data holds no NaN or inf: too high a learning rate" in str(e.value)



def test_a_batch_that_counted_nothing_with_a_nan_loss_is_named_where_the_run_went_bad(
        make_cfg):
    """Its loss weighed 0, so its step read as finite, while its NaN gradients spoilt the
    weights: the stop named the data or the learning rate, and the steps after it."""
    from trainer.runner import train
    from trainer.windowlog import NonFiniteLoss

    with pytest.raises(NonFiniteLoss) as e:
        train(make_cfg("task._target_=tests.helpers.EmptyThirdBatch", "trainer.max_bad_steps=3",
                       "trainer.log_every_n_steps=1", "trainer.max_steps=20",
                       "trainer.sanity_check=false"))
    assert str(e.value).startswith("the loss was not finite for 3 optimizer steps in a row "
                                   "(up to step 6,"), str(e.value)
    assert ("; step 3's batch counted 0 units (task.count) and its loss "
                                 "was not finite, as a loss divided by its count is for an "
                                 "empty batch (0 / 0): its weight of 0 leaves the loss out, not "
                                 "the NaN gradients the weights took; return a finite loss "
                                 "there, e.g. divide by count.clamp(min=1)") in str(e.value), str(e.value)


def test_an_empty_batch_on_one_rank_is_named_by_rank_0_and_not_after_the_weights_went_nan(
        tmp_path):
    """Under DDP its NaN gradients reach every rank's weights: rank 0, whose own batches all
    counted, names rank 1's. An empty batch after the loss went non-finite for another
    reason is not named (NaN weights make every empty batch's loss NaN)."""
    from tests.helpers import torchrun

    out = torchrun(2, ["task._target_=tests.helpers.EmptyThirdBatch", "+task.rank=1",
                       "trainer.max_bad_steps=3", "trainer.log_every_n_steps=1",
                       "trainer.max_steps=20", "trainer.sanity_check=false",
                       f"hydra.run.dir={tmp_path / 'ddp'}"], tmp_path)
    assert out.returncode != 0
    assert "the loss was not finite for 3 optimizer steps in a row (up to step 6," in out.stderr
    assert "; step 3's batch counted 0 units (task.count)" in out.stderr, out.stderr[-3000:]


def test_an_empty_batch_after_the_loss_went_non_finite_is_not_named(make_cfg):
    """NaN weights make every empty batch's loss NaN: not the cause, so the stop keeps the
    data's hint."""
    from trainer.runner import train
    from trainer.windowlog import NonFiniteLoss

    with pytest.raises(NonFiniteLoss) as e:
        train(make_cfg("task._target_=tests.helpers.EmptyThirdBatch", "trainer.max_bad_steps=4",
                       "trainer.log_every_n_steps=1", "trainer.max_steps=20",
                       "trainer.sanity_check=false", "optim.lr=1e30"))
    assert "counted 0 units" not in str(e.value), str(e.value)
    assert "learning rate" in str(e.value), str(e.value)
