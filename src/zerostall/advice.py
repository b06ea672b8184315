"""The checkpoint-interval advisor: how often to save, from measured costs and an MTBF.

Pure computation: no torch, no I/O, no threads, no clocks (every time is passed in), so every
result is a deterministic function of its inputs. A :class:`Checkpointer` feeds a
:class:`CadenceEstimator` with the times of its steps and saves, reads :class:`MeasuredCosts`
from it, and asks :func:`advise` for the interval that minimises the expected time lost to
saving plus failures; :class:`AutoInterval` is the rule behind ``save_interval="auto"``.
docs/advice.md derives the models and works an example.

What a save costs an asynchronous checkpointer. A save has two durations that the classical
models merge into one. Its *cost* ``C`` is the training time it takes away: the seconds the
training thread is blocked plus the training lost while the save persists in the background
(iterations run slower while a writer competes for memory bandwidth, PCIe and cores). Its
*latency* ``L`` is the time from the save's start until it is durable: a failure in that window
falls back to the previous save. Cost is paid on every save, latency only on a failure, so the
cost sets the interval and the latency adds to the work lost per failure (Vaidya 1997: "for
equidistant checkpoints, optimal checkpoint interval is ... typically independent of checkpoint
latency"; :func:`one_level_overhead` shows that under exponential failures it is exactly so).

Models (``M`` the mean time between failures of the whole job, ``R`` the time from a failure
until training runs again, ``tau`` the training time between two saves, ``P = tau + C`` the
wall time between save starts):

* Young (1974), first order: ``tau = sqrt(2 C M)``.
* Daly (2006), higher order: ``tau = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` for
  ``C < 2M``, else ``tau = M``.
* Two levels (memory tier): memory saves every ``tau``, every ``k``-th also persisted; a fraction
  ``p`` of failures recovers from memory. First-order expected waste, minimised over whole
  ``(steps, k)``; its optimum is Benoit et al. (2017)'s ``sqrt(2 lambda_1 C_1) + sqrt(2 lambda_2 C_2)``.
* Three tiers (memory tier with ``replicas``): the same saves, recovered from this host's memory
  after a process crash, from a replica in another host's memory after a node loss, from
  storage when every copy in memory is lost (:class:`FailureMix` says how often each happens).
  Its waste has the two-level form with ``p`` the share recovered from memory of any host and
  the replicas' cost added to every save (:func:`three_tier_overhead`).

References:
    J. W. Young, "A first order approximation to the optimum checkpoint interval",
    Communications of the ACM 17(9):530-531, 1974. doi:10.1145/361147.361115
    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    Future Generation Computer Systems 22(3):303-312, 2006. doi:10.1016/j.future.2004.11.016
    N. H. Vaidya, "Impact of checkpoint latency on overhead ratio of a checkpointing scheme",
    IEEE Transactions on Computers 46(8):942-947, 1997. doi:10.1109/12.609281
    A. Benoit, A. Cavelan, V. Le Fevre, Y. Robert, H. Sun, "Towards optimal multi-level
    checkpointing", IEEE Transactions on Computers 66(7):1212-1226, 2017.
    doi:10.1109/TC.2016.2643660
    S. Di, M. S. Bouguerra, L. Bautista-Gomez, F. Cappello, "Optimization of multi-level
    checkpoint model for large scale HPC applications", IPDPS 2014. doi:10.1109/IPDPS.2014.122
"""

from __future__ import annotations

import bisect
import enum
import math
import statistics
from collections import deque
from dataclasses import dataclass

from zerostall.errors import AdviceError

__all__ = [
    # AdviceError, raised here, is in zerostall.errors with every error class
    "SaveCost",
    "MeasuredCosts",
    "ReplicaCost",
    "FailureMix",
    "Model",
    "Advice",
    "TierAdvice",
    "advise",
    "young_interval",
    "daly_interval",
    "one_level_overhead",
    "two_level_overhead",
    "three_tier_overhead",
    "steps_for",
    "mtbf_from_restarts",
    "CadenceEstimator",
    "SaveKind",
    "AutoInterval",
    "DEFAULT_MEMORY_FRACTION",
    "DEFAULT_FAILURE_MIX",
]

_MAX_PERSIST_EVERY = 1_000_000


# -- inputs and outputs ------------------------------------------------------------------------


