"""Which leaves an optimizer owns (``stage.ownership.owners_of``): by identity, by address, by containment."""

from __future__ import annotations

import random

import torch

from zerostall.stage.ownership import Spans, optimizer_tensors, owners_of, span
from zerostall.tree import flatten


def _by_spans(leaves, optimizers):
    """The reference answer: every leaf looked up by span containment alone (the rule before the
    identity and address shortcuts)."""
    owned = Spans()
    for i, opt in enumerate(optimizers):
        for t in optimizer_tensors(opt):
            sp = span(t)
            if sp is not None:
                owned.add(sp, i)
    out = []
    for leaf in leaves:
        sp = span(leaf.value) if leaf.kind == "torch" and leaf.nbytes > 0 else None
        out.append(owned.containing(sp) if sp is not None else None)
    return out


def test_state_dict_leaves_views_and_strangers() -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 8)
    b = torch.nn.Linear(4, 4)
    big = torch.zeros(64)
    p = torch.nn.Parameter(big[:16])  # a parameter that is a prefix view of a larger buffer
    opts = [torch.optim.AdamW(a.parameters()), torch.optim.SGD([*b.parameters(), p], lr=0.1, momentum=0.9)]
    for m in (a, b):
        m(torch.randn(2, m.in_features)).sum().backward()
    p.grad = torch.ones(16)
    for o in opts:
        o.step()
    w = a.weight.detach()
    tree = {
        "a": a.state_dict(), "b": b.state_dict(), "opt0": opts[0].state_dict(), "opt1": opts[1].state_dict(),
        "prefix": w.view(-1)[:10],  # starts where a.weight starts, ends inside it
        "middle": w.view(-1)[5:20],  # starts inside a.weight: containment
        "strided": w[:, 2],  # not contiguous: its whole storage (a.weight's) is looked up
        "longer": big[:32],  # starts where p starts but runs past its end: not owned
        "stranger": torch.ones(3),
        "p": p.detach(),
    }
    leaves = flatten({"t": tree}).leaves
    got = owners_of(leaves, opts)
    assert got == _by_spans(leaves, opts)
    by_key = dict(zip((leaf.key for leaf in leaves), got, strict=True))
    assert by_key["t/a/weight"] == 0 and by_key["t/b/bias"] == 1 and by_key["t/p"] == 1
    assert by_key["t/prefix"] == 0 and by_key["t/middle"] == 0 and by_key["t/strided"] == 0
    assert by_key["t/longer"] is None and by_key["t/stranger"] is None
    assert any(k.endswith("exp_avg_sq") and v == 0 for k, v in by_key.items())
    assert any(k.endswith("momentum_buffer") and v == 1 for k, v in by_key.items())


def test_agrees_with_span_containment_on_random_slices() -> None:
    rng = random.Random(3)
    params = [torch.nn.Parameter(torch.randn(rng.randint(1, 50))) for _ in range(12)]
    opt = torch.optim.SGD(params, lr=0.1)
    stranger = torch.randn(40)
    tree = {}
    for i in range(300):
        src = rng.choice([*params, stranger]).detach()
        lo = rng.randrange(src.numel())
        hi = rng.randint(lo + 1, src.numel())
        tree[f"s{i}"] = src[lo:hi]
    leaves = flatten({"t": tree}).leaves
    assert owners_of(leaves, [opt]) == _by_spans(leaves, [opt])
