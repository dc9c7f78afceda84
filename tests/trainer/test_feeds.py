"""trainer/feeds.py: where each split's data lives, the workers `auto` picks, the stall advice
on real runs, and the device-resident path training exactly like the loader path."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings

import pytest
import torch

from tests.helpers import ROOT, children_left, final_weights, summary_of, torchrun
from trainer.config import ConfigError
from trainer.runner import train


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

IMAGES = ["data=synthetic", "model=cnn", "data.dataset.num_samples=96",
          "data.input_shape=[3,8,8]", "data.dataset.dtype=uint8", "data.batch_size=16",
          "data.normalize_mean=[0.5,0.5,0.5]", "data.normalize_std=[0.25,0.25,0.25]",
          "sched=constant", "trainer.tensorboard=false"]


def data_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]


def test_auto_keeps_tensor_data_on_the_device_without_workers(make_cfg, caplog):
    caplog.set_level(logging.INFO, logger="stoker")
    summary = train(make_cfg("data.num_workers=auto", "trainer.max_epochs=1"))
    lines = data_lines(caplog)
    assert lines[0].startswith("data: train set: 1438 samples, 0.4 MB of tensors kept on cpu, "
                               "batched by indexing (data.placement=auto)")
    assert lines[1].startswith("data: val set: 359 samples")
    assert summary["run_data_wait_frac"] < 0.5  # indexing, no loader


def test_auto_workers_are_zero_for_tensors_in_memory_and_cpus_otherwise(make_cfg, caplog,
                                                                       tmp_path):
    caplog.set_level(logging.INFO, logger="stoker")
    train(make_cfg("data.num_workers=auto", "data.placement=host", "trainer.max_steps=2",
                   run_dir=tmp_path / "digits"))
    assert "through a DataLoader with 0 workers (data.num_workers=auto" in data_lines(caplog)[0]
    caplog.clear()
    train(make_cfg("data.num_workers=auto", "data=synthetic", "data.dataset.num_samples=64",
                   "data.input_shape=[1,8,8]", "trainer.max_steps=2",
                   run_dir=tmp_path / "synthetic"))
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    expected = max(1, min(16, workers))
    assert f"through a DataLoader with {expected} workers" in data_lines(caplog)[0]


def test_device_placement_trains_exactly_like_the_loader(make_cfg, tmp_path):
    common = ["trainer.max_epochs=2", "sched=constant", "trainer.tensorboard=false"]
    host = train(make_cfg(*common, "data.placement=host", run_dir=tmp_path / "host"))
    device = train(make_cfg(*common, "data.placement=device", run_dir=tmp_path / "device"))
    assert host["val_acc"] == device["val_acc"] and host["val_loss"] == device["val_loss"]
    assert same_weights(final_weights(host), final_weights(device))


@pytest.mark.slow
def test_two_ranks_shard_the_device_resident_data_like_the_loader(tmp_path):
    args = ["trainer.max_epochs=2", "sched=constant", "trainer.progress_bar=false",
            "data.num_workers=0"]
    for placement in ("host", "device"):
        proc = torchrun(2, [*args, f"data.placement={placement}",
                            f"hydra.run.dir={tmp_path / placement}"], ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    host, device = summary_of(tmp_path / "host"), summary_of(tmp_path / "device")
    assert host["val_acc"] == device["val_acc"] and host["steps"] == device["steps"] == 24
    assert same_weights(final_weights(host), final_weights(device))


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_augmented_device_run_resumes_mid_epoch_bit_exact(make_cfg, tmp_path, accelerator):
    """uint8 images cached in memory, so kept on the device; crops and flips drawn per sample.
    Stopped after 5 of 12 steps and resumed: the same weights as the run straight through
    (on CUDA with trainer.deterministic, as exact comparisons of conv backward passes need)."""
    common = [*IMAGES, "data.cache=memory", "data.augment.crop_padding=2",
              "data.augment.hflip=true", f"trainer.accelerator={accelerator}",
              f"trainer.deterministic={accelerator == 'cuda'}"]
    full = train(make_cfg(*common, "trainer.max_epochs=2", run_dir=tmp_path / "full"))
    train(make_cfg(*common, "trainer.max_epochs=2", "trainer.max_steps=5",
                   run_dir=tmp_path / "part"))
    resumed = train(make_cfg(*common, "trainer.max_epochs=2", "trainer.resume=auto",
                             run_dir=tmp_path / "part"))
    assert resumed["steps"] == full["steps"] == 12
    assert same_weights(final_weights(full), final_weights(resumed))
    plain = train(make_cfg(*common[:-4], *common[-2:], "trainer.max_epochs=2",
                           run_dir=tmp_path / "plain"))
    assert not same_weights(final_weights(full), final_weights(plain))  # augmentation acted


def test_limit_val_batches_0_validates_nothing_and_builds_no_val_split(make_cfg, tmp_path):
    summary = train(make_cfg("data=custom", "+data.dataset._target_=tests.helpers."
                             "TrainOnlyDigits", "data.input_shape=[64]", "data.num_classes=10",
                             "trainer.limit_val_batches=0", "trainer.max_epochs=2",
                             run_dir=tmp_path / "run"))
    assert summary["steps"] == 46 and summary["run_val_s"] == 0.0
    assert not any(k.startswith("val_") for k in summary)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert rows and {row["split"] for row in rows} == {"train"}
    with pytest.raises(ConfigError, match=r"^trainer\.checkpoint\.monitor=val_loss: nothing is "
                                          r"validated in this run \(trainer\.limit_val_batches=0"
                                          r"\), so there is no value to monitor"):
        train(make_cfg("trainer.limit_val_batches=0", "trainer.checkpoint.monitor=val_loss",
                       run_dir=tmp_path / "monitored"))


@pytest.mark.parametrize("overrides,message", [
    (["data=synthetic", "data.dataset.num_samples=32", "data.input_shape=[1,8,8]"],
     "data.placement=device: the train set cannot be kept on the device: SyntheticDataset is "
     "not a set of tensors"),
    (["+data.collate_fn={_target_:torch.utils.data.default_collate}"],
     "data.placement=device: the train set cannot be kept on the device: data.collate_fn is "
     "set"),
    (["data=synthetic", "data.dataset.num_samples=32", "data.input_shape=[1,8,8]",
      "+data.collate_fn={_target_:torch.utils.data.default_collate}"],  # the reason that fits
     "data.placement=device: the train set cannot be kept on the device: data.collate_fn is "
     "set"),
])
def test_device_placement_that_cannot_be_had_is_one_line(make_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        train(make_cfg("data.placement=device", *overrides))


def test_auto_budget_keeps_large_tensor_data_on_the_host():
    from omegaconf import OmegaConf

    from data.datasets import DigitsDataset
    from trainer.config import DataConfig
    from trainer.feeds import placement

    d = OmegaConf.structured(DataConfig(device_budget_mb=0.1))
    ds = DigitsDataset("train")  # 0.4 MB
    # an accelerator (any non-CPU device): the budget applies; on CPU nothing is copied
    assert placement(d, ds, torch.device("meta"), False) == (
        "host", "its tensors take 0.4 MB > data.device_budget_mb")
    assert placement(d, ds, torch.device("cpu"), False) == ("device", None)
    d.device_budget_mb = 1.0
    assert placement(d, ds, torch.device("meta"), False) == ("device", None)


def test_a_later_split_counts_the_epoch_copy_an_earlier_one_will_make(monkeypatch):
    """The validation set is placed after the training set's tensors are on the GPU but before
    the training set's epoch copy is made: that copy is counted as taken, or both splits'
    copies together could outgrow the memory each was checked against alone."""
    from omegaconf import OmegaConf

    from data.datasets import DigitsDataset
    from trainer.config import DataConfig
    from trainer.feeds import placement

    d = OmegaConf.structured(DataConfig())
    ds = DigitsDataset("train")  # 0.4 MB, 0.7 MB with its epoch copy
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * 2**20, 80 * 2**30))
    cuda = torch.device("cuda", 0)
    assert placement(d, ds, cuda, False) == ("device", None)
    where, why_not = placement(d, ds, cuda, False, reserved_mb=0.6)
    assert where == "host" and "more than half of the 1 MB free on cuda:0 besides 1 MB for " \
        "the training set's epoch copy" in why_not


def test_memory_mapped_arrays_are_batched_by_indexing_within_the_budget(make_cfg, caplog,
                                                                          tmp_path):
    """data=memmap under auto: within data.device_budget_mb its arrays are batched by
    indexing (no workers), training exactly as the DataLoader does; beyond it, on CPU too,
    loader workers read them."""
    from omegaconf import OmegaConf

    from data.datasets import MemmapDataset
    from tests.helpers import make_memmap_root
    from trainer.config import DataConfig
    from trainer.feeds import placement

    root = make_memmap_root(tmp_path / "mm", n=64, dtype="uint8")
    common = ["data=memmap", f"data.dataset.root={root}", "model=cnn", "data.batch_size=16",
              "data.normalize_mean=[0.5,0.5,0.5]", "data.normalize_std=[0.25,0.25,0.25]",
              "trainer.max_epochs=2", "sched=constant", "trainer.tensorboard=false"]
    caplog.set_level(logging.INFO, logger="stoker")
    auto = train(make_cfg(*common, run_dir=tmp_path / "auto"))
    assert data_lines(caplog)[0].startswith(
        "data: train set: 64 samples, 0.0 MB of memory-mapped arrays kept on cpu, batched by "
        "indexing (data.placement=auto)")
    host = train(make_cfg(*common, "data.placement=host", "data.num_workers=0",
                          run_dir=tmp_path / "host"))
    assert same_weights(final_weights(auto), final_weights(host))
    caplog.clear()
    train(make_cfg(*common, "data.device_budget_mb=0.01", "data.num_workers=1",
                   "trainer.max_steps=1", run_dir=tmp_path / "over"))
    assert data_lines(caplog)[0].startswith(
        "data: train set: 64 samples through a DataLoader with 1 worker (data.num_workers=1, "
        "data.placement=auto); not batched on the device: its arrays take 0.0 MB > "
        "data.device_budget_mb")
    d = OmegaConf.structured(DataConfig(device_budget_mb=0.01))  # the arrays: 12 KB
    ds = MemmapDataset("train", str(root))
    assert placement(d, ds, torch.device("cpu"), False) == (
        "host", "its arrays take 0.0 MB > data.device_budget_mb")
    d.device_budget_mb = 1.0
    assert placement(d, ds, torch.device("cpu"), False) == ("device", None)


def test_memory_mapped_arrays_that_cannot_be_indexed_are_read_by_workers(tmp_path):
    """A wrapper with samples of its own (the lru cache) is not its arrays; targets stored as
    uint16 (no index_select kernel) go to the workers with the reason, never a traceback."""
    import numpy as np
    from omegaconf import OmegaConf

    from data.lrucache import LRUCache
    from data.datasets import MemmapDataset
    from data.resident import rows_of
    from tests.helpers import make_memmap_root
    from trainer.config import DataConfig
    from trainer.feeds import placement

    root = make_memmap_root(tmp_path / "mm", n=16, dtype="uint8")
    d = OmegaConf.structured(DataConfig())
    wrapped = LRUCache(MemmapDataset("train", str(root)), max_bytes=2**20)
    assert rows_of(wrapped) is None
    assert placement(d, wrapped, torch.device("cpu"), False)[0] == "host"
    y = np.load(root / "train" / "y.npy")
    np.save(root / "train" / "y.npy", y.astype(np.uint16))
    assert placement(d, MemmapDataset("train", str(root)), torch.device("cpu"), False) == (
        "host", "its arrays hold torch.uint16, which index_select does not support (store "
                "int64, int32 or uint8)")


@pytest.mark.parametrize("extra", [[], ["trainer.limit_train_batches=3"]])
def test_training_workers_run_on_across_epochs_and_resume_exactly(make_cfg, tmp_path, extra):
    """One DataLoader iterator for a run straight through (limited epochs too); stopped
    mid-epoch and resumed, the same weights as the run straight through."""
    from trainer.loop import Callback

    class Restarts(Callback):
        seen: list = []

        def after_epoch(self, loop, val) -> None:
            self.seen.append(loop.train_feed.loader.restarts)

    common = ["data=synthetic", "data.dataset.num_samples=96", "data.input_shape=[1,8,8]",
              "data.batch_size=16", "data.num_workers=2", "trainer.max_epochs=3",
              "sched=constant", "trainer.tensorboard=false", *extra]
    counter = Restarts()
    full = train(make_cfg(*common, run_dir=tmp_path / "full"), callbacks=[counter])
    assert counter.seen == [1, 1, 1]
    train(make_cfg(*common, "trainer.max_steps=4", run_dir=tmp_path / "part"))
    resumed = train(make_cfg(*common, "trainer.resume=auto", run_dir=tmp_path / "part"))
    assert resumed["steps"] == full["steps"]
    assert same_weights(final_weights(full), final_weights(resumed))


def test_run_on_workers_end_when_training_fails(make_cfg):
    """A run that fails (here a callback's error at step 2) leaves no loader workers behind
    in the calling process, even while its traceback is kept."""
    import multiprocessing

    from trainer.loop import Callback

    class Boom(Callback):
        def after_step(self, loop) -> None:
            if loop.state.step == 2:
                raise RuntimeError("boom")

    cfg = make_cfg("data=synthetic", "data.dataset.num_samples=96", "data.input_shape=[1,8,8]",
                   "data.batch_size=16", "data.num_workers=2", "trainer.tensorboard=false")
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="boom") as kept:
        train(cfg, callbacks=[Boom()])
    assert not children_left(before) and kept.value is not None


@contextlib.contextmanager
def two_cores(n: int = 2):
    """This process (and the loader workers it forks) on `n` CPU cores, so `cores` in the
    advice is `n` on any machine."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < n:
        pytest.skip(f"needs {n} CPU cores and sched_setaffinity")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(before)[:n])
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


