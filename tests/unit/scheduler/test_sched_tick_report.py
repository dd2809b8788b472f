"""The core's tick reports: every phase, in the seeds' order, naming what it did (swept,
retired, preempted, swapped in, resumed, admitted, the step's rows and tokens), with the
core's counts at the end of the tick; the totals over a run match the core's counters."""

from __future__ import annotations

import json

from spillway.services.scheduler.core import SchedulerCore
from spillway.shared.protocol import TICK_PHASES, ErrorInfo, TickReport
from tests.unit.scheduler.harness import FakeWorker, Outcome, collect, make_core, submit, tick

BS = 4
BLOCK_BYTES = 1000
N, MAX_TOKENS = 6, 20


def _core(**kwargs) -> tuple[SchedulerCore, object]:
    core, clock = make_core(block_size=BS, **kwargs)
    assert core.worker is not None
    core.attach_worker(core.worker.model_copy(update={"block_bytes": BLOCK_BYTES}))
    return core, clock


def _run(core: SchedulerCore, clock) -> tuple[list[TickReport], dict[str, Outcome]]:
    worker = FakeWorker(BS)
    reports: list[TickReport] = []
    outcomes: dict[str, Outcome] = {}
    for _ in range(500):
        collect(outcomes, tick(core, worker)[1])
        reports.append(core.tick_report("s1", "w1", 1_700_000_000.0 + len(reports)))
        if not core.has_work():
            break
    return reports, outcomes


def _phase(report: TickReport, name: str):
    return next(p for p in report.phases if p.name == name)


def _pressure(mode: str) -> tuple[SchedulerCore, list[TickReport], dict[str, Outcome]]:
    core, clock = _core(num_kv_blocks=14, spill_store=True, preemption_mode=mode, max_batch=N)
    for i in range(N):
        submit(core, f"r{i}", prompt=[200 + 17 * i + j for j in range(7)], max_tokens=MAX_TOKENS)
    reports, outcomes = _run(core, clock)
    return core, reports, outcomes


def test_each_report_lists_every_phase_in_the_seeds_order_and_counts_the_tick():
    _, reports, _ = _pressure("spill")
    assert [r.tick for r in reports] == list(range(1, len(reports) + 1))
    for report in reports:
        assert [p.name for p in report.phases] == list(TICK_PHASES)
        assert (report.scheduler, report.worker) == ("s1", "w1")
        assert all(p.seconds >= 0 for p in report.phases)
    busy = max(reports, key=lambda r: r.running)
    assert busy.running > 0 and 0 < busy.kv_cache_usage <= 1
    last = reports[-1]
    assert (last.running, last.waiting, last.swapped, last.kv_cache_usage) == (0, 0, 0, 0.0)
    # Plain JSON a stranger can read back.
    again = TickReport.model_validate_json(json.dumps(last.model_dump(mode="json")))
    assert again == last


def test_spills_and_swap_ins_are_reported_with_their_bytes_and_match_the_core():
    core, reports, _ = _pressure("spill")
    preempted = [p for r in reports for ph in r.phases for p in ph.preempted]
    assert core.stats.preemptions["spill"] > 0
    assert len(preempted) == core.stats.preemptions["spill"]
    assert {p.mode for p in preempted} == {"spill"}
    assert all(p.bytes > 0 and p.bytes % BLOCK_BYTES == 0 for p in preempted)
    # Preemptions make room for a step's rows: they belong to admission.
    assert all(ph.name == "admit" for r in reports for ph in r.phases if ph.preempted)
    swapped_in = [s for r in reports for s in _phase(r, "swap_in").swapped_in]
    assert len(swapped_in) == core.stats.swap_ins > 0
    assert {s.request_id for s in swapped_in} <= {p.request_id for p in preempted}
    assert all(s.bytes % BLOCK_BYTES == 0 for s in swapped_in)
    assert sum(s.bytes for s in swapped_in) > 0


def test_admissions_retirements_and_tokens_add_up_to_the_run():
    core, reports, outcomes = _pressure("recompute")
    admitted = [a.request_id for r in reports for a in _phase(r, "admit").admitted]
    assert sorted(admitted) == sorted(outcomes) and len(admitted) == N
    retired = {x.request_id: x.finish_reason for r in reports for x in _phase(r, "retire").retired}
    assert retired == {rid: "length" for rid in outcomes}
    resumed = [rid for r in reports for rid in _phase(r, "resume").resumed]
    assert core.stats.preemptions["recompute"] > 0 and resumed
    sampled = sum(_phase(r, "step").sampled for r in reports)
    assert sampled == sum(len(o.token_ids) for o in outcomes.values()) == N * MAX_TOKENS
    assert sum(_phase(r, "step").rows for r in reports) >= sampled


def test_a_request_past_its_deadline_is_swept_and_retired_in_the_same_tick():
    core, clock = _core(max_batch=1, num_kv_blocks=16)
    worker = FakeWorker(BS)
    submit(core, "late", max_tokens=50, deadline_ms=50)
    tick(core, worker)
    core.tick_report("s1", "w1", 0.0)
    clock.advance(0.06)
    tick(core, worker)
    report = core.tick_report("s1", "w1", 0.0)
    assert _phase(report, "deadline_sweep").swept == ["late"]
    retired = _phase(report, "retire").retired
    assert [(x.request_id, x.finish_reason) for x in retired] == [("late", "timeout")]


def test_a_worker_out_of_memory_preempts_in_the_step_phase():
    core, _ = _core(max_batch=4, num_kv_blocks=64)
    for i in range(3):
        submit(core, f"r{i}", max_tokens=5)
    plan = core.schedule()
    assert plan is not None and len(plan.rows) == 3
    core.fail_step(plan, ErrorInfo(message="out of memory", code="out_of_memory"))
    report = core.tick_report("s1", "w1", 0.0)
    victims = _phase(report, "step").preempted
    assert [v.request_id for v in victims] == ["r2"]
    assert not _phase(report, "admit").preempted
