"""write_arrays and the data.cache modes give back exactly the source samples."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from data import cache, lrucache
from data.datasets import MemmapDataset, SyntheticDataset
from trainer.config import ConfigError


def source():
    return SyntheticDataset("train", num_samples=10, input_shape=(2, 4, 4), num_classes=3)


def same(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        assert torch.equal(a[i][0], b[i][0]) and int(a[i][1]) == int(b[i][1])


def test_write_arrays_round_trip_and_no_temp_files(tmp_path):
    shape = cache.write_arrays(source(), tmp_path / "train", num_workers=2)
    assert shape == (2, 4, 4)
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["x.npy", "y.npy"]
    same(MemmapDataset("train", str(tmp_path)), source())


@pytest.mark.parametrize("mode", ["none", "memory", "shm"])
def test_cache_modes_keep_the_samples(mode, monkeypatch, tmp_path):
    monkeypatch.setattr(cache, "SHM_ROOT", tmp_path)  # keep the test out of /dev/shm
    cached = cache.cache_dataset(source(), mode, tag="t")
    same(cached, source())
    if mode == "shm":
        assert isinstance(cached, MemmapDataset) and str(tmp_path) in cached.x.path


def test_cache_refuses_datasets_that_are_not_pairs():
    class Triples(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.zeros(1), torch.zeros(1), torch.zeros(1)

    with pytest.raises(ValueError, match="\\(input, target\\) tensor pairs"):
        cache.cache_dataset(Triples(), "memory", tag="t")


@pytest.mark.parametrize("mode", ["memory", "shm"])
def test_cache_refuses_samples_the_default_collate_cannot_batch_in_its_own_words(mode):
    """Varying-length token rows (which a data.collate_fn of one's own pads): the line says
    what the cache needs, not the loader's advice to set data.collate_fn, which is set."""
    from tests.helpers import PaddedTokens

    with pytest.raises(ConfigError) as e:
        cache.cache_dataset(PaddedTokens(num_samples=8), mode, tag="t")
    assert str(e.value).startswith(
        "data.cache and scripts/prepare_data.py need a dataset of (input, target) tensor "
        "pairs, which the default collate batches: the dataset yields samples the default "
        "collate cannot batch (")
    assert str(e.value).endswith("); use data.cache=none for other samples")
    assert "set data.collate_fn" not in str(e.value)


class Counting(torch.utils.data.Dataset):
    """SyntheticDataset samples, counting how many were made (in this process)."""

    def __init__(self, n=10, tag=""):
        self.inner, self.made, self.tag = source(), 0, tag
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.made += 1
        return self.inner[i]

    def fingerprint(self):
        return self.tag


def test_lru_serves_hits_without_making_the_sample_again():
    ds = Counting()
    lru = cache.cache_dataset(ds, "lru", tag="t", cache_mb=1.0)
    first = [lru[i] for i in range(10)]
    second = [lru[i] for i in range(10)]
    assert ds.made == 10 and lru.hits == 10 and lru.misses == 10
    assert all(a[0] is b[0] for a, b in zip(first, second))
    same(lru, source())


def test_lru_evicts_the_least_recently_used_by_bytes_not_items():
    ds = Counting()
    per_sample = lrucache._sample_bytes(ds.inner[0])  # 2x4x4 float32 + an int64 and allowances
    lru = lrucache.LRUCache(ds, max_bytes=3 * per_sample)
    for i in (0, 1, 2):
        lru[i]
    lru[0]  # 0 is now the most recently used: 1 goes first
    lru[3]
    assert sorted(lru._items) == [0, 2, 3] and lru.bytes <= 3 * per_sample
    made = ds.made
    lru[1]  # evicted: made again
    assert ds.made == made + 1
    big = lrucache.LRUCache(Counting(), max_bytes=per_sample - 1)  # nothing fits: pass-through
    big[0]
    assert not big._items and big.bytes == 0


def test_lru_keeps_the_datasets_attributes_and_collate():
    ds = Counting()
    ds.classes, ds.collate_fn = ["a", "b"], torch.utils.data.default_collate
    lru = lrucache.LRUCache(ds, 2**20)
    assert lru.classes == ["a", "b"] and lru.collate_fn is ds.collate_fn
    import pickle

    assert len(pickle.loads(pickle.dumps(lru))) == 10  # a worker gets a copy


def test_disk_cache_is_written_once_and_found_by_a_later_run(tmp_path):
    first = Counting()
    cached = cache.cache_dataset(first, "disk", tag="cfg", cache_dir=str(tmp_path))
    assert isinstance(cached, MemmapDataset) and first.made == 10
    same(cached, source())
    later = Counting()
    again = cache.cache_dataset(later, "disk", tag="cfg", cache_dir=str(tmp_path))
    assert later.made == 0 and again.x.path == cached.x.path  # read, not written again
    folders = [p.name for p in tmp_path.iterdir()]
    assert len(folders) == 1 and ".tmp" not in folders[0]
    assert json.loads((tmp_path / folders[0] / "done.json").read_text())["dataset"] == "cfg"


def test_disk_cache_is_rebuilt_when_the_config_or_the_files_change(tmp_path):
    base = cache.cache_dataset(Counting(), "disk", tag="cfg", cache_dir=str(tmp_path))
    other_cfg = Counting()
    by_cfg = cache.cache_dataset(other_cfg, "disk", tag="cfg2", cache_dir=str(tmp_path))
    other_files = Counting(tag="files changed")
    by_files = cache.cache_dataset(other_files, "disk", tag="cfg", cache_dir=str(tmp_path))
    assert other_cfg.made == 10 and other_files.made == 10
    assert len({base.x.path, by_cfg.x.path, by_files.x.path}) == 3


def test_a_failed_disk_write_leaves_no_folder_that_a_later_run_would_trust(tmp_path):
    class Broken(Counting):
        def __getitem__(self, i):
            if i == 7:
                raise RuntimeError("disk full")
            return super().__getitem__(i)

    with pytest.raises(RuntimeError, match="disk full"):
        cache.cache_dataset(Broken(), "disk", tag="cfg", cache_dir=str(tmp_path),
                            owner={"job": "SLURM_JOB_ID=7"})
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # no partial folder
    failed = [p for p in tmp_path.iterdir() if ".failed-" in p.name]
    assert len(failed) == 1  # for the waiting ranks
    with pytest.raises(ConfigError, match="failed to write it: disk full"):
        cache.cache_dataset(Broken(), "disk", tag="cfg", local_rank=1, cache_dir=str(tmp_path),
                            owner={"job": "SLURM_JOB_ID=7"}, start_s=30)
    # a rerun's ranks, there before their writer removed the line, wait for their own writer
    from data.cachewait import WriterGone

    with pytest.raises(WriterGone, match="did not begin writing it within 0.5 s"):
        cache.cache_dataset(Broken(), "disk", tag="cfg", local_rank=1, cache_dir=str(tmp_path),
                            owner={"job": "SLURM_JOB_ID=7", "launch": "SLURM_STEP_ID=1"},
                            start_s=0.5)
    ok = Counting()
    cache.cache_dataset(ok, "disk", tag="cfg", cache_dir=str(tmp_path))
    assert ok.made == 10 and not any(".failed-" in p.name for p in tmp_path.iterdir())


def test_write_arrays_keeps_only_the_rows_of_samples_not_skipped(tmp_path):
    from torch.utils.data import default_collate

    class Holes(Counting):
        collate_fn = staticmethod(lambda s: default_collate([x for x in s if x is not None]))

        def __getitem__(self, i):
            return None if i in (2, 5) else super().__getitem__(i)

    cache.write_arrays(Holes(), tmp_path / "train")
    mm, src = MemmapDataset("train", str(tmp_path)), source()
    assert len(mm) == 8
    kept = [i for i in range(10) if i not in (2, 5)]
    assert all(torch.equal(mm[j][0], src[i][0]) for j, i in enumerate(kept))


def test_a_disk_too_full_for_the_arrays_is_an_error_naming_them_not_a_bus_error(tmp_path,
                                                                               monkeypatch):
    """The arrays' blocks are reserved before they are written through a memory map: a map
    over a sparse file the disk cannot fill ends the process with SIGBUS (no message, no
    cleanup). Here the reservation is refused as a full disk refuses it."""
    reserved = []

    def full(fd, offset, length):
        reserved.append(length)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"train: cannot reserve 0\.\d MB for x\.npy: No space "
                                      r"left on device"):
        cache.write_arrays(source(), tmp_path / "train")
    assert reserved and reserved[0] > 128  # the whole file, header included
    assert list((tmp_path / "train").iterdir()) == []  # nothing half-written left


