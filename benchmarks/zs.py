"""zerostall adapter: the system under test, measured with the same loop as every peer.

The free functions keep one writer process and one set of staging buffers per layout alive
across calls, so the first save (buffer allocation, writer start) is reported separately from
the later ones; every save targets a new path because an existing path raises.

Run alone: ``python -m benchmarks.zs --size 256M --repeats 1 --dir /tmp/zsb``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from benchmarks import measure
from benchmarks.floors import child_args
from benchmarks.state import build_state, parse_size


class _ZsPending(measure.Pending):
    def __init__(self, resp: Any) -> None:
        self.resp = resp

    def wait(self) -> dict[str, Any] | None:
        self.resp.result()
        stats = getattr(self.resp, "stats", None)
        if stats is None:
            return None
        if dataclasses.is_dataclass(stats):
            return dataclasses.asdict(stats)
        return dict(vars(stats))


class Zerostall(measure.System):
    """``zerostall.save_pytree_async`` / ``load_pytree`` (in place into the template)."""

    name = "zerostall"
    in_place = True

    def setup(self, directory: Path) -> None:
        import zerostall

        self.zs = zerostall

    def save(self, path: Path, state: Any) -> measure.Pending:
        return _ZsPending(self.zs.save_pytree_async(str(path), state))

    def restore(self, path: Path, template: Any) -> Any:
        return self.zs.load_pytree(str(path), template)

    def restore_variants(self) -> dict[str, Any]:
        # The default load verifies every leaf's checksum; timing it without shows whether a
        # slow restore is I/O or checksum CPU.
        lo = getattr(self.zs, "LoadOptions", None)
        if lo is None:
            return {}
        try:
            opts = lo(verify=False)
        except TypeError:
            return {}
        return {"verify=False": lambda path, template: self.zs.load_pytree(str(path), template, options=opts)}


def available() -> str | None:
    """None if zerostall's API is importable, else why not (the suite then skips it)."""
    try:
        import zerostall
    except ImportError as e:
        return f"zerostall not importable: {e}"
    missing = [n for n in ("save_pytree_async", "load_pytree") if not hasattr(zerostall, n)]
    return f"zerostall lacks {', '.join(missing)}" if missing else None


def main() -> None:
    args = child_args(__doc__.splitlines()[0]).parse_args()
    why = available()
    if why:
        measure.emit({"system": "zerostall", "skipped": why})
        return
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    state = build_state(parse_size(args.size))
    measure.emit(measure.measure_system(Zerostall(), state, directory, args.repeats))


if __name__ == "__main__":
    main()
