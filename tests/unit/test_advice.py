"""The checkpoint-interval advisor: models against closed forms, brute force and simulation;
the cadence estimator and the auto rule on synthetic timelines."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerostall.advice import (
    DEFAULT_FAILURE_MIX,
    DEFAULT_MEMORY_FRACTION,
    AutoInterval,
    CadenceEstimator,
    FailureMix,
    MeasuredCosts,
    Model,
    ReplicaCost,
    SaveCost,
    SaveKind,
    advise,
    daly_interval,
    mtbf_from_restarts,
    one_level_overhead,
    steps_for,
    three_tier_overhead,
    two_level_overhead,
    young_interval,
)
from zerostall.errors import AdviceError, ZerostallError

HOUR = 3600.0
PERSISTED = SaveCost(blocked_s=0.1, background_s=2.0, durable_s=60.0, restore_s=600.0)
MEMORY = SaveCost(blocked_s=0.1, background_s=0.2, durable_s=2.0, restore_s=120.0)


def one_level(step_s: float = 10.0, save: SaveCost = PERSISTED) -> MeasuredCosts:
    return MeasuredCosts(step_s=step_s, persisted=save)


def two_levels(step_s: float = 10.0, persisted: SaveCost = PERSISTED, memory: SaveCost = MEMORY) -> MeasuredCosts:
    return MeasuredCosts(step_s=step_s, persisted=persisted, memory=memory)


# -- closed forms --------------------------------------------------------------------------------


@pytest.mark.parametrize("c,m", [(2.1, 3 * HOUR), (0.5, 24 * HOUR), (300.0, 6 * HOUR), (60.0, 600.0)])
def test_young_and_daly_match_their_closed_forms(c, m):
    assert young_interval(c, m) == pytest.approx((2 * c * m) ** 0.5, rel=1e-12)
    r = c / (2 * m)
    daly = (2 * c * m) ** 0.5 * (1 + r ** 0.5 / 3 + r / 9) - c
    assert daly_interval(c, m) == pytest.approx(daly, rel=1e-12)


def test_daly_reproduces_the_papers_examples():
    # Daly (2006), Figs. 3 and 4: delta = 5 min; M = 24 h -> tau_opt = 117 min, M = 6 h -> 57 min.
    assert daly_interval(5 * 60.0, 24 * HOUR) / 60 == pytest.approx(117, abs=0.5)
    assert daly_interval(5 * 60.0, 6 * HOUR) / 60 == pytest.approx(57, abs=0.5)


def test_daly_falls_back_to_the_mtbf_when_the_cost_reaches_twice_it():
    assert daly_interval(200.0, 100.0) == 100.0
    assert daly_interval(1e6, 100.0) == 100.0
    assert daly_interval(199.0, 100.0) < 100.0


def test_daly_is_close_to_the_exact_optimum_of_its_cost_function():
    # The exact optimum of (e^((tau + C)/M) - 1) / tau, found numerically; Daly's series is an
    # approximation of it, accurate to well under 1% for C <= M / 10.
    for c_over_m in (1e-4, 1e-3, 1e-2, 0.1):
        m = 1000.0
        c = c_over_m * m

        def cost(tau):
            return math.expm1((tau + c) / m) / tau

        lo, hi = 1e-9, 3 * m
        for _ in range(200):  # golden section
            a, b = hi - (hi - lo) / 1.618033988749895, lo + (hi - lo) / 1.618033988749895
            lo, hi = (lo, b) if cost(a) < cost(b) else (a, hi)
        assert daly_interval(c, m) == pytest.approx((lo + hi) / 2, rel=0.01)
        assert daly_interval(c, m) == pytest.approx(m * (1 + _lambert_w0(-math.exp(-1 - c / m))), rel=0.01)


def _lambert_w0(z: float) -> float:
    w = 0.0 if z > -0.3 else -0.5
    for _ in range(100):  # Halley's iteration
        e = math.exp(w)
        f = w * e - z
        w -= f / (e * (w + 1) - (w + 2) * f / (2 * w + 2))
    return w


@pytest.mark.parametrize("model", [Model.YOUNG, Model.DALY])
def test_one_level_interval_is_the_better_whole_step_around_the_closed_form(model):
    costs = one_level(step_s=7.0)
    m = 3 * HOUR
    a = advise(costs, mtbf_s=m, model=model)
    tau = (young_interval if model is Model.YOUNG else daly_interval)(PERSISTED.cost_s, m)
    candidates = {math.floor(tau / 7.0), math.ceil(tau / 7.0)}
    assert a.interval_steps in candidates
    assert a.interval_steps == min(candidates, key=lambda n: one_level_overhead(n * 7.0, PERSISTED, m, model=model))
    assert a.interval_s == pytest.approx(a.interval_steps * 7.0 + PERSISTED.cost_s)
    assert a.persist_every == 1 and a.model is model and a.costs is costs and a.mtbf_s == m
    assert a.overhead == pytest.approx(one_level_overhead(a.interval_steps * 7.0, PERSISTED, m, model=model))
    assert a.save_overhead == pytest.approx(PERSISTED.cost_s / a.interval_s)
    assert a.restore_s == PERSISTED.restore_s and a.caveats == ()


def test_first_order_overhead_and_work_lost_are_youngs():
    c, l, r, m, tau = 2.0, 60.0, 600.0, 3 * HOUR, 200.0
    save = SaveCost(blocked_s=0.5, background_s=1.5, durable_s=l, restore_s=r)
    period = tau + c
    assert one_level_overhead(tau, save, m, model=Model.YOUNG) == pytest.approx(c / period + (r + l + period / 2) / m)
    a = advise(MeasuredCosts(step_s=10.0, persisted=save), mtbf_s=m, model=Model.YOUNG)
    assert a.work_lost_s == pytest.approx(l + a.interval_s / 2)


def test_the_latency_does_not_move_the_exact_optimum():
    # Vaidya (1997); in the exact model e^((R + L)/M) is a constant factor.
    m = 1000.0

    def best(l, r):
        save = SaveCost(blocked_s=0.0, background_s=5.0, durable_s=l, restore_s=r)
        return min(range(1, 2000), key=lambda n: one_level_overhead(n * 0.5, save, m))

    assert best(0.0, 0.0) == best(200.0, 0.0) == best(0.0, 300.0) == best(200.0, 300.0)
    assert best(0.0, 0.0) * 0.5 == pytest.approx(daly_interval(5.0, m), rel=0.01)


# -- the models against a simulation of the process they describe --------------------------------


def _simulate(*, m, work_s, k, costs, p, rng, target, restart_failures=True, peer=None, extra_cost_s=0.0):
    """Overhead of saves every ``work_s`` (every k-th persisted) under exponential failures.

    Progress is wall time of execution; a save at progress j*P_m is durable at j*P_m + L (in
    memory, or on storage for every k-th); a failure restores from the newest durable save of
    the level that survives it (memory with probability p); the restore point is durable.
    With ``peer=(share, latency, restart)`` a further share of the failures restores from the
    newest save that is ``latency`` old (a replica on another host); every save costs
    ``extra_cost_s`` more.
    """
    mem = costs.memory or costs.persisted
    per = costs.persisted
    a = (k - 1) * (mem.cost_s + extra_cost_s) + per.cost_s + extra_cost_s
    cycle = k * work_s + a
    pm = cycle / k  # the model spaces memory saves evenly through the cycle
    x = origin = stored = wall = 0.0
    while True:
        f = rng.expovariate(1.0 / m)
        if x + f >= target:
            wall += target - x
            break
        x += f
        wall += f
        j = k * math.floor((x - per.durable_s) / (k * pm))
        if j * pm > origin:
            stored = max(stored, j * pm)
        u = rng.random()
        if u < p:
            j = math.floor((x - mem.durable_s) / pm)
            restore, r = max(origin, j * pm), mem.restore_s
        elif peer is not None and u < p + peer[0]:
            j = math.floor((x - peer[1]) / pm)
            restore, r = max(origin, j * pm), peer[2]
        else:
            restore, r = stored, per.restore_s
        while True:  # a failure during the restart restarts it (Daly's convention)
            g = rng.expovariate(1.0 / m) if restart_failures else math.inf
            if g >= r:
                wall += r
                break
            wall += g
        x = origin = restore
    return 1.0 - target * (k * work_s / cycle) / wall


def test_exact_one_level_model_with_latency_matches_simulation():
    # Large latency and restart against the MTBF, where first order would be off.
    save = SaveCost(blocked_s=1.0, background_s=4.0, durable_s=20.0, restore_s=10.0)
    costs = one_level(step_s=1.0, save=save)
    m, work = 100.0, 25.0
    simulated = _simulate(m=m, work_s=work, k=1, costs=costs, p=0.0, rng=random.Random(1), target=3e6)
    exact = one_level_overhead(work, save, m, model=Model.DALY)
    assert simulated == pytest.approx(exact, rel=0.02)
    # and the first-order formula is visibly off in that range
    assert abs(one_level_overhead(work, save, m, model=Model.YOUNG) - simulated) > 0.05


def test_two_level_waste_matches_simulation_in_its_first_order_range():
    costs = two_levels(step_s=10.0)
    m = 3 * HOUR
    for work, k, p in [(100.0, 4, 0.75), (200.0, 2, 0.5), (50.0, 8, 0.9)]:
        simulated = _simulate(m=m, work_s=work, k=k, costs=costs, p=p, rng=random.Random(k), target=4e8,
                              restart_failures=False)
        assert simulated == pytest.approx(two_level_overhead(work, k, costs, m, p), rel=0.05)


# -- two levels ----------------------------------------------------------------------------------


def _grid_optimum(costs, m, p, n_max, k_max):
    """Brute force over whole (steps, persist_every), with the latency floor advise applies."""
    mem, per, dt = costs.memory, costs.persisted, costs.step_s
    best = None
    for k in range(1, k_max + 1):
        a = (k - 1) * mem.cost_s + per.cost_s
        for n in range(1, n_max + 1):
            cycle = k * n * dt + a
            if cycle < per.durable_s or cycle / k < mem.durable_s:
                continue
            w = two_level_overhead(n * dt, k, costs, m, p)
            if best is None or w < best[0]:
                best = (w, n, k)
    return best


@pytest.mark.parametrize("p", [0.0, 0.25, 0.5, 0.75, 0.9, 0.99])
@pytest.mark.parametrize("m_hours", [0.5, 3.0, 24.0])
def test_two_level_optimum_matches_brute_force(p, m_hours):
    costs = two_levels(step_s=10.0)
    m = m_hours * HOUR
    a = advise(costs, mtbf_s=m, memory_fraction=p)
    w, n, k = _grid_optimum(costs, m, p, n_max=400, k_max=80)
    assert a.model is Model.TWO_LEVEL and a.memory_fraction == p
    assert a.overhead == pytest.approx(w, rel=1e-12)
    assert (a.interval_steps, a.persist_every) == (n, k)


def test_two_level_brute_force_where_the_latency_floor_binds():
    costs = two_levels(step_s=1.0, persisted=SaveCost(blocked_s=0.1, background_s=1.0, durable_s=900.0))
    m = 2 * HOUR
    a = advise(costs, mtbf_s=m)  # the default mix: DEFAULT_MEMORY_FRACTION of failures spare memory
    w, n, k = _grid_optimum(costs, m, DEFAULT_MEMORY_FRACTION, n_max=1000, k_max=100)
    assert (a.interval_steps, a.persist_every) == (n, k) and a.overhead == pytest.approx(w, rel=1e-12)
    assert a.interval_s * a.persist_every >= 900.0
    assert any("latency" in c for c in a.caveats)


def test_two_level_optimum_is_benoits_sum_of_square_roots():
    # k* = sqrt(extra p / (C_m (1 - p))) = 4 here; with fine steps the waste is
    # const + sqrt(2 lambda_1 C_1) + sqrt(2 lambda_2 C_2) (Benoit et al. 2017).
    mem = SaveCost(blocked_s=0.1, background_s=0.2, durable_s=0.0)
    per = SaveCost(blocked_s=0.1, background_s=1.8, durable_s=0.0)
    costs = two_levels(step_s=0.001, persisted=per, memory=mem)
    m, p = 3 * HOUR, 0.75
    a = advise(costs, mtbf_s=m, memory_fraction=p)
    assert a.persist_every == 4
    lam = 1 / m
    expected = (2 * p * lam * 0.3) ** 0.5 + (2 * (1 - p) * lam * 1.6) ** 0.5
    assert a.overhead == pytest.approx(expected, rel=1e-4)


def test_two_levels_reduce_to_young_with_one_level_of_failures():
    costs = two_levels()
    for work in (10.0, 200.0, 5000.0):
        assert two_level_overhead(work, 1, costs, 3 * HOUR, 0.0) == pytest.approx(
            one_level_overhead(work, PERSISTED, 3 * HOUR, model=Model.YOUNG))


def test_two_levels_beat_one_level_when_most_failures_spare_memory():
    m = 3 * HOUR
    one = advise(one_level(), mtbf_s=m, model=Model.YOUNG)
    two = advise(two_levels(), mtbf_s=m, memory_fraction=0.75)
    assert two.persist_every > 1 and two.interval_s < one.interval_s
    assert two.overhead < one.overhead and two.work_lost_s < one.work_lost_s
    # with no failure recoverable from memory, memory-only saves are pure cost
    assert advise(two_levels(), mtbf_s=m, memory_fraction=0.0).persist_every == 1


# -- three tiers: memory, a peer's memory, storage ------------------------------------------------

REPLICA = ReplicaCost(background_s=0.1, send_s=5.0, fetch_s=30.0, host_bytes=4 << 30)
MIX = FailureMix(crash=0.2, node_loss=0.7)  # the other 0.1 loses every copy in memory


def three_tiers(step_s: float = 10.0, replica: ReplicaCost | None = REPLICA, persisted: SaveCost = PERSISTED,
                memory: SaveCost = MEMORY) -> MeasuredCosts:
    return MeasuredCosts(step_s=step_s, persisted=persisted, memory=memory, replica=replica)


def _waste_by_hand(work, k, costs, m, mix, r):
    """docs/advice.md's three-tier waste, term by term: every save pays r replicas; a crash loses
    the newest save in this host's memory, a node loss the newest a peer holds (r >= 1) or the
    newest persisted one (r = 0), the rest the newest persisted one."""
    mem, per, rep = costs.memory, costs.persisted, costs.replica or ReplicaCost()
    a = (k - 1) * (mem.cost_s + r * rep.background_s) + per.cost_s + r * rep.background_s
    cycle = k * work + a
    from_storage = per.restore_s + per.durable_s + cycle / 2
    crash = mix.crash * (mem.restore_s + mem.durable_s + cycle / (2 * k))
    if r:
        node = mix.node_loss * (mem.restore_s + rep.fetch_s + mem.durable_s + r * rep.send_s + cycle / (2 * k))
        rest = mix.memory_lost * from_storage
    else:
        node, rest = mix.node_loss * from_storage, mix.memory_lost * from_storage
    return a / cycle + (crash + node + rest) / m


@pytest.mark.parametrize("r", [0, 1, 2])
def test_three_tier_waste_is_the_formula_of_the_docs(r):
    costs, m = three_tiers(), 3 * HOUR
    for work, k in [(100.0, 1), (100.0, 4), (35.0, 9), (2000.0, 2)]:
        got = three_tier_overhead(work, k, costs, m, failure_mix=MIX, replicas=r)
        assert got == pytest.approx(_waste_by_hand(work, k, costs, m, MIX, r), rel=1e-12)
    # without replicas it is the two-level waste of the crash share
    if r == 0:
        assert three_tier_overhead(100.0, 4, costs, m, failure_mix=MIX) == pytest.approx(
            two_level_overhead(100.0, 4, costs, m, MIX.crash), rel=1e-12)


def test_without_replicas_node_losses_roll_back_to_the_last_persisted_step():
    costs, m = three_tiers(), 3 * HOUR
    a = advise(costs, mtbf_s=m, failure_mix=MIX, replicas=0)
    assert [t.tier for t in a.tiers] == ["memory", "storage"] and a.tier("peer") is None
    memory, storage = a.tier("memory"), a.tier("storage")
    cycle = a.interval_s * a.persist_every
    assert storage.failure_share == pytest.approx(MIX.node_loss + MIX.memory_lost)
    assert storage.work_lost_s == pytest.approx(PERSISTED.durable_s + cycle / 2)  # half a persist cycle
    assert storage.restore_s == PERSISTED.restore_s
    assert storage.interval_steps == a.interval_steps * a.persist_every and storage.interval_s == pytest.approx(cycle)
    assert memory.failure_share == MIX.crash and memory.work_lost_s == pytest.approx(MEMORY.durable_s + a.interval_s / 2)
    assert a.work_lost_s == pytest.approx(sum(t.failure_share * t.work_lost_s for t in a.tiers))
    assert a.restore_s == pytest.approx(sum(t.failure_share * t.restore_s for t in a.tiers))
    # replicas' costs do not count without replicas: it is the two-level advice of the crash share
    two = advise(two_levels(), mtbf_s=m, memory_fraction=MIX.crash)
    assert (a.interval_steps, a.persist_every) == (two.interval_steps, two.persist_every)
    assert a.overhead == pytest.approx(two.overhead, rel=1e-12) and a.replica_host_bytes == 0


@pytest.mark.parametrize("r", [1, 2, 3])
def test_with_replicas_a_node_loss_costs_a_crash_plus_the_fetch_from_the_peer(r):
    a = advise(three_tiers(), mtbf_s=3 * HOUR, failure_mix=MIX, replicas=r)
    assert [t.tier for t in a.tiers] == ["memory", "peer", "storage"] and a.replicas == r
    memory, peer, storage = a.tiers
    assert peer.failure_share == MIX.node_loss and storage.failure_share == pytest.approx(MIX.memory_lost)
    # the same save interval as a crash; later by the r sends, and the fetch on top of the restart
    assert peer.interval_steps == memory.interval_steps == a.interval_steps
    assert peer.work_lost_s == pytest.approx(memory.work_lost_s + r * REPLICA.send_s)
    assert peer.restore_s == pytest.approx(memory.restore_s + REPLICA.fetch_s)
    assert a.memory_fraction == pytest.approx(MIX.crash + MIX.node_loss)
    # free replication: a node loss costs exactly a crash
    free = advise(three_tiers(replica=ReplicaCost(host_bytes=1)), mtbf_s=3 * HOUR, failure_mix=MIX, replicas=r)
    assert free.tier("peer").work_lost_s == free.tier("memory").work_lost_s
    assert free.tier("peer").restore_s == free.tier("memory").restore_s


def test_replicas_covering_node_loss_lengthen_the_persist_interval():
    # k* = sqrt(D q / (C_m (1 - q))), C_m a memory save's cost with its replicas, D = C_p - C_m the
    # extra cost of persisting (replicas add to both), q the share of failures recovered from
    # memory of any host. Here D = 1.4 - 0.2 = 1.2; without replicas C_m = 0.2 and q = 0.2
    # (k* = 1.22); with one C_m = 0.2 + 0.1 and q = 0.2 + 0.6 (k* = 4).
    mem = SaveCost(blocked_s=0.1, background_s=0.1, durable_s=0.0)
    per = SaveCost(blocked_s=0.1, background_s=1.3, durable_s=0.0)
    costs = three_tiers(step_s=0.001, persisted=per, memory=mem, replica=ReplicaCost(background_s=0.1))
    mix, m = FailureMix(crash=0.2, node_loss=0.6), 3 * HOUR
    d, lam = per.cost_s - mem.cost_s, 1 / m
    k_star = {}
    for r, q in [(0, mix.crash), (1, mix.crash + mix.node_loss)]:
        cm = mem.cost_s + r * 0.1
        k_star[r] = math.sqrt(d * q / (cm * (1 - q)))
        a = advise(costs, mtbf_s=m, failure_mix=mix, replicas=r)
        assert a.persist_every in (math.floor(k_star[r]), math.ceil(k_star[r]))
        if r == 1:  # k* whole: Benoit et al.'s sum of square roots, the replica's cost in every save
            assert a.persist_every == round(k_star[r]) == 4
            assert a.overhead == pytest.approx((2 * q * lam * cm) ** 0.5 + (2 * (1 - q) * lam * d) ** 0.5, rel=1e-3)
    assert k_star[1] > k_star[0]
    without = advise(three_tiers(), mtbf_s=m, failure_mix=MIX, replicas=0)
    with_one = advise(three_tiers(), mtbf_s=m, failure_mix=MIX, replicas=1)
    assert with_one.tier("storage").interval_s > without.tier("storage").interval_s
    assert with_one.overhead < without.overhead and with_one.work_lost_s < without.work_lost_s
    assert with_one.restore_s < without.restore_s


@pytest.mark.parametrize("r", [0, 1, 2])
@pytest.mark.parametrize("m_hours", [0.5, 3.0, 24.0])
def test_three_tier_optimum_matches_brute_force(r, m_hours):
    costs, m = three_tiers(), m_hours * HOUR
    a = advise(costs, mtbf_s=m, failure_mix=MIX, replicas=r)
    mem, per = costs.memory, costs.persisted
    memory_latency = mem.durable_s + r * REPLICA.send_s  # saves no closer than the replicas hold them
    best = None
    for k in range(1, 81):
        cost = (k - 1) * (mem.cost_s + r * REPLICA.background_s) + per.cost_s + r * REPLICA.background_s
        for n in range(1, 401):
            cycle = k * n * costs.step_s + cost
            if cycle < per.durable_s or cycle / k < memory_latency:
                continue
            w = _waste_by_hand(n * costs.step_s, k, costs, m, MIX, r)
            if best is None or w < best[0]:
                best = (w, n, k)
    w, n, k = best
    assert (a.interval_steps, a.persist_every) == (n, k)
    assert a.overhead == pytest.approx(w, rel=1e-9)


def test_saves_are_no_closer_than_their_replicas_take():
    # A slow link: a replica is held 150 s after the save is in memory. With max_in_flight=1 the
    # next save would wait for it, so the memory period is at least L_m + r S.
    slow = ReplicaCost(background_s=0.0, send_s=150.0, fetch_s=0.0)
    costs, m, r = three_tiers(step_s=1.0, replica=slow), HOUR, 1
    a = advise(costs, mtbf_s=m, failure_mix=MIX, replicas=r)
    floor = MEMORY.durable_s + r * slow.send_s
    assert a.interval_s >= floor and any("1 replica holds it" in c for c in a.caveats)
    best = None
    for k in range(1, 60):
        cost = (k - 1) * MEMORY.cost_s + PERSISTED.cost_s
        for n in range(1, 1200):
            cycle = k * n + cost
            if cycle < PERSISTED.durable_s or cycle / k < floor:
                continue
            w = _waste_by_hand(n * 1.0, k, costs, m, MIX, r)
            if best is None or w < best[0]:
                best = (w, n, k)
    assert (a.interval_steps, a.persist_every) == best[1:] and a.overhead == pytest.approx(best[0], rel=1e-9)
    # without the floor the model would save more often than the replicas can follow
    unbounded = min((_waste_by_hand(n * 1.0, a.persist_every, costs, m, MIX, r), n) for n in range(1, 1200))
    assert unbounded[1] < a.interval_steps


def test_three_tier_waste_matches_simulation_in_its_first_order_range():
    costs, m = three_tiers(), 3 * HOUR
    for work, k, r in [(100.0, 6, 1), (150.0, 4, 2), (200.0, 1, 1)]:
        peer = (MIX.node_loss, MEMORY.durable_s + r * REPLICA.send_s, MEMORY.restore_s + REPLICA.fetch_s)
        simulated = _simulate(m=m, work_s=work, k=k, costs=costs, p=MIX.crash, rng=random.Random(k), target=4e8,
                              restart_failures=False, peer=peer, extra_cost_s=r * REPLICA.background_s)
        assert simulated == pytest.approx(three_tier_overhead(work, k, costs, m, failure_mix=MIX, replicas=r),
                                          rel=0.05)


def test_three_tier_limits():
    m = 3 * HOUR
    # free replicas recover node losses like crashes: the two-level advice of crash + node_loss
    free = three_tiers(replica=ReplicaCost())
    a = advise(free, mtbf_s=m, failure_mix=MIX, replicas=1)
    b = advise(free, mtbf_s=m, failure_mix=FailureMix(crash=MIX.crash + MIX.node_loss, node_loss=0.0))
    assert (a.interval_steps, a.persist_every) == (b.interval_steps, b.persist_every)
    assert a.overhead == pytest.approx(b.overhead, rel=1e-12) and a.work_lost_s == pytest.approx(b.work_lost_s)
    # with no node losses, free replicas change nothing
    no_node = FailureMix(crash=0.6, node_loss=0.0)
    assert advise(free, mtbf_s=m, failure_mix=no_node, replicas=1).overhead == pytest.approx(
        advise(free, mtbf_s=m, failure_mix=no_node).overhead, rel=1e-12)
    # the rarer the failures that lose every copy in memory, the rarer the persisted saves
    cycles = [advise(three_tiers(), mtbf_s=m, failure_mix=FailureMix(crash=0.2, node_loss=0.8 - lost), replicas=1)
              for lost in (0.3, 0.1, 0.03, 0.01, 0.001)]
    storage = [c.tier("storage").interval_s for c in cycles]
    assert storage == sorted(storage) and storage[-1] > 10 * storage[0]
    assert [c.tier("memory").interval_steps for c in cycles][-1] >= 1
    # ... and with none, persisting could never pay: an error, not an endless interval
    with pytest.raises(AdviceError) as e:
        advise(three_tiers(), mtbf_s=m, failure_mix=FailureMix(crash=0.2, node_loss=0.8), replicas=1)
    assert e.value.key == "failure_mix" and "memory_lost" in str(e.value)


@settings(max_examples=60, deadline=None)
@given(crash=st.floats(0, 0.6), node=st.floats(0, 0.35), m_hours=st.floats(0.25, 48))
def test_free_replicas_never_cost(crash, node, m_hours):
    # Moving failures from storage to a peer only shortens what each loses, at every (steps, k).
    # (The persist interval itself can step back where whole-step optima are near ties.)
    free = three_tiers(replica=ReplicaCost())
    mix = FailureMix(crash=crash, node_loss=node)
    without = advise(free, mtbf_s=m_hours * HOUR, failure_mix=mix)
    with_one = advise(free, mtbf_s=m_hours * HOUR, failure_mix=mix, replicas=1)
    assert with_one.overhead <= without.overhead + 1e-12


def test_replicas_take_one_copy_of_the_rank_state_each_in_host_memory():
    m = 3 * HOUR
    for r in (1, 2, 3):
        a = advise(three_tiers(), mtbf_s=m, failure_mix=MIX, replicas=r)
        assert a.replica_host_bytes == r * REPLICA.host_bytes and a.caveats == ()
    assert f"+{2 * REPLICA.host_bytes / 2**30:.3g} GiB per rank" in advise(
        three_tiers(), mtbf_s=m, failure_mix=MIX, replicas=2).summary()
    assert advise(three_tiers(), mtbf_s=m, failure_mix=MIX).replica_host_bytes == 0
    assert advise(three_tiers(replica=ReplicaCost(send_s=1.0)), mtbf_s=m, failure_mix=MIX,
                  replicas=1).replica_host_bytes is None
    unmeasured = advise(three_tiers(replica=None), mtbf_s=m, failure_mix=MIX, replicas=1)
    assert unmeasured.replica_host_bytes is None and any("not measured" in c for c in unmeasured.caveats)


def test_the_default_failure_mix_is_llama3s():
    # 419 unexpected interruptions: about 78% hardware; 35 a network switch or cable
    assert DEFAULT_FAILURE_MIX.crash == pytest.approx(1 - 0.78)
    assert DEFAULT_FAILURE_MIX.node_loss == pytest.approx(0.78 - 35 / 419)
    assert DEFAULT_FAILURE_MIX.memory_lost == pytest.approx(35 / 419)
    assert DEFAULT_FAILURE_MIX.crash == DEFAULT_MEMORY_FRACTION
    # without replicas the default is the crash share as memory_fraction (what Checkpointer.advice passes)
    costs = three_tiers()
    assert advise(costs, mtbf_s=3 * HOUR) == advise(costs, mtbf_s=3 * HOUR, memory_fraction=DEFAULT_MEMORY_FRACTION)
    a = advise(costs, mtbf_s=3 * HOUR, replicas=1)
    assert a.tier("peer").failure_share == DEFAULT_FAILURE_MIX.node_loss


def _bad_inputs():
    m = HOUR
    return [
        ("failure_mix.crash", lambda: FailureMix(crash=-0.1, node_loss=0.5)),
        ("failure_mix.crash", lambda: FailureMix(crash=1.5, node_loss=0.0)),
        ("failure_mix.crash", lambda: FailureMix(crash=math.nan, node_loss=0.0)),
        ("failure_mix.crash", lambda: FailureMix(crash="0.2", node_loss=0.0)),
        ("failure_mix.node_loss", lambda: FailureMix(crash=0.2, node_loss=1.01)),
        ("failure_mix.node_loss", lambda: FailureMix(crash=0.2, node_loss=True)),
        ("failure_mix", lambda: FailureMix(crash=0.6, node_loss=0.6)),
        ("failure_mix", lambda: advise(three_tiers(), mtbf_s=m, failure_mix=(0.2, 0.7))),
        ("failure_mix", lambda: advise(three_tiers(), mtbf_s=m, failure_mix=MIX, memory_fraction=0.5)),
        ("failure_mix", lambda: advise(three_tiers(), mtbf_s=m, failure_mix=FailureMix(crash=1.0, node_loss=0.0))),
        ("memory_fraction", lambda: advise(three_tiers(), mtbf_s=m, memory_fraction=0.5, replicas=1)),
        ("memory_fraction", lambda: advise(three_tiers(), mtbf_s=m, memory_fraction=-0.5)),
        ("memory_fraction", lambda: advise(three_tiers(), mtbf_s=m, memory_fraction="0.5")),
        ("replicas", lambda: advise(three_tiers(), mtbf_s=m, replicas=-1)),
        ("replicas", lambda: advise(three_tiers(), mtbf_s=m, replicas=True)),
        ("replicas", lambda: advise(three_tiers(), mtbf_s=m, replicas=1.0)),
        ("replicas", lambda: advise(one_level(), mtbf_s=m, replicas=1)),
        ("replicas", lambda: advise(three_tiers(), mtbf_s=m, replicas=1, model=Model.DALY)),
        ("replicas", lambda: three_tier_overhead(10.0, 2, three_tiers(), m, replicas=-2)),
        ("replicas", lambda: AutoInterval(mtbf_s=m, replicas=1)),
        ("replicas", lambda: AutoInterval(mtbf_s=m, memory_tier=True, replicas=-1)),
        ("send_s", lambda: ReplicaCost(send_s=-1.0)),
        ("fetch_s", lambda: ReplicaCost(fetch_s=math.inf)),
        ("background_s", lambda: ReplicaCost(background_s=math.nan)),
        ("host_bytes", lambda: ReplicaCost(host_bytes=-1)),
        ("host_bytes", lambda: ReplicaCost(host_bytes=1.5)),
        ("costs.memory", lambda: three_tier_overhead(10.0, 2, one_level(), m)),
    ]


@pytest.mark.parametrize("key,call", _bad_inputs(), ids=[f"{k}-{i}" for i, (k, _) in enumerate(_bad_inputs())])
def test_three_tier_inputs_out_of_range_are_typed_errors_naming_the_argument(key, call):
    with pytest.raises(AdviceError) as e:
        call()
    assert isinstance(e.value, ValueError) and isinstance(e.value, ZerostallError)
    assert e.value.key == key and key.rsplit(".", 1)[-1] in str(e.value)


def test_auto_with_replicas_follows_the_three_tier_advice():
    mix = FailureMix(crash=0.2, node_loss=0.75)
    saves, auto = run_auto(AutoInterval(mtbf_s=3 * HOUR, memory_tier=True, clean_steps=4, failure_mix=mix,
                                        replicas=1), 600)
    a = auto.advice
    assert a is not None and a.replicas == 1 and a.tier("peer").failure_share == 0.75
    assert a == advise(a.costs, mtbf_s=3 * HOUR, failure_mix=mix, replicas=1)
    assert a.persist_every > advise(a.costs, mtbf_s=3 * HOUR, failure_mix=mix).persist_every
    steady = saves[-3 * a.persist_every:]
    persisted = [i for i, (_, k) in enumerate(steady) if k is SaveKind.PERSIST]
    assert {b - a_ for a_, b in zip(persisted, persisted[1:])} == {a.persist_every}


# -- monotonicity and degenerate inputs ----------------------------------------------------------

costs_strategy = st.builds(
    lambda b, g, l, r, dt: MeasuredCosts(step_s=dt, persisted=SaveCost(blocked_s=b, background_s=g, durable_s=l,
                                                                       restore_s=r)),
    st.floats(0, 5), st.floats(0, 50), st.floats(0, 120), st.floats(0, 900), st.floats(0.05, 30))


@settings(max_examples=150, deadline=None)
@given(costs=costs_strategy, model=st.sampled_from([Model.YOUNG, Model.DALY]),
       m1=st.floats(60, 1e6), ratio=st.floats(1, 100))
def test_a_longer_mtbf_never_shortens_the_interval(costs, model, m1, ratio):
    a, b = advise(costs, mtbf_s=m1, model=model), advise(costs, mtbf_s=m1 * ratio, model=model)
    assert b.interval_steps >= a.interval_steps
    assert b.overhead <= a.overhead + 1e-12


def test_a_longer_mtbf_lengthens_both_levels():
    costs = two_levels(step_s=1.0)
    advices = [advise(costs, mtbf_s=h * HOUR) for h in (0.25, 0.5, 1, 3, 10, 30, 100)]
    for a, b in zip(advices, advices[1:]):
        assert b.interval_s >= a.interval_s
        assert b.interval_s * b.persist_every > a.interval_s * a.persist_every
        assert b.overhead < a.overhead
    assert advices[-1].interval_s > 5 * advices[0].interval_s


def test_free_saves_go_every_step_unless_their_latency_spaces_them():
    free = SaveCost(blocked_s=0.0, background_s=0.0, durable_s=0.0)
    for model in (Model.YOUNG, Model.DALY):
        a = advise(one_level(save=free), mtbf_s=HOUR, model=model)
        assert a.interval_steps == 1 and a.save_overhead == 0.0 and a.caveats == ()
    slow = SaveCost(blocked_s=0.0, background_s=0.0, durable_s=45.0)
    a = advise(one_level(save=slow), mtbf_s=HOUR)
    assert a.interval_steps == 5 and any("latency" in c for c in a.caveats)


def test_a_save_dearer_than_the_mtbf_gets_dalys_fallback_and_a_caveat():
    dear = SaveCost(blocked_s=100.0, background_s=150.0, durable_s=300.0)
    a = advise(one_level(step_s=10.0, save=dear), mtbf_s=100.0, model=Model.DALY)
    assert a.interval_steps == 10  # tau = M
    assert any("Daly's fallback" in c for c in a.caveats)
    y = advise(one_level(step_s=10.0, save=dear), mtbf_s=100.0, model=Model.YOUNG)
    assert y.overhead == 1.0 and any("out of range" in c for c in y.caveats)


@pytest.mark.parametrize("mtbf", [0.0, -1.0, math.nan, math.inf])
def test_a_meaningless_mtbf_is_a_typed_error(mtbf):
    with pytest.raises(AdviceError) as e:
        advise(one_level(), mtbf_s=mtbf)
    assert isinstance(e.value, ValueError) and isinstance(e.value, ZerostallError)
    assert e.value.key == "mtbf_s" and "mtbf_s" in str(e.value)
    with pytest.raises(AdviceError):
        young_interval(1.0, mtbf)
    with pytest.raises(AdviceError):
        daly_interval(1.0, mtbf)


def test_other_inputs_out_of_range_are_typed_errors():
    with pytest.raises(AdviceError, match="background_s"):
        SaveCost(blocked_s=0.1, background_s=-1.0, durable_s=1.0)
    with pytest.raises(AdviceError, match="step_s"):
        MeasuredCosts(step_s=0.0, persisted=PERSISTED)
    with pytest.raises(AdviceError, match="memory_fraction"):
        advise(two_levels(), mtbf_s=HOUR, memory_fraction=1.0)
    with pytest.raises(AdviceError, match="costs.memory"):
        advise(one_level(), mtbf_s=HOUR, model=Model.TWO_LEVEL)
    with pytest.raises(AdviceError, match="persist_every"):
        two_level_overhead(10.0, 0, two_levels(), HOUR, 0.5)
    with pytest.raises(AdviceError, match="model"):
        one_level_overhead(10.0, PERSISTED, HOUR, model=Model.TWO_LEVEL)


def test_conversions():
    assert steps_for(212.9, step_s=10.0) == 21
    assert steps_for(215.0, step_s=10.0) == 22
    assert steps_for(0.0, step_s=10.0) == steps_for(4.0, step_s=10.0) == 1
    with pytest.raises(AdviceError):
        steps_for(10.0, step_s=0.0)
    assert mtbf_from_restarts(uptime_s=54 * 86400.0, failures=419) == pytest.approx(11135.08, abs=0.01)
    assert mtbf_from_restarts(uptime_s=1000.0, failures=0) is None
    with pytest.raises(AdviceError, match="failures"):
        mtbf_from_restarts(uptime_s=1000.0, failures=-1)


def test_worked_example_of_the_docs():
    # docs/advice.md: 16k GPUs, a failure every 3 hours.
    m = 3 * HOUR
    young = advise(one_level(), mtbf_s=m, model=Model.YOUNG)
    daly = advise(one_level(), mtbf_s=m, model=Model.DALY)
    two = advise(two_levels(), mtbf_s=m, memory_fraction=0.75)
    quarter = advise(two_levels(), mtbf_s=m, memory_fraction=0.25)
    rows = [(a.interval_steps, a.persist_every, round(a.interval_s, 1), round(100 * a.overhead, 2),
             round(a.work_lost_s)) for a in (young, daly, two, quarter)]
    assert rows == [(21, 1, 212.1, 8.08, 166), (21, 1, 212.1, 7.77, 166), (10, 4, 100.8, 3.94, 105),
                    (21, 1, 212.1, 6.84, 152)]
    assert young.summary() == ("save every 21 steps (212 s); expected overhead 8.08%, work lost per failure "
                               "166 s (young, MTBF 3.00 h)")


def test_worked_example_with_replicas_of_the_docs():
    # docs/advice.md: the same job with Llama 3's failure mix, 0, 1 and 2 replicas.
    m = 3 * HOUR
    daly = advise(one_level(), mtbf_s=m)
    by_replicas = [advise(three_tiers(), mtbf_s=m, replicas=r) for r in (0, 1, 2)]
    rows = [(a.interval_steps, round(a.interval_s), a.persist_every, round(a.interval_s * a.persist_every),
             round(100 * a.save_overhead, 2), round(100 * (a.overhead - a.save_overhead), 2), round(100 * a.overhead, 2),
             round(a.work_lost_s), round(a.restore_s), a.replica_host_bytes) for a in (daly, *by_replicas)]
    gib = 1 << 30
    assert rows == [(21, 212, 1, 212, 0.99, 6.78, 7.77, 166, 600, 0), (21, 212, 1, 212, 0.99, 6.0, 6.99, 153, 494, 0),
                    (10, 101, 7, 705, 0.65, 2.47, 3.12, 86, 181, 4 * gib),
                    (11, 111, 6, 665, 0.72, 2.53, 3.25, 92, 181, 8 * gib)]
    one = by_replicas[1]
    assert [(t.tier, round(t.interval_s), round(100 * t.failure_share, 1), round(t.work_lost_s), round(t.restore_s))
            for t in one.tiers] == [("memory", 101, 22.0, 52, 120), ("peer", 101, 69.6, 57, 150),
                                    ("storage", 705, 8.4, 412, 600)]
    assert one.summary() == ("save every 10 steps (101 s), persisting every 7 saves, 1 replica in other hosts' "
                             "memory (+4 GiB per rank); expected overhead 3.12%, work lost per failure 86 s "
                             "(two_level, MTBF 3.00 h)")


# -- the cadence estimator on synthetic timelines ------------------------------------------------


class Timeline:
    """A training loop in simulated time: a step is ``step_s`` of work; a save blocks the loop
    for its blocked time, then runs in the background for ``window_s`` during which work
    advances ``slowdown`` times slower (the largest factor of the saves in flight)."""

    def __init__(self, step_s=10.0):
        self.step_s = step_s
        self.t = 0.0
        self.step = 0
        self.windows: list[tuple[float, float, float]] = []  # (start, end, factor)

    def factor(self, t):
        return max([f for a, b, f in self.windows if a <= t < b], default=1.0)

    def run_step(self, extra_s=0.0):
        left = self.step_s
        while left > 1e-12:
            f = self.factor(self.t)
            ends = [b for a, b, _ in self.windows if a <= self.t < b] + [a for a, _, _ in self.windows if a > self.t]
            horizon = min(ends, default=math.inf)
            need = left * f
            if self.t + need <= horizon:
                self.t += need
                left = 0.0
            else:
                left -= (horizon - self.t) / f
                self.t = horizon
        self.t += extra_s
        self.step += 1
        return self.step, self.t

    def save(self, blocked_s, window_s, slowdown):
        start = self.t
        self.t += blocked_s
        self.windows.append((self.t, self.t + window_s, slowdown))
        return start, self.t + window_s


def drive(est, tl, plan, *, outliers=()):
    """Run ``plan``: a list of (steps to run, save or None); a save is (blocked, window,
    slowdown, persisted). Saves are observed at the first step that ends after they are
    durable, as a Checkpointer learns of them."""
    pending = []
    est.observe_step(*tl.run_step())
    for steps, save in plan:
        for _ in range(steps):
            step, t = tl.run_step(extra_s=30.0 if tl.step + 1 in outliers else 0.0)
            est.observe_step(step, t)
            for item in [x for x in pending if x[3] <= t]:
                est.observe_save(*item[:4], persisted=item[4])
                pending.remove(item)
        if save is not None:
            blocked, window, slowdown, persisted = save
            ts, td = tl.save(blocked, window, slowdown)
            pending.append((tl.step, blocked, ts, td, persisted))
    return pending


def test_estimator_recovers_the_costs_of_a_clean_timeline():
    est, tl = CadenceEstimator(), Timeline(step_s=10.0)
    # persists of 42 s during which steps run 1.2x slower, every 12 steps
    drive(est, tl, [(12, (0.1, 42.0, 1.2, True))] * 6 + [(12, None)])
    c = est.costs()
    assert c is not None and c.memory is None
    assert c.step_s == pytest.approx(10.0)
    assert c.persisted.blocked_s == pytest.approx(0.1)
    assert c.persisted.durable_s == pytest.approx(42.1)
    assert c.persisted.background_s == pytest.approx(42.0 * (1 - 1 / 1.2), rel=1e-9)
    assert est.slowdown() == pytest.approx(1 - 1 / 1.2, rel=1e-9)
    assert c.persisted.restore_s == 0.0
    est.observe_restore(500.0)
    est.observe_restore(700.0)
    assert est.costs().persisted.restore_s == 600.0


def test_estimator_shrugs_off_outlier_iterations():
    est, tl = CadenceEstimator(), Timeline(step_s=10.0)
    # a 30 s stall every 9th step, one of them inside a persist
    drive(est, tl, [(12, (0.1, 42.0, 1.2, True))] * 7 + [(12, None)], outliers=set(range(9, 200, 9)))
    c = est.costs()
    assert c.step_s == pytest.approx(10.0)
    assert c.persisted.background_s == pytest.approx(7.0, rel=1e-9)


def test_estimator_keeps_memory_and_persisted_saves_apart():
    est, tl = CadenceEstimator(), Timeline(step_s=10.0)
    memory = (0.05, 3.0, 1.5, False)
    persist = (0.1, 42.0, 1.2, True)
    plan = [(8, persist), (8, memory), (8, memory), (8, memory)] * 4 + [(8, None)]
    drive(est, tl, plan)
    c = est.costs()
    assert c.persisted.background_s == pytest.approx(7.0, rel=1e-9)
    assert c.memory is not None
    assert c.memory.blocked_s == pytest.approx(0.05)
    assert c.memory.durable_s == pytest.approx(3.05)
    assert c.memory.background_s == pytest.approx(1.0, rel=1e-9)
    assert est.saves_observed(persisted=False) == 12 and est.saves_observed() == 4


def test_estimator_shares_the_excess_of_overlapping_saves():
    est, tl = CadenceEstimator(), Timeline(step_s=10.0)
    # 40 s persists started 2 (slowed: 25 s) steps apart overlap: [0, 40], [25, 65], [50, 90]
    drive(est, tl, [(10, None)] + [(2, (0.0, 40.0, 1.25, True))] * 3 + [(10, None)])
    c = est.costs()
    assert c.persisted.background_s == pytest.approx(90.0 * (1 - 1 / 1.25) / 3, rel=1e-9)
    assert c.persisted.durable_s == pytest.approx(40.0)


def test_estimator_waits_for_enough_measurements():
    est, tl = CadenceEstimator(min_saves=3, min_clean_steps=8), Timeline()
    assert est.costs() is None and est.step_s() is None
    pending = drive(est, tl, [(10, (0.1, 42.0, 1.2, True))] * 3)
    assert est.step_s() == pytest.approx(10.0) and est.costs() is None  # 2 saves measured
    # The third is reported durable at once (its durable time lies ahead of the last step):
    # it counts once a step has ended after it, and that step bumps the version.
    (step, blocked, ts, td, _), = pending
    est.observe_save(step, blocked, ts, td)
    assert est.costs() is None
    v = est.version
    while tl.t < td:
        est.observe_step(*tl.run_step())
    assert est.version == v + 1 and est.costs() is not None


def test_estimator_rejects_a_clock_running_backwards_and_impossible_saves():
    est = CadenceEstimator()
    est.observe_step(1, 10.0)
    with pytest.raises(AdviceError, match="monotonic"):
        est.observe_step(2, 9.0)
    est.observe_step(1, 11.0)  # a reload to an earlier step starts a new stretch
    with pytest.raises(AdviceError, match="t_durable"):
        est.observe_save(1, 0.5, 10.0, 10.2)
    with pytest.raises(AdviceError, match="blocked_s"):
        est.observe_save(1, -0.5, 10.0, 10.2)
    with pytest.raises(AdviceError, match="window_steps"):
        CadenceEstimator(window_steps=0)


# -- save_interval="auto" ------------------------------------------------------------------------


def run_auto(auto, steps, *, persist=(0.1, 42.0, 1.2), memory=(0.05, 3.0, 1.5)):
    """A training loop under ``auto`` on a Timeline; returns [(step, kind)] of the saves."""
    est, tl = CadenceEstimator(), Timeline(step_s=10.0)
    saves, pending = [], []
    step, t = tl.run_step()
    est.observe_step(step, t)
    for _ in range(steps):
        step, t = tl.run_step()
        est.observe_step(step, t)
        for item in [x for x in pending if x[3] <= t]:
            est.observe_save(*item[:4], persisted=item[4])
            pending.remove(item)
        kind = auto.decide(step, est, in_flight=len(pending))
        if kind is not None:
            blocked, window, slowdown = persist if kind is SaveKind.PERSIST else memory
            ts, td = tl.save(blocked, window, slowdown)
            pending.append((step, blocked, ts, td, kind is SaveKind.PERSIST))
            saves.append((step, kind))
    return saves, auto


def test_auto_measures_without_overlapping_saves_then_follows_the_advice():
    saves, auto = run_auto(AutoInterval(mtbf_s=3 * HOUR, clean_steps=8), 400)
    a = auto.advice
    assert a is not None and a.model is Model.DALY
    assert a.costs.persisted.background_s == pytest.approx(7.0, rel=1e-6)
    steps = [s for s, _ in saves]
    assert all(k is SaveKind.PERSIST for _, k in saves)
    # warm-up: the first save once 8 whole steps have run with nothing in flight, each next
    # one when the previous is durable (4 slowed steps) and 8 more have; three saves measured,
    # it follows the advice: C = 7.1 s, sqrt(2 C M) = 392 s, 39 steps
    assert steps[:3] == [10, 22, 34]
    assert a.interval_steps == 39 == advise(a.costs, mtbf_s=3 * HOUR).interval_steps
    assert {b - a_ for a_, b in zip(steps[2:], steps[3:])} == {39}


def test_auto_with_the_memory_tier_measures_both_kinds_then_persists_every_kth():
    # three failures in four spare host memory: the measured costs then make persisting every kth pay
    saves, auto = run_auto(AutoInterval(mtbf_s=3 * HOUR, memory_tier=True, memory_fraction=0.75, clean_steps=4), 600)
    a = auto.advice
    assert a is not None and a.model is Model.TWO_LEVEL and a.persist_every > 1
    kinds = [k for _, k in saves]
    assert kinds[:6] == [SaveKind.PERSIST, SaveKind.MEMORY] * 3
    steady = saves[-3 * a.persist_every:]
    gaps = {b[0] - a_[0] for a_, b in zip(steady, steady[1:])}
    assert gaps == {a.interval_steps}
    persisted = [i for i, (_, k) in enumerate(steady) if k is SaveKind.PERSIST]
    assert {b - a_ for a_, b in zip(persisted, persisted[1:])} == {a.persist_every}


def test_auto_defers_a_due_save_while_the_staging_slot_is_busy():
    auto = AutoInterval(mtbf_s=3 * HOUR, clean_steps=2)
    est = CadenceEstimator()
    assert [auto.decide(s, est, in_flight=1) for s in range(10)] == [None] * 10
    assert auto.decide(10, est) is None and auto.decide(11, est) is None
    assert auto.decide(12, est) is SaveKind.PERSIST


def test_auto_rejects_bad_configuration():
    with pytest.raises(AdviceError, match="mtbf_s"):
        AutoInterval(mtbf_s=0.0)
    with pytest.raises(AdviceError, match="memory_tier"):
        AutoInterval(mtbf_s=HOUR, model=Model.TWO_LEVEL)
    with pytest.raises(AdviceError, match="clean_steps"):
        AutoInterval(mtbf_s=HOUR, clean_steps=0)