HEAVY = ["data=synthetic", "data.dataset.num_samples=256", "data.input_shape=[1,8,8]",
         "data.dataset.cost_ms=4", "data.batch_size=16", "model=mlp", "trainer.max_epochs=1",
         "data.placement=host", "trainer.progress_bar=false", "trainer.save_checkpoint=false"]


@pytest.mark.slow
@pytest.mark.parametrize("case,overrides,advice", [
    ("CPU-bound decoding", [*HEAVY, "data.num_workers=2"],
     "the loader is CPU-bound: 2 workers on 2 cores cannot decode faster"),
    ("more workers than cores", [*HEAVY, "data.num_workers=4"],
     "data.num_workers=4 is more than the 2 CPU cores this rank has"),
    ("tiny data in memory", ["data.placement=host", "data.num_workers=2", "model.hidden=[8]",
                             "trainer.max_epochs=2", "trainer.progress_bar=false",
                             "trainer.save_checkpoint=false"],
     "the samples are tensors in memory: set data.placement=device"),
    ("samples that wait (a sleep standing for storage)",
     ["data.dataset._target_=tests.helpers.SlowDigits", "+data.dataset.delay=0.002",
      "data.num_workers=2", "data.placement=host", "trainer.max_steps=12",
      "trainer.progress_bar=false", "trainer.save_checkpoint=false"],
     "making a sample mostly waits"),
    ("a dataset of one's own holding tensors, cheap to index",
     ["data=custom", "+data.dataset._target_=tests.helpers.Diabetes", "data.input_shape=[10]",
      "+model.num_classes=1", "task=regression", "data.num_workers=2", "trainer.max_epochs=2",
      "data.batch_size=16", "trainer.progress_bar=false", "trainer.save_checkpoint=false"],
     "less than handing it over from a worker: data.cache=memory keeps the samples"),
    ("uint8 samples converted on the CPU", ["data=synthetic", "data.dataset.num_samples=512",
                                            "data.input_shape=[3,8,8]", "data.dataset.dtype=uint8",
                                            "data.cache=memory", "model=mlp",
                                            "trainer.progress_bar=false",
                                            "trainer.save_checkpoint=false"],
     "the wait is their conversion to normalised floats"),
])
def test_stall_advice_fits_the_case_it_sees(make_cfg, caplog, monkeypatch, case, overrides,
                                           advice):
    """The advice a run gives follows what its feed shows. Whether a run waits more than the
    bar that earns advice depends on this machine's load, which is not what is tested here:
    the bar is lowered to 0 so every run gives its advice."""
    import trainer.ending

    if "mostly waits" in advice and not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("no /proc/thread-self/schedstat: the time queued for a CPU is unknown")
    monkeypatch.setattr(trainer.ending, "STALL_ADVICE_ABOVE", 0.0)
    with two_cores(), caplog.at_level(logging.INFO, logger="stoker"):
        train(make_cfg(*overrides))
    line = [r.getMessage() for r in caplog.records if "steps waited for data" in r.getMessage()]
    assert len(line) == 1 and advice in line[0], (case, line)
    assert "prefetch_factor" not in line[0]


