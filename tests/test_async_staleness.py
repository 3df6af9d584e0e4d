"""Unit tests of the pieces under the asynchronous controller: sampler, ledger, prompt cursor, config and
waits."""

from __future__ import annotations

import asyncio
import random

import pytest

from posttrain.algorithms.async_grpo.config import AsyncGRPOConfig
from posttrain.algorithms.async_grpo.contracts import WaitTimeout, bounded
from posttrain.algorithms.async_grpo.ledger import BufferedGroup, GroupState, Ledger, StalenessSampler
from posttrain.algorithms.async_grpo.meters import BusyMeter
from posttrain.config import ConfigError, build_config
from posttrain.tasks.datasets import PromptCursor


def group(gid: int, version: int) -> BufferedGroup:
    return BufferedGroup(gid, gid, version, 0, samples=None, num_samples=4)


@pytest.mark.parametrize(
    "selection, expected", [("fresh_first", [3, 1, 4, 0, 2]), ("stale_first", [0, 2, 1, 4, 3])]
)
def test_sampler_orders_by_lag_then_age(selection, expected):
    sampler = StalenessSampler(max_staleness=2, selection=selection)
    for gid, version in [(0, 3), (1, 4), (2, 3), (3, 5), (4, 4)]:  # arrival order = gid
        sampler.add(group(gid, version))
    assert [sampler.pop(5).group_id for _ in range(5)] == expected
    assert sampler.pop(5) is None


def test_sampler_never_admits_or_keeps_stale_groups():
    sampler = StalenessSampler(max_staleness=1)
    for gid, version in enumerate([0, 1, 2, 2]):
        sampler.add(group(gid, version))
    assert [g.group_id for g in sampler.evict_stale(2)] == [0]
    assert sampler.pop(3).group_id == 2  # group 1 (lag 2) is not eligible at version 3
    assert [g.group_id for g in sampler.evict_stale(3)] == [1]
    assert [g.group_id for g in sampler.groups()] == [3]
    with pytest.raises(AssertionError, match="newer than the trainer"):
        sampler.pop(1)


def test_sampler_keep_order_puts_aborted_groups_back_in_place():
    sampler = StalenessSampler(max_staleness=0)
    for gid in range(3):
        sampler.add(group(gid, 0))
    first = sampler.pop(0)
    sampler.add(first, keep_order=True)
    assert [g.group_id for g in sampler.groups()] == [0, 1, 2]
    sampler.add(group(7, 0))
    assert sampler.groups()[-1].order == 3


@pytest.mark.parametrize("selection", ["fresh_first", "stale_first"])
def test_sealed_groups_are_admitted_before_later_arrivals_and_survive_a_state_round_trip(selection):
    sampler = StalenessSampler(max_staleness=1, selection=selection)
    for gid, version in [(0, 1), (1, 2), (2, 1)]:
        sampler.add(group(gid, version))
    sampler.seal()
    for gid, version in [(3, 2), (4, 1)]:  # arrive after the checkpoint
        sampler.add(group(gid, version))
    assert sampler.sealed == 3
    restored = StalenessSampler(max_staleness=1, selection=selection)
    restored.load_state_dict(sampler.state_dict())
    for g in sampler.groups():
        restored.add(g, keep_order=True)
    sealed_first = {"fresh_first": [1, 0, 2], "stale_first": [0, 2, 1]}[selection]
    later = {"fresh_first": [3, 4], "stale_first": [4, 3]}[selection]
    for s in (sampler, restored):
        assert [s.pop(2).group_id for _ in range(5)] == sealed_first + later
        assert s.sealed == 0


def test_an_evicted_sealed_group_leaves_the_seal():
    sampler = StalenessSampler(max_staleness=0)
    sampler.add(group(0, 0))
    sampler.add(group(1, 1))
    sampler.seal()
    assert [g.group_id for g in sampler.evict_stale(1)] == [0]
    assert sampler.sealed == 1 and sampler.state_dict()["sealed"] == [1]


def test_ledger_allows_only_the_loop_transitions():
    ledger = Ledger()
    for state in (GroupState.IN_FLIGHT, GroupState.BUFFERED, GroupState.TRAINING, GroupState.TRAINED):
        ledger.move(1, state)
    with pytest.raises(AssertionError, match="group 1 has ended and cannot go to training"):
        ledger.move(1, GroupState.TRAINING)
    with pytest.raises(AssertionError, match="group 1 has ended and cannot go to pending"):
        ledger.move(1, GroupState.PENDING)  # not even as a new group
    with pytest.raises(AssertionError, match="cannot go from new to training"):
        ledger.move(3, GroupState.TRAINING)
    ledger.move(2, GroupState.IN_FLIGHT)
    with pytest.raises(AssertionError, match="left in flight"):
        ledger.check_settled()
    ledger.move(2, GroupState.PENDING)
    ledger.check_settled()
    assert ledger.counts()["trained"] == 1 and ledger.ids(GroupState.PENDING) == [2]
    assert ledger.ended(1) and ledger.state(1) is None and not ledger.ended(2)
    with pytest.raises(ValueError, match="trained groups are counted, not kept by id; use counts"):
        ledger.ids(GroupState.TRAINED)


