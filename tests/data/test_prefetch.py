"""DevicePrefetcher: pass-through semantics on CPU; side-stream copies on CUDA (marked gpu)."""
from __future__ import annotations

import dataclasses
from collections import UserDict, namedtuple
from collections.abc import Mapping
from types import MappingProxyType

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from data.loader import build_loader
from data.prefetch import (DeviceAugment, DevicePrefetcher, InputTransform, _stream_context,
                           each_tensor, map_tensors, to_device)
from trainer.config import ConfigError, DataConfig

Pair = namedtuple("Pair", "x y")
CPU = torch.device("cpu")


class DictSet(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"inputs": torch.full((3, 2, 2), i, dtype=torch.uint8),
                "meta": {"id": i, "half": torch.tensor(i, dtype=torch.float16)}}


def test_to_device_keeps_nested_structure_and_types():
    batch = {"img": torch.ones(2, dtype=torch.uint8), "meta": [torch.zeros(1), "id-7", 3],
             "pair": Pair(torch.ones(1), (torch.ones(1, dtype=torch.int64),))}
    out = to_device(batch, CPU)
    assert out["img"].dtype == torch.uint8 and out["meta"][1:] == ["id-7", 3]
    assert isinstance(out["pair"], Pair) and isinstance(out["pair"].y, tuple)
    assert out["img"] is batch["img"]  # already there: no copy


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    ids: list
    note: str = "kept"


class Encoding(UserDict):
    """A dict-like batch that is not a dict (as Hugging Face's BatchEncoding), with state of
    its own besides its entries."""

    def __init__(self, data=None, extra="kept"):
        super().__init__(data)
        self.extra = extra


def test_map_tensors_reaches_into_dict_like_batches_and_dataclasses():
    """Dict-like batches that are not dicts and dataclass batches get every tensor mapped
    (the prefetcher moves them to the GPU with this walk), their type and other state kept."""
    add_one = lambda t: t + 1  # noqa: E731
    enc = Encoding({"input_ids": torch.zeros(2, 3), "labels": [torch.ones(2)]}, extra="x")
    out = map_tensors(enc, add_one)
    assert type(out) is Encoding and out.extra == "x" and out is not enc
    assert out["input_ids"].eq(1).all() and out["labels"][0].eq(2).all()
    assert enc["input_ids"].eq(0).all()  # the batch it was given is left as it was
    frozen = FrozenBatch(torch.zeros(2), [torch.zeros(1), "id"])
    out = map_tensors(frozen, add_one)
    assert type(out) is FrozenBatch and out.note == "kept" and out.ids[1] == "id"
    assert out.x.eq(1).all() and out.ids[0].eq(1).all() and frozen.x.eq(0).all()
    state = torch.nn.BatchNorm1d(2).state_dict()  # an OrderedDict with version metadata
    out = map_tensors(state, add_one)
    assert type(out) is type(state) and out._metadata == state._metadata
    assert list(out) == list(state)
    assert map_tensors(MappingProxyType({"a": torch.zeros(1)}), add_one)["a"].eq(1).all()


class OnlyTensors(Mapping):
    """A read-only dict-like batch whose constructor takes tensors alone: a rebuild with
    anything else in its entries fails."""

    def __init__(self, data):
        assert all(isinstance(v, torch.Tensor) for v in data.values()), data
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


def test_each_tensor_visits_what_map_tensors_maps_and_builds_nothing():
    """The prefetcher marks every tensor of a handed-out batch with this walk (CUDA's
    record_stream), once per batch: no copy of the batch, so a type that accepts tensors
    alone is walked as well."""
    strict = OnlyTensors({"a": torch.zeros(1), "b": torch.ones(2)})
    batch = [Pair(torch.zeros(3), (torch.ones(1),)), strict, "id", 7,
             {"enc": Encoding({"x": torch.zeros(4)}), "f": FrozenBatch(torch.ones(5), [])}]
    seen = []
    each_tensor(batch, seen.append)
    mapped = []
    map_tensors(batch, lambda t: mapped.append(t) or t)
    assert [t.numel() for t in seen] == [3, 1, 1, 2, 4, 5]
    assert len(seen) == len(mapped) and all(a is b for a, b in zip(seen, mapped))
    with pytest.raises(AssertionError):  # what a rebuild of it meets
        map_tensors(strict, lambda t: None)


