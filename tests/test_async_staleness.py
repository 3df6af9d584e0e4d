"""Unit tests of the pieces under the asynchronous controller: sampler, ledger, data cursor, config, waits."""

from __future__ import annotations

import asyncio

import pytest

from posttrain.algorithms.async_grpo import AsyncGRPOConfig
from posttrain.algorithms.async_metrics import BusyMeter
from posttrain.algorithms.async_types import WaitTimeout, bounded
from posttrain.algorithms.rollout_pool import DataCursor
from posttrain.algorithms.staleness import BufferedGroup, GroupState, Ledger, StalenessSampler
from posttrain.config import ConfigError, build_config


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


def test_ledger_allows_only_the_loop_transitions():
    ledger = Ledger()
    for state in (GroupState.IN_FLIGHT, GroupState.BUFFERED, GroupState.TRAINING, GroupState.TRAINED):
        ledger.move(1, state)
    with pytest.raises(AssertionError, match="cannot go from trained to training"):
        ledger.move(1, GroupState.TRAINING)
    ledger.move(2, GroupState.IN_FLIGHT)
    with pytest.raises(AssertionError, match="left in flight"):
        ledger.check_settled()
    ledger.move(2, GroupState.PENDING)
    ledger.check_settled()
    assert ledger.counts()["trained"] == 1 and ledger.ids(GroupState.PENDING) == [2]


def test_data_cursor_epochs_shuffle_and_state():
    cursor = DataCursor(5, num_epochs=2, shuffle=True, seed=3)
    seen = [cursor.next() for _ in range(10)]
    assert cursor.next() is None and cursor.exhausted
    assert sorted(seen[:5]) == sorted(seen[5:]) == list(range(5)) and seen[:5] != seen[5:]
    again = DataCursor(5, num_epochs=2, shuffle=True, seed=3)
    for _ in range(7):
        again.next()
    resumed = DataCursor(5, num_epochs=2, shuffle=True, seed=3)
    resumed.load_state_dict(again.state_dict())
    assert [resumed.next() for _ in range(3)] == seen[7:]
    assert DataCursor(0, num_epochs=None, shuffle=False, seed=0).next() is None


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
