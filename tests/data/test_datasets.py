from __future__ import annotations

import time

import pytest
import torch

from data.datasets import DigitsDataset, SyntheticDataset, SyntheticTokens


def test_digits_split_is_fixed_disjoint_and_complete():
    train, val = DigitsDataset("train"), DigitsDataset("val")
    assert len(train) + len(val) == 1797 and len(val) == 359
    x, y = train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0.0 <= float(train.x.min()) and float(train.x.max()) <= 1.0
    rows = {tuple(r.flatten().tolist()) for r in train.x}
    overlap = sum(tuple(r.flatten().tolist()) in rows for r in val.x)
    assert overlap < 5  # a few digits are pixel-identical duplicates in the source
    assert torch.equal(DigitsDataset("val").x, val.x)


def test_bad_split_and_fraction():
    with pytest.raises(ValueError, match="split='test'"):
        DigitsDataset("test")
    with pytest.raises(ValueError, match="val_fraction"):
        DigitsDataset("train", val_fraction=1.5)
    with pytest.raises(ValueError, match=r"^val_fraction=0.9999: leaves no training sample of "
                                         r"the 1797"):
        DigitsDataset("train", val_fraction=0.9999)  # (rounded: "has no samples" before)
    with pytest.raises(ValueError, match=r"^val_fraction=0.0001: leaves no validation sample"):
        DigitsDataset("val", val_fraction=0.0001)


def test_synthetic_is_a_pure_function_of_index():
    a = SyntheticDataset("train", num_samples=10, input_shape=[2, 4, 4], num_classes=3)
    b = SyntheticDataset("train", num_samples=10, input_shape=[2, 4, 4], num_classes=3)
    for i in (0, 9, 3):
        assert torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1])
    assert not torch.equal(a[0][0], a[1][0])
    val = SyntheticDataset("val", num_samples=10, input_shape=[2, 4, 4], num_classes=3)
    assert not torch.equal(a[0][0], val[0][0])
    with pytest.raises(IndexError):
        a[10]


def test_synthetic_uint8_and_cpu_cost():
    d = SyntheticDataset("train", num_samples=4, input_shape=[3, 8, 8], dtype="uint8",
                         cost_ms=20)
    t0 = time.process_time()
    x, _ = d[0]
    assert x.dtype == torch.uint8
    assert time.process_time() - t0 >= 0.015  # CPU time, not sleep


def test_synthetic_is_learnable_labels_follow_prototypes():
    d = SyntheticDataset("train", num_samples=200, input_shape=[16], num_classes=4, noise=0.1)
    hits = sum(int(((d.prototypes - x).flatten(1).norm(dim=1)).argmin()) == int(y)
               for x, y in (d[i] for i in range(200)))
    assert hits == 200


def test_memmap_opens_lazily_and_matches_the_source(tmp_path):
    from data.datasets import MemmapDataset
    from tests.helpers import make_memmap_root

    root = make_memmap_root(tmp_path / "mm", n=12, dtype="uint8")
    source = SyntheticDataset("val", num_samples=12, input_shape=(3, 8, 8), num_classes=4,
                              dtype="uint8")
    ds = MemmapDataset("val", str(root))
    assert ds.x._mm is None and len(ds) == 12  # length from the header, nothing mapped
    for i in (0, 5, 11):
        x, y = ds[i]
        assert x.dtype == torch.uint8 and torch.equal(x, source[i][0])
        assert int(y) == int(source[i][1])
    assert ds.x._mm is not None


def test_memmap_is_mapped_anew_in_each_worker(tmp_path):
    import pickle

    from data.datasets import MemmapDataset
    from tests.helpers import make_memmap_root

    ds = MemmapDataset("train", str(make_memmap_root(tmp_path / "mm", n=8)))
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned worker receives
    assert clone.x._mm is None
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    xs = torch.cat([x for x, _ in loader])
    assert torch.equal(xs, torch.stack([ds[i][0] for i in range(8)]))


def test_memmap_as_tensors_are_its_samples_mapped_copy_on_write(tmp_path):
    """Row i of as_tensors() is sample i (what batching by indexing relies on); writing to a
    row leaves the file alone; a subclass that makes its samples otherwise offers none."""
    from data.datasets import MemmapDataset
    from tests.helpers import make_memmap_root

    root = make_memmap_root(tmp_path / "mm", n=10, dtype="uint8")
    ds = MemmapDataset("train", str(root))
    x, y = ds.as_tensors()
    assert x.shape == (10, 3, 8, 8) and x.dtype == torch.uint8 and y.shape == (10,)
    samples = [ds[i] for i in range(10)]
    assert torch.equal(x, torch.stack([s[0] for s in samples]))
    assert torch.equal(y, torch.stack([s[1] for s in samples]))
    x[3] = 7
    assert torch.equal(MemmapDataset("train", str(root))[3][0], samples[3][0])

    class Flipped(MemmapDataset):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return x.flip(-1), y

    assert Flipped("train", str(root)).as_tensors() is None

    class Fewer(MemmapDataset):
        def __len__(self):
            return 4

    assert Fewer("train", str(root)).as_tensors() is None


def test_memmap_missing_files_name_the_key(tmp_path):
    from data.datasets import MemmapDataset

    with pytest.raises(FileNotFoundError, match="data.dataset.root=.*prepare_data"):
        MemmapDataset("train", str(tmp_path))