@pytest.mark.parametrize("damage", ["done.json", "x.npy missing", "x.npy cut", "x.npy garbage"])
def test_a_damaged_disk_cache_is_one_line_naming_it_and_what_to_delete(tmp_path, damage):
    cache.cache_dataset(source(), "disk", tag="cfg", cache_dir=str(tmp_path))
    [root] = [p for p in tmp_path.iterdir() if p.is_dir()]
    x = root / "train" / "x.npy"
    if damage == "done.json":
        (root / "done.json").write_text("{not json")
    elif damage == "x.npy missing":
        x.unlink()
    elif damage == "x.npy cut":
        x.write_bytes(x.read_bytes()[:200])
    else:
        x.write_bytes(b"\x17" * 500)
    with pytest.raises(ConfigError, match=rf"^data.cache=disk: the cache {root} is damaged "
                                          r"\(.*\); delete that folder and the next run writes "
                                          r"it again$") as e:
        cache.cache_dataset(source(), "disk", tag="cfg", cache_dir=str(tmp_path))
    assert "prepare_data" not in str(e.value)  # (a packed array's own way out: one way here)


def test_a_disk_cache_without_its_done_record_is_one_line_before_any_sample_is_made(tmp_path):
    """A folder of the cache's name without done.json (cut, or not a run's): the whole set was
    made again, then `[Errno 39] Directory not empty` where it was to be renamed into place."""
    cache.cache_dataset(source(), "disk", tag="cfg", cache_dir=str(tmp_path))
    [root] = [p for p in tmp_path.iterdir() if p.is_dir()]
    (root / "done.json").unlink()
    again = Counting()
    with pytest.raises(ConfigError, match=rf"^data.cache=disk: the cache {root} is incomplete "
                                          r"\(no done.json, which a finished write leaves in "
                                          r"it\); delete that folder and the next run writes it "
                                          r"again$"):
        cache.cache_dataset(again, "disk", tag="cfg", cache_dir=str(tmp_path))
    assert again.made == 0 and (root / "train" / "x.npy").is_file()  # (nothing deleted)


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_a_dataset_of_which_nothing_can_be_read_is_one_line_not_an_empty_cache(tmp_path, mode):
    from torch.utils.data import default_collate

    class Unreadable(Counting):
        collate_fn = staticmethod(lambda s: default_collate([x for x in s if x is not None])
                                  if any(x is not None for x in s) else
                                  (torch.zeros(0, 2, 4, 4), torch.zeros(0, dtype=torch.long)))

        def __getitem__(self, i):
            return None

    with pytest.raises(ConfigError, match=r"^data: nothing to cache or pack: none of the "
                                          r"dataset's 10 samples could be read"):
        cache.cache_dataset(Unreadable(), mode, tag="cfg", cache_dir=str(tmp_path))
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # no cache left to trust