def test_no_advice_for_a_fast_dev_run_or_a_few_steps(make_cfg, caplog, monkeypatch, tmp_path):
    """One step's wait is the loader's start-up: no advice, however long it waited."""
    import trainer.ending

    monkeypatch.setattr(trainer.ending, "STALL_ADVICE_ABOVE", 0.0)
    for i, args in enumerate((["trainer.fast_dev_run=true"], ["trainer.max_steps=9"],
                              ["trainer.max_steps=10"])):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="stoker"):
            train(make_cfg(*args, "trainer.progress_bar=false", run_dir=tmp_path / str(i)))
        advice = [r for r in caplog.records if "waited for data" in r.getMessage()]
        assert len(advice) == (args == ["trainer.max_steps=10"]), args


def test_a_disk_cache_inside_the_data_it_reads_is_refused(make_cfg, tmp_path):
    """Its key folders became class folders of the image folder: every later run failed."""
    from scripts.make_images import write_images
    from trainer.config import ConfigError

    root = tmp_path / "imgs"
    write_images(root, count=8, size=16, classes=2)
    with pytest.raises(ConfigError, match=rf"^data.cache_dir={root}/train: inside "
                                          rf"{root}/train, which data.dataset reads, where the "
                                          r"cache's folders would become part of the data"):
        train(make_cfg("data=image_folder", f"data.dataset.root={root}", "data.dataset.size=8",
                       "model=cnn", "data.cache=disk", f"data.cache_dir={root}/train"))
    assert sorted(p.name for p in (root / "train").iterdir()) == ["class_00", "class_01"]
    # a folder of classes split by val_fraction: the folder itself is the data
    with pytest.raises(ConfigError, match=rf"^data.cache_dir={root}/train/cache: inside "
                                          rf"{root}/train, which data.dataset reads"):
        train(make_cfg("data=image_folder", f"data.dataset.root={root}/train",
                       "data.dataset.val_fraction=0.5", "data.dataset.size=8", "model=cnn",
                       "data.cache=disk", f"data.cache_dir={root}/train/cache"))
    assert sorted(p.name for p in (root / "train").iterdir()) == ["class_00", "class_01"]
    train(make_cfg("data=image_folder", f"data.dataset.root={root}", "data.dataset.size=8",
                   "model=cnn", "data.cache=disk", f"data.cache_dir={root}/.cache",
                   "trainer.max_steps=1"))  # beside the splits: nothing reads it as data