def _check(value: float, key: str, *, positive: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        bound = "> 0" if positive else ">= 0"
        raise AdviceError(f"{key} must be a finite number {bound}, got {value!r}", key=key)
    return v


def _check_share(value: float, key: str) -> float:
    """A share of failures: a finite number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AdviceError(f"{key} must be a number in [0, 1], got {value!r}", key=key)
    v = float(value)
    if not 0.0 <= v <= 1.0:  # NaN fails both comparisons
        raise AdviceError(f"{key} must be a number in [0, 1], got {value!r}", key=key)
    return v


@dataclass(frozen=True, kw_only=True)
class SaveCost:
    """What one kind of save costs, per save, in seconds.

    Attributes:
        blocked_s: the training thread was blocked in the save call.
        background_s: training time lost while the save ran in the background (the slowdown
            of the iterations that overlapped it, summed).
        durable_s: from the save's start until it could be restored after a failure (on storage
            for a persisted save, in host memory for a memory-only one): its latency.
        restore_s: from a failure until training runs again when recovering from this kind of
            save (relaunch plus restore); 0 when unknown. It moves the overhead, not the interval.

    ``cost_s`` (blocked plus background) is what a save takes from training.

    Raises:
        AdviceError: a value is negative or not finite.

    Example::

        >>> SaveCost(blocked_s=0.1, background_s=2.0, durable_s=60.0).cost_s
        2.1
    """

    blocked_s: float
    background_s: float
    durable_s: float
    restore_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("blocked_s", "background_s", "durable_s", "restore_s"):
            object.__setattr__(self, name, _check(getattr(self, name), name))

    @property
    def cost_s(self) -> float:
        return self.blocked_s + self.background_s


@dataclass(frozen=True, kw_only=True)
class ReplicaCost:
    """What one replica of a rank's state in another host's memory costs (``MemoryTier(replicas=k)``
    pays it ``k`` times). Times in seconds, per save unless said otherwise.

    Attributes:
        background_s: training time lost while one replica is sent (the slowdown of the
            iterations that overlap the send, summed); 0 when unmeasured, or when
            ``MeasuredCosts.memory`` was measured with the replicas on and already counts it.
        send_s: from the save being held in this host's memory until one replica holds it too.
            ``k`` replicas leave over the same host link, so the last is held ``k * send_s``
            later; that is the latency of the copies that survive a node loss.
        fetch_s: after a node loss, the time a rank on a new host takes to fetch its state from
            a peer, on top of ``MeasuredCosts.memory.restore_s``.
        host_bytes: host memory one replica takes on the host that holds it: with zerostall's
            keepers two copies of the rank's state (the bytes a save stages): the newest replica
            and the buffers the next one arrives into (one with ``MemoryTier(replicas_in_place=True)``);
            None when unknown.

    Raises:
        AdviceError: a time is negative or not finite, or ``host_bytes`` is not an int >= 0.

    Example::

        >>> r = ReplicaCost(send_s=4.0, fetch_s=8.0, host_bytes=4 << 30)
        >>> r.background_s, r.host_bytes // (1 << 30)
        (0.0, 4)
    """

    background_s: float = 0.0
    send_s: float = 0.0
    fetch_s: float = 0.0
    host_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("background_s", "send_s", "fetch_s"):
            object.__setattr__(self, name, _check(getattr(self, name), name))
        if self.host_bytes is not None:
            _check_count(self.host_bytes, "host_bytes", minimum=0)


@dataclass(frozen=True, kw_only=True)
class MeasuredCosts:
    """The costs the advisor works from: the iteration time and what each kind of save costs.

    Attributes:
        step_s: seconds per training iteration with no save in flight.
        persisted: a save that reaches storage (every save when the memory tier is off).
        memory: a memory-only save (the memory tier); ``None`` when there is no memory tier.
        replica: what each replica in another host's memory adds to a save and to a recovery
            (the memory tier's ``replicas``); ``None`` when unmeasured: with ``replicas >= 1``
            the advisor then takes replicas as free and says so in ``caveats``.

    Raises:
        AdviceError: ``step_s`` is not a finite number > 0.

    Example::

        >>> MeasuredCosts(step_s=10.0, persisted=SaveCost(blocked_s=0.1, background_s=2.0,
        ...                                                durable_s=60.0)).memory is None
        True
    """

    step_s: float
    persisted: SaveCost
    memory: SaveCost | None = None
    replica: ReplicaCost | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_s", _check(self.step_s, "step_s", positive=True))


@dataclass(frozen=True, kw_only=True)
class FailureMix:
    """What a job's failures take with them, as shares of all its failures.

    Attributes:
        crash: the training processes die, their hosts live on with their memory (a software
            bug, an NCCL timeout): recovery from this host's memory tier.
        node_loss: one host leaves the job, its memory with it (a failed GPU or HBM, a host
            part, unplanned maintenance): recovery from a replica in another host's memory when
            ``replicas >= 1``, else from storage.

    The rest, :attr:`memory_lost` ``= 1 - crash - node_loss``, loses every copy in host memory
    (several hosts at once, such as a switch and the hosts behind it, or a restart on other
    machines): recovery from storage. docs/advice.md gives the default's source.

    Raises:
        AdviceError: a share is not a number in ``[0, 1]`` (key ``failure_mix.crash`` or
            ``failure_mix.node_loss``), or the two add up to more than 1 (key ``failure_mix``).

    Example::

        >>> round(FailureMix(crash=0.2, node_loss=0.7).memory_lost, 2)
        0.1
    """

    crash: float
    node_loss: float

    def __post_init__(self) -> None:
        c = _check_share(self.crash, "failure_mix.crash")
        n = _check_share(self.node_loss, "failure_mix.node_loss")
        if c + n > 1.0 + 1e-9:
            raise AdviceError(f"failure_mix: crash + node_loss must be at most 1, got {c!r} + {n!r}",
                              key="failure_mix")
        object.__setattr__(self, "crash", c)
        object.__setattr__(self, "node_loss", min(n, 1.0 - c))

    @property
    def memory_lost(self) -> float:
        """Share of failures that lose every copy in host memory: only storage has the state."""
        return max(0.0, 1.0 - self.crash - self.node_loss)


_LLAMA3_HARDWARE_SHARE = 0.78
"""Llama 3 405B pre-training, 54 days on 16,384 H100 GPUs: of 419 unexpected interruptions,
about 78% were attributed to confirmed or suspected hardware issues (GPUs 58.7%)."""
_LLAMA3_SWITCH_CABLE_SHARE = 35 / 419
"""The same run: 35 of the 419 were a network switch or cable (8.4%)."""

DEFAULT_FAILURE_MIX = FailureMix(crash=1.0 - _LLAMA3_HARDWARE_SHARE,
                                 node_loss=_LLAMA3_HARDWARE_SHARE - _LLAMA3_SWITCH_CABLE_SHARE)
"""The failure mix of Llama 3's 54-day run (Llama Team, "The Llama 3 Herd of Models", 2024,
table 5): 419 unexpected interruptions, about 78% attributed to hardware, 22% not (software
bugs and other causes). docs/advice.md says what each share counts.

* ``crash`` = 0.22: the failures that are not hardware; a restart on the same hosts finds
  their memory intact.
* ``node_loss`` = 0.78 - 35/419 = 0.696: the other hardware failures take their host out of the
  job (a faulty GPU, HBM3, SRAM, a host part); one host at a time, so a replica on another
  host survives.
* ``memory_lost`` = 35/419 = 0.084: a network switch or cable. A switch cuts off every host
  behind it, which with replicas placed on a neighbouring host often include the replica's
  holder; counted as losing every copy in memory (cautious: a cable takes one host).