def test_every_rank_refuses_a_damaged_cache_alike_after_the_barrier(tmp_path):
    """Local rank 0 refused a broken done.json before the job's barrier, which the other
    ranks then waited in alone (a gloo read error when rank 0 exited, or a wait to the DDP
    timeout): each rank reads it now, after the barrier."""
    cache.cache_dataset(source(), "disk", tag="cfg", cache_dir=str(tmp_path))
    [root] = [p for p in tmp_path.iterdir() if p.is_dir()]
    (root / "done.json").write_text("{not json")
    barrier = []
    for rank in (1, 0):
        with pytest.raises(ConfigError, match="is damaged"):
            cache.cache_dataset(source(), "disk", tag="cfg", cache_dir=str(tmp_path),
                                local_rank=rank, wait=lambda: barrier.append(rank))
    assert barrier == [1, 0]  # both passed the barrier before refusing


def test_a_failed_shm_write_leaves_its_line_for_the_ranks_that_wait(tmp_path, monkeypatch):
    """The writer's exit removes the node's copy, but not the one line the other ranks are
    polling for (they would wait on for a writer that is gone); a later run reclaims it."""
    from trainer import runlock

    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise ValueError("bad sample")

    monkeypatch.setattr(cache, "SHM_ROOT", tmp_path)
    me = runlock.owner()
    cleanups = []
    monkeypatch.setattr(cache.atexit, "register", lambda *a: cleanups.append(a))
    with pytest.raises(ValueError):
        cache.cache_dataset(Broken(), "shm", tag="t", owner=me)
    (root,) = tmp_path.iterdir()
    (func, *args), = cleanups
    func(*args)  # the writer's exit
    assert sorted(p.name for p in root.iterdir()) == ["failed.txt", cache.OWNER]
    with pytest.raises(ConfigError, match=r"local rank 0 failed to write it: .*bad sample"):
        cache.cache_dataset(Broken(), "shm", tag="t", local_rank=1, owner=me,
                            alive=runlock.owner_alive)
    # the ranks of a later launch (of the same job: a second srun) wait for their own writer
    from data.cachewait import WriterGone

    with pytest.raises(WriterGone, match="did not begin writing it within 0.5 s"):
        cache.cache_dataset(Broken(), "shm", tag="t", local_rank=1, alive=runlock.owner_alive,
                            owner={**me, "launch": "SLURM_STEP_ID=9"}, start_s=0.5)
    # another run on the node leaves it to the ranks on their way to read it, for a while
    assert cache.reclaim_shm(lambda who: False, root=tmp_path) == [] and root.exists()
    monkeypatch.setattr(cache, "FAILED_KEEP_S", 0.0)
    assert cache.reclaim_shm(lambda who: False, root=tmp_path) == [root]


