from __future__ import annotations

from collections import namedtuple

import torch

from data.prefetch import to_device

Pair = namedtuple("Pair", "x y")


def test_nested_structures_keep_their_shape_and_types():
    cpu = torch.device("cpu")
    batch = {"img": torch.ones(2, dtype=torch.uint8), "meta": [torch.zeros(1), "id-7", 3],
             "pair": Pair(torch.ones(1), (torch.ones(1, dtype=torch.int64),))}
    out = to_device(batch, cpu)
    assert out["img"].dtype == torch.uint8 and out["meta"][1:] == ["id-7", 3]
    assert isinstance(out["pair"], Pair) and isinstance(out["pair"].y, tuple)
    assert out["img"] is batch["img"]  # already there: no copy