def test_a_num_classes_other_than_the_folders_is_refused(make_cfg, tmp_path):
    """A 5-way model trained on a 2-class folder, with no word."""
    from scripts.make_images import write_images
    from trainer.config import ConfigError

    folder = tmp_path / "imgs"
    write_images(folder, count=12, size=16, classes=3)
    with pytest.raises(ConfigError, match=r"^data.num_classes=5: data.dataset has 3 classes "
                                          r"\(class_00, class_01, class_02\); leave the key out"):
        train(make_cfg("data=image_folder", f"data.dataset.root={folder}", "data.num_classes=5",
                       "data.dataset.size=8", "model=cnn"))


def test_a_dataset_naming_its_classes_gives_data_num_classes(make_cfg, tmp_path):
    """Its `classes` were checked against data.num_classes, whose refusal said to leave the
    key out to take the count; left out, the model got none (a model of another output size
    then trained unchecked)."""
    import json

    from trainer.config import ConfigError

    named = ["data.dataset._target_=tests.helpers.NamedClassesDigits", "data.num_classes=null",
             "trainer.max_steps=2"]
    summary = train(make_cfg(*named, run_dir=tmp_path / "run"))
    assert summary["steps"] == 2
    assert "num_classes: 10\n" in (tmp_path / "run" / "config.yaml").read_text()
    assert json.loads((tmp_path / "run" / "classes.json").read_text())[:2] == ["digit 0",
                                                                              "digit 1"]
    with pytest.raises(ConfigError, match=r"^task classification: logits with 4 classes but "
                                          r"data.num_classes=10"):
        train(make_cfg(*named, "+model.num_classes=4", run_dir=tmp_path / "other"))
    for dataset, said in [("SplitNamedDigits", "data: data.dataset (the validation split) has "
                           "9 classes (digit 0, digit 1, digit 2, digit 3, digit 4, ...), the "
                           "training split 10; give both splits the same classes"),
                          ("OneNamedDigits", "data: data.dataset has 1 classes (digit); a "
                           "classifier needs 2 or more (task=regression for one real value)")]:
        with pytest.raises(ConfigError) as e:  # (said as the splits', not data.num_classes=N)
            train(make_cfg(*named, f"data.dataset._target_=tests.helpers.{dataset}",
                           run_dir=tmp_path / dataset))
        assert str(e.value) == said


