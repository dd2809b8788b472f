"""A core's counters and the batch cap after an out-of-memory step (stats.py)."""

from __future__ import annotations

from spillway.services.scheduler.stats import OOM_RECOVERY_STEPS, CoreStats, RowCap


def test_the_row_cap_drops_below_the_rows_that_ran_out_and_climbs_back_one_at_a_time():
    cap = RowCap(max_batch=8)
    assert cap.limit == 8
    assert cap.out_of_memory(5) == 4 and cap.limit == 4
    for _ in range(OOM_RECOVERY_STEPS - 1):
        cap.step_ran()
    assert cap.limit == 4
    cap.step_ran()
    assert cap.limit == 5
    for _ in range(3 * OOM_RECOVERY_STEPS):
        cap.step_ran()
    assert cap.limit == 8
    for _ in range(5 * OOM_RECOVERY_STEPS):
        cap.step_ran()
    assert cap.limit == 8  # never above max_batch


def test_totals_add_ended_and_live_cores_and_name_no_mode_before_one_counts():
    assert CoreStats.total([CoreStats.empty()]).preemptions == {}
    ended = CoreStats.empty()
    gone = CoreStats(num_steps=7, spill_failures=1, last_spill_error="store full")
    gone.preemptions["spill"] += 2
    gone.spill_became_recompute()  # one of them never reached the store
    ended.add(gone)
    live = CoreStats(num_steps=3, swap_ins=1, migrations=2, prefix_hit_tokens=16)
    live.preemptions["recompute"] += 1
    total = CoreStats.total([ended, live])
    assert total.preemptions == {"recompute": 2, "spill": 1}
    assert (total.num_steps, total.spill_failures, total.swap_ins) == (10, 1, 1)
    assert (total.migrations, total.prefix_hit_tokens) == (2, 16)
    assert total.last_spill_error == ""  # a failure's words are a live core's own