def test_cpu_pass_through_order_exhaustion_and_reiteration():
    ds = TensorDataset(torch.arange(10).float().view(10, 1), torch.arange(10))
    feed = DevicePrefetcher(DataLoader(ds, batch_size=4), CPU)
    assert feed.side_stream is None and len(feed) == 3
    for _ in range(2):  # a second epoch iterates again from the start
        ys = [y.tolist() for _, y in feed]
        assert ys == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    it = iter(feed)
    for _ in range(3):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


class Counting:
    """An iterable of 6 batches that counts the batches read from it."""

    def __init__(self):
        self.read = 0

    def __len__(self):
        return 6

    def __iter__(self):
        for i in range(6):
            self.read += 1
            yield torch.full((2, 3), float(i)), torch.tensor([i, i])


@pytest.mark.parametrize("device", [CPU, pytest.param("cuda", marks=pytest.mark.gpu)])
def test_take_reads_no_batch_past_its_limit(device):
    """A limited pass (limit_val_batches, an epoch's plan) reads exactly the batches it hands
    out, though on CUDA the next batch is fetched while the current one is used."""
    device = torch.device(device) if device == "cuda" else device
    source = Counting()
    feed = DevicePrefetcher(source, device)
    assert [int(x[0, 0]) for x, _ in feed.take(4)] == [0, 1, 2, 3]
    assert source.read == 4
    source.read = 0
    assert len(list(feed.take(None))) == 6 and source.read == 6
    assert len(list(feed.take(9))) == 6  # a limit past the end: every batch, once


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_resident_batches_pass_through_or_get_any_callable_transform(dtype):
    """Float resident batches skip an identity transform; uint8 ones are still converted;
    a transform of one's own (a callable with `augment`, no `identity`) is called on every
    batch."""
    from data.resident import ResidentBatches
    from data.sampler import ResumableDistributedSampler

    x = torch.arange(24, dtype=torch.float32).view(6, 4).to(dtype)
    sampler = ResumableDistributedSampler(6, shuffle=False)
    resident = ResidentBatches([x, torch.arange(6)], sampler, batch_size=4, drop_last=False,
                               device=torch.device("cpu"))
    plain = [b[0] for b in DevicePrefetcher(resident, torch.device("cpu"))]
    assert [b.dtype for b in plain] == [torch.float32] * 2
    assert torch.equal(torch.cat(plain), x.float() / (255.0 if dtype == torch.uint8 else 1.0))
    calls = []

    class Tag:
        augment = None

        def __call__(self, batch, key=None):
            calls.append(key)
            return batch

    assert len(list(DevicePrefetcher(resident, torch.device("cpu"), Tag()))) == 2
    assert calls == [None, None]


def test_empty_loader_yields_nothing():
    empty = TensorDataset(torch.zeros(0, 1), torch.zeros(0))
    assert list(DevicePrefetcher(DataLoader(empty, batch_size=4), CPU)) == []


def test_dict_batches_uint8_inputs_become_floats_and_the_rest_passes():
    feed = DevicePrefetcher(DataLoader(DictSet(), batch_size=3), CPU)
    batches = list(feed)
    assert len(batches) == 2
    first = batches[0]
    assert first["inputs"].dtype == torch.float32
    assert torch.allclose(first["inputs"][1], torch.full((3, 2, 2), 1 / 255))
    assert first["meta"]["half"].dtype == torch.float16
    assert first["meta"]["id"].tolist() == [0, 1, 2]