@pytest.mark.parametrize("cache", ["shm", "disk"])
def test_ranks_waiting_for_a_cache_writer_that_was_killed_stop_in_one_line(tmp_path, cache):
    """An srun launch has no torchrun agent to end the other ranks when local rank 0 dies
    while it writes the node's copy: they see its process gone and stop, each saying so
    (rank 0, which would speak for them, is the one gone)."""
    from data.cache import reclaim_shm
    from tests.helpers import slurm_tasks
    from trainer import runlock

    codes, outs = slurm_tasks(tmp_path, 2, [
        "data=custom", "+data.dataset._target_=tests.helpers.KilledWhileCaching",
        "data.input_shape=[1,8,8]", "data.num_classes=10", f"data.cache={cache}",
        f"data.cache_dir={tmp_path / 'cache'}", "trainer.ddp.timeout_s=120",
        "trainer.max_steps=2"], timeout=100)
    reclaim_shm(runlock.owner_alive)  # the killed writer's copy (a later run's job)
    assert codes[0] == -9 and codes[1] == 1, outs
    line = [ln for ln in outs[1].splitlines() if ln.startswith("stoker: error:")]
    assert len(line) == 1 and f"data.cache={cache} in " in line[0] and line[0].endswith(
        "local rank 0, which was writing it, ended before it finished; its own error, if it "
        "had one, is in its output"), outs[1][-2000:]
    assert "Traceback" not in outs[1]


