"""The copy-engine choice and the staging copies, on CPU. The CUDA engine's logic is driven with
a stand-in for torch.cuda (streams are the only CUDA-specific part; the copy calls are real)."""

import numpy as np
import torch

from zerostall.stage import BufferPool, CpuCopyEngine, CudaCopyEngine, make_plan, select_engine, stage
from zerostall.tree import flatten


def _staged_bytes(state):
    flat = flatten({"p": state})
    plan = make_plan(flat)
    pool = BufferPool(1)
    slot = pool.acquire()
    pool.fit(slot, [f.alloc for f in plan.files])
    stage(flat, plan, slot)
    return flat, plan, slot


def test_stage_copies_strided_views_and_every_kind():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"t": base.t(), "view": base[1:3, ::2], "np": np.arange(5, dtype=np.int16), "b": b"xyz",
             "bf": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}
    flat, plan, slot = _staged_bytes(state)
    buf = slot.buffers[0].mmap
    for leaf, place in zip(flat.leaves, plan.leaves):
        raw = bytes(buf[place.offset:place.offset + place.nbytes])
        v = leaf.value
        if isinstance(v, torch.Tensor):
            assert raw == v.contiguous().view(torch.uint8).numpy().tobytes(), leaf.key
        elif isinstance(v, np.ndarray):
            assert raw == v.tobytes()
        else:
            assert raw == v
    assert bytes(buf[:len(plan.files[0].header)]) == plan.files[0].header


def test_engine_is_cpu_without_cuda_tensors():
    flat = flatten({"p": {"a": torch.zeros(2)}})
    assert isinstance(select_engine(flat.leaves), CpuCopyEngine)
    assert isinstance(select_engine(flat.leaves, cuda_available=True), CpuCopyEngine)


class _FakeCudaTensor:
    """Stands in for a CUDA tensor: device and is_cuda are what the engine looks at."""

    def __init__(self, t):
        self.t = t
        self.is_cuda = True
        self.device = type("Device", (), {"type": "cuda"})()


class _FakeCuda:
    def __init__(self):
        self.events = []
        outer = self

        class Stream:
            def __init__(self, device=None):
                outer.events.append("stream")

            def wait_stream(self, other):
                outer.events.append("wait")

            def synchronize(self):
                outer.events.append("sync")

        class Ctx:
            def __init__(self, s):
                pass

            def __enter__(self):
                outer.events.append("enter")

            def __exit__(self, *a):
                outer.events.append("exit")

        self.Stream = Stream
        self.stream = Ctx
        self.current_stream = lambda device=None: "main"


class _FakeTorch:
    def __init__(self):
        self.cuda = _FakeCuda()


class _Dst:
    def __init__(self):
        self.calls = []

    def copy_(self, src, non_blocking=False):
        self.calls.append(non_blocking)


def test_cuda_engine_waits_for_producer_stream_then_copies_async_and_syncs():
    fake = _FakeTorch()
    eng = CudaCopyEngine(fake, device=None)
    d1, d2 = _Dst(), _Dst()
    eng.copy(d1, _FakeCudaTensor(None))
    eng.copy(d2, _FakeCudaTensor(None))
    assert eng.finish() == {}  # DMA copies checksum nothing: the writer sums those leaves
    ev = fake.cuda.events
    # one wait on the trainer's stream, before any copy; copies non-blocking on the side stream
    assert ev.count("wait") == 1 and ev.index("wait") < ev.index("enter")
    assert d1.calls == [True] and d2.calls == [True]
    assert ev[-1] == "sync"
    # a CPU source is copied synchronously
    d3 = _Dst()
    cpu_src = torch.zeros(1)
    eng.copy(d3, cpu_src)
    assert d3.calls == [False]


def test_pool_reuses_buffers_for_same_or_smaller_layouts():
    pool = BufferPool(1)
    slot = pool.acquire()
    assert pool.fit(slot, [8192])
    first = slot.buffers[0]
    assert not pool.fit(slot, [4096])
    assert slot.buffers[0] is first
    assert pool.fit(slot, [16384])
    assert slot.buffers[0] is not first
    pool.release(slot)
    pool.close()


def test_stage_checksums_what_it_streams_and_leaves_the_rest_to_the_writer(monkeypatch):
    import crc32c

    import zerostall.memcopy as memcopy

    if not memcopy.CRC_COPY:
        monkeypatch.setattr(memcopy, "CRC_COPY", False)
    big = torch.randn(memcopy.MIN_STREAM // 4 + 5)
    state = {"big": big, "np": np.random.default_rng(0).random(memcopy.MIN_STREAM // 8 + 3),
             "small": torch.ones(3), "strided": torch.randn(600, 200).t(), "b": b"xyz"}
    flat = flatten({"p": state})
    plan = make_plan(flat)
    pool = BufferPool(1)
    slot = pool.acquire()
    pool.fit(slot, [f.alloc for f in plan.files])
    crcs = [None] * len(flat.leaves)
    stage(flat, plan, slot, crcs=crcs)
    by_key = {leaf.key.rsplit("/", 1)[-1]: (leaf, c) for leaf, c in zip(flat.leaves, crcs)}
    if memcopy.CRC_COPY:
        for name in ("big", "np"):
            leaf, c = by_key[name]
            raw = leaf.value.numpy().tobytes() if isinstance(leaf.value, torch.Tensor) else leaf.value.tobytes()
            assert c == crc32c.crc32c(raw), name
    else:  # no kernel: nothing checksummed, the writer sums every leaf
        assert by_key["big"][1] is None and by_key["np"][1] is None
    # small, strided (gathered by copy_) and bytes leaves are not checksummed at staging
    assert [by_key[k][1] for k in ("small", "strided", "b")] == [None, None, None]
    # staged bytes are those of the sources either way
    buf = slot.buffers[0].mmap
    for leaf, place in zip(flat.leaves, plan.leaves):
        v = leaf.value
        want = v.contiguous().numpy().tobytes() if isinstance(v, torch.Tensor) else (v.tobytes() if isinstance(v, np.ndarray) else v)
        assert bytes(buf[place.offset:place.offset + place.nbytes]) == want, leaf.key
