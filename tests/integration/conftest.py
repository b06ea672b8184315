"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from nshosts import Hosts, NamespacesUnavailable

from zerostall import Checkpointer, SaveOptions, WriterKind


@pytest.fixture
def run_dir(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A run directory holding committed steps 1 and 2, saved without faults.

    The states come from the requesting test module's own ``state(step)``.
    """
    state = request.module.state
    d = tmp_path / "run"
    with Checkpointer(d, save_options=SaveOptions(writer=WriterKind.THREAD)) as c:
        c.save_pytree(1, state(1))
        c.save_pytree(2, state(2))
    return d


@pytest.fixture
def nshosts() -> Iterator[Callable[..., Hosts]]:
    """A factory of namespace hosts (tests/support/nshosts.py): ``nshosts(["a", "b"],
    shared=[tmp_path]) -> Hosts``; every Hosts it made is closed at teardown, whatever the test did.

    Where the namespaces cannot be made (not root, no ``ip``) the test fails naming why: CI runs
    these tests as root, so a skip would hide that they never ran.
    """
    made: list[Hosts] = []

    def make(names: Sequence[str], *, shared: Sequence[Path | str] = ()) -> Hosts:
        try:
            hosts = Hosts(names, shared=shared)
        except NamespacesUnavailable as e:
            pytest.fail(f"cannot make namespace hosts {list(names)}: {e}", pytrace=False)
        made.append(hosts)
        return hosts

    yield make
    errors = []
    for hosts in reversed(made):
        try:
            hosts.close()
        except RuntimeError as e:  # close the others still, then report
            errors.append(str(e))
    if errors:
        pytest.fail("; ".join(errors), pytrace=False)