def test_device_placement_names_the_collate_that_stops_it(tmp_path):
    """An image folder's own collate is no `data.collate_fn is set` (it was not): the line
    says its samples are not tensors; one's own collate is named as set."""
    from omegaconf import OmegaConf
    from PIL import Image

    from data.datasets import DigitsDataset
    from data.images import ImageFolder
    from trainer.config import DataConfig
    from trainer.feeds import placement

    for name in ("a", "b"):
        (tmp_path / "train" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "train" / name / "x.png")
    images = ImageFolder("train", str(tmp_path), size=8)
    d = OmegaConf.structured(DataConfig(placement="device"))
    where, why_not = placement(d, images, torch.device("cpu"), True)
    assert where == "host" and why_not.startswith("ImageFolder is not a set of tensors"), why_not
    d.collate_fn = {"_target_": "torch.utils.data.default_collate", "_partial_": True}
    assert placement(d, DigitsDataset("train"), torch.device("cpu"), True)[1] == (
        "data.collate_fn is set, and device batches are formed by indexing")


def test_more_workers_than_any_sample_uses_is_one_warning_naming_the_key(make_cfg, caplog,
                                                                       tmp_path):
    """data.num_workers=32 carried to a smaller machine: PyTorch said a paragraph per loader
    (twice on the first epoch) in no words of the key, and at any worker past the CPUs, which
    the stall advice itself asks for where samples wait on storage. One warning names the key
    past the most that advice asks for (4 per CPU, 8 at least); none below it."""
    args = ("data=synthetic", "data.dataset.num_samples=64", "data.input_shape=[1,8,8]",
            "data.placement=host", "trainer.max_epochs=2", "trainer.progress_bar=false",
            "sched=constant", "data.batch_size=4", "trainer.max_steps=2")
    said = {}
    with two_cores(1), warnings.catch_warnings(record=True) as torch_said, \
            caplog.at_level(logging.INFO, logger="stoker"):
        warnings.simplefilter("always")
        for workers in ("9", "8", "auto"):
            caplog.clear()
            train(make_cfg(*args, f"data.num_workers={workers}", run_dir=tmp_path / workers))
            said[workers] = [r.getMessage() for r in caplog.records
                             if r.levelno == logging.WARNING]
    assert said == {"9": ["data.num_workers=9: 9 loader workers per rank for this node's 1 CPU: "
                          "more than 4 per CPU (8 at least), past what even samples that wait "
                          "on storage use, and each holds its copy of the dataset and batches "
                          "in flight; data.num_workers=auto gives 1 (scripts/tune_loader.py "
                          "measures others)"],
                    "8": [], "auto": []}
    assert not [w for w in torch_said if "worker processes in total" in str(w.message)]


