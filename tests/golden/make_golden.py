"""Make the golden checkpoints of one format version, and define the values they must load as.

Run from the repository root when a new format version is introduced (never to "refresh" an
existing version: its files are the compatibility promise)::

    python tests/golden/make_golden.py            # writes tests/golden/v<FORMAT_VERSION>/ if absent
    python tests/golden/make_golden.py --force    # rewrites it

Values come from formulas, not random generators, so they are the same on every platform and
torch version. ``test_golden.py`` loads the committed files and compares them with
:func:`expected` bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import shutil
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
Pair = namedtuple("Pair", ["first", "second"])


def register_handlers() -> None:
    """The custom leaf handlers the golden checkpoints use (a loader must register them too)."""
    import zerostall

    zerostall.register_handler(datetime.date, name="golden.date", format="json",
                               encode=lambda d: d.isoformat(), decode=datetime.date.fromisoformat)
    zerostall.register_handler(decimal.Decimal, name="golden.decimal", format="bytes",
                               encode=lambda d: str(d).encode(), decode=lambda b: decimal.Decimal(b.decode()))


def expected() -> dict[str, dict[str, Any]]:
    """``{checkpoint name: {item name: value}}`` for every golden checkpoint."""
    ar = torch.arange(24, dtype=torch.float64)
    tensors = {
        "f64": (ar / 7).reshape(2, 3, 4),
        "f32": (torch.arange(12, dtype=torch.float32) - 5.5) / 3,
        "f16": torch.linspace(-2, 2, 9, dtype=torch.float32).to(torch.float16),
        "bf16": torch.tensor([0.0, -0.0, 1.0, -1.5, 3.140625, 65280.0, float("inf"), -float("inf")],
                             dtype=torch.bfloat16),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "i8": torch.tensor([-128, -1, 0, 1, 127], dtype=torch.int8),
        "i16": torch.arange(-3, 4, dtype=torch.int16) * 1000,
        "i32": torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int32),
        "i64": torch.tensor([-(2**63), -1, 2**62, 2**63 - 1], dtype=torch.int64),
        "u8": torch.arange(0, 256, 51, dtype=torch.uint8),
        "c64": torch.complex(torch.arange(3.0), -torch.arange(3.0)),
        "scalar0d": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "strided": torch.arange(20, dtype=torch.int32).reshape(4, 5).t(),  # saved contiguous
    }
    arrays = {
        "np_f32": np.arange(6, dtype=np.float32).reshape(3, 2) / 4,
        "np_u16": np.array([0, 1, 65535], dtype=np.uint16),
        "np_bool": np.array([True, False]),
        "np_scalar": np.float64(-0.125),
        "np_int_scalar": np.int32(-7),
    }
    plain = {
        "int": 42, "big_int": 2**80, "neg": -3, "float": 0.1, "neg_zero": -0.0, "inf": float("inf"),
        "str": "zerostall ✓ ünïcode", "empty_str": "", "none": None, "true": True, "false": False,
        "bytes": b"\x00\x01binary\xff", "empty_bytes": b"",
    }
    nested = {
        "list": [1, [2, [3, torch.tensor([4, 5], dtype=torch.int64)]]],
        "tuple": (1.5, "a", None),
        "pair": Pair(torch.ones(2, dtype=torch.float16), {"x": 1}),
        "int_keys": {0: "zero", 7: torch.tensor([7], dtype=torch.int8)},
        "empty_dict": {}, "empty_list": [],
        "date": datetime.date(2024, 2, 29),
        "decimal": decimal.Decimal("3.14159265358979323846"),
    }
    return {
        "pytree_all_types": {"pytree": {"tensors": tensors, "arrays": arrays, "plain": plain, "nested": nested}},
        "checkpointables": {
            "model": {"layer.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                      "layer.bias": torch.tensor([0.5, -0.5], dtype=torch.bfloat16)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 3), 0.25)}},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
            "extra": {"epoch": 2, "rng": b"\x07" * 16},
        },
    }


METADATA = {"pytree_all_types": {"note": "golden v1"}, "checkpointables": {"epoch": 2, "tags": ["golden"]}}


def make(out: Path) -> None:
    import zerostall
    from zerostall import SaveOptions, WriterKind

    register_handlers()
    opts = SaveOptions(writer=WriterKind.THREAD)
    out.mkdir(parents=True)
    for name, items in expected().items():
        zerostall.save_checkpointables(out / name, items, metadata=METADATA[name], options=opts)
    # A Checkpointer directory with two steps (and retention that kept both).
    with zerostall.Checkpointer(out / "run", keep_last=2, save_options=opts) as ckpt:
        for step in (100, 200):
            ckpt.save_pytree(step, run_state(step))


def run_state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(8, dtype=torch.float32) * step, "step": step}


def main(argv: list[str]) -> int:
    from zerostall.format.manifest import FORMAT_VERSION

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="rewrite an existing version's directory")
    p.add_argument("--out", type=Path, default=HERE / f"v{FORMAT_VERSION}")
    args = p.parse_args(argv)
    if args.out.exists():
        if not args.force:
            print(f"{args.out} exists; pass --force to rewrite it", file=sys.stderr)
            return 1
        shutil.rmtree(args.out)
    make(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