@pytest.mark.parametrize("mode", ["shm", "disk"])
def test_ranks_on_their_way_to_a_killed_writers_copy_stop_after_another_run_reclaimed_it(
        tmp_path, monkeypatch, mode):
    """Local rank 0 killed mid-write, and another run on the node reclaims its copy before
    this rank looks: its record stays (its data goes), an hour from then however long it
    wrote, so the rank stops at once, naming the writer gone; it waited for one that never
    began before (trainer.ddp.timeout_s), then named that. A record of another launch of the
    same job (a second srun) is not its."""
    from data.cachewait import WriterGone
    from tests.helpers import dead_pid
    from trainer import runlock

    monkeypatch.setattr(cache, "SHM_ROOT", tmp_path / "shm")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    me = runlock.owner()
    killed = {**me, "pid": dead_pid()}
    key = cache.cache_key("t", source())
    if mode == "shm":
        folder = tmp_path / "shm" / f"stoker-{key}"
        (folder / "train").mkdir(parents=True)
        (folder / "train" / "x.npy").write_bytes(b"half")
        (folder / cache.OWNER).write_text(json.dumps(killed))
        os.utime(folder / cache.OWNER, (time.time() - 7200,) * 2)  # (after 2 h of writing)
        assert cache.reclaim_shm(runlock.owner_alive, root=tmp_path / "shm") == [folder]
        assert [p.name for p in folder.iterdir()] == [cache.OWNER]  # its data freed at once
        assert cache.reclaim_shm(runlock.owner_alive, root=tmp_path / "shm") == []
    else:
        import socket
        unfinished = tmp_path / "c" / f"{key}.tmp-{socket.gethostname()}-{killed['pid']}-ab12"
        unfinished.mkdir(parents=True)
        record = tmp_path / "c" / cache.WRITER.format(key=key, host=socket.gethostname(),
                                                      pid=killed["pid"])
        record.write_text(json.dumps(killed))
        os.utime(record, (time.time() - 7200,) * 2)  # (after 2 h of writing)
        # another run writing another cache there, which reclaims what dead writers left
        cache.cache_dataset(source(), "disk", tag="other", cache_dir=str(tmp_path / "c"))
        assert not unfinished.exists() and record.exists()

    def wait(launch):
        start = time.monotonic()
        with pytest.raises(WriterGone) as stopped:
            cache.cache_dataset(source(), mode, tag="t", local_rank=1,
                                owner={**me, "launch": launch}, alive=runlock.owner_alive,
                                cache_dir=str(tmp_path / "c"), start_s=3)
        return str(stopped.value), time.monotonic() - start

    said, took = wait(me["launch"])
    assert said.endswith("local rank 0, which was writing it, ended before it finished; its "
                         "own error, if it had one, is in its output") and took < 3
    said, took = wait("SLURM_STEP_ID=1")  # the next srun's: waits for its own writer
    assert "did not begin writing it within 3 s" in said and took >= 3
    monkeypatch.setattr(cache, "FAILED_KEEP_S", 0.0)  # an hour on: the record goes too
    if mode == "shm":
        assert cache.reclaim_shm(runlock.owner_alive, root=tmp_path / "shm") == [folder]
        assert not folder.exists()
    else:
        cache.cache_dataset(source(), "disk", tag="more", cache_dir=str(tmp_path / "c"))
        assert not list((tmp_path / "c").glob("*.writer-*"))


def test_a_disk_cache_of_arrays_written_again_is_rebuilt(tmp_path):
    """Memory-mapped arrays were keyed by their config alone: after prepare_data.py wrote them
    again (another split), the cache kept serving the old rows. Their files key it too."""
    import numpy as np

    def arrays(n, value, when=None):
        folder = tmp_path / "data" / "train"
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / "x.npy", np.full((n, 3), value, np.float32))
        np.save(folder / "y.npy", np.zeros(n, np.int64))
        if when is not None:  # (a time of its own: two writes may share a clock tick)
            os.utime(folder / "x.npy", ns=(when, when))
        return MemmapDataset("train", str(tmp_path / "data"))

    where = str(tmp_path / "cache")
    first = cache.cache_dataset(arrays(8, 1.0, when=10**18), "disk", tag="cfg", cache_dir=where)
    again = cache.cache_dataset(MemmapDataset("train", str(tmp_path / "data")), "disk",
                                tag="cfg", cache_dir=where)
    assert again.x.path == first.x.path  # (the same files: read, not written again)
    same_size = cache.cache_dataset(arrays(8, 2.0, when=2 * 10**18), "disk", tag="cfg",
                                    cache_dir=where)
    assert float(same_size[0][0][0]) == 2.0
    fewer = cache.cache_dataset(arrays(5, 3.0), "disk", tag="cfg", cache_dir=where)
    assert len(fewer) == 5 and float(fewer[0][0][0]) == 3.0