"""

DEFAULT_MEMORY_FRACTION = DEFAULT_FAILURE_MIX.crash
"""Share of failures a restart on the same hosts fixes, so that host memory survives them:
:data:`DEFAULT_FAILURE_MIX`'s ``crash`` (0.22, Llama 3's non-hardware interruptions). With no
replicas the rest recover from storage, as in :data:`DEFAULT_FAILURE_MIX`. Fleets differ
(DLRover reports "about 75% of the faults could be recovered by restarting the training
process"): pass the fraction your restarts show.
"""


class Model(enum.Enum):
    """Which model chose the interval."""

    YOUNG = "young"  # first order, one level
    DALY = "daly"  # higher order under exponential failures, one level
    TWO_LEVEL = "two_level"  # first order, memory saves plus every k-th persisted (with replicas: three tiers)


@dataclass(frozen=True, kw_only=True)
class TierAdvice:
    """One tier's part of an :class:`Advice`: how often it receives a save and what a failure
    that recovers from it loses.

    Attributes:
        tier: ``"memory"`` (this host's memory: a process crash), ``"peer"`` (a replica in
            another host's memory: a node loss, with ``replicas >= 1``) or ``"storage"``.
        interval_steps: steps between two saves this tier receives (memory and peer: every
            save; storage: every ``persist_every``-th).
        interval_s: wall-clock seconds between those saves.
        failure_share: share of the failures that recover from this tier.
        work_lost_s: expected training time redone per such failure: the tier's latency plus
            half its interval to first order (the one-level Daly model: its exact mean).
        restore_s: time from such a failure until training runs again.
    """

    tier: str
    interval_steps: int
    interval_s: float
    failure_share: float
    work_lost_s: float
    restore_s: float


@dataclass(frozen=True, kw_only=True)
class Advice:
    """How often to save, and what that is expected to cost.

    Attributes:
        model: the model that chose the interval.
        interval_steps: save every this many steps (>= 1).
        interval_s: wall-clock seconds between the starts of two saves at that interval
            (iterations plus the training time the save takes).
        persist_every: every this many saves is persisted (1: all of them; > 1 only with the
            memory tier, the others stay in host memory).
        overhead: expected fraction of the run's wall-clock time lost to saving, to work redone
            after failures and to restarts.
        save_overhead: the part of ``overhead`` that saving costs when nothing fails.
        work_lost_s: expected training time redone per failure (time since the newest save that
            survived it, including that save's latency).
        restore_s: expected time from a failure until training runs again (the costs' restore).
        mtbf_s: the mean time between failures used.
        memory_fraction: share of failures recoverable from host memory, this host's or (with
            replicas) another's (two levels only).
        costs: the measured costs used.
        caveats: where the inputs leave the model's range or a bound changed the optimum.
        replicas: copies of each rank's state in other hosts' memory (``MemoryTier.replicas``).
        tiers: per tier that a failure can recover from (``memory``, ``peer`` with replicas,
            ``storage``), its interval and expected loss (:class:`TierAdvice`); the failure
            shares add up to 1 and ``work_lost_s`` / ``restore_s`` are their weighted sums.
        replica_host_bytes: extra host memory the replicas take per rank, summed over the
            hosts that hold them: ``replicas`` copies of the rank's state
            (``replicas * costs.replica.host_bytes``); 0 without replicas, None when the
            state's size is not known.
    """

    model: Model
    interval_steps: int
    interval_s: float
    persist_every: int
    overhead: float
    save_overhead: float
    work_lost_s: float
    restore_s: float
    mtbf_s: float
    memory_fraction: float | None
    costs: MeasuredCosts
    caveats: tuple[str, ...] = ()
    replicas: int = 0
    tiers: tuple[TierAdvice, ...] = ()
    replica_host_bytes: int | None = 0

    def tier(self, name: str) -> TierAdvice | None:
        """The :class:`TierAdvice` of ``name`` (``"memory"``, ``"peer"``, ``"storage"``), None
        when no failure recovers from that tier."""
        return next((t for t in self.tiers if t.tier == name), None)

    def summary(self) -> str:
        """One line for a log, e.g. ``save every 21 steps (212 s); ...``."""
        s = f"save every {self.interval_steps} steps ({self.interval_s:.0f} s)"
        if self.persist_every > 1:
            s += f", persisting every {self.persist_every} saves"
        if self.replicas:
            s += f", {self.replicas} {'replica' if self.replicas == 1 else 'replicas'} in other hosts' memory"
            if self.replica_host_bytes:
                s += f" (+{self.replica_host_bytes / 2**30:.3g} GiB per rank)"
        s += (f"; expected overhead {self.overhead:.2%}, work lost per failure {self.work_lost_s:.0f} s"
              f" ({self.model.value}, MTBF {self.mtbf_s / 3600:.2f} h)")
        return s


# -- the models --------------------------------------------------------------------------------


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: training seconds between saves, ``sqrt(2 C M)``.

    Young (1974) minimises the first-order expected waste ``C / tau + tau / 2M``. Accurate
    while ``C << M``.

    Raises:
        AdviceError: ``cost_s`` < 0 or ``mtbf_s`` <= 0 (or either not finite).

    Example::

        >>> round(young_interval(2.0, 10_000.0), 1)
        200.0
    """
    c = _check(cost_s, "cost_s")
    m = _check(mtbf_s, "mtbf_s", positive=True)
    return math.sqrt(2.0 * c * m)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum: training seconds between saves.

    Daly (2006, eq. 37) expands the optimum of the expected run time under exponential
    failures, ``M e^(R/M) (e^((tau + C)/M) - 1) / tau`` per unit of work:
    ``tau = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C`` for ``C < 2M``; beyond
    that range the series fails and Daly's answer is ``tau = M``. The restart time ``R`` (and a
    latency, see :func:`one_level_overhead`) scale that cost by a constant and do not move it.

    Raises:
        AdviceError: ``cost_s`` < 0 or ``mtbf_s`` <= 0 (or either not finite).

    Example::

        >>> round(daly_interval(2.0, 10_000.0), 1)
        198.7
    """
    c = _check(cost_s, "cost_s")
    m = _check(mtbf_s, "mtbf_s", positive=True)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def one_level_overhead(work_s: float, save: SaveCost, mtbf_s: float, *, model: Model = Model.DALY) -> float:
    """Expected fraction of wall-clock time lost with a save every ``work_s`` training seconds.

    With ``C`` = ``save.cost_s``, ``L`` = ``save.durable_s``, ``R`` = ``save.restore_s``,
    ``P = work_s + C``:

    * ``Model.DALY``, exact under exponential failures: ``1 - work_s / E`` with
      ``E = M e^((R + L)/M) (e^(P/M) - 1)`` the expected wall time per save period. Derivation
      (docs/advice.md): from the moment one save becomes durable, the next must be reached;
      a failure after ``u < P`` loses ``L + u`` (the save in flight is not durable), and after
      a restart the job needs ``P + L`` failure-free seconds, the restored save being durable
      already. With ``L = 0`` this is Daly's (2006) model; ``e^(L/M)`` is a constant factor,
      so the optimal interval does not depend on the latency (Vaidya 1997).
    * ``Model.YOUNG``, first order: ``C / P + (R + L + P / 2) / M``.

    Raises:
        AdviceError: ``work_s`` < 0, ``mtbf_s`` <= 0, or ``model`` is ``TWO_LEVEL``.

    Example::

        >>> s = SaveCost(blocked_s=0.0, background_s=2.0, durable_s=0.0)
        >>> round(one_level_overhead(198.0, s, 10_000.0, model=Model.YOUNG), 4)
        0.02
    """
    w = _check(work_s, "work_s")
    m = _check(mtbf_s, "mtbf_s", positive=True)
    p = w + save.cost_s
    if model is Model.YOUNG:
        if p == 0:
            return (save.restore_s + save.durable_s) / m
        return save.cost_s / p + (save.restore_s + save.durable_s + p / 2.0) / m
    if model is Model.DALY:
        if w == 0:
            return 1.0
        expected = m * math.exp((save.restore_s + save.durable_s) / m) * math.expm1(p / m)
        return 1.0 - w / expected
    raise AdviceError("one_level_overhead takes Model.YOUNG or Model.DALY", key="model")


def two_level_overhead(work_s: float, persist_every: int, costs: MeasuredCosts, mtbf_s: float,
                       memory_fraction: float) -> float:
    """First-order expected waste of memory saves every ``work_s`` training seconds, every
    ``persist_every``-th of them also persisted.

    One cycle of ``k = persist_every`` saves lasts ``P = k work_s + A`` wall seconds, with
    ``A = (k - 1) C_m + C_p`` the training time its saves take (``C_m`` a memory-only save's
    cost, ``C_p`` a persisted save's). A fraction ``p`` of the failures recovers from the newest
    save in memory (it loses ``L_m + P / 2k`` on average, then ``R_m`` to restart); the others
    from the newest persisted save (``L_p + P / 2``, then ``R_p``). The waste is
    ``A / P + [p (R_m + L_m + P / 2k) + (1 - p)(R_p + L_p + P / 2)] / M``
    (first order, as in Young; the multi-level form of Benoit et al. 2017 and Di et al. 2014).
    It is :func:`three_tier_overhead` without replicas, ``crash = p``.

    Raises:
        AdviceError: ``costs.memory`` is None, ``persist_every`` < 1, ``memory_fraction``
            outside ``[0, 1)``, ``work_s`` < 0, or ``mtbf_s`` <= 0.

    Example::

        >>> c = MeasuredCosts(step_s=1.0, persisted=SaveCost(blocked_s=0.0, background_s=2.0, durable_s=0.0),
        ...                   memory=SaveCost(blocked_s=0.0, background_s=0.0, durable_s=0.0))
        >>> round(two_level_overhead(99.0, 2, c, 10_000.0, 0.5), 4)
        0.0175
    """
    p = _check_fraction(memory_fraction)
    return three_tier_overhead(work_s, persist_every, costs, mtbf_s,
                               failure_mix=FailureMix(crash=p, node_loss=1.0 - p), replicas=0)


def three_tier_overhead(work_s: float, persist_every: int, costs: MeasuredCosts, mtbf_s: float, *,
                        failure_mix: FailureMix = DEFAULT_FAILURE_MIX, replicas: int = 0) -> float:
    """First-order expected waste of memory saves every ``work_s`` training seconds, each also
    held by ``replicas`` other hosts, every ``persist_every``-th also persisted.

    With ``r = replicas``, ``B``, ``S``, ``F`` a replica's background cost, send time and fetch
    time (``costs.replica``; zero when None), every save costs ``r B`` more: one cycle of
    ``k = persist_every`` saves lasts ``P = k work_s + A``, ``A = (k - 1)(C_m + r B) + C_p + r B``.
    With ``c``, ``n``, ``s`` the shares of crashes, node losses and failures that lose all host
    memory (``failure_mix``), a failure loses on average

    * a crash: ``R_m + L_m + P / 2k`` (the newest save in this host's memory);
    * a node loss, ``r >= 1``: ``R_m + F + L_m + r S + P / 2k`` (the newest save a peer holds);
      ``r = 0``: ``R_p + L_p + P / 2`` (the newest persisted save);
    * the rest: ``R_p + L_p + P / 2``.

    The waste is ``A / P`` plus the expected loss over ``M``. With ``q`` the share recovered from
    memory (``c``, plus ``n`` with replicas) it is the two-level waste with ``p = q``:
    ``A / P + [sum of share x (R + L) + P (q / 2k + (1 - q) / 2)] / M`` (docs/advice.md).

    Raises:
        AdviceError: ``costs.memory`` is None, ``persist_every`` < 1, ``replicas`` < 0,
            ``work_s`` < 0, ``mtbf_s`` <= 0, or ``failure_mix`` is not a :class:`FailureMix`.

    Example::

        >>> c = MeasuredCosts(step_s=1.0, persisted=SaveCost(blocked_s=0.0, background_s=2.0, durable_s=0.0),
        ...                   memory=SaveCost(blocked_s=0.0, background_s=0.0, durable_s=0.0))
        >>> mix = FailureMix(crash=0.25, node_loss=0.5)
        >>> round(three_tier_overhead(99.0, 2, c, 10_000.0, failure_mix=mix, replicas=0), 5)
        0.01875
        >>> round(three_tier_overhead(99.0, 2, c, 10_000.0, failure_mix=mix, replicas=1), 5)
        0.01625
    """
    w = _check(work_s, "work_s")
    m = _check(mtbf_s, "mtbf_s", positive=True)
    k = _check_count(persist_every, "persist_every")
    plan = _Tiers.of(costs, _check_mix(failure_mix), _check_count(replicas, "replicas", minimum=0))
    return plan.waste(w, k, m)


@dataclass(frozen=True)
class _Tiers:
    """The constants of the tiered waste for one ``(costs, failure mix, replicas)``."""

    cm: float  # a memory-only save's cost, replicas included
    cp: float  # a persisted save's cost, replicas included
    q: float  # share of failures recovered from memory (this host's or a peer's)
    lost: float  # sum over tiers of share x (restart + latency)
    memory_floor_s: float  # the latency of the newest copy in memory that the memory tiers rely on
    persist_floor_s: float
    # per tier: (name, share, latency, restore, every k-th save), in recovery order
    tiers: tuple[tuple[str, float, float, float, bool], ...]

    @staticmethod
    def of(costs: MeasuredCosts, mix: FailureMix, replicas: int) -> _Tiers:
        mem, per = _memory_costs(costs), costs.persisted
        rep = costs.replica if costs.replica is not None else ReplicaCost()
        extra = replicas * rep.background_s
        peer_latency = mem.durable_s + replicas * rep.send_s
        memory_share = mix.crash
        peer_share = mix.node_loss if replicas else 0.0
        storage_share = 1.0 - memory_share - peer_share
        tiers = [("memory", memory_share, mem.durable_s, mem.restore_s, False)]
        if replicas:
            tiers.append(("peer", peer_share, peer_latency, mem.restore_s + rep.fetch_s, False))
        tiers.append(("storage", storage_share, per.durable_s, per.restore_s, True))
        lost = 0.0
        for _, share, latency, restore, _ in tiers:
            lost += share * (restore + latency)
        return _Tiers(cm=mem.cost_s + extra, cp=per.cost_s + extra, q=memory_share + peer_share, lost=lost,
                      memory_floor_s=peer_latency if replicas else mem.durable_s,
                      persist_floor_s=per.durable_s, tiers=tuple(tiers))

    def cycle_cost(self, k: int) -> float:
        return (k - 1) * self.cm + self.cp

    def waste(self, work_s: float, k: int, m: float) -> float:
        a = self.cycle_cost(k)
        cycle = k * work_s + a
        if cycle == 0:
            return self.lost / m
        return a / cycle + (self.lost + cycle * (self.q / (2.0 * k) + (1.0 - self.q) / 2.0)) / m


def _memory_costs(costs: MeasuredCosts) -> SaveCost:
    if costs.memory is None:
        raise AdviceError("two levels need the costs of memory-only saves (costs.memory is None)",
                          key="costs.memory")
    return costs.memory


def _check_fraction(memory_fraction: float) -> float:
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)):
        raise AdviceError(f"memory_fraction must be a number in [0, 1), got {memory_fraction!r}",
                          key="memory_fraction")
    p = float(memory_fraction)
    if not 0.0 <= p < 1.0:
        raise AdviceError(
            f"memory_fraction must be in [0, 1), got {memory_fraction!r} (with 1 no failure would "
            "ever need storage, and persisting could never pay)", key="memory_fraction")
    return p


def _check_mix(failure_mix: FailureMix) -> FailureMix:
    if not isinstance(failure_mix, FailureMix):
        raise AdviceError(f"failure_mix must be a FailureMix, got {failure_mix!r}", key="failure_mix")
    return failure_mix


def _resolve_mix(memory_fraction: float | None, failure_mix: FailureMix | None, replicas: int) -> FailureMix:
    """The failure mix that ``memory_fraction`` or ``failure_mix`` (at most one) says, else the default."""
    if failure_mix is not None and memory_fraction is not None:
        raise AdviceError("give memory_fraction or failure_mix, not both (memory_fraction=p is "
                          "FailureMix(crash=p, node_loss=1 - p))", key="failure_mix")
    if failure_mix is not None:
        return _check_mix(failure_mix)
    if memory_fraction is None:
        return DEFAULT_FAILURE_MIX
    p = _check_fraction(memory_fraction)
    if replicas:
        raise AdviceError(
            f"memory_fraction={memory_fraction!r} does not say which failures replicas cover: with "
            f"replicas={replicas}, give failure_mix=FailureMix(crash=, node_loss=) (the rest lose every "
            "copy in memory), or leave both out for DEFAULT_FAILURE_MIX", key="memory_fraction")
    return FailureMix(crash=p, node_loss=1.0 - p)


def _check_count(value: int, key: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AdviceError(f"{key} must be an int >= {minimum}, got {value!r}", key=key)
    return value


# -- choosing the interval ---------------------------------------------------------------------


def steps_for(seconds: float, *, step_s: float) -> int:
    """The whole number of steps nearest to ``seconds`` of training, at least 1.

    Raises:
        AdviceError: ``seconds`` < 0 or ``step_s`` <= 0 (or either not finite).

    Example::

        >>> steps_for(212.9, step_s=10.0), steps_for(0.0, step_s=10.0)
        (21, 1)
    """
    s = _check(seconds, "seconds")
    dt = _check(step_s, "step_s", positive=True)
    return max(1, round(s / dt))


def _rounded(tau: float, step_s: float, floor_steps: int) -> tuple[int, int]:
    """The whole step counts on either side of ``tau`` seconds, none below ``floor_steps``."""
    n = tau / step_s
    return max(floor_steps, math.floor(n)), max(floor_steps, math.ceil(n))


def advise(costs: MeasuredCosts, *, mtbf_s: float, memory_fraction: float | None = None,
           model: Model | None = None, failure_mix: FailureMix | None = None, replicas: int = 0) -> Advice:
    """The save interval that minimises the expected time lost, and what it costs.

    Args:
        costs: measured costs (:class:`CadenceEstimator` gives them for a running job).
        mtbf_s: mean time between failures of the whole job (a node's MTBF divided by the
            number of nodes, or :func:`mtbf_from_restarts`).
        memory_fraction: share of failures recoverable from this host's memory (two levels
            only), shorthand for ``failure_mix=FailureMix(crash=p, node_loss=1 - p)``; only
            without replicas.
        model: ``None`` picks ``TWO_LEVEL`` when ``costs.memory`` is given, else ``DALY``.
        failure_mix: the shares of process crashes, node losses and failures that lose every
            copy in memory (two levels only). Without it and ``memory_fraction``:
            :data:`DEFAULT_FAILURE_MIX` (Llama 3's).
        replicas: copies of each rank's state in other hosts' memory (``MemoryTier.replicas``):
            node losses then recover from a peer (three tiers); their cost is
            ``costs.replica``.

    The interval is a whole number of steps: of the two step counts around the model's optimum
    the one with the smaller expected overhead under that model (for two levels, the exact
    optimum over whole ``(steps, persist_every)``). Saves never start closer together than a
    save's latency (``durable_s``; with replicas, until the replicas hold it): with one staging
    slot (``SaveOptions.max_in_flight=1``) a save issued while the previous one is in flight
    blocks the training thread, and overlapping saves share the bandwidth the costs were
    measured with. ``caveats`` says when that bound moved the optimum or the inputs leave a
    model's range.

    Raises:
        AdviceError: ``mtbf_s`` <= 0 or not finite, ``memory_fraction`` outside ``[0, 1)``,
            both ``memory_fraction`` and ``failure_mix``, ``memory_fraction`` with replicas,
            ``replicas`` not an int >= 0, replicas without the memory tier's two-level model,
            a mix in which no failure needs storage, or ``TWO_LEVEL`` without ``costs.memory``.
            ``key`` names the argument.

    Example::

        >>> costs = MeasuredCosts(step_s=10.0,
        ...                       persisted=SaveCost(blocked_s=0.1, background_s=2.0, durable_s=60.0))
        >>> advise(costs, mtbf_s=3 * 3600.0, model=Model.YOUNG).interval_steps
        21
    """
    m = _check(mtbf_s, "mtbf_s", positive=True)
    r = _check_count(replicas, "replicas", minimum=0)
    mix = _resolve_mix(memory_fraction, failure_mix, r)
    if model is None:
        model = Model.TWO_LEVEL if costs.memory is not None else Model.DALY
    if model is Model.TWO_LEVEL:
        plan = _Tiers.of(costs, mix, r)
        if plan.q >= 1.0:
            raise AdviceError(
                f"no failure in the mix needs storage (crash {mix.crash:g}, node_loss {mix.node_loss:g}, "
                f"replicas {r}), so persisting could never pay: give a failure_mix with memory_lost > 0",
                key="memory_fraction" if memory_fraction is not None else "failure_mix")
        return _advise_two_levels(costs, m, plan, r)
    if r:
        why = ("costs.memory is None: replicas copy the memory tier's saves" if costs.memory is None
               else f"model {model.value} has one level; replicas need Model.TWO_LEVEL (or model=None)")
        raise AdviceError(f"replicas={r}: {why}", key="replicas")
    return _advise_one_level(costs, m, model)


def _advise_one_level(costs: MeasuredCosts, m: float, model: Model) -> Advice:
    save, dt = costs.persisted, costs.step_s
    c = save.cost_s
    caveats: list[str] = []
    if model is Model.YOUNG:
        tau = young_interval(c, m)
    else:
        tau = daly_interval(c, m)
        if c >= 2.0 * m:
            caveats.append(f"a save costs {c:.3g} s, at least twice the MTBF: Daly's fallback, save every MTBF")
    floor_steps = max(1, math.ceil((save.durable_s - c) / dt - 1e-9))
    n = min(_rounded(tau, dt, floor_steps), key=lambda k: (one_level_overhead(k * dt, save, m, model=model), k))
    if n == floor_steps > max(_rounded(tau, dt, 1)):
        caveats.append(f"interval raised to the save latency ({save.durable_s:.3g} s)")
    period = n * dt + c
    overhead = one_level_overhead(n * dt, save, m, model=model)
    if model is Model.YOUNG:
        lost = save.durable_s + period / 2.0
    else:  # mean time into a period of the failures that strike it, exponential failures
        lost = save.durable_s + (m - period / math.expm1(period / m) if period > 0 else 0.0)
    if overhead >= 1.0:
        caveats.append("expected overhead >= 100%: the first-order model is out of range")
    storage = TierAdvice(tier="storage", interval_steps=n, interval_s=period, failure_share=1.0, work_lost_s=lost,
                         restore_s=save.restore_s)
    return Advice(model=model, interval_steps=n, interval_s=period, persist_every=1,
                  overhead=min(overhead, 1.0), save_overhead=c / period if period > 0 else 0.0,
                  work_lost_s=lost, restore_s=save.restore_s, mtbf_s=m, memory_fraction=None,
                  costs=costs, caveats=tuple(caveats), tiers=(storage,))


def _advise_two_levels(costs: MeasuredCosts, m: float, plan: _Tiers, replicas: int) -> Advice:
    dt = costs.step_s
    p = plan.q
    cm, extra = plan.cm, max(plan.cp - plan.cm, 0.0)
    lost_const = plan.lost / m
    # Continuous optimum (docs/advice.md): k* = sqrt(extra p / (C_m (1 - p))); the waste at the
    # best period for a given k is lost_const + sqrt(2 g(k) / M), g convex with its minimum at k*.
    k_star = math.sqrt(extra * p / (cm * (1.0 - p))) if cm * (1.0 - p) > 0 else math.inf

    best: tuple[float, int, int] | None = None  # (waste, k, n)
    bound_moved = False
    k = 1
    while k <= _MAX_PERSIST_EVERY:
        a = plan.cycle_cost(k)
        slope = p / (2.0 * k) + (1.0 - p) / 2.0
        # Both bounds below hold for every n; from k* on both grow with k, so once either passes
        # the best waste found, no larger k can do better.
        unconstrained = lost_const + 2.0 * math.sqrt(a * slope / m)
        linear = lost_const + (1.0 - p) * (k * dt + a) / (2.0 * m)
        if best is not None and (linear > best[0] or (k >= k_star and unconstrained > best[0])):
            break
        # Saves no closer than their latency: the cycle >= L_p, a memory period >= the latency
        # of the memory copies recovered from (with replicas: until the replicas hold it).
        floor_steps = max(1, math.ceil((plan.persist_floor_s - a) / (k * dt) - 1e-9),
                          math.ceil((k * plan.memory_floor_s - a) / (k * dt) - 1e-9))
        tau = max(math.sqrt(a * m / slope) - a, 0.0) / k
        for n in sorted(set(_rounded(tau, dt, floor_steps))):
            w = plan.waste(n * dt, k, m)
            if best is None or w < best[0]:
                best = (w, k, n)
                bound_moved = n == floor_steps > max(_rounded(tau, dt, 1))
        k += 1
    assert best is not None
    waste, k, n = best
    mem = _memory_costs(costs)
    caveats = []
    if bound_moved:
        in_memory = (f"{plan.memory_floor_s:.3g} s until {replicas} {'replica holds' if replicas == 1 else 'replicas hold'} it"
                     if replicas else f"{mem.durable_s:.3g} s in memory")
        caveats.append(f"interval raised to the save latency ({costs.persisted.durable_s:.3g} s persisted, {in_memory})")
    if k == _MAX_PERSIST_EVERY:
        caveats.append(f"persist_every capped at {_MAX_PERSIST_EVERY}")
    if waste >= 1.0:
        caveats.append("expected overhead >= 100%: the first-order model is out of range")
    if replicas and costs.replica is None:
        caveats.append("replication not measured (costs.replica is None): taken as free, and the extra host memory "
                       "as unknown")
    a = plan.cycle_cost(k)
    cycle = k * n * dt + a
    tiers = tuple(
        TierAdvice(tier=name, interval_steps=n * k if persisted else n, interval_s=cycle if persisted else cycle / k,
                   failure_share=share, work_lost_s=latency + (cycle / 2.0 if persisted else cycle / (2.0 * k)),
                   restore_s=restore)
        for name, share, latency, restore, persisted in plan.tiers)
    work_lost = restore_s = 0.0
    for t in tiers:
        work_lost += t.failure_share * t.work_lost_s
        restore_s += t.failure_share * t.restore_s
    host_bytes: int | None = 0
    if replicas:
        per_copy = costs.replica.host_bytes if costs.replica is not None else None
        host_bytes = None if per_copy is None else replicas * per_copy
    return Advice(model=Model.TWO_LEVEL, interval_steps=n, interval_s=cycle / k, persist_every=k,
                  overhead=min(waste, 1.0), save_overhead=a / cycle, mtbf_s=m, memory_fraction=p,
                  work_lost_s=work_lost, restore_s=restore_s, costs=costs, caveats=tuple(caveats),
                  replicas=replicas, tiers=tiers, replica_host_bytes=host_bytes)


def mtbf_from_restarts(*, uptime_s: float, failures: int) -> float | None:
    """Mean time between failures revealed by a job's restarts: ``uptime_s / failures``.

    The maximum-likelihood estimate for exponential failures (SCR's ``scr_ckpt_interval.py``
    divides run time by starts the same way). With ``n`` failures its relative standard error
    is about ``1 / sqrt(n)``: prefer a user-given MTBF until a handful have been seen.
    Returns None when no failure has been seen.

    Raises:
        AdviceError: ``uptime_s`` < 0 or ``failures`` < 0.

    Example::

        >>> mtbf_from_restarts(uptime_s=54 * 86400.0, failures=419) // 60
        185.0
    """
    u = _check(uptime_s, "uptime_s")
    n = _check_count(failures, "failures", minimum=0)
    return u / n if n else None


# -- measuring the costs on the running job ----------------------------------------------------


@dataclass(frozen=True)
class _Interval:
    t0: float
    t1: float
    steps: int


@dataclass(frozen=True)
class _Save:
    blocked_s: float
    t_start: float
    t_durable: float
    persisted: bool


class CadenceEstimator:
    """Estimates a running job's :class:`MeasuredCosts` from the times of its steps and saves.

    Feed it ``observe_step(step, t)`` after every step and ``observe_save(...)`` once a save is
    durable, with times from one monotonic clock. It keeps the last ``window_steps`` step
    intervals and saves, and at query time:

    * the iteration time is the median per-step duration of the intervals that no save
      overlapped;
    * a save's background cost is the excess of the intervals overlapping it
      (``duration - steps x iteration time``, summed) minus its blocked time: the training
      time it took beyond blocking the caller. Saves whose overlapping intervals touch each
      other share their excess equally (or are left out when memory and persisted saves mix);
    * each cost is the median over the last ``window_saves`` saves of its kind, so that a
      stray slow iteration (evaluation, a data-loader stall) does not move it.

    A save counts once the steps observed cover it; intervals of a save that is still in flight
    count as clean until it is observed (the median shrugs off that one window). Not
    thread-safe: the caller serialises the calls.

    Example::

        >>> est = CadenceEstimator(min_clean_steps=2, min_saves=1)
        >>> for s in range(6):
        ...     est.observe_step(s, 10.0 * s)
        >>> est.observe_save(5, blocked_s=0.5, t_start=50.0, t_durable=75.0)
        >>> for s, t in [(6, 61.0), (7, 72.0), (8, 82.5), (9, 92.5)]:
        ...     est.observe_step(s, t)
        >>> c = est.costs()
        >>> c.step_s, c.persisted.blocked_s, round(c.persisted.background_s, 3), c.persisted.durable_s
        (10.0, 0.5, 2.0, 25.0)
    """

    def __init__(self, *, window_steps: int = 512, window_saves: int = 16, min_clean_steps: int = 8,
                 min_saves: int = 3) -> None:
        for key, v in (("window_steps", window_steps), ("window_saves", window_saves),
                       ("min_clean_steps", min_clean_steps), ("min_saves", min_saves)):
            _check_count(v, key)
        self.window_saves = window_saves
        self.min_clean_steps = min_clean_steps
        self.min_saves = min_saves
        self._intervals: deque[_Interval] = deque(maxlen=window_steps)
        self._saves: deque[_Save] = deque(maxlen=window_steps)
        self._restores: dict[bool, deque[float]] = {True: deque(maxlen=window_saves),
                                                    False: deque(maxlen=window_saves)}
        self._last: tuple[int, float] | None = None
        self._last_t = -math.inf
        self._uncovered: list[float] = []  # durable times of saves no observed step has reached
        self.version = 0
        """Bumped by every observation that can change :meth:`costs` other than a step."""

    def observe_step(self, step: int, t: float) -> None:
        """Step ``step`` ended at time ``t``. A step not above the previous one (a reload)
        starts a new stretch: no interval spans the two.

        Raises:
            AdviceError: ``t`` is not finite or is earlier than a time observed before.
        """
        t = self._check_time(t, "t")
        if self._last is not None and step > self._last[0]:
            self._intervals.append(_Interval(self._last[1], t, step - self._last[0]))
        self._last = (step, t)
        if self._uncovered and min(self._uncovered) <= t:  # a save's cost can now be measured
            self._uncovered = [td for td in self._uncovered if td > t]
            self.version += 1

    def observe_save(self, step: int, blocked_s: float, t_start: float, t_durable: float, *,
                     persisted: bool = True) -> None:
        """The save of ``step`` started at ``t_start``, blocked its caller ``blocked_s`` seconds
        and was durable at ``t_durable`` (in host memory for a memory-only save,
        ``persisted=False``). Call it once per save, when it is durable.

        Raises:
            AdviceError: a value is not finite or negative, or ``t_durable`` is earlier than
                the end of the blocked part.
        """
        b = _check(blocked_s, "blocked_s")
        ts, td = float(t_start), float(t_durable)
        if not (math.isfinite(ts) and math.isfinite(td)) or td < ts + b - 1e-9:
            raise AdviceError(
                f"save of step {step}: durable at {t_durable!r} before its blocked part ended "
                f"({t_start!r} + {blocked_s!r})", key="t_durable")
        self._saves.append(_Save(b, ts, td, bool(persisted)))
        if td > self._last_t:
            self._uncovered.append(td)
        self.version += 1

    def observe_restore(self, restore_s: float, *, persisted: bool = True) -> None:
        """Training ran again ``restore_s`` seconds after a failure, recovering from storage
        (``persisted=True``) or from host memory.

        Raises:
            AdviceError: ``restore_s`` is negative or not finite.
        """
        self._restores[bool(persisted)].append(_check(restore_s, "restore_s"))
        self.version += 1

    def _check_time(self, t: float, key: str) -> float:
        v = float(t)
        if not math.isfinite(v) or v < self._last_t:
            raise AdviceError(f"{key} must be finite and never decrease (a monotonic clock), "
                              f"got {t!r} after {self._last_t!r}", key=key)
        self._last_t = v
        return v

    # -- queries -------------------------------------------------------------------------------

    def step_s(self) -> float | None:
        """Median seconds per step with no save in flight; None before ``min_clean_steps``."""
        return self._analyse()[0]

    def saves_observed(self, *, persisted: bool = True) -> int:
        """How many saves of this kind are in the window."""
        return sum(1 for s in self._saves if s.persisted == persisted)

    def slowdown(self, *, persisted: bool = True) -> float | None:
        """Median fraction of training time lost while a save of this kind runs in the
        background (its background cost over its background duration); None if unmeasured."""
        ratios = [lost / (s.t_durable - s.t_start - s.blocked_s)
                  for s, lost in self._samples(persisted, self._analyse()[1])
                  if s.t_durable - s.t_start - s.blocked_s > 0]
        return max(0.0, statistics.median(ratios)) if ratios else None

    def costs(self) -> MeasuredCosts | None:
        """The measured costs, or None until ``min_clean_steps`` clean intervals and
        ``min_saves`` covered persisted saves have been seen. ``memory`` is None until
        ``min_saves`` memory-only saves have been."""
        step_s, lost = self._analyse()
        if step_s is None or step_s <= 0:
            return None
        persisted = self._cost(True, lost)
        if persisted is None:
            return None
        return MeasuredCosts(step_s=step_s, persisted=persisted, memory=self._cost(False, lost))

    def _cost(self, persisted: bool, lost: dict[int, float]) -> SaveCost | None:
        samples = self._samples(persisted, lost)
        if len(samples) < self.min_saves:
            return None
        restores = self._restores[persisted]
        return SaveCost(
            blocked_s=statistics.median(s.blocked_s for s, _ in samples),
            background_s=max(0.0, statistics.median(x for _, x in samples)),
            durable_s=statistics.median(s.t_durable - s.t_start for s, _ in samples),
            restore_s=statistics.median(restores) if restores else 0.0)

    def _samples(self, persisted: bool, lost: dict[int, float]) -> list[tuple[_Save, float]]:
        """The last ``window_saves`` measured saves of a kind, each with its background cost."""
        kind = [(s, lost[i]) for i, s in enumerate(self._saves) if s.persisted == persisted and i in lost]
        return kind[-self.window_saves:]

    def _analyse(self) -> tuple[float | None, dict[int, float]]:
        """Baseline seconds per step, and background cost by index into ``_saves``."""
        ivs = list(self._intervals)
        ends = [iv.t1 for iv in ivs]
        touching: list[list[int]] = []  # per save, indices of the intervals it overlaps
        covered: list[bool] = []
        busy: set[int] = set()
        for s in self._saves:
            first = bisect.bisect_right(ends, s.t_start)
            hit = []
            j = first
            while j < len(ivs) and ivs[j].t0 < s.t_durable:
                hit.append(j)
                j += 1
            touching.append(hit)
            busy.update(hit)
            covered.append(bool(ivs) and ivs[0].t0 <= s.t_start and ivs[-1].t1 >= s.t_durable)
        clean = [(iv.t1 - iv.t0) / iv.steps for j, iv in enumerate(ivs) if j not in busy]
        if len(clean) < self.min_clean_steps:
            return None, {}
        base = statistics.median(clean)
        lost: dict[int, float] = {}
        for group in _groups(touching):
            saves = [self._saves[i] for i in group]
            if not all(covered[i] for i in group) or len({s.persisted for s in saves}) > 1:
                continue
            hit = sorted({j for i in group for j in touching[i]})
            excess = sum(ivs[j].t1 - ivs[j].t0 - base * ivs[j].steps for j in hit)
            share = (excess - sum(s.blocked_s for s in saves)) / len(group)
            lost.update((i, share) for i in group)
        return base, lost


def _groups(touching: list[list[int]]) -> list[list[int]]:
    """Saves linked by a shared interval, transitively (their excess cannot be told apart)."""
    owner: dict[int, int] = {}  # interval -> group id
    parent = list(range(len(touching)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, hit in enumerate(touching):
        for j in hit:
            if j in owner:
                parent[root(i)] = root(owner[j])
            else:
                owner[j] = i
    out: dict[int, list[int]] = {}
    for i in range(len(touching)):
        out.setdefault(root(i), []).append(i)
    return list(out.values())


# -- save_interval="auto" -----------------------------------------------------------------------


class SaveKind(enum.Enum):
    """What :meth:`AutoInterval.decide` asks for at a step."""

    MEMORY = "memory"  # a memory-only save (memory tier)
    PERSIST = "persist"  # a save that reaches storage


class AutoInterval:
    """The rule behind ``save_interval="auto"``: measure first, then follow :func:`advise`.

    Call :meth:`decide` once per step, after feeding the step to the estimator.

    * Warm-up, until the estimator has costs (and, with ``memory_tier``, memory-save costs):
      a save starts only when nothing is in flight and ``clean_steps`` steps have passed with
      nothing in flight since the last one, and at least ``initial_interval_steps`` after it.
      So the iteration time without saves and each save's cost can be measured, and no save
      waits on another. The first save comes after ``clean_steps`` steps. With the memory
      tier, warm-up alternates persisted and memory-only saves (persisted first).
    * Then: a save every ``advice.interval_steps`` steps, every ``advice.persist_every``-th
      persisted, the advice recomputed whenever a new save or restore has been observed. A due
      save waits while ``max_in_flight`` saves are in flight (it would block training).

    With the memory tier, ``failure_mix`` (or ``memory_fraction``, its shorthand without
    replicas; default :data:`DEFAULT_FAILURE_MIX`) and ``replicas`` go to :func:`advise`.

    Raises:
        AdviceError: a value out of range (``key`` names it), ``Model.TWO_LEVEL`` or
            ``replicas >= 1`` without ``memory_tier``, or ``memory_fraction`` with replicas.

    Example::

        >>> est, auto = CadenceEstimator(), AutoInterval(mtbf_s=3 * 3600.0, clean_steps=2)
        >>> [auto.decide(s, est) for s in range(4)]
        [None, None, <SaveKind.PERSIST: 'persist'>, None]
    """

    def __init__(self, *, mtbf_s: float, memory_tier: bool = False,
                 memory_fraction: float | None = None, model: Model | None = None,
                 initial_interval_steps: int = 1, clean_steps: int = 8, max_in_flight: int = 1,
                 failure_mix: FailureMix | None = None, replicas: int = 0) -> None:
        self.mtbf_s = _check(mtbf_s, "mtbf_s", positive=True)
        self.replicas = _check_count(replicas, "replicas", minimum=0)
        self.failure_mix = _resolve_mix(memory_fraction, failure_mix, self.replicas)
        """The failure mix the advice uses (``memory_fraction`` p is ``FailureMix(crash=p, node_loss=1 - p)``)."""
        self.memory_fraction = self.failure_mix.crash
        for key, v in (("initial_interval_steps", initial_interval_steps), ("clean_steps", clean_steps),
                       ("max_in_flight", max_in_flight)):
            _check_count(v, key)
        if model is Model.TWO_LEVEL and not memory_tier:
            raise AdviceError("Model.TWO_LEVEL needs memory_tier=True", key="model")
        if self.replicas and not (memory_tier and model in (None, Model.TWO_LEVEL)):
            raise AdviceError(f"replicas={self.replicas} needs memory_tier=True and the two-level model",
                              key="replicas")
        self.memory_tier = memory_tier
        self.model = model
        self.initial_interval_steps = initial_interval_steps
        self.clean_steps = clean_steps
        self.max_in_flight = max_in_flight
        self._advice: Advice | None = None
        self._version = -1
        self._last_save: int | None = None
        self._quiet = 0  # steps with nothing in flight since the last save
        self._since_persist = 0  # memory-only saves since the last persisted one
        self._warmup_saves = {SaveKind.MEMORY: 0, SaveKind.PERSIST: 0}

    @property
    def advice(self) -> Advice | None:
        """The advice being followed; None during warm-up."""
        return self._advice

    def decide(self, step: int, estimator: CadenceEstimator, *, in_flight: int = 0) -> SaveKind | None:
        """Whether to save at ``step`` and which kind; ``in_flight``: saves not yet durable."""
        if in_flight == 0:
            self._quiet += 1
        if estimator.version != self._version:
            self._version = estimator.version
            costs = estimator.costs()
            needs_memory = self.memory_tier and self.model in (None, Model.TWO_LEVEL)
            if costs is not None and (costs.memory is not None or not needs_memory):
                m = self.model or (Model.TWO_LEVEL if self.memory_tier else Model.DALY)
                self._advice = advise(costs, mtbf_s=self.mtbf_s, failure_mix=self.failure_mix, model=m,
                                      replicas=self.replicas)
        since = math.inf if self._last_save is None else step - self._last_save
        kind: SaveKind | None = None
        if self._advice is None:
            if in_flight == 0 and self._quiet > self.clean_steps and since >= self.initial_interval_steps:
                kind = SaveKind.PERSIST
                if self.memory_tier and self._warmup_saves[SaveKind.MEMORY] < self._warmup_saves[SaveKind.PERSIST]:
                    kind = SaveKind.MEMORY
                self._warmup_saves[kind] += 1
        elif since >= self._advice.interval_steps and in_flight < self.max_in_flight:
            kind = SaveKind.PERSIST
            if self.memory_tier and self._since_persist + 1 < self._advice.persist_every:
                kind = SaveKind.MEMORY
            self._since_persist = self._since_persist + 1 if kind is SaveKind.MEMORY else 0
        if kind is not None:
            self._last_save = step
            self._quiet = 0
        return kind