def test_a_dict_batchs_images_are_its_pixel_values_or_the_entry_task_input_key_names():
    """A Hugging Face vision collate's {"pixel_values", "labels"}: the model got raw 0-255
    uint8 values, not normalised, not flipped, while the log said "augmented on the device"."""
    from trainer.config import ConfigError

    images = torch.full((2, 3, 2, 2), 255, dtype=torch.uint8)
    labels = torch.tensor([0, 1])
    t = InputTransform(mean=[0.5] * 3, std=[0.5] * 3)
    out = t({"pixel_values": images, "labels": labels})
    assert torch.equal(out["pixel_values"], torch.ones(2, 3, 2, 2)) and out["labels"] is labels
    named = InputTransform(mean=[0.5] * 3, std=[0.5] * 3, input_key="image")
    assert torch.equal(named({"image": images, "labels": labels})["image"],
                       torch.ones(2, 3, 2, 2))
    with pytest.raises(ConfigError, match=r"^data.normalize_mean: a dict batch's images are its "
                       r"entry named by task.input_key, else pixel_values or inputs; this batch "
                       r"has img, labels, none of them a tensor there"):
        t({"img": images, "labels": labels})
    with pytest.raises(ConfigError, match=r"named by task.input_key=image; this batch has "
                       r"pixel_values, labels,"):
        named({"pixel_values": images, "labels": labels})
    # nothing asked of the inputs (text, say): a dict without images passes as it is
    ids = {"input_ids": torch.zeros(2, 3, dtype=torch.int64), "labels": labels}
    assert InputTransform(channels_last=True)(ids) is ids


def test_statistics_on_the_0_255_scale_for_uint8_images_are_one_line():
    """mmcv's and timm's mean/std in 0-255 units: every input near -2, chance accuracy, exit 0."""
    from trainer.config import ConfigError

    images = torch.full((2, 3, 2, 2), 255, dtype=torch.uint8)
    zoo = InputTransform(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375])
    with pytest.raises(ConfigError, match=r"^data.normalize_mean=\[123.675,116.28,103.53\] "
                       r"data.normalize_std=\[58.395,57.12,57.375\]: on the 0-255 scale.*divide "
                       r"them by 255 \(data.normalize_mean=\[0.485,0.456,0.406\] "):
        zoo((images, torch.tensor([0, 1])))
    # floats are not scaled: their statistics are the user's to give, in any units
    floats = torch.full((2, 3, 2, 2), 200.0)
    assert torch.allclose(zoo((floats, None))[0][:, 0], (200 - 123.675) / 58.395 * torch.ones(2, 2, 2))


def test_transform_normalises_per_channel_and_sets_channels_last():
    t = InputTransform(mean=[0.5, 0.0], std=[0.5, 2.0], channels_last=True)
    x = torch.stack([torch.full((2, 3, 3), 255, dtype=torch.uint8)] * 2)
    x[:, 1] = 0
    out, y = t((x, torch.tensor([1, 2])))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out[:, 0], torch.ones(2, 3, 3))  # (1 - 0.5) / 0.5
    assert torch.allclose(out[:, 1], torch.zeros(2, 3, 3))
    assert y.tolist() == [1, 2]
    floats = torch.randn(2, 3)
    assert InputTransform()((floats, y))[0] is floats  # nothing asked: untouched


CUDA = torch.device("cuda", 0) if torch.cuda.is_available() else None


@pytest.mark.gpu
def test_cuda_values_equal_and_one_stream_across_epochs():
    ds = TensorDataset(torch.randint(0, 255, (64, 3, 8, 8), dtype=torch.uint8),
                       torch.arange(64))
    feed = DevicePrefetcher(DataLoader(ds, batch_size=8, pin_memory=True), CUDA)
    stream = feed.side_stream
    assert stream is not None
    for epoch in range(3):
        got = [(x.cpu(), y.cpu()) for x, y in feed]
        assert feed.side_stream is stream  # never a new stream per epoch
        # the same arithmetic on the device: CUDA divides by a scalar as a multiplication
        # by its reciprocal, one rounding away from the CPU's division
        want = (ds.tensors[0].to(CUDA).float() / 255).cpu()
        assert torch.equal(torch.cat([x for x, _ in got]), want)
        assert torch.equal(torch.cat([y for _, y in got]), ds.tensors[1])
        if epoch == 0:
            torch.cuda.synchronize()
            after_first = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= after_first  # nothing accumulates per epoch


