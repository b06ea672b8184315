"""Synthetic GPT-like training state of a chosen byte size.

The state mimics what a trainer checkpoints: model parameters plus AdamW ``exp_avg`` and
``exp_avg_sq`` for every parameter, plus a scalar ``step``: 52 parameters -> 157 fp32 tensors, of
mixed sizes (large embedding and MLP matrices, tiny LayerNorm vectors), the same shape mix
as ``/work/shared/peer-numbers.md``.

Every byte is written once at construction: untouched ``torch.empty`` pages would turn the first
copy of the state into a page-fault benchmark instead of a memcpy benchmark. The contents are
tiled from a small random block because the value distribution is irrelevant (nothing here
compresses), and generating 4 GiB of normal samples on two cores would take longer than most
of the measurements.

Run ``python -m benchmarks.state 256M`` to print the layout for a size.
"""

from __future__ import annotations

import mmap
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: Transformer depth of the synthetic model: 6 matrices/vectors per block.
N_LAYERS = 8
#: Vocabulary and context length as multiples of the model width d; chosen so that the
#: embedding is a large minority of the bytes, as in GPT-2-like models.
VOCAB_PER_D = 8
CONTEXT_PER_D = 1

#: Alignment of each tensor in :func:`flat_views`' buffer.
ALIGN = 64
_KEEP: dict[int, mmap.mmap] = {}  # the mappings behind flat_views' buffers, kept alive

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Parse ``"256M"``, ``"1G"``, ``"4GiB"`` or a plain byte count into bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 256M, 1G, 4G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(nbytes: int) -> str:
    """Inverse of :func:`parse_size` for display: ``268435456 -> "256M"``."""
    for unit in ("T", "G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return f"{nbytes / (1 << 20):.0f}M"


def _param_shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("wte.weight", (VOCAB_PER_D * d, d)),
        ("wpe.weight", (CONTEXT_PER_D * d, d)),
    ]
    for i in range(N_LAYERS):
        p = f"h.{i}."
        shapes += [
            (p + "ln_1.weight", (d,)),
            (p + "attn.c_attn.weight", (3 * d, d)),
            (p + "attn.c_proj.weight", (d, d)),
            (p + "ln_2.weight", (d,)),
            (p + "mlp.c_fc.weight", (4 * d, d)),
            (p + "mlp.c_proj.weight", (d, 4 * d)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def choose_width(target_bytes: int) -> int:
    """Largest model width (multiple of 16) whose params + two AdamW moments fit in target_bytes."""
    lo, hi = 16, 16
    while 12 * sum(_numel(s) for _, s in _param_shapes(hi)) + 4 <= target_bytes:
        lo, hi = hi, hi * 2
    while hi - lo > 16:  # binary search on multiples of 16
        mid = (lo + hi) // 2 // 16 * 16
        if 12 * sum(_numel(s) for _, s in _param_shapes(mid)) + 4 <= target_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def build_state(target_bytes: int, seed: int = 0) -> dict[str, Any]:
    """Build ``{"model": {name: W}, "optim": {"state": {name: {exp_avg, exp_avg_sq}}, "step": t}}``.

    The byte size is at most ``target_bytes`` and within a few percent of it (the width is
    rounded to a multiple of 16). All tensors are contiguous fp32 on CPU and fully written.
    """
    d = choose_width(target_bytes)
    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(1 << 22, generator=gen)  # 16 MiB of fp32 to tile from

    def filled(shape: tuple[int, ...], offset: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        flat = t.view(-1)
        n = flat.numel()
        pos = 0
        while pos < n:  # tile the block; the offset makes tensors differ from each other
            k = min(n - pos, block.numel() - offset)
            flat[pos : pos + k].copy_(block[offset : offset + k])
            pos += k
            offset = 0
        return t

    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for i, (name, shape) in enumerate(_param_shapes(d)):
        model[name] = filled(shape, (i * 7919) % (1 << 20))
        moments[name] = {
            "exp_avg": filled(shape, (i * 104729) % (1 << 20)) * 0.1,
            "exp_avg_sq": filled(shape, (i * 1299709) % (1 << 20)).abs_() * 0.01,
        }
    return {"model": model, "optim": {"state": moments, "step": torch.tensor(1000.0)}}


def iter_tensors(tree: Any, prefix: str = "", kind: type | tuple[type, ...] = torch.Tensor) -> Iterator[tuple[str, Any]]:
    """Yield ``(dotted.key, leaf)`` for every leaf of type ``kind`` (torch tensors unless told:
    a peer with its own array type, e.g. ``jax.Array``, walks its tree with the same keys)."""
    if isinstance(tree, kind):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k in tree:
            yield from iter_tensors(tree[k], f"{prefix}.{k}" if prefix else str(k), kind)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from iter_tensors(v, f"{prefix}.{i}" if prefix else str(i), kind)


def flat_dict(tree: Any) -> dict[str, torch.Tensor]:
    """Flat ``{dotted.key: tensor}`` view of the tree (for safetensors); shares storage."""
    return dict(iter_tensors(tree))


def nbytes(tree: Any) -> int:
    """Total tensor payload of the tree in bytes."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(tree))


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Same structure, ``fn`` applied to every tensor leaf; other leaves are kept as they are."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(v, fn) for v in tree)
    return tree


def template_like(tree: Any) -> Any:
    """Same structure, new zero-filled (hence already faulted-in) tensors: a restore target."""
    return map_tensors(tree, torch.zeros_like)


def trees_equal(a: Any, b: Any) -> bool:
    """Exact equality of every tensor leaf and of the key structure (correctness check)."""
    ka, kb = list(iter_tensors(a)), list(iter_tensors(b))
    if [k for k, _ in ka] != [k for k, _ in kb]:
        return False
    return all(torch.equal(x, y) for (_, x), (_, y) in zip(ka, kb))


def flat_views(state: Any) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One faulted-in uint8 buffer with room for every tensor of ``state`` (each at a 64-byte
    aligned offset), and ``(tensor, view of the buffer)`` pairs: the destination of the memcpy
    floors. The buffer is page-aligned anonymous memory, so ``O_DIRECT`` can write from it."""
    pairs_meta = []
    off = 0
    for _, t in iter_tensors(state):
        pairs_meta.append((t, off))
        off += (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
    # Page-aligned anonymous memory so that O_DIRECT can write straight from it; rounded up to
    # whole pages so the last O_DIRECT write may be a full page.
    size = (off + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    mem = mmap.mmap(-1, size)
    flat = torch.frombuffer(mem, dtype=torch.uint8)
    flat.zero_()  # every page faulted in now, not timed
    _KEEP[id(flat)] = mem
    pairs = []
    for t, o in pairs_meta:
        n = t.numel() * t.element_size()
        pairs.append((t, flat[o : o + n].view(t.dtype).view(t.shape)))
    return flat, pairs


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    target = parse_size(argv[0] if argv else "256M")
    d = choose_width(target)
    state = build_state(target)
    tensors = list(iter_tensors(state))
    sizes = sorted(t.numel() * 4 for _, t in tensors)
    print(
        f"target {format_size(target)}: width {d}, {len(tensors)} tensors, "
        f"{nbytes(state) / 2**20:.1f} MiB; largest {sizes[-1] / 2**20:.1f} MiB, "
        f"median {sizes[len(sizes) // 2] / 2**10:.0f} KiB, smallest {sizes[0]} B"
    )


if __name__ == "__main__":
    main()
