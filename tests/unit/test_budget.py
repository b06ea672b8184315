"""zerostall.budget: the host-memory accounting and the limit's checks (no state, no processes)."""

from __future__ import annotations

import pytest

import zerostall
from zerostall.budget import MIN_PIECE, PIECE_ALIGN, TRANSFER_CHUNK, HostLimit, account
from zerostall.errors import ArgumentTypeError, HostMemoryLimitError, InvalidArgumentError
from zerostall.memtier.replica import CHUNK_BYTES

GiB = 1 << 30


def test_parts_per_configuration() -> None:
    m = account(GiB, slots=2, held_slots=1, replicas=1)
    assert (m.slots, m.held_step, m.replicas, m.transfer) == (2 * GiB, GiB, 2 * GiB, TRANSFER_CHUNK)
    assert m.total == 5 * GiB + TRANSFER_CHUNK
    one = account(GiB, slots=2, held_slots=1, replicas=1, in_place=True)
    assert one.replicas == GiB and one.n_copies == 1
    assert account(GiB, slots=2).total == 2 * GiB


def test_transfer_chunk_is_the_replica_links() -> None:
    assert TRANSFER_CHUNK == CHUNK_BYTES


def test_replicas_too_large_names_parts_and_what_fits() -> None:
    limit = HostLimit(3 * GiB + GiB // 2, max_in_flight=2, held_slots=1, replicas=1)
    with pytest.raises(HostMemoryLimitError) as info:
        limit.decide(GiB, path="/run/step_00000007", step=7)
    msg = str(info.value)
    assert "MemoryTier(replicas=1) needs 5.0 GiB per rank" in msg
    assert "2 staging slots 2.0 GiB" in msg and "held step 1.0 GiB" in msg and "2 replica copies 2.0 GiB" in msg
    assert "max_in_flight=1 without replicas needs 2.0 GiB: fits" in msg
    assert "host_memory_limit is 3.5 GiB" in msg
    assert "replicas_in_place=True needs 4.0 GiB: does not fit either" in msg
    assert "without replicas needs 3.0 GiB: fits" in msg
    assert "step 7" in msg and "/run/step_00000007" in msg
    assert info.value.argument == "host_memory_limit"
    assert isinstance(info.value, ValueError)


def test_memory_tier_below_its_slots_refused() -> None:
    limit = HostLimit(GiB, max_in_flight=1, held_slots=1)
    assert limit.decide(GiB // 2).slots == 2
    with pytest.raises(HostMemoryLimitError, match="MemoryTier\\(\\) needs"):
        limit.decide(GiB)


def test_without_memory_tier_fewer_slots_then_pieces() -> None:
    limit = HostLimit(3 * GiB, max_in_flight=2)
    assert limit.decide(GiB).slots == 2 and not limit.decide(GiB).pieces
    one = limit.decide(2 * GiB)
    assert (one.slots, one.pieces) == (1, False)
    fit = limit.decide(4 * GiB)
    assert fit.pieces and fit.slots == 2 and fit.piece_bytes * 2 <= 3 * GiB
    assert fit.piece_bytes % PIECE_ALIGN == 0
    small = HostLimit(MIN_PIECE, max_in_flight=2).decide(GiB)
    assert (small.slots, small.piece_bytes) == (1, MIN_PIECE)


def test_pieces_refused_where_they_cannot_be_used() -> None:
    limit = HostLimit(64 << 20, max_in_flight=2)
    with pytest.raises(HostMemoryLimitError, match="collective"):
        limit.decide(GiB, collective=True)
    with pytest.raises(HostMemoryLimitError, match="writes no data file in pieces"):
        limit.decide(GiB, piece_writes=False)


def test_fixed_parts_checked_without_state() -> None:
    HostLimit(MIN_PIECE, max_in_flight=2).check_fixed()
    with pytest.raises(HostMemoryLimitError, match="one piece buffer"):
        HostLimit(MIN_PIECE - 1, max_in_flight=2).check_fixed("/run")
    with pytest.raises(HostMemoryLimitError, match="memory tier"):
        HostLimit(TRANSFER_CHUNK, max_in_flight=2, held_slots=1, replicas=1).check_fixed()


@pytest.mark.parametrize(("value", "error"), [(-1, InvalidArgumentError), (True, ArgumentTypeError),
                                              ("1GiB", ArgumentTypeError), (1.5e9, ArgumentTypeError),
                                              (1000, HostMemoryLimitError)])
def test_bad_arguments_name_host_memory_limit(tmp_path: object, value: object, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        zerostall.Checkpointer(str(tmp_path), host_memory_limit=value)  # type: ignore[arg-type]
    assert getattr(info.value, "argument", None) == "host_memory_limit"
    assert "host_memory_limit" in str(info.value) and str(tmp_path) in str(info.value)
