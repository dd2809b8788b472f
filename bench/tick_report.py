"""What a tick report costs, against the tick it describes:

    python -m bench.tick_report [--seqs 32] [--ticks 2000]

Drives a scheduler core (no model: a worker stand-in that samples a fixed token) with
`--seqs` sequences decoding together on a KV cache small enough for preemptions, and
measures per tick, in microseconds: the core's own work (schedule, apply the result, end
of tick), the same with the tick log switched off (what recording the phases adds), and
building the report, encoding it and publishing it to a private nats-server. Prints the
report's size and the report's cost as a share of the core's tick (a real tick also
waits for the model's forward, milliseconds: the share there is far smaller).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from services.cli.servers import start_nats
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.tick_report import TickLog
from shared.bus import Bus
from shared.clock import MonotonicClock
from shared.protocol import (
    FinishReason,
    RowResult,
    SamplingParams,
    StepPlan,
    StepResult,
    SubmitRequest,
    TickPhaseName,
    WorkerInfo,
    encode,
)


class _Off(TickLog):
    """A tick log that records nothing (the baseline)."""

    def timed(self, name: TickPhaseName, seconds: float) -> None:
        pass

    def swept(self, request_id: str) -> None:
        pass

    def retired(self, request_id: str, finish_reason: FinishReason) -> None:
        pass

    def swapped_in(self, request_id: str, num_bytes: int) -> None:
        pass

    def resumed(self, request_id: str) -> None:
        pass

    def admitted(self, request_id: str, cached_tokens: int) -> None:
        pass

    def preempted(self, request_id: str, mode: str, num_bytes: int) -> None:
        pass

    def stepped(self, rows: int, tokens: int, sampled: int) -> None:
        pass


def _result(plan: StepPlan) -> StepResult:
    rows = [RowResult(seq_id=r.seq_id, token_id=100) for r in plan.rows if r.sample]
    return StepResult(step_id=plan.step_id, rows=rows)


def _core(seqs: int, log_on: bool) -> SchedulerCore:
    core = SchedulerCore(
        MonotonicClock(), SchedulerConfig(max_batch=seqs, max_num_batched_tokens=4096)
    )
    if not log_on:
        core.ticks = _Off()
    # Room for about 3/4 of the sequences at full length: preemptions happen.
    info = WorkerInfo(
        worker_id="w1", model_id="bench", num_kv_blocks=seqs * 12, block_size=16,
        max_model_len=4096, vocab_size=1000, eos_token_ids=[2], device="cpu",
        dtype="float32", block_bytes=1 << 16,
    )  # fmt: skip
    core.attach_worker(info)
    return core


def _submit(core: SchedulerCore, n: int, start: int) -> None:
    for i in range(start, start + n):
        core.add_request(
            SubmitRequest(
                request_id=f"r{i}", gateway_id="g", prompt_token_ids=[3 + i % 50] * 64,
                sampling=SamplingParams(temperature=0.0), max_tokens=200, ignore_eos=True,
            )
        )  # fmt: skip


async def _run(seqs: int, ticks: int, log_on: bool, bus: Bus | None) -> dict[str, float]:
    core = _core(seqs, log_on)
    _submit(core, seqs, 0)
    submitted = seqs
    core_s: list[float] = []
    report_s: list[float] = []
    sizes: list[int] = []
    for _ in range(ticks):
        t0 = time.perf_counter()
        plan = core.schedule()
        if plan is not None:
            core.update_from_output(plan, _result(plan))
        core.end_tick()
        t1 = time.perf_counter()
        core_s.append(t1 - t0)
        if bus is not None:
            report = core.tick_report("s1", "w1", time.time())
            body = encode(report)
            await bus.publish("sched.s1.tick", body)
            report_s.append(time.perf_counter() - t1)
            sizes.append(len(body))
        if core.num_live < seqs:  # keep the batch full
            _submit(core, seqs - core.num_live, submitted)
            submitted += seqs
    out = {
        "core_us": 1e6 * statistics.median(core_s),
        "preemptions": sum(core.preemptions.values()),
    }
    if report_s:
        out["report_us"] = 1e6 * statistics.median(report_s)
        out["report_mean_us"] = 1e6 * statistics.fmean(report_s)
        out["bytes"] = statistics.median(sizes)
    return out


async def main_async(seqs: int, ticks: int) -> None:
    server = start_nats(jetstream=False)
    try:
        bus = await Bus.connect(server.url, "bench", "bench-tick")
        # Alternated, best of three each: the machine may be shared.
        ons, offs = [], []
        for _ in range(3):
            offs.append(await _run(seqs, ticks, False, None))
            ons.append(await _run(seqs, ticks, True, bus))
        await bus.close()
        on = min(ons, key=lambda r: r["core_us"])
        on["report_us"] = min(r["report_us"] for r in ons)
        off = min(offs, key=lambda r: r["core_us"])
    finally:
        server.stop()
    record = on["core_us"] - off["core_us"]
    print(f"{seqs} sequences, {ticks} ticks, {on['preemptions']:.0f} preemptions")
    print(f"core tick (log off)            {off['core_us']:9.1f} us (median)")
    print(f"core tick (log on)             {on['core_us']:9.1f} us  (+{record:.1f} recording)")
    print(f"report: build+encode+publish   {on['report_us']:9.1f} us (median), "
          f"{on['report_mean_us']:.1f} us mean, {on['bytes']:.0f} bytes")  # fmt: skip
    share = (on["report_us"] + max(0.0, record)) / on["core_us"]
    print(f"report cost / core tick        {share:9.2f}")
    for step_ms in (5, 30):
        tick_us = on["core_us"] + 1000 * step_ms
        print(
            f"report cost / tick with a {step_ms:2d} ms step {share * on['core_us'] / tick_us:7.4f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--ticks", type=int, default=2000)
    args = parser.parse_args()
    asyncio.run(main_async(args.seqs, args.ticks))


if __name__ == "__main__":
    main()
