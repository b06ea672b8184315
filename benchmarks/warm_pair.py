"""Warm restore, paired: zerostall's default load vs ``safetensors.load_file`` + ``copy_`` into the
same template, alternating in one process, each pair followed by a read of zerostall's files.

    python -m benchmarks.warm_pair --size 1G --repeats 3 --dir /tmp/zsb

Why a child of its own: the zerostall and safetensors children of ``benchmarks.run`` run minutes
apart, and on this VM the speed of a copy into memory changes 1.5-4x from one minute, or one
process, to the next with nothing else running (the same 4 GiB copy took 0.106 s in one process and
0.170 s in the next; ``benchmarks/probes/copy_speed.py``). A 4 GiB warm load is such a copy,
so comparing the two children's medians compared the machine's moments as much as the loaders.
Here both load the same state into the same template, alternating which goes first, and the
verdict is the median of the per-pair ratios.

The state is freed once both files are written, so that at 4 GiB both files stay in the page cache
beside the template (as ``benchmarks.probes.restore_ab --lean``); the template is checked against the
state's CRC32Cs at the end.
"""

from __future__ import annotations

import mmap
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import measure
from benchmarks.floors import child_args
from benchmarks.state import build_state, flat_dict, iter_tensors, nbytes, parse_size, template_like

PAIRS_PER_REPEAT = 2  # pairs are cheap next to the saves and cold reads of the other children


def run(size: int, directory: Path, pairs: int) -> dict[str, Any]:
    """``pairs`` alternating warm loads of each system; seconds per load, the per-pair ratios
    (safetensors / zerostall: above 1 means zerostall is faster) and the paired read."""
    import safetensors.torch as st
    import torch

    import zerostall
    from zerostall.checksum import checksum

    def crcs(tree: Any) -> list[int]:
        return [checksum(t.contiguous().view(-1).view(torch.uint8).numpy()) for _, t in iter_tensors(tree)]

    root = measure.scratch_path(directory, "warm-pair")
    root.mkdir(parents=True)
    try:
        state = build_state(size)
        total = nbytes(state)
        ck, sf = root / "zs", root / "state.safetensors"
        zerostall.save_pytree(str(ck), state)
        st.save_file(flat_dict(state), str(sf))
        want = crcs(state)
        tmpl = template_like(state)
        del state
        read_buf = memoryview(mmap.mmap(-1, 64 << 20))
        read_buf[:] = bytes(len(read_buf))  # faulted in here, not in the first timed read

        def zs_load() -> None:
            zerostall.load_pytree(str(ck), tmpl)

        def st_load() -> None:  # as benchmarks.peers.Safetensors.restore
            flat = st.load_file(str(sf))
            for key, dst in iter_tensors(tmpl):
                dst.copy_(flat[key])

        loads = {"zerostall": (ck, zs_load), "safetensors": (sf, st_load)}
        for _, fn in loads.values():  # untimed: imports, thread pools, first mappings
            fn()
        times: dict[str, list[float]] = {"zerostall": [], "safetensors": [], "read": []}
        for i in range(pairs):
            order = ["zerostall", "safetensors"] if i % 2 == 0 else ["safetensors", "zerostall"]
            for name in order:
                path, fn = loads[name]
                measure.warm_cache(path)
                measure.wait_for_quiet(max_wait_s=measure.QUIET_WAIT_S)
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            measure.warm_cache(ck)
            measure.wait_for_quiet(max_wait_s=measure.QUIET_WAIT_S)
            times["read"].append(measure.raw_read(ck, read_buf))
            measure.log(f"warm pair {i}: zerostall {times['zerostall'][-1]:.3f}s "
                        f"safetensors {times['safetensors'][-1]:.3f}s read {times['read'][-1]:.3f}s")
        zs_load()  # the last load into the template is zerostall's, checked against the state
        correct = crcs(tmpl) == want
    finally:
        measure.remove(root)
    ratios = [s / z for s, z in zip(times["safetensors"], times["zerostall"], strict=True)]
    return {"nbytes": total, "pairs": pairs, "warm_s": times, "st_x_zs": ratios,
            "st_x_zs_median": statistics.median(ratios), "correct": correct}


def main() -> None:
    args = child_args(__doc__.splitlines()[0]).parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    measure.emit(run(parse_size(args.size), directory, max(3, PAIRS_PER_REPEAT * args.repeats + 1)))


if __name__ == "__main__":
    main()