@pytest.mark.gpu
def test_cuda_dict_like_and_dataclass_batches_reach_the_device():
    """Batches of the user's collate that are not tuples, lists or dicts still arrive on the
    GPU through the side stream, with every tensor inside moved."""
    BatchEncoding = pytest.importorskip("transformers").BatchEncoding

    def collate(samples):
        x = torch.stack([s[0] for s in samples])
        return [BatchEncoding({"input_ids": x, "labels": torch.stack([s[1] for s in samples])}),
                FrozenBatch(x, [x])]

    ds = TensorDataset(torch.arange(32).view(8, 4), torch.arange(8))
    feed = DevicePrefetcher(DataLoader(ds, batch_size=4, collate_fn=collate, pin_memory=True),
                            CUDA)
    for enc, frozen in feed:
        assert isinstance(enc, BatchEncoding) and isinstance(frozen, FrozenBatch)
        for t in (enc["input_ids"], enc["labels"], frozen.x, frozen.ids[0]):
            assert t.device == CUDA


@pytest.mark.gpu
def test_cuda_copy_does_not_block_the_compute_stream():
    """While batch 1 is copied on the side stream, the compute stream is free to run step 0:
    an event queued on the compute stream completes before the copy does."""
    ds = TensorDataset(torch.randn(3, 64, 1024, 1024), torch.arange(3))  # 256 MB batches
    feed = DevicePrefetcher(DataLoader(ds, batch_size=1, pin_memory=True), CUDA)
    it = iter(feed)
    next(it)  # batch 0 is ready; batch 1's copy has just been queued on the side stream
    copy_done, compute_free = torch.cuda.Event(), torch.cuda.Event()
    copy_done.record(feed.side_stream)
    compute_free.record(torch.cuda.current_stream(CUDA))
    compute_free.synchronize()
    assert not copy_done.query(), "the compute stream waited for the next batch's copy"
    copy_done.synchronize()
    x, y = next(it)
    assert torch.equal(x.cpu(), ds.tensors[0][1:2]) and y.item() == 1


@pytest.mark.gpu
def test_cuda_next_copy_does_not_wait_for_the_steps_queued_before_it():
    """The side stream does not wait on the compute stream: with a long step queued there,
    the next batch's copy completes while the step still runs."""
    ds = TensorDataset(torch.randn(4, 256), torch.arange(4))
    feed = DevicePrefetcher(DataLoader(ds, batch_size=1, pin_memory=True), CUDA)
    it = iter(feed)
    next(it)  # batch 0 handed out; batch 1 copied
    torch.cuda._sleep(2_000_000_000)  # a step of about a second on the compute stream
    step_done = torch.cuda.Event()
    step_done.record(torch.cuda.current_stream(CUDA))
    next(it)  # batch 1 handed out; batch 2's copy queued on the side stream
    copy_done = torch.cuda.Event()
    copy_done.record(feed.side_stream)
    copy_done.synchronize()
    assert not step_done.query(), "the next batch's copy waited for the queued step"
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_batch_in_use_survives_the_copies_after_it():
    """A batch the compute stream reads late (its step queued behind a long one) keeps its
    values while later batches are copied and the training loop drops its reference:
    `record_stream` keeps the side stream from reusing its memory."""
    ds = TensorDataset(torch.arange(8 * 2**16, dtype=torch.float32).view(8, 2**16),
                       torch.arange(8))
    feed = DevicePrefetcher(DataLoader(ds, batch_size=1, pin_memory=True), CUDA)
    it = iter(feed)
    x0, _ = next(it)
    x0 * 1  # the kernel loaded now, not while the step below is queued
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # the step that reads x0 starts late
    seen = x0 * 1  # queued on the compute stream behind the sleep
    read = torch.cuda.Event()
    read.record(torch.cuda.current_stream(CUDA))
    del x0  # its block is freed while the compute stream has yet to read it
    rest = [x for x, _ in it]  # seven more copies on the side stream, same size
    copies_done = torch.cuda.Event()
    copies_done.record(feed.side_stream)
    copies_done.synchronize()
    assert not read.query(), "the copies did not run while the step waited: nothing tested"
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), ds.tensors[0][:1])
    assert torch.equal(torch.cat(rest).cpu(), ds.tensors[0][1:])


