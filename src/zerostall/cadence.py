"""The Checkpointer's automatic save interval: times its steps and saves, decides ``"auto"`` saves
(the advisor of :mod:`zerostall.advice`, fed with this Checkpointer's measurements)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from zerostall.advice import AutoInterval, CadenceEstimator, MeasuredCosts, SaveKind
from zerostall.errors import AdviceError, InvalidArgumentError
from zerostall.response import Response

__all__ = ["Cadence", "FixedCosts"]


class Cadence:
    """The Checkpointer's side of the advisor: times its steps and saves, decides ``"auto"`` saves.

    Steps are observed on the training thread (``should_save``); a save becomes durable on the
    writer's listener thread, so it is queued and handed to the (single-threaded) estimator by
    the training thread's next call.
    """

    def __init__(self, save_interval: str | None, save_interval_steps: int | None, mtbf_s: float | None,
                 costs: MeasuredCosts | None, max_in_flight: int, *, memory_tier: bool = False,
                 replicas: int = 0) -> None:
        if save_interval not in (None, "auto"):
            raise InvalidArgumentError(f"save_interval must be 'auto' or None (use save_interval_steps for a fixed "
                             f"interval), got {save_interval!r}")
        if save_interval == "auto" and save_interval_steps is not None:
            raise InvalidArgumentError("pass save_interval='auto' or save_interval_steps, not both")
        if save_interval == "auto" and mtbf_s is None:
            raise AdviceError("save_interval='auto' needs mtbf_s (the job's mean time between failures)",
                              key="mtbf_s")
        if save_interval == "auto" and memory_tier and costs is not None and costs.memory is None:
            raise AdviceError("with the memory tier, given costs need the memory-only saves' costs "
                              "(MeasuredCosts(memory=...))", key="costs")
        #: the clock every observation uses (monotonic; seconds)
        self.clock: Callable[[], float] = time.monotonic
        self.mtbf_s = mtbf_s
        self.fixed = costs
        self.estimator = CadenceEstimator()
        self.auto = AutoInterval(mtbf_s=mtbf_s, max_in_flight=max_in_flight, memory_tier=memory_tier,
                                 replicas=replicas) \
            if save_interval == "auto" and mtbf_s is not None else None
        self.memory_tier = memory_tier
        #: the last "auto" decision: (step, kind); a save of that step persists unless it is MEMORY
        self.decided: tuple[int, SaveKind | None] | None = None
        self._durable: deque[tuple[int, float, float, float, bool]] = deque()  # appended by the listener thread
        self._lock = threading.Lock()
        self._in_flight = 0
        self._fixed_est = FixedCosts(costs) if costs is not None else None

    def observe_step(self, step: int) -> None:
        self._drain()
        self.estimator.observe_step(step, self.clock())

    def decide(self, step: int) -> SaveKind | None:
        assert self.auto is not None
        self.observe_step(step)
        with self._lock:
            in_flight = self._in_flight
        est = self._fixed_est if self._fixed_est is not None else self.estimator
        return self.auto.decide(step, est, in_flight=in_flight)

    def persist_at(self, step: int) -> bool:
        """Whether a memory-tier save of ``step`` persists: unless the advisor asked for a memory-only
        save at that step (a save at a step it did not choose persists)."""
        return not (self.decided is not None and self.decided == (step, SaveKind.MEMORY))

    def costs(self) -> MeasuredCosts | None:
        if self.fixed is not None:
            return self.fixed
        self._drain()
        return self.estimator.costs()

    def started(self) -> None:
        with self._lock:
            self._in_flight += 1

    def durable(self, step: int, t_start: float, r: Response, exc: BaseException | None, *,
                persisted: bool = True) -> None:
        t_durable = self.clock()
        with self._lock:
            self._in_flight -= 1
        if exc is None:
            blocked = min(r.stats.stall_s, t_durable - t_start)
            self._durable.append((step, blocked, t_start, t_durable, persisted))

    def _drain(self) -> None:
        while self._durable:
            step, blocked, t_start, t_durable, persisted = self._durable.popleft()
            self.estimator.observe_save(step, blocked, t_start, t_durable, persisted=persisted)


class FixedCosts(CadenceEstimator):
    """An estimator that answers given costs (``Checkpointer(costs=...)``)."""

    def __init__(self, costs: MeasuredCosts) -> None:
        super().__init__()
        self._fixed = costs

    def costs(self) -> MeasuredCosts | None:
        return self._fixed
