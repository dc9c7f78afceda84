from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.models import MLP, SmallCNN


@pytest.mark.parametrize("cls,shape", [(MLP, [1, 8, 8]), (MLP, [20]), (SmallCNN, [3, 16, 16])])
def test_logits_shape_and_no_dropout_by_default(cls, shape):
    model = cls(input_shape=shape, num_classes=7)
    assert model(torch.randn(5, *shape)).shape == (5, 7)
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())


def test_cnn_refuses_a_flat_shape():
    with pytest.raises(ValueError, match=r"input_shape \[C, H, W\]"):
        SmallCNN(input_shape=[64], num_classes=10)
