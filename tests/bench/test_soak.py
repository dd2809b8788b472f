"""The soak's pure parts: the fault schedule and windows, the requests and what a client
made of their chunks, every invariant (holding and broken), and the tables (the run
itself is `python -m bench.soak`; tests/e2e/test_soak.py runs a short one)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from bench.soak_checks import (
    RssSample,
    across_bus_restart,
    ended_once,
    error_lines,
    errors_logged_for_faults,
    greedy_difference,
    greedy_equal,
    idle,
    metrics_match,
    rss_bounded,
    rss_growth,
    tokens_whole,
)
from bench.soak_faults import (
    FAULTS,
    WINDOW_MARGIN_S,
    Injected,
    fault_at,
    fault_during,
    interval_for,
    schedule,
)
from bench.soak_report import faults_table, report, requests_table, rss_table
from bench.soak_traffic import (
    KINDS,
    Outcome,
    absorb,
    absorb_sse,
    greedy_body,
    reference_bodies,
    request,
)


def test_a_long_soak_injects_a_fault_every_two_and_a_half_minutes_in_turn() -> None:
    plan = schedule(30 * 60)
    assert [p.at_s for p in plan] == [150.0 * k for k in range(1, 12)]
    assert [p.fault for p in plan] == [FAULTS[k % len(FAULTS)] for k in range(11)]
    refusal = next(p for p in plan if p.fault == "redis_refuses_writes")
    assert refusal.hold_s == 30.0
    assert next(p for p in plan if p.fault == "gateway_stop").hold_s == 3.0
    assert next(p for p in plan if p.fault == "worker_kill").hold_s == 0.0


def test_a_short_soak_fits_every_fault_once_with_a_quiet_end() -> None:
    plan = schedule(180)
    assert [p.fault for p in plan] == list(FAULTS)
    interval = interval_for(180)
    assert interval == pytest.approx(180 / 7)
    assert plan[-1].at_s <= 180 - interval + 1e-3
    # Holds shrink to half an interval, but the gateway's 3 s stop is the case itself.
    assert next(p for p in plan if p.fault == "redis_refuses_writes").hold_s == interval / 2
    assert next(p for p in plan if p.fault == "gateway_stop").hold_s == 3.0


def test_a_soak_may_study_some_faults_at_its_own_pace() -> None:
    plan = schedule(600, ("scheduler_kill",), interval_s=90)
    assert [p.at_s for p in plan] == [90.0 * k for k in range(1, 6)]
    assert {p.fault for p in plan} == {"scheduler_kill"}
    with pytest.raises(ValueError, match="faults must be some of"):
        schedule(600, ("scheduler_kil",))
    with pytest.raises(ValueError):
        schedule(600, ())


def test_a_moment_belongs_to_the_fault_whose_window_holds_it() -> None:
    a = Injected("worker_kill", at_s=10, lifted_s=10, recovered_s=14)
    b = Injected("nats_restart", at_s=40, lifted_s=42, recovered_s=None)  # never recovered
    assert fault_during([a, b], 0, 9, end_s=100) is None
    assert fault_during([a, b], 0, 10, end_s=100) is a
    assert fault_during([a, b], 0, 50, end_s=100) is b
    assert fault_during([a, b], 0, 50, end_s=100, kinds={"worker_kill"}) is a
    assert fault_at([a, b], 9.9, end_s=100) is None
    assert fault_at([a, b], 12, end_s=100) is a
    assert fault_at([a, b], 14 + WINDOW_MARGIN_S, end_s=100) is a
    assert fault_at([a, b], 14 + WINDOW_MARGIN_S + 0.1, end_s=100) is None
    assert fault_at([a, b], 100 + WINDOW_MARGIN_S, end_s=100) is b
    assert a.recovery_s == 4 and b.recovery_s is None


def test_every_kind_builds_a_request_and_greedy_ones_have_a_reference() -> None:
    refs = reference_bodies()
    for kind in KINDS:
        for i in range(12):
            req = request(kind, i)
            assert req.body["max_tokens"] > 0
            if req.reference is not None:
                assert req.body["temperature"] == 0 and req.reference in refs
                assert req.body["max_tokens"] <= refs[req.reference]["max_tokens"]
    assert request("deadline", 0).body["deadline_ms"] > 0
    assert request("n2", 0).choices == 2
    assert request("nats", 0).path == "nats" and not request("nats", 0).stream
    with pytest.raises(ValueError, match="unknown request kind"):
        request("telepathy", 0)
    # Every prompt and length comes round.
    lengths = {greedy_body(i)["max_tokens"] for i in range(48)}
    prompts = {greedy_body(i)["prompt"] for i in range(48)}
    assert len(lengths) == 4 and len(prompts) == 6


def _chunk(index: int, ids: list[int], finish: str | None = None, text: str = "x") -> str:
    return json.dumps({
        "choices": [{
            "index": index, "text": text, "finish_reason": finish,
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                         "top_logprobs": [{"a": -0.1, "b": -2.0} for _ in ids]},
        }]
    })  # fmt: skip


def test_an_outcome_gathers_a_streams_tokens_finishes_and_usage() -> None:
    out = Outcome("stream", 0.0, choices=2)
    absorb_sse(out, _chunk(0, [1, 2]))
    absorb_sse(out, _chunk(1, [7]))
    absorb_sse(out, _chunk(0, [3], finish="length"))
    absorb_sse(out, _chunk(1, [8], finish="stop"))
    absorb_sse(out, json.dumps({"choices": [], "usage": {"completion_tokens": 5}}))
    absorb_sse(out, "[DONE]")
    assert out.tokens == {0: [1, 2, 3], 1: [7, 8]}
    assert out.gaps[0] == pytest.approx([1.9] * 3)
    assert out.finishes == {0: ["length"], 1: ["stop"]} and out.usage_completion == 5
    assert out.done_marks == 1 and out.after_done == 0 and out.text[0] == "xx"
    absorb_sse(out, _chunk(0, [4]))
    assert out.after_done == 1

    tool = Outcome("tools", 0.0)
    message = {"content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    absorb(tool, {"choices": [{"index": 0, "message": message,
                               "finish_reason": "tool_calls"}]}, streamed=False)  # fmt: skip
    assert tool.tool_arguments == ["{}"] and tool.finish == "tool_calls"
    failed = Outcome("stream", 0.0)
    absorb(failed, {"error": {"code": "no_worker"}}, streamed=False)
    assert failed.error == {"code": "no_worker"}


def _done(kind: str = "stream", at: float = 1.0, **kw) -> Outcome:
    o = Outcome(kind, at, ended_s=at + 1, **kw)
    o.finishes = {i: ["length"] for i in range(o.choices)}
    o.done_marks = 1
    return o


def test_ended_once_holds_for_finished_left_and_fault_time_errors_only() -> None:
    fault = Injected("worker_kill", at_s=10, lifted_s=10, recovered_s=12)
    left = Outcome("disconnect", 2.0, disconnected=True)
    during = Outcome("stream", 9.0, ended_s=11.0, error={"code": "no_worker"})
    # A client that gave up long after the fault it was caught in.
    caught = Outcome("nats_stream", 8.0, ended_s=50.0, error={"code": "client_timeout"})
    good = [_done(), _done("n2", choices=2), left, during, caught]
    assert ended_once(good, [fault], end_s=60).ok

    twice = _done()
    twice.finishes[0].append("length")
    marks = _done()
    marks.done_marks = 2
    after = _done()
    after.after_done = 1
    missing = _done("n2", choices=2)
    del missing.finishes[1]
    stray = Outcome("stream", 40.0, ended_s=41.0, error={"code": "no_worker"})
    v = ended_once([twice, marks, after, missing, stray], [fault], end_s=60)
    assert not v.ok and v.detail.startswith("5 bad")
    joined = "\n".join(v.examples)
    for words in ("finished 2 times", "2 end marks", "after the end", "choice 1 finished 0",
                  "outside any fault"):  # fmt: skip
        assert words in joined


def test_greedy_runs_equal_their_reference_up_to_a_near_tie() -> None:
    want, want_gaps = [1, 2, 3, 4], [1.0, 1.0, 1e-4, 1.0]
    assert greedy_difference([1, 2, 3, 4], [1.0] * 4, want, want_gaps) is None
    assert greedy_difference([1, 2], [1.0] * 2, want, want_gaps) is None  # cut short
    assert greedy_difference([1, 2, 9, 9], [1.0] * 4, want, want_gaps) is None  # a tie
    assert greedy_difference([1, 9], [1.0] * 2, want, want_gaps) == (
        1,
        "token 9 != 2 (top-2 gap 1.00e+00)",
    )
    assert greedy_difference([1, 2, 3, 4, 5], [1.0] * 5, want, want_gaps)[0] == 4

    refs = {"p": (want, want_gaps)}
    same = _done(reference="p")
    same.tokens, same.gaps, same.usage_completion = {0: [1, 2, 3, 4]}, {0: [1.0] * 4}, 4
    tie = _done(reference="p")
    tie.tokens, tie.gaps = {0: [1, 2, 9, 9]}, {0: [1.0] * 4}
    v = greedy_equal([same, tie, _done()], refs, [], 60)
    assert v.ok and v.detail.startswith("2 compared, 1 parted at a near tie, 0 NATS")
    lost = _done(reference="p")
    lost.tokens, lost.gaps = {0: [1, 3]}, {0: [1.0] * 2}
    miscounted = _done(reference="p")
    miscounted.tokens, miscounted.gaps, miscounted.usage_completion = {0: [1, 2]}, {0: [1.0] * 2}, 3
    v = greedy_equal([lost, miscounted], refs, [], 60)
    assert not v.ok and "at 1: token 3 != 2" in v.examples[0] and "usage says 3" in v.examples[1]


def test_tokens_whole_counts_every_choice_of_a_finished_stream() -> None:
    o = _done("n2", choices=2)
    o.tokens, o.usage_completion = {0: [1, 2], 1: [3]}, 3
    assert tokens_whole([o], [], 60).ok
    o.usage_completion = 4
    assert not tokens_whole([o], [], 60).ok
    chat = _done("tools")
    chat.usage_completion = 9  # no token ids: not counted
    assert tokens_whole([chat], [], 60).detail.startswith("0 counted")


def test_nats_clients_across_a_nats_restart_are_left_out_of_the_token_checks() -> None:
    restart = Injected("nats_restart", at_s=20, lifted_s=22, recovered_s=24)
    short = _done("nats_stream", at=19.0, reference="p")
    short.tokens, short.gaps, short.usage_completion = {0: [1, 3]}, {0: [1.0] * 2}, 3
    http = _done("stream", at=19.0, reference="p")
    http.tokens, http.gaps, http.usage_completion = {0: [1, 3]}, {0: [1.0] * 2}, 3
    refs = {"p": ([1, 2, 3], [1.0] * 3)}
    assert across_bus_restart(short, [restart], 60)
    assert not across_bus_restart(http, [restart], 60)
    assert not across_bus_restart(short, [Injected("worker_kill", 20, 20, 24)], 60)
    g = greedy_equal([short, http], refs, [restart], 60)
    t = tokens_whole([short, http], [restart], 60)
    assert "1 NATS-API clients across a NATS restart not compared" in g.detail
    assert "1 NATS-API clients across a NATS restart not counted" in t.detail
    assert len(g.examples) == 1 and len(t.examples) == 1 and "stream at 19.0s" in t.examples[0]


def test_idle_wants_every_gauge_and_spill_key_at_zero() -> None:
    assert idle({"spillway_requests_running": 0.0}, []).ok
    v = idle({"spillway_kv_cache_usage_ratio": 0.25}, ["s:a:1:0", "s:a:1:1", "s:index (b:2)"])
    assert not v.ok and v.examples == [
        "spillway_kv_cache_usage_ratio = 0.25",
        "3 spill keys in Redis: s:a:1:0, s:a:1:1, s:index (b:2)",
    ]


def test_metrics_match_the_clients_count_with_room_only_for_unheard_tokens() -> None:
    finished = _done(max_tokens=48)
    finished.usage_completion = 48
    pair = _done("n2", choices=2, max_tokens=40)
    pair.usage_completion = 80
    left = Outcome("disconnect", 2.0, disconnected=True, max_tokens=240)
    refused = Outcome("stream", 3.0, error={"code": "no_worker"}, max_tokens=96)
    outcomes = [finished, pair, left, refused]
    # The client that left: `abort`, or `length` when its run ended first; the error:
    # `error`, or nothing when it was refused before it ran.
    for reasons in ({"length": 3.0, "abort": 1.0, "error": 1.0},
                    {"length": 4.0, "error": 1.0}, {"length": 4.0}):  # fmt: skip
        assert metrics_match(outcomes, reasons, 128.0 + 240 + 96).ok
        assert metrics_match(outcomes, reasons, 128.0).ok
    v = metrics_match(outcomes, {"length": 3.0, "abort": 2.0, "timeout": 1.0}, 127.0)
    assert not v.ok
    assert v.examples == [
        "finish_reason=abort: metrics 2, clients 0 (+ up to 1 left, given up or refused)",
        "choices finished: metrics 6, clients 4 (+ up to 1 errors)",
        "generation tokens: metrics 127, clients 128 (+ at most 336 unheard)",
    ]


def test_a_request_the_client_gave_up_on_may_never_have_been_counted() -> None:
    """A NATS-API request published while NATS restarted never reaches a gateway: its
    client times out, and no counter has it. One whose client left after chunks has."""
    finished = _done(max_tokens=48)
    finished.usage_completion = 48
    lost = Outcome("nats_stream", 2.0, error={"code": "client_timeout"}, max_tokens=48)
    left = Outcome("disconnect", 3.0, disconnected=True, max_tokens=48)
    for reasons in ({"length": 1.0, "abort": 1.0}, {"length": 2.0, "abort": 1.0}):
        assert metrics_match([finished, lost, left], reasons, 48.0).ok
    v = metrics_match([finished, lost, left], {"length": 1.0}, 48.0)  # the left one uncounted
    assert not v.ok
    assert v.examples == [
        "choices finished: metrics 1, clients 2 (+ up to 1 given up by the client)"
    ]


def test_rss_growth_is_measured_past_the_warm_up_of_each_process() -> None:
    mib = 2**20
    samples = [RssSample(t, "worker", 1, (100 + t // 10) * mib) for t in range(0, 100, 5)]
    # Restarted at 80 s: its own third comes later; too few samples after it.
    samples += [RssSample(t, "scheduler", 2, 50 * mib) for t in (80, 85, 90)]
    growth = rss_growth(samples, warmup_s=30, end_s=100)
    role, base, final, g = growth[1]
    assert (role, base, final) == ("worker", 103 * mib, 109 * mib)
    assert g == pytest.approx(6 / 103)
    assert growth[2] is None
    v = rss_bounded(samples, warmup_s=30, end_s=100)
    assert not v.ok and "worker 1: 103.0 -> 109.0 MiB (+5.8%)" in v.examples[0]
    flat = [RssSample(t, "scheduler", 3, 50 * mib) for t in range(0, 100, 5)]
    flat += [RssSample(t, "gateway", 4, (50 + t) * mib) for t in range(0, 100, 5)]  # not held
    assert rss_bounded(flat, 30, 100).ok


def test_error_lines_outside_a_faults_window_fail() -> None:
    wall0 = datetime(2026, 12, 5, 8, 0, 0).timestamp()
    log = "\n".join([
        "2026-12-05 08:00:05,000 worker INFO spillway.worker: ready",
        "2026-12-05 08:00:12,500 scheduler ERROR spillway.scheduler: worker w1 lost",
        "Traceback (most recent call last):",
        "2026-12-05 08:01:40,000 gateway ERROR spillway.gateway: something broke",
    ])  # fmt: skip
    lines = error_lines(log, wall0)
    assert [t for t, _ in lines] == pytest.approx([12.5, 100.0])
    fault = Injected("worker_kill", at_s=10, lifted_s=10, recovered_s=13)
    v = errors_logged_for_faults(lines, [fault], end_s=120)
    assert not v.ok and "something broke" in v.examples[0]
    assert errors_logged_for_faults(lines[:1], [fault], end_s=120).ok
    # In the window, but about something else than the fault.
    unrelated = [(12.0, "2026-12-05 08:00:12,000 gateway ERROR x: template failed")]
    assert not errors_logged_for_faults(unrelated, [fault], end_s=120).ok


def test_the_tables_show_kinds_faults_rss_and_verdicts() -> None:
    ok = _done()
    ok.tokens = {0: [1]}
    err = Outcome("nats", 3.0, error={"code": "no_worker"})
    left = Outcome("disconnect", 4.0, disconnected=True)
    text = requests_table([ok, err, left])
    assert "length:1" in text and "no_worker:1" in text
    assert text.splitlines()[-1].split() == ["all", "3", "1", "1", "1"]
    faults = faults_table([Injected("gateway_stop", 10, 13, 14.5),
                           Injected("worker_kill", 20, 20, None)])  # fmt: skip
    assert "1.5" in faults and "never" in faults
    rss = rss_table([RssSample(t, "worker", 7, 100 * 2**20) for t in range(10)], columns=3)
    assert rss.splitlines()[0].split() == ["process", "pid", "0s", "4s", "9s"]
    assert rss.splitlines()[2].split() == ["worker", "7", "100", "100", "100"]
    full = report([ok], [], [], [idle({}, [])], {"swap-ins": 12.0})
    assert "[ok] KV blocks and spill keys back to zero at idle" in full
    assert "swap-ins     12" in full
