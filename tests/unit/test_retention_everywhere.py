"""Collective retention: a step is deleted only once every rank's view holds keep_last newer steps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from zerostall.commit import steps_to_delete, steps_to_delete_everywhere

steps = st.lists(st.integers(0, 40), max_size=12, unique=True).map(sorted)


@given(steps, st.integers(41, 50), st.one_of(st.none(), st.integers(1, 5)), st.one_of(st.none(), st.integers(1, 7)))
def test_one_view_is_plain_retention(view: list[int], newest: int, keep: int | None, every: int | None) -> None:
    assert steps_to_delete_everywhere([view], newest=newest, keep_last=keep, keep_every_n_steps=every) == \
        steps_to_delete(view, newest=newest, keep_last=keep, keep_every_n_steps=every)


@given(st.lists(steps, min_size=1, max_size=4), st.integers(41, 50), st.integers(1, 5))
def test_every_rank_keeps_keep_last_common_steps(views: list[list[int]], newest: int, keep: int) -> None:
    doomed = set(steps_to_delete_everywhere(views, newest=newest, keep_last=keep, keep_every_n_steps=None))
    common = set(views[0]).intersection(*views[1:]) | {newest}
    left = [set(v) - doomed | {newest} for v in views]
    # the keep_last newest steps every rank could load before are still loadable by every rank
    assert set(sorted(common)[-keep:]) <= set.intersection(*left)
    # and nothing deleted is newer than a step some rank still needs
    floor = sorted(common)[-keep:][0]
    assert all(s < floor for s in doomed)


def test_step_missing_from_one_view_protects_the_common_one() -> None:
    # rank 1 lost step 3: after 4, step 2 is what both can load besides 4, so it stays
    assert steps_to_delete_everywhere([[1, 2, 3], [1, 2]], newest=4, keep_last=2, keep_every_n_steps=None) == [1]
    assert steps_to_delete([1, 2, 3], newest=4, keep_last=2, keep_every_n_steps=None) == [1, 2]
    # keep_every_n_steps still keeps its multiples
    assert steps_to_delete_everywhere([[2, 3, 4, 5]], newest=6, keep_last=1, keep_every_n_steps=2) == [3, 5]
