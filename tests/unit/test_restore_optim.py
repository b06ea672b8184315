"""Optimizer state loaded into a fresh optimizer (``restore.optim``): the moments come back laid out
like their parameters, so a fused optimizer that pairs elements by memory position resumes exactly."""

from __future__ import annotations

from pathlib import Path

import torch

import zerostall


def test_a_fresh_fused_adamw_over_a_channels_last_cnn_resumes_bit_for_bit(tmp_path: Path) -> None:
    # A fresh optimizer has no state to fill in place: its moments are made by the load. Made
    # contiguous while the channels_last parameters are not, fused AdamW would pair each moment
    # with the wrong parameter element and every step after the resume would drift, silently.
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer, i: int) -> None:
        x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(i))
        m(x.to(memory_format=torch.channels_last)).square().mean().backward()
        o.step()
        o.zero_grad()

    ma, oa = build()
    for i in range(1, 4):
        step(ma, oa, i)
    zerostall.save_pytree(tmp_path / "c", {"m": ma, "o": oa})
    mb, ob = build()
    zerostall.load_pytree(tmp_path / "c", {"m": mb, "o": ob})
    pa, pb = ma[0].weight, mb[0].weight
    assert ob.state[pb]["exp_avg"].stride() == oa.state[pa]["exp_avg"].stride() == pb.stride()
    assert torch.equal(ob.state[pb]["exp_avg"], oa.state[pa]["exp_avg"])
    assert type(ob.state[pb]["step"]) is type(oa.state[pa]["step"])
    for i in range(4, 6):
        step(ma, oa, i)
        step(mb, ob, i)
    for k, v in ma.state_dict().items():
        assert torch.equal(v, mb.state_dict()[k]), k
