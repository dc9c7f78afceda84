"""Writes any dataset as tar shards (WebDataset format) with the index.json that data/shards.py
reads: `python scripts/prepare_data.py --format shards` calls it.
"""
from __future__ import annotations

import io
import json
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from data.images import ImageFolder
from data.shards import INDEX


def write_shards(dataset, folder, samples_per_shard: int = 1000, num_workers: int = 0,
                 seed: int = 0, num_classes: Optional[int] = None) -> dict:
    """Writes `dataset` (every sample, in a seeded shuffled order, so that no shard holds one
    class) as tar shards and `index.json` under `folder`; returns the index.

    An image folder's files go in as they are (`.jpg`/`.png` + `.cls`: decoded when read, so
    the shards are as compact as the files); any other dataset's samples as `.x.npy` and
    `.y.npy`. The index is written last: a set of shards without it is not readable."""
    from pathlib import Path

    from webdataset import ShardWriter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    images = isinstance(dataset, ImageFolder)
    index: Dict[str, Any] = {"kind": "image" if images else "npy",
                             "classes": getattr(dataset, "classes", None), "shards": []}
    if index["classes"] is not None or num_classes is not None:
        index["num_classes"] = len(index["classes"]) if index["classes"] else num_classes
    counts: Dict[str, int] = {}  # samples per shard file, in the order written
    with ShardWriter(str(folder / "shard-%06d.tar"), maxcount=samples_per_shard,
                     maxsize=float("inf"), verbose=0) as sink:
        for pos, sample in enumerate(_records(dataset, order, num_workers)):
            shape = sample.pop("shape", None)
            if shape is not None:
                index["input_shape"] = list(shape)
            sink.write({"__key__": f"{pos:09d}", **sample})
            name = Path(sink.fname).name
            counts[name] = counts.get(name, 0) + 1
    index["shards"] = [{"url": name, "samples": c} for name, c in counts.items()]
    tmp = folder / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    tmp.replace(folder / INDEX)
    return index


def _records(dataset, order: List[int], num_workers: int) -> Iterator[Dict[str, Any]]:
    """Tar members of each sample in `order`."""
    from data.loader import readable  # (data.loader builds shard loaders: imported late)

    if isinstance(dataset, ImageFolder):  # its files' bytes, checked by decoding them once
        checked = DataLoader(_Checked(dataset, order), batch_size=None, num_workers=num_workers)
        for i, ok in zip(order, readable(iter(checked), workers=num_workers > 0)):
            if not ok:  # on_error=skip: warned and counted by the folder; left out
                continue
            path, label = dataset.samples[i]
            ext = path.rsplit(".", 1)[-1].lower()
            with open(path, "rb") as f:
                yield {ext: f.read(), "cls": str(label).encode(), "path": path.encode()}
        return
    from torch.utils.data import Subset

    from data.cache import pair_batches  # (data.cache imports the loader: late)

    subset = Subset(dataset, order)
    subset.collate_fn = getattr(dataset, "collate_fn", None)  # (a Subset does not pass it on)
    # anything but (input, target) tensor pairs (dicts, string labels, a third item) is the
    # one-line ConfigError that --format npy gives, not a traceback from unpacking it here
    for x, y in pair_batches(subset, num_workers):
        for xi, yi in zip(x.numpy(), y.numpy()):
            xb, yb = io.BytesIO(), io.BytesIO()
            np.save(xb, xi)
            np.save(yb, yi)
            yield {"x.npy": xb.getvalue(), "y.npy": yb.getvalue(), "shape": xi.shape}


class _Checked(torch.utils.data.Dataset):
    """Whether each file (in `order`) decodes, under the folder's on_error policy: an
    unreadable one is False with on_error=skip, and stops the packing with on_error=fail."""

    def __init__(self, folder: ImageFolder, order: List[int]):
        self.folder, self.order = folder, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> bool:
        return self.folder[self.order[i]] is not None