@pytest.mark.gpu
@pytest.mark.parametrize("given", ["cuda:0", "cuda"])
def test_cuda_batch_made_on_the_device_is_read_after_it_is_written(given):
    """A collate of one's own that makes its batch on the GPU writes it on the compute
    stream: the side stream's transform (uint8 to float) must wait for that write. A
    prefetcher given "cuda" (no index) knows such a batch as made there too."""
    n = 2**20

    def collate(samples):
        i = samples[0]
        torch.zeros(n, dtype=torch.uint8, device=CUDA)  # a freed block for the batch below
        torch.cuda._sleep(500_000_000)  # the batch is written well after it is queued
        return torch.full((1, n), i + 1, dtype=torch.uint8, device=CUDA), torch.tensor([i])

    feed = DevicePrefetcher(DataLoader(list(range(3)), batch_size=1, collate_fn=collate),
                            torch.device(given))
    assert feed.device == CUDA
    got = [(x[0, [0, -1]].cpu(), y.item()) for x, y in feed]
    assert [y for _, y in got] == [0, 1, 2]
    for x, y in got:  # (CUDA divides by 255 as a multiplication by its reciprocal)
        assert torch.equal(x, torch.full((2,), y + 1, dtype=torch.uint8, device=CUDA)
                           .float().div_(255).cpu())


def images(n=6, c=3, h=5, w=7):
    return torch.arange(n * c * h * w, dtype=torch.float32).view(n, c, h, w)


def test_augment_crops_of_the_padded_image_and_mirrors_per_sample():
    x, pad = images(), 2
    padded = torch.nn.functional.pad(x, (pad,) * 4)
    out = DeviceAugment(crop_padding=pad, hflip=True, seed=1)(x, key=5)
    assert out.shape == x.shape
    windows = [padded[:, :, dy:dy + 5, dx:dx + 7] for dy in range(5) for dx in range(5)]
    for i in range(len(x)):  # each sample is one window of its own padded image, maybe mirrored
        assert any(torch.equal(out[i], win[i]) or torch.equal(out[i], win[i].flip(-1))
                   for win in windows)
    many = DeviceAugment(crop_padding=pad, hflip=True)(images(n=64), key=0)
    firsts = {tuple(s[0, 2, :2].tolist()) for s in many}
    assert len(firsts) > 8  # per-sample randomness, not one draw for the batch


def test_augment_is_a_function_of_its_key():
    aug = DeviceAugment(crop_padding=3, hflip=True, seed=7, rank=1)
    x = images(n=16)
    assert torch.equal(aug(x, aug.key(2, 64)), aug(x, aug.key(2, 64)))
    assert not torch.equal(aug(x, aug.key(2, 64)), aug(x, aug.key(2, 80)))
    assert aug.key(2, 64) != DeviceAugment(3, True, seed=7, rank=0).key(2, 64)
    flip_only = DeviceAugment(hflip=True)(x, key=1)
    assert all(torch.equal(a, b) or torch.equal(a, b.flip(-1)) for a, b in zip(flip_only, x))


