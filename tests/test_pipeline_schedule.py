"""The pipeline schedule simulator: the closed formulas come out where they hold (equal stages), and sends,
uneven stages and the first/last micro-batch's extras move the step as the action lists say."""

from __future__ import annotations

import dataclasses

import pytest

from hf_colossal_auto.plan import PIPELINE_SCHEDULES, stage_ranks
from hf_colossal_auto.solve.pricing.pipeline_schedule import (
    Link,
    StageCost,
    point_to_point_traffic,
    schedule_actions,
    simulate_schedule,
)

F, B = 1.0, 2.0  # seconds of one micro-batch's forward and backward on one (whole) stage
ACT = 1000  # activation bytes one micro-batch keeps on one stage


def _equal(stages: int, virtual: int = 1, **kw) -> list[StageCost]:
    """Equal stages; with ``virtual`` chunks per rank each chunk does 1/virtual of a rank's work."""
    return [StageCost(F / virtual, B / virtual / 2, B / virtual / 2, activation_bytes=ACT, **kw)] * stages


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 16), (8, 8)])
def test_gpipe_and_1f1b_have_the_classic_bubble(p, m):
    for schedule in ("gpipe", "1f1b"):
        sim = simulate_schedule(schedule, _equal(p), m, p)
        assert sim.step_time_s == pytest.approx((m + p - 1) * (F + B))
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 3)])
def test_gpipe_keeps_every_micro_batch_and_1f1b_at_most_stages_minus_index(p, m):
    gpipe = simulate_schedule("gpipe", _equal(p), m, p)
    one_f_one_b = simulate_schedule("1f1b", _equal(p), m, p)
    assert gpipe.max_in_flight == [m] * p and gpipe.peak_activation_bytes == [m * ACT] * p
    assert one_f_one_b.max_in_flight == [min(m, p - i) for i in range(p)]
    assert one_f_one_b.peak_activation_bytes == [min(m, p - i) * ACT for i in range(p)]


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (2, 4, 2), (4, 8, 4)])
def test_interleaved_1f1b_divides_the_bubble_by_the_virtual_stages(p, m, v):
    """Megatron's interleaved schedule: the bubble is (p - 1) x (f + b) / v (torch's action list)."""
    sim = simulate_schedule("interleaved-1f1b", _equal(p * v, v), m, p)
    assert sim.step_time_s == pytest.approx(m * (F + B) + (p - 1) * (F + B) / v)
    plain = simulate_schedule("1f1b", _equal(p), m, p)
    # each chunk keeps 1/v of a stage's activations per micro-batch, but more micro-batches are in flight
    chunk = [StageCost(F / v, B / v / 2, B / v / 2, activation_bytes=ACT // v)] * (p * v)
    interleaved = simulate_schedule("interleaved-1f1b", chunk, m, p)
    assert interleaved.peak_activation_bytes[0] >= plain.peak_activation_bytes[0]


def test_zero_bubble_schedules_fill_the_bubble_with_weight_gradients():
    p, m = 4, 8
    plain = simulate_schedule("1f1b", _equal(p), m, p)
    for schedule in ("interleaved-zero-bubble", "zbv"):
        sim = simulate_schedule(schedule, _equal(2 * p, 2), m, p)
        assert sum(sim.busy_s) == pytest.approx(sum(plain.busy_s))  # the same work
        assert sim.bubble_fraction < plain.bubble_fraction / 3, schedule
        assert any(a[0] == "W" for a in schedule_actions(schedule, p, m, 2)[0])


def test_sends_on_the_critical_path_add_latency_twice_per_hop():
    p, m, latency = 4, 8, 0.25  # a send shorter than any compute: no queueing on the link
    sim = simulate_schedule("gpipe", _equal(p), m, p, link=Link(latency_s=latency))
    assert sim.step_time_s == pytest.approx((m + p - 1) * (F + B) + 2 * (p - 1) * latency)


def test_a_slow_link_serialises_sends():
    """2 stages, 4 micro-batches, each send 3 s (longer than a forward): activations arrive at 4, 7, 10, 13,
    the second stage's backwards run 14..22, the gradients arrive at 19, 22, 25, 28 and the first stage's
    last backward ends at 30."""
    stages = [StageCost(F, B / 2, B / 2, send_bytes=300)] * 2
    sim = simulate_schedule("gpipe", stages, 4, 2, link=Link(bandwidth_bytes_per_s=100.0))
    assert sim.step_time_s == pytest.approx(30.0)
    starts = [start for rank, action, start, _ in sim.timeline if rank == 1 and action[0] == "F"]
    assert starts == pytest.approx([4.0, 7.0, 10.0, 13.0])


def test_uneven_stages_and_extras_move_the_step():
    p, m = 2, 4
    heavy_last = [StageCost(F, B / 2, B / 2), StageCost(2 * F, B, B)]  # the head makes the last stage slower
    sim = simulate_schedule("1f1b", heavy_last, m, p)
    # the slow stage runs all the time after the first forward: F + m x (2F + 2B), then the first stage's B
    assert sim.step_time_s == pytest.approx(F + m * (2 * F + 2 * B) + B)
    extras = [StageCost(F, B / 2, B / 2, unsharded_at_s=0.5, last_backward_extra_s=0.75)] * p
    plain = simulate_schedule("1f1b", _equal(p), m, p).step_time_s
    with_extras = simulate_schedule("1f1b", extras, m, p, optimizer_s=0.1).step_time_s
    # the first stage's gather delays the forward chain; the second stage's, gathered meanwhile, does not; the
    # second stage's sync runs while the first stage does its last backward, whose own sync then ends the step
    assert with_extras == pytest.approx(plain + 0.5 + 0.75 + 0.1)
    late = [StageCost(F, B / 2, B / 2), StageCost(F, B / 2, B / 2, unsharded_at_s=F + 0.25)]
    # the second stage's parameters arrive 0.25 s after its first micro-batch: the chain waits that long
    assert simulate_schedule("1f1b", late, m, p).step_time_s == pytest.approx(plain + 0.25)


@pytest.mark.parametrize("schedule", list(PIPELINE_SCHEDULES))
def test_every_action_list_runs_each_stage_and_micro_batch_once(schedule):
    p, m = 2, 4
    v = PIPELINE_SCHEDULES[schedule][0]
    lists = schedule_actions(schedule, p, m, v)
    owner = stage_ranks(schedule, p * v, p)
    for rank, actions in enumerate(lists):
        mine = [s for s in range(p * v) if owner[s] == rank]
        forwards = sorted((s, mb) for kind, s, mb in actions if kind == "F")
        assert forwards == sorted((s, mb) for s in mine for mb in range(m))
        backwards = sorted((s, mb) for kind, s, mb in actions if kind in ("B", "I"))
        assert backwards == forwards
        weights = sorted((s, mb) for kind, s, mb in actions if kind == "W")
        assert weights in ([], forwards)


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"), [("gpipe", 2, 4, 1), ("1f1b", 4, 4, 1), ("interleaved-1f1b", 2, 4, 2)]
)
def test_sends_are_one_per_micro_batch_each_way_across_every_rank_boundary(schedule, p, m, v):
    """Between consecutive stages on different ranks, each micro-batch's activation goes forward and its gradient
    back: ``m`` sends of ``send_bytes`` each way per boundary (what c10d records on real ranks, test_pipeline_search)."""
    stages = [StageCost(F / v, B / v / 2, B / v / 2, send_bytes=64)] * (p * v)
    traffic = point_to_point_traffic(simulate_schedule(schedule, stages, m, p).sends)
    boundaries: dict[tuple[int, int], int] = {}
    owner = stage_ranks(schedule, p * v, p)
    for s in range(p * v - 1):
        for pair in ((owner[s], owner[s + 1]), (owner[s + 1], owner[s])):
            boundaries[pair] = boundaries.get(pair, 0) + m
    assert traffic == {pair: (count, 64 * count) for pair, count in boundaries.items()}


def test_gradients_exist_from_a_stages_first_backward_and_the_transient_tops_a_backward():
    """GPipe holds every micro-batch when its first backward starts, before any gradient exists; the gradients
    count from that backward on (whole: a bound within it), and each backward starts with its transient on top:
    the peak is the most of those moments."""
    p, m, grads = 2, 4, 1500
    for transient in (3000, 0):
        stages = [StageCost(F, B / 2, B / 2, activation_bytes=ACT, grad_bytes=grads,
                            backward_transient_bytes=transient)] * p  # fmt: skip
        first_backward_starts = m * ACT + transient
        first_backward_ends = m * ACT + grads
        second_backward_starts = (m - 1) * ACT + grads + transient
        expected = max(first_backward_starts, first_backward_ends, second_backward_starts)
        assert simulate_schedule("gpipe", stages, m, p).peak_activation_bytes == [expected] * p
    assert expected == m * ACT + grads  # without a transient the end of the first backward is the peak


def test_sent_gradients_live_as_long_as_the_runtime_keeps_their_sends():
    """GPipe waits its gradient sends only at the step's end, 1F1B each send before the next, and under the
    multi-stage schedules the runtime frees a sent gradient once the schedule's order proves it received: a rank
    holds the gradients its stages sent back to other ranks accordingly (a sent activation is the stage's kept
    output, freed with its backward: the runtime's stage frees it). Two ranks, no activations of their own:
    under GPipe the second stage ends holding the gradients it sent back for every micro-batch (the first sends
    none back); under 1F1B nothing is held past its send; under interleaved 1F1B (stages 0, 2 on rank 0 and 1,
    3 on rank 1) at most two of stage 2's on rank 0 (each freed at the backward of stage 0 that waited on the
    gradient rank 1 sent after receiving it) and three on rank 1, where torch's runtime would hold all 4 and 8."""
    p, m, sent = 2, 4, 700
    stages = [StageCost(F, B / 2, B / 2, send_bytes=sent)] * p
    assert simulate_schedule("gpipe", stages, m, p).peak_activation_bytes == [0, m * sent]
    assert simulate_schedule("1f1b", stages, m, p).peak_activation_bytes == [0, 0]
    interleaved = simulate_schedule(
        "interleaved-1f1b", [StageCost(F, B / 2, B / 2, send_bytes=sent)] * 4, m, p
    )
    assert interleaved.peak_activation_bytes == [2 * sent, 3 * sent]


def test_a_sent_gradient_is_freed_once_a_later_message_proves_it_received():
    """Interleaved 1F1B, 2 ranks, 4 micro-batches (torch's order): rank 0 sends stage 2's gradients to rank 1,
    which waits on each at its backward of stage 1 and then sends stage 1's gradient to rank 0, waited on at
    rank 0's backward of stage 0 — where the send of stage 2 is freed. Rank 1's first gradient of stage 1 is
    proven received by the activation rank 0 sends it for stage 3's last micro-batch (rank 0 ran stage 0's
    backward of micro-batch 0 before that forward); the last sends of stage 1 have no later message: in no list
    (to the step's end). A release always comes after its send on the same rank."""
    from hf_colossal_auto.pipeline_receipts import gradient_send_releases

    actions = schedule_actions("interleaved-1f1b", 2, 4, 2)
    releases = gradient_send_releases(actions, [0, 1, 0, 1])
    assert {a: keys for a, keys in releases.items() if a[1] == 0} == {
        ("B", 0, mb): [(2, mb)] for mb in range(4)
    }
    assert releases[("F", 3, 3)] == [(1, 0)]
    released = {key for keys in releases.values() for key in keys}
    assert (1, 2) not in released and (1, 3) not in released
    for rank_actions in actions:
        for at, action in enumerate(rank_actions):
            for stage, mb in releases.get(action, ()):
                assert rank_actions.index(("B", stage, mb)) < at
    # Llama 3's 4-D pipeline (16 ranks, 2 stages each, 32 micro-batches): three in four freed before the end
    big = schedule_actions("interleaved-1f1b", 16, 32, 2)
    owner = [s % 16 for s in range(32)]
    sent = sum(1 for rank in big for kind, stage, _ in rank if kind == "B" and stage > 0)
    assert sum(map(len, gradient_send_releases(big, owner).values())) >= 0.75 * sent


def test_the_gradient_synchronisation_transient_comes_on_top_as_a_stages_last_backward_ends():
    """FSDP2 reduce-scatters a unit's gradients from a copy of them after the stage's last backward: its
    ``sync_transient_bytes`` come on top of what is held then (the gradients), once, not at every backward."""
    p, m = 2, 4
    for schedule, v in (("1f1b", 1), ("zbv", 2)):
        held_in_flight = [StageCost(F, B / 2, B / 2, activation_bytes=100, grad_bytes=10)] * (p * v)
        with_sync = [dataclasses.replace(s, sync_transient_bytes=1000) for s in held_in_flight]
        plain = simulate_schedule(schedule, held_in_flight, m, p).peak_activation_bytes
        synced = simulate_schedule(schedule, with_sync, m, p).peak_activation_bytes
        # on top of what is held then, which is less than the rank's peak without it (micro-batches freed)
        assert all(0 < s - q <= 1000 for s, q in zip(synced, plain, strict=True)), (schedule, synced, plain)