def test_a_worker_count_no_machine_runs_is_refused_before_a_worker_starts(make_cfg, tmp_path):
    """`data.num_workers=100000` (zeros too many) forked until the memory ran out, and the
    processes outlived the run: past 16 per CPU (64 at least) is one line, nothing forked."""
    from omegaconf import OmegaConf

    from trainer.feeds import _check_worker_count

    with two_cores(1), pytest.raises(ConfigError) as info:
        train(make_cfg("data.placement=host", "data.num_workers=100000", run_dir=tmp_path))
    assert str(info.value) == (
        "data.num_workers=100000: 100000 loader processes per rank for 1 CPU; at most 64 (16 "
        "per CPU, 64 at least): each is a process holding its copy of the dataset; "
        "data.num_workers=auto gives 1")
    assert not (tmp_path / "checkpoints").exists()
    with two_cores(1):  # 64 is not past it (too_many_workers warns)
        _check_worker_count(OmegaConf.create({"num_workers": 64}), 1)


def test_a_training_set_whose_epochs_keep_a_repeat_says_so():
    """The sampler pads an epoch to a multiple of the ranks and leaves a repeat out of a rank's
    last batch where that batch keeps a sample of its own (data/sampler.py): 203 samples on 2
    ranks of 8 repeat none. Where the repeat is a rank's whole last batch (17 on 2 ranks of 8:
    9 = 8 + 1 each), the epoch's last step counts it twice, and the data line says so."""
    from trainer.feeds import repeated

    assert repeated(203, 2, 8, False) == repeated(1438, 3, 64, False) == ""
    assert repeated(17, 2, 8, False) == (
        "; 1 sample repeated each epoch (as a rank's whole last batch, so that every rank "
        "takes as many batches; the epoch's last step counts it twice; another "
        "data.batch_size, or data.drop_last=true, which leaves samples out, avoids it)")
    assert "2 samples repeated" in repeated(10, 4, 2, False)
    assert repeated(202, 2, 8, False) == repeated(17, 1, 8, False) == \
        repeated(17, 2, 8, True) == ""


@pytest.mark.parametrize("key,val", [("num_classes", 8), ("classes", ["a", "b"]),
                                     ("kind", "image")])
def test_a_shard_sets_splits_that_describe_other_samples_are_one_line(make_cfg, tmp_path, key,
                                                                      val):
    """A val index.json of fewer classes than the train one was blamed on data.num_classes
    (which the train index sets), or, of another count unnamed, accepted."""
    from data.datasets import DigitsDataset
    from data.shardwriter import write_shards
    from trainer.feeds import build_datasets

    root = tmp_path / "shards"
    for split in ("train", "val"):
        write_shards(DigitsDataset(split), root / split, samples_per_shard=500, num_classes=10)
    index = json.loads((root / "val" / "index.json").read_text())
    was = index.get(key)
    (root / "val" / "index.json").write_text(json.dumps({**index, key: val}))
    with pytest.raises(ConfigError) as e:
        build_datasets(make_cfg("data=shards", f"data.dataset.root={root}"))
    assert str(e.value) == (f"data: {root}/val/index.json says {key} {json.dumps(val)}, "
                            f"{root}/train/index.json {json.dumps(was)}; write both splits with "
                            "one scripts/prepare_data.py --format shards run")