def test_augment_refuses_inputs_that_are_not_images():
    with pytest.raises(ConfigError, match="data.augment: crops and flips need image batches"):
        DeviceAugment(hflip=True)(torch.zeros(4, 10), key=0)


def test_augmented_batches_repeat_exactly_after_a_resume_mid_epoch():
    """Keys come from (epoch, position): the batches after set_start are the same as the tail
    of the full epoch, on the loader path and the device-resident path alike."""
    ds = TensorDataset((torch.rand(40, 3, 6, 6) * 255).to(torch.uint8), torch.arange(40))
    c = DataConfig(dataset=None, input_shape=[3, 6, 6], num_classes=40, batch_size=8,
                   num_workers=0)
    for placement in ("host", "device"):
        loader = build_loader(ds, c, train=True, rank=1, world_size=2, seed=4,
                              placement=placement)
        feed = DevicePrefetcher(loader, CPU, InputTransform(
            [0.5] * 3, [0.25] * 3, augment=DeviceAugment(2, True, seed=4, rank=1)))
        loader.sampler.set_epoch(3)
        full = list(feed)
        loader.sampler.set_epoch(3)
        loader.sampler.set_start(2 * 8 * 2)  # two batches on each of the two ranks
        resumed = list(feed)
        assert len(resumed) == len(full) - 2
        for a, b in zip(full[2:], resumed):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert not torch.equal(full[0][0], full[1][0])


def test_the_side_stream_is_entered_by_its_own_context_where_it_has_one():
    """A `torch.Stream` (a CUDA build's `torch.cuda.Stream` is one) is made current by its own
    `with`, switched in C++; any other stream object through `torch.cuda.stream`; no stream,
    no context."""
    stream = torch.Stream(device="cpu")
    enter = _stream_context(stream)
    assert enter() is stream
    with enter():  # entered and left again, as once per batch
        pass
    with enter():
        pass

    class Other:
        pass

    assert isinstance(_stream_context(Other())(), torch.cuda.StreamContext)
    assert _stream_context(None) is None


@pytest.mark.parametrize("shards", [True, False])
def test_a_pass_ends_its_loader_workers_when_its_reader_is_done(tmp_path, monkeypatch, shards):
    """A pass taken to its count of batches ends its workers then, not when its iterator is
    collected: a shard loader's pass still had a worker waiting to say it was done, and where
    a reference cycle held the iterator, the garbage collector ended it after stopping the
    threads that feed its workers' requests, so the request to stop never reached them and
    the shutdown waited 5 s for each, twice (10 s an epoch). Persistent workers are kept."""
    from data.datasets import DigitsDataset
    from data.shards import ShardLoader, ShardStream
    from data.shardwriter import write_shards

    if shards:
        write_shards(DigitsDataset("train"), tmp_path / "train", samples_per_shard=500,
                     num_classes=10)
        dataset, loaders = ShardStream("train", str(tmp_path)), ShardLoader
    else:
        dataset, loaders = DigitsDataset("train"), DataLoader
    kept, iterate = [], loaders.__iter__

    def held(self):  # the pass's iterator, kept alive as a cycle would keep it
        kept.append(iterate(self))
        return kept[-1]

    monkeypatch.setattr(loaders, "__iter__", held)
    for persistent in (False, True):
        cfg = DataConfig(batch_size=64, num_workers=2, persistent_workers=persistent)
        loader = build_loader(dataset, cfg, train=True, rank=0, world_size=1, seed=3,
                              num_workers=2)
        feed = DevicePrefetcher(loader, CPU)
        assert len(list(feed.take(len(loader)))) == len(loader) == 23
        keeps = persistent and not shards  # (a shard loader starts its workers per pass)
        workers = kept[-1]._workers
        assert kept[-1]._shutdown is not keeps and len(workers) == 2
        assert all(w.is_alive() is keeps for w in workers)
        feed.close()
        assert not any(w.is_alive() for w in workers)
