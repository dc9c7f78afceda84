"""Small reference models. Users bring their own through `model._target_`.

Every model takes `input_shape` (one sample's shape) and `num_classes`, which the model configs
interpolate from the data config, and returns logits: (batch, classes) for the classifiers,
(batch, tokens, vocabulary) for the language model. No dropout by default, so fp32 runs on
CPU are deterministic.

`activation_checkpointing=True` keeps only each block's input during the forward pass and
recomputes the block's activations in the backward pass: less activation memory for about one
more forward pass of compute. BatchNorm running statistics are updated once per step, not a
second time by the recomputation.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _buffers_kept(block: nn.Module):
    """Restores the block's buffers afterwards: a recomputed BatchNorm forward must not move
    its running statistics a second time."""
    saved = [(b, b.clone()) for b in block.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _contexts(block: nn.Module):
    return contextlib.nullcontext(), _buffers_kept(block)


def run_blocks(blocks: Sequence[nn.Module], x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    """Applies `blocks` in order, each under activation checkpointing when `checkpointed` and
    gradients are being recorded (evaluation runs them plainly)."""
    for block in blocks:
        if not (checkpointed and torch.is_grad_enabled()):
            x = block(x)
        elif torch.compiler.is_compiling():
            # compiled, the recomputation is part of the backward graph, which does not
            # repeat the forward's buffer updates (and takes no context_fn but dispatch modes)
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = checkpoint(block, x, use_reentrant=False,
                           context_fn=functools.partial(_contexts, block))
    return x


def _widths(name: str, value, what: str, example: str) -> list:
    """`value` as a list of sizes >= 1, else a ValueError naming the argument (model.NAME)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name}={value}: must be a list of sizes, e.g. {name}={example}")
    sizes = list(value)
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in sizes):
        raise ValueError(f"{name}={sizes}: every {what} must be an integer >= 1")
    return sizes


class MLP(nn.Module):
    """Flattens the input and applies Linear-ReLU blocks, then a linear classifier."""

    def __init__(self, input_shape: Sequence[int], num_classes: int,
                 hidden: Sequence[int] = (128, 128), dropout: float = 0.0,
                 activation_checkpointing: bool = False):
        super().__init__()
        self.checkpointed = activation_checkpointing
        self.blocks = nn.ModuleList()
        hidden = _widths("hidden", hidden, "layer width", "[128, 128]")
        width = math.prod(input_shape)
        for h in hidden:
            layers: list[nn.Module] = [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            self.blocks.append(nn.Sequential(*layers))
            width = h
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(run_blocks(self.blocks, x.flatten(1), self.checkpointed))


class SmallCNN(nn.Module):
    """Conv-BN-ReLU stages (stride 2 after the first), global average pool, linear head.

    Takes (C, H, W) inputs; a 1-D shape is not an image and is refused at construction.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int,
                 channels: Sequence[int] = (32, 64), batch_norm: bool = True,
                 dropout: float = 0.0, activation_checkpointing: bool = False):
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"SmallCNN needs input_shape [C, H, W], got {list(input_shape)}")
        channels = _widths("channels", channels, "stage's channels", "[32, 64]")
        self.checkpointed = activation_checkpointing
        self.stages = nn.ModuleList()
        c_in = input_shape[0]
        for i, c in enumerate(channels):
            layers: list[nn.Module] = [nn.Conv2d(c_in, c, 3, stride=1 if i == 0 else 2,
                                                 padding=1, bias=not batch_norm)]
            if batch_norm:
                layers.append(nn.BatchNorm2d(c))
            layers.append(nn.ReLU(inplace=True))
            self.stages.append(nn.Sequential(*layers))
            c_in = c
        head: list[nn.Module] = [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        if dropout > 0:
            head.append(nn.Dropout(dropout))
        head.append(nn.Linear(c_in, num_classes))
        self.head = nn.Sequential(*head)

    def forward(self, x):
        return self.head(run_blocks(self.stages, x, self.checkpointed))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP, each residual."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        # (b, heads, t, head_dim); the fused kernel (flash / memory-efficient) picks itself
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """A small decoder-only language model: token + position embeddings, pre-norm causal
    blocks, a final LayerNorm and a head tied to the token embedding.

    Takes int64 tokens of shape (batch, tokens) with `input_shape = [tokens]` (the longest
    sequence) and `num_classes` = vocabulary size; returns next-token logits for every
    position, (batch, tokens, vocabulary).
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, dim: int = 128,
                 layers: int = 2, heads: int = 4, dropout: float = 0.0,
                 activation_checkpointing: bool = False):
        super().__init__()
        if len(input_shape) != 1:
            raise ValueError(f"Transformer needs input_shape [tokens] (e.g. data=tokens), "
                             f"got {list(input_shape)}")
        if min(dim, layers, heads) < 1:
            raise ValueError(f"Transformer dim={dim}, layers={layers}, heads={heads}: each "
                             "must be >= 1")
        if dim % heads:
            raise ValueError(f"Transformer dim={dim} must be a multiple of heads={heads}")
        self.context, self.dim, self.depth = input_shape[0], dim, layers
        self.checkpointed = activation_checkpointing
        self.tokens = nn.Embedding(num_classes, dim)
        self.positions = nn.Embedding(self.context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes, bias=False)
        self.head.weight = self.tokens.weight  # tied: one vocabulary matrix
        # GPT-2's 0.02: nn.Embedding's N(0, 1) through the tied head gives logits of std
        # ~sqrt(dim), a first loss of ~90 where a uniform guess over the vocabulary is ~5.5
        for table in (self.tokens, self.positions):
            nn.init.normal_(table.weight, std=0.02)

    def get_input_embeddings(self) -> nn.Embedding:
        """The table the token ids index (Hugging Face's name for it)."""
        return self.tokens

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(pos)
        return self.head(self.norm(run_blocks(self.blocks, x, self.checkpointed)))

    def flops_per_token(self, tokens: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6 per non-embedding weight plus the
        attention scores and values, 12 x layers x dim x context (the PaLM appendix count,
        which also counts the tied head's 6 x dim x vocabulary)."""
        t = tokens or self.context
        weights = sum(p.numel() for n, p in self.named_parameters()
                      if not n.startswith(("tokens.", "positions.")))
        return 6.0 * (weights + self.tokens.weight.numel()) + 12.0 * self.depth * self.dim * t
