"""data/shardwriter.py: every sample written once, in a shuffled order, into shards that
data/shards.py reads; an image folder's files packed as they are, each checked first."""
from __future__ import annotations

import json

import pytest
import torch

from data.shards import ShardStream
from data.shardwriter import write_shards
from tests.helpers import numbered


def test_write_shards_index_lists_every_sample_in_a_shuffled_order(tmp_path):
    write_shards(numbered(103), tmp_path / "train", samples_per_shard=10)
    index = json.loads((tmp_path / "train" / "index.json").read_text())
    assert index["kind"] == "npy" and index["input_shape"] == [2]
    assert [s["samples"] for s in index["shards"]] == [10] * 10 + [3]
    stream = ShardStream("train", str(tmp_path))
    raw = list(stream.samples_in(list(range(11)), 0, 103))
    ids = [int(stream.decode(s)[1]) for s in raw]
    assert sorted(ids) == list(range(103)) and ids != list(range(103))


def test_packing_an_image_folder_checks_each_file_under_its_policy(tmp_path):
    from data.images import ImageError, ImageFolder
    from scripts.make_images import write_images

    write_images(tmp_path / "im", count=6, size=16, classes=2, val_fraction=0.0)
    (tmp_path / "im" / "train" / "class_00" / "zz.jpg").write_bytes(b"broken")
    with pytest.raises(ImageError, match="zz.jpg"):
        write_shards(ImageFolder("train", str(tmp_path / "im"), size=8, on_error="fail"),
                     tmp_path / "a")
    assert not (tmp_path / "a" / "index.json").exists()
    folder = ImageFolder("train", str(tmp_path / "im"), size=8)
    index = write_shards(folder, tmp_path / "b", num_workers=2)
    assert sum(s["samples"] for s in index["shards"]) == 6
    assert [p.endswith("zz.jpg") for p in folder.skipped()] == [True]


@pytest.mark.parametrize("sample", [{"x": torch.zeros(2), "labels": 0},
                                    (torch.zeros(2), "cat"), (torch.zeros(2), 0, 1.0)])
def test_samples_that_are_not_input_target_pairs_are_refused_before_an_index(tmp_path,
                                                                             sample):
    """A dict, a string label or a third item: the ConfigError that writing arrays raises
    (data.cache's check), not a traceback of unpacking them; no index is written."""
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"need a dataset of \(input, target\) tensor pairs"):
        write_shards([sample] * 4, tmp_path / "train")
    assert not (tmp_path / "train" / "index.json").exists()