def test_ledger_keeps_live_groups_and_intervals_of_ended_ones():
    """Ended groups are counted and their ids merged into intervals: the ledger's size follows the live
    groups (at most 3 here, ending in random order), not the 1,000 groups it has seen."""
    rng = random.Random(0)
    ledger = Ledger()
    ends = [GroupState.TRAINED, GroupState.FILTERED, GroupState.DROPPED_STALE]
    live: list[int] = []
    retained = []
    expected = {s.value: 0 for s in ends}
    for gid in range(1000):
        ledger.move(gid, GroupState.IN_FLIGHT)
        ledger.move(gid, GroupState.BUFFERED)
        live.append(gid)
        if len(live) == 3:
            done = live.pop(rng.randrange(3))
            end = ends[done % 3]
            if end != GroupState.DROPPED_STALE:
                ledger.move(done, GroupState.TRAINING)
            ledger.move(done, end)
            expected[end.value] += 1
        retained.append(ledger.retained())
    assert sorted(ledger.states) == live and ledger.ids(GroupState.BUFFERED) == live
    counts = ledger.counts()
    assert {s.value: counts[s.value] for s in ends} == expected and sum(expected.values()) == 998
    assert counts["buffered"] == 2
    assert all(ledger.ended(g) == (g not in live) for g in range(1000))
    assert not ledger.ended(1000) and not ledger.ended(-1)
    assert max(retained) <= 2 * 3 + 1  # live groups + the intervals between them


def test_prompt_cursor_epochs_shuffle_and_state():
    cursor = PromptCursor(5, num_epochs=2, shuffle=True, seed=3)
    seen = [cursor.next() for _ in range(10)]
    assert cursor.next() is None and cursor.exhausted
    assert sorted(seen[:5]) == sorted(seen[5:]) == list(range(5)) and seen[:5] != seen[5:]
    again = PromptCursor(5, num_epochs=2, shuffle=True, seed=3)
    for _ in range(7):
        again.next()
    resumed = PromptCursor(5, num_epochs=2, shuffle=True, seed=3)
    resumed.load_state_dict(again.state_dict())
    assert [resumed.next() for _ in range(3)] == seen[7:]
    assert PromptCursor(0, num_epochs=None, shuffle=False, seed=0).next() is None
    assert [PromptCursor(4, shuffle=False).next_indices(6)] == [[0, 1, 2, 3, 0, 1]]


def test_prompt_cursor_refuses_the_state_of_another_dataset():
    state = PromptCursor(8, seed=3).state_dict()
    assert state == {
        "epoch": 0,
        "position": 0,
        "seed": 3,
        "run_seed": None,
        "shuffle": True,
        "num_items": 8,
        "fingerprint": None,
    }
    with pytest.raises(ValueError, match="saved with num_items=8 but this dataset has num_items=9"):
        PromptCursor(9, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with seed=3"):
        PromptCursor(8, seed=4).load_state_dict(state)


def test_busy_meter_counts_overlapping_jobs_once_and_reads_up_to_a_given_time():
    now = [0.0]
    meter = BusyMeter(lambda: now[0])
    meter.start()
    now[0] = 1.0
    meter.start()  # a second job while the first runs: still one busy resource
    now[0] = 2.0
    meter.stop()
    assert meter.total() == 2.0
    assert meter.total(now=1.5) == 1.5  # a reading taken before: never more busy than alive
    now[0] = 3.0
    meter.stop()
    now[0] = 5.0
    assert meter.total() == 3.0 and meter.total(now=9.0) == 3.0  # idle since 3.0


def test_config_validation_says_how_to_fix():
    with pytest.raises(ConfigError, match="set num_steps or num_epochs"):
        build_config(AsyncGRPOConfig, {"num_epochs": None})
    with pytest.raises(
        ConfigError, match="max_outstanding_groups=2 is below target_prompt_groups_per_step=8"
    ):
        build_config(AsyncGRPOConfig, {"max_outstanding_groups": 2})
    with pytest.raises(ConfigError, match="max_groups_per_call=5 is above max_in_flight_per_worker=4"):
        build_config(AsyncGRPOConfig, {"max_groups_per_call": 5, "max_in_flight_per_worker": 4})
    cfg = AsyncGRPOConfig(max_staleness=2, target_prompt_groups_per_step=3)
    assert cfg.outstanding_cap == 9
    assert (
        cfg.loss.use_importance_sampling_correction and cfg.loss.truncated_importance_sampling_type == "tis"
    )


def test_bounded_wait_times_out_and_cancels():
    cancelled = []

    async def forever():
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def body():
        with pytest.raises(WaitTimeout, match="thing did not answer within 0.05s"):
            await bounded(forever(), 0.05, "thing")
        await asyncio.sleep(0)
        assert cancelled == [True]
        assert await bounded(asyncio.sleep(0, result=5), 1.0, "x") == 5

    asyncio.run(asyncio.wait_for(body(), 5.0))
