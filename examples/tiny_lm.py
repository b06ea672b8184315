"""A small byte-level transformer language model and a resumable synthetic data loader (pure PyTorch)."""

from __future__ import annotations

import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """GPT-style decoder over bytes."""

    def __init__(self, vocab: int = 256, d: int = 128, layers: int = 3, heads: int = 4, ctx: int = 64,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def make_corpus(n_lines: int = 20000, seed: int = 0) -> bytes:
    """Synthetic text with structure to learn: sums written out, one per line."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randrange(1000), rng.randrange(1000)
        lines.append(f"{a}+{b}={a + b}")
    return ("\n".join(lines) + "\n").encode()


class Loader:
    """Random windows of the corpus. Its position and generator state are checkpointed (Stateful)."""

    def __init__(self, corpus: bytes, batch: int, ctx: int, seed: int = 0) -> None:
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        self.batch, self.ctx = batch, ctx
        self.gen = torch.Generator().manual_seed(seed)
        self.position = 0  # batches served

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.ctx - 1, (self.batch,), generator=self.gen)
        x = torch.stack([self.data[s:s + self.ctx] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1:s + 1 + self.ctx] for s in starts.tolist()])
        self.position += 1
        return x, y

    def state_dict(self) -> dict:
        return {"position": self.position, "gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self.position = sd["position"]
        self.gen.set_state(sd["gen"])


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return f


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
