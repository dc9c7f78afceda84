from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from trainer.models import MLP, SmallCNN, Transformer


@pytest.mark.parametrize("cls,shape", [(MLP, [1, 8, 8]), (MLP, [20]), (SmallCNN, [3, 16, 16])])
def test_logits_shape_and_no_dropout_by_default(cls, shape):
    model = cls(input_shape=shape, num_classes=7)
    assert model(torch.randn(5, *shape)).shape == (5, 7)
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())


def test_cnn_refuses_a_flat_shape():
    with pytest.raises(ValueError, match=r"input_shape \[C, H, W\]"):
        SmallCNN(input_shape=[64], num_classes=10)


def saved_bytes(model, x) -> int:
    """Bytes autograd keeps for the backward pass of one forward (activations)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).float().sum().backward()
    return total


CASES = [(MLP, [3, 16, 16], torch.randn(8, 3, 16, 16), {"hidden": [256, 256, 256]}),
         (SmallCNN, [3, 16, 16], torch.randn(8, 3, 16, 16), {"channels": [16, 32, 32]}),
         (Transformer, [32], torch.randint(50, (8, 32)), {"dim": 64, "layers": 3})]


@pytest.mark.parametrize("cls,shape,x,kw", CASES, ids=[c[0].__name__ for c in CASES])
def test_activation_checkpointing_same_result_less_memory(cls, shape, x, kw):
    torch.manual_seed(0)
    plain = cls(input_shape=shape, num_classes=50, **kw)
    ckpt = copy.deepcopy(plain)
    ckpt.checkpointed = True
    out_plain, out_ckpt = plain(x), ckpt(x)
    torch.testing.assert_close(out_plain, out_ckpt)
    out_plain.float().square().mean().backward()
    out_ckpt.float().square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    # BatchNorm running statistics move once per step, not again in the recomputation
    for (name, b), c in zip(plain.named_buffers(), ckpt.buffers()):
        assert torch.equal(b, c), name
    assert saved_bytes(ckpt, x) < 0.6 * saved_bytes(plain, x)


def test_compiled_activation_checkpointing_matches_eager_and_moves_statistics_once():
    """Under torch.compile (aot_eager: the same graph capture as inductor, without code
    generation) the checkpointed CNN trains like the eager plain one."""
    torch.manual_seed(0)
    plain = SmallCNN([3, 16, 16], 10, channels=[8, 16])
    ckpt = copy.deepcopy(plain)
    ckpt.checkpointed = True
    x = torch.randn(8, 3, 16, 16)
    graphs = []

    def capture(gm, inputs):  # records dynamo's graph, then compiles it as aot_eager does
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)

    torch.compile(ckpt, backend=capture)(x).square().mean().backward()
    plain(x).square().mean().backward()
    assert any("tag_activation_checkpoint" in gm.code for gm in graphs)  # still checkpointed
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for (name, b), c in zip(plain.named_buffers(), ckpt.buffers()):
        torch.testing.assert_close(b, c, msg=name)


def test_activation_checkpointing_is_off_in_evaluation():
    model = SmallCNN([3, 8, 8], 4, activation_checkpointing=True).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 8, 8)).shape == (2, 4)


def test_transformer_is_causal_and_returns_logits_per_token():
    torch.manual_seed(0)
    model = Transformer([16], num_classes=30, dim=32, layers=2, heads=4)
    x = torch.randint(30, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 30)
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 30  # change the future: earlier positions must not notice
    torch.testing.assert_close(model(y)[:, :10], logits[:, :10])
    assert model.head.weight is model.tokens.weight  # tied
    with pytest.raises(ValueError, match=r"input_shape \[tokens\]"):
        Transformer([1, 8, 8], 10)
    with pytest.raises(ValueError, match="multiple of heads"):
        Transformer([8], 10, dim=30, heads=4)


def test_transformer_flops_per_token_counts_weights_and_attention():
    d, n_layers, vocab, t = 64, 3, 100, 32
    model = Transformer([t], num_classes=vocab, dim=d, layers=n_layers, heads=4)
    # per block: qkv 3d^2+3d, proj d^2+d, mlp 8d^2+5d, two LayerNorms 4d; final norm 2d
    block = 12 * d * d + 13 * d
    weights = n_layers * block + 2 * d + vocab * d  # + the tied head
    assert model.flops_per_token() == 6 * weights + 12 * n_layers * d * t


def test_a_fresh_transformer_starts_near_a_uniform_guess():
    """Its tied embedding is small at init (GPT-2's 0.02): N(0, 1) made the first loss ~90."""
    torch.manual_seed(0)
    vocab = 256
    model = Transformer([64], num_classes=vocab)
    tokens = torch.randint(vocab, (8, 64))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab),
                                             tokens[:, 1:].reshape(-1))
    assert abs(loss.item() - math.log(vocab)) < 0.5


def test_reference_models_refuse_sizes_of_zero():
    import pytest

    from trainer.models import MLP, SmallCNN, Transformer

    with pytest.raises(ValueError, match=r"^hidden=\[64, 0\]: every layer width must be an "
                                         r"integer >= 1"):
        MLP([1, 8, 8], 10, hidden=[64, 0])
    with pytest.raises(ValueError, match=r"^hidden=5: must be a list of sizes, e.g. "
                                         r"hidden=\[128, 128\]"):
        MLP([1, 8, 8], 10, hidden=5)  # (was: 'int' object is not iterable)
    with pytest.raises(ValueError, match=r"^channels=8: must be a list of sizes"):
        SmallCNN([3, 8, 8], 10, channels=8)
    with pytest.raises(ValueError, match="Transformer dim=0, layers=2, heads=4: each must be"):
        Transformer([16], 10, dim=0)
