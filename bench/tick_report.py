"""What a tick report costs, against the tick it describes:

    python -m bench.tick_report [--seqs 32] [--ticks 2000]

Drives a scheduler core (no model: a worker stand-in that samples a fixed token) with
`--seqs` sequences decoding together on a KV cache small enough for preemptions, and
measures per tick, in microseconds: the core's own work (schedule, apply the result, end
of tick), the same with the tick log switched off (what recording the phases adds; the
two cores tick in turn), and building the report, encoding it and publishing it to a
private nats-server. Prints the report's size and the report's cost as a share of the
core's tick (a real tick also waits for the model's forward, milliseconds: the share
there is far smaller).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from spillway.services.cli.servers import start_nats
from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.scheduler.tick_report import TickLog
from spillway.shared.bus import Bus
from spillway.shared.clock import MonotonicClock
from spillway.shared.protocol import (
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
        MonotonicClock(),
        SchedulerConfig(max_batch=seqs, max_num_batched_tokens=4096),
        ticks=None if log_on else _Off(),
    )
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


class _Driver:
    """One core with its batch kept full."""

    def __init__(self, seqs: int, log_on: bool) -> None:
        self.seqs = seqs
        self.core = _core(seqs, log_on)
        _submit(self.core, seqs, 0)
        self.submitted = seqs
        self.tick_s: list[float] = []

    def tick(self) -> None:
        core = self.core
        t0 = time.perf_counter()
        plan = core.schedule()
        if plan is not None:
            core.update_from_output(plan, _result(plan))
        core.end_tick()
        self.tick_s.append(time.perf_counter() - t0)
        if core.num_live < self.seqs:
            _submit(core, self.seqs - core.num_live, self.submitted)
            self.submitted += self.seqs


async def main_async(seqs: int, ticks: int) -> None:
    # Two cores tick by tick in turn, one recording and one not, so that whatever else
    # the machine does weighs on both alike; the recording one's reports are built,
    # encoded and published (timed on their own).
    server = start_nats()
    try:
        bus = await Bus.connect(server.url, "bench", "bench-tick")
        on, off = _Driver(seqs, True), _Driver(seqs, False)
        report_s: list[float] = []
        sizes: list[int] = []
        for i in range(ticks):
            for driver in (on, off) if i % 2 else (off, on):
                driver.tick()
            t0 = time.perf_counter()
            body = encode(on.core.tick_report("s1", "w1", time.time()))
            await bus.publish("sched.s1.tick", body)
            report_s.append(time.perf_counter() - t0)
            sizes.append(len(body))
        await bus.close()
    finally:
        server.stop()
    core_on = 1e6 * statistics.median(on.tick_s)
    core_off = 1e6 * statistics.median(off.tick_s)
    report = 1e6 * statistics.median(report_s)
    record = core_on - core_off
    preemptions = sum(on.core.stats.preemptions.values())
    print(f"{seqs} sequences, {ticks} ticks, {preemptions} preemptions (medians per tick)")
    print(f"core tick, tick log off        {core_off:9.1f} us")
    print(f"core tick, tick log on         {core_on:9.1f} us  ({record:+.1f} us recording)")
    print(f"report: build+encode+publish   {report:9.1f} us "
          f"({1e6 * statistics.fmean(report_s):.1f} us mean), "
          f"{statistics.median(sizes):.0f} bytes")  # fmt: skip
    cost = report + max(0.0, record)
    print(f"report cost / core tick        {cost / core_on:9.3f}")
    for step_ms in (5, 30):
        share = cost / (core_on + 1000 * step_ms)
        print(f"report cost / tick with a {step_ms:2d} ms step {share:7.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--ticks", type=int, default=2000)
    args = parser.parse_args()
    asyncio.run(main_async(args.seqs, args.ticks))


if __name__ == "__main__":
    main()
