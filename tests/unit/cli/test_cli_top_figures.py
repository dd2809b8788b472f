"""`spillway top`'s figures from tick reports, on a fake clock: latest counts per
scheduler and worker, rates over the window (decaying when a lane goes quiet), mean phase
times, stale lanes; and the rendering of them."""

from __future__ import annotations

import pytest
from rich.console import Console

from spillway.services.cli.main import main
from spillway.services.cli.top import render
from spillway.services.cli.top_figures import TopFigures
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import (
    TICK_PHASES,
    PreemptedRequest,
    SwappedInRequest,
    TickPhase,
    TickReport,
)


def report(
    tick: int,
    scheduler: str = "s1",
    worker: str = "w1",
    spills: int = 0,
    recomputes: int = 0,
    swap_ins: int = 0,
    sampled: int = 0,
    tokens: int = 0,
    step_s: float = 0.0,
    admit_s: float = 0.0,
    running: int = 0,
    kv: float = 0.0,
) -> TickReport:
    phases = {name: TickPhase(name=name) for name in TICK_PHASES}
    phases["admit"].seconds = admit_s
    phases["admit"].preempted = [
        PreemptedRequest(request_id=f"p{i}", mode="spill", bytes=4096) for i in range(spills)
    ] + [PreemptedRequest(request_id=f"q{i}", mode="recompute") for i in range(recomputes)]
    phases["swap_in"].swapped_in = [
        SwappedInRequest(request_id=f"p{i}", bytes=4096) for i in range(swap_ins)
    ]
    phases["step"].seconds = step_s
    phases["step"].sampled = sampled
    phases["step"].tokens = tokens
    return TickReport(
        scheduler=scheduler,
        worker=worker,
        tick=tick,
        time=1e9 + tick,
        phases=list(phases.values()),
        running=running,
        waiting=1,
        swapped=2,
        kv_cache_usage=kv,
    )


def test_rates_count_what_came_after_the_windows_first_report():
    clock = FakeClock(100.0)
    top = TopFigures(clock, window_s=5.0)
    for i in range(1, 11):  # ten ticks, 0.1 s apart
        top.add(report(i, spills=1, swap_ins=2, sampled=4, tokens=10, recomputes=1))
        clock.advance(0.1)
    clock.advance(-0.1)  # "now" is the last report's arrival
    (f,) = top.figures()
    # Nine reports after the first, over 0.9 s.
    assert f.ticks_per_s == pytest.approx(10.0)
    assert f.spills_per_s == pytest.approx(10.0)
    assert f.preemptions_per_s == pytest.approx(20.0)
    assert f.swap_ins_per_s == pytest.approx(20.0)
    assert f.tokens_per_s == pytest.approx(40.0)
    assert f.computed_tokens_per_s == pytest.approx(100.0)
    assert (f.tick, f.waiting, f.swapped) == (10, 1, 2)


def test_a_single_report_has_counts_but_no_rates_yet():
    clock = FakeClock()
    top = TopFigures(clock)
    top.add(report(1, spills=3, sampled=5, running=4, kv=0.5))
    (f,) = top.figures()
    assert (f.running, f.kv_cache_usage) == (4, 0.5)
    assert f.spills_per_s == f.tokens_per_s == f.ticks_per_s == 0.0


def test_rates_decay_when_a_lane_goes_quiet_and_it_turns_stale():
    clock = FakeClock()
    top = TopFigures(clock, window_s=2.0, stale_s=10.0)
    for i in range(1, 6):
        top.add(report(i, sampled=10))
        clock.advance(0.25)
    busy = top.figures()[0].tokens_per_s
    clock.advance(1.0)
    quieter = top.figures()[0].tokens_per_s
    assert busy > quieter > 0
    clock.advance(3.0)  # every report left the window
    (f,) = top.figures()
    assert f.tokens_per_s == 0.0 and not f.stale and f.tick == 5  # the counts stay
    clock.advance(10.0)
    assert top.figures()[0].stale
    top.forget_stale(5.0)
    assert top.figures() == []


def test_phase_times_are_means_per_tick_over_the_window():
    clock = FakeClock()
    top = TopFigures(clock, window_s=10.0)
    top.add(report(1, step_s=0.010, admit_s=0.001))
    clock.advance(1.0)
    top.add(report(2, step_s=0.030, admit_s=0.003))
    (f,) = top.figures()
    assert list(f.phase_s) == list(TICK_PHASES)
    assert f.phase_s["step"] == pytest.approx(0.020)
    assert f.phase_s["admit"] == pytest.approx(0.002)
    assert f.phase_s["retire"] == 0.0


def test_lanes_are_kept_apart_and_listed_by_scheduler_then_worker():
    clock = FakeClock()
    top = TopFigures(clock)
    top.add(report(7, scheduler="s2", worker="w1", running=1))
    top.add(report(3, scheduler="s1", worker="w2", running=2))
    top.add(report(5, scheduler="s1", worker="w1", running=3))
    rows = [(f.scheduler, f.worker, f.tick, f.running) for f in top.figures()]
    assert rows == [("s1", "w1", 5, 3), ("s1", "w2", 3, 2), ("s2", "w1", 7, 1)]


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="window_s"):
        TopFigures(FakeClock(), window_s=0)


def test_the_view_shows_each_lane_with_its_figures():
    clock = FakeClock()
    top = TopFigures(clock)
    top.add(report(1, scheduler="sched-a", sampled=5, running=3, kv=0.25))
    clock.advance(0.5)
    top.add(report(2, scheduler="sched-a", sampled=5, spills=1, running=3, kv=0.25, step_s=0.002))
    console = Console(record=True, width=160, force_terminal=False)
    console.print(render(top.figures(), "sched.*.tick", top.num_reports, bad=1))
    screen = console.export_text()
    row = next(line for line in screen.splitlines() if "sched-a" in line and "%" in line)
    assert "25.0%" in row and "10.0" in row  # KV use; 5 tokens over 0.5 s
    assert "ignored 1 malformed" in screen
    assert "1.000" in screen  # the step's mean ms per tick: 2 ms / 2 ticks
    empty = Console(record=True, width=160)
    empty.print(render([], "ns.sched.*.tick", 0, 0))
    assert "waiting for tick reports" in empty.export_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--window", "0"], "--window must be positive"),
        (["--namespace", "a.b"], "--namespace 'a.b'"),
    ],
)
def test_bad_options_are_clear_errors_before_connecting(argv, message, capsys):
    assert main(["top", "--nats-url", "nats://127.0.0.1:1", *argv]) == 2
    assert message in capsys.readouterr().err