def test_a_truncated_array_or_a_broken_meta_json_names_the_file(tmp_path):
    import numpy as np

    from data.datasets import MemmapDataset, NpyRows, read_meta
    from tests.helpers import make_memmap_root

    root = make_memmap_root(tmp_path / "mm", n=12, dtype="uint8")
    x = root / "train" / "x.npy"
    x.write_bytes(x.read_bytes()[:300])
    with pytest.raises(ValueError, match=rf"^{x}: 300 bytes where its header describes \d+ "
                                         r"\(a truncated file\?\); write it again"):
        MemmapDataset("train", str(root))
    (root / "meta.json").write_text("{'not': json")
    with pytest.raises(ValueError, match=rf"^{root / 'meta.json'}: not valid JSON"):
        read_meta(str(root))
    x.write_bytes(b"\x17" * 500)  # numpy's own words named no file
    with pytest.raises(ValueError, match=rf"^{x}: not a .npy array \(the magic string is not "
                                         r"correct.*\); write it again"):
        MemmapDataset("train", str(root))
    np.save(root / "train" / "y.npy", np.array([1, "a"] * 6, dtype=object))
    with pytest.raises(ValueError, match=r"y.npy: an array of Python objects \(object\); store "
                                         r"numbers"):  # (it was called truncated)
        NpyRows(root / "train" / "y.npy")


def test_heavy_config_is_the_classic_benchmark():
    from tests.helpers import compose_cfg

    cfg = compose_cfg("unused", "data=heavy")
    assert cfg.data.dataset.num_samples == 1024 and cfg.data.dataset.cost_ms == 5.0
    assert list(cfg.data.input_shape) == [3, 224, 224] and cfg.data.batch_size == 64
    assert list(cfg.data.dataset.input_shape) == [3, 224, 224]


def test_tokens_are_shifted_pairs_following_the_successor_table():
    ds = SyntheticTokens("train", num_samples=200, tokens=64, vocab_size=40, noise=0.1, seed=3)
    x, y = ds[5]
    assert x.shape == y.shape == (64,) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])  # targets are the inputs shifted by one
    assert torch.equal(SyntheticTokens("train", 200, 64, 40, 0.1, 3)[5][0], x)  # deterministic
    assert not torch.equal(SyntheticTokens("val", 200, 64, 40, 0.1, 3)[5][0], x)
    # the successor table (shared by the splits) explains ~90% of transitions
    pairs = torch.stack([torch.stack([ds[i][0], ds[i][1]]) for i in range(len(ds))])
    prev, nxt = pairs[:, 0].flatten(), pairs[:, 1].flatten()
    table = torch.zeros(40, 40).index_put_((prev, nxt), torch.ones(len(prev)), accumulate=True)
    explained = table.max(dim=1).values.sum() / len(prev)
    assert 0.85 < float(explained) < 0.95
    with pytest.raises(ValueError, match="noise=2"):
        SyntheticTokens(noise=2)


def test_a_memmap_root_says_whether_it_is_missing_a_file_or_without_meta_json(tmp_path):
    """A root that does not exist was said as 'no meta.json', which sent a user looking for a
    file in a folder that was not there."""
    from data.datasets import read_meta

    tail = "; write the dataset with scripts/prepare_data.py"
    for root, what in ((tmp_path / "nope", "no such folder"),
                       (tmp_path, "no meta.json in that folder")):
        with pytest.raises(FileNotFoundError) as e:
            read_meta(str(root))
        assert str(e.value) == f"data.dataset.root={root}: {what}{tail}"
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileNotFoundError, match="a file, not the folder scripts/prepare_data"):
        read_meta(str(tmp_path / "f"))


def test_memmap_arrays_of_another_shape_than_meta_json_says_are_refused(tmp_path):
    """x.npy rewritten at 16x16 beside a meta.json (and a val split) of 32x32: the run
    trained on one size and validated on the other, exit 0."""
    import numpy as np

    from data.datasets import MemmapDataset
    from tests.helpers import make_memmap_root

    root = make_memmap_root(tmp_path / "mm", shape=(3, 32, 32))
    MemmapDataset("train", root=str(root))  # (as written: fine)
    x = np.load(root / "train" / "x.npy")
    np.save(root / "train" / "x.npy", np.ascontiguousarray(x[:, :, :16, :16]))
    with pytest.raises(ValueError, match=r"train/x.npy: its samples are \(3, 16, 16\), and "
                                         r".*meta.json says input_shape \[3, 32, 32\]; write "
                                         r"the dataset again"):
        MemmapDataset("train", root=str(root))
    MemmapDataset("val", root=str(root))


@pytest.mark.parametrize("seed", [-1, 2.5, True, "7"])
def test_a_split_seed_that_is_no_whole_number_names_the_key(seed):
    """numpy's words named no key: `expected non-negative integer`, `SeedSequence expects
    int or sequence of ints for entropy not 2.5`."""
    with pytest.raises(ValueError, match=rf"^data.dataset.split_seed={seed}: must be a whole "
                                         r"number >= 0"):
        DigitsDataset("train", split_seed=seed)
    assert len(DigitsDataset("val", split_seed=3)) == 359
