"""What tracing costs per step, in one run:

    python -m bench.tracing [--requests 32] [--prompt-len 64] [--output-len 128] [--rounds 3]

Drives a scheduler core through whole generations (steps answered at once with a fixed
token, so the figure is the tracing work alone, not a model's) the way a lane does
(planning, the step's span and context, applying the result, the end-of-tick phases),
plus the worker's spans of each step, three ways: no observer at all; the span observer
with no exporter (what every deployment without --otlp-endpoint runs: request spans,
prefill chunks and phase spans, no decode or step spans); and the span observer with an
exporter attached (a batch processor whose exporter encodes every span to OTLP protobuf,
as the real one does before it posts it). Prints CPU microseconds per step (the process's,
the exporter's thread included), the overhead over no observer and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.scheduler.observer import NullObserver
from spillway.services.scheduler.tracing import SpanObserver
from spillway.services.worker.step_spans import StepSpans
from spillway.shared.clock import MonotonicClock
from spillway.shared.protocol import (
    RowResult,
    SamplingParams,
    StepPlan,
    StepResult,
    SubmitRequest,
    WorkerInfo,
)
from spillway.shared.telemetry import Telemetry

BLOCK_SIZE = 16


class EncodingExporter(SpanExporter):
    """Encodes each batch to OTLP protobuf and drops it (no network in the figure)."""

    def __init__(self) -> None:
        self.num_spans = 0
        self.num_bytes = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.num_spans += len(spans)
        self.num_bytes += len(encode_spans(spans).SerializeToString())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _result(plan: StepPlan) -> StepResult:
    rows = [RowResult(seq_id=row.seq_id, token_id=7) for row in plan.rows if row.sample]
    return StepResult(step_id=plan.step_id, rows=rows, forward_s=0.001)


def run(args: argparse.Namespace, mode: str) -> tuple[float, int, int]:
    """Seconds per step, steps, spans exported."""
    clock = MonotonicClock()
    tel = Telemetry("scheduler", None)
    exporter = EncodingExporter()
    if mode == "exporter":
        tel.exporting = True
        tel.provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=500, max_queue_size=1 << 16)
        )
    tracer = SpanObserver(tel, clock, lambda: "bench") if mode != "none" else None
    worker_spans = StepSpans(tel.tracer, "bench")
    blocks_per_seq = -(-(args.prompt_len + args.output_len) // BLOCK_SIZE)
    config = SchedulerConfig(
        max_batch=args.requests, max_num_batched_tokens=max(512, args.prompt_len * 4)
    )
    core = SchedulerCore(clock, config, tracer if tracer is not None else NullObserver())
    core.attach_worker(
        WorkerInfo(
            worker_id="w", model_id="bench", num_kv_blocks=blocks_per_seq * args.requests + 8,
            block_size=BLOCK_SIZE, max_model_len=4096, vocab_size=1000, eos_token_ids=[2],
            device="cpu", dtype="float32", block_bytes=4096,
        )
    )  # fmt: skip
    for i in range(args.requests):
        prompt = [(i * 131 + j) % 900 + 10 for j in range(args.prompt_len)]
        request = SubmitRequest(
            request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=args.output_len,
            gateway_id="g", sampling=SamplingParams(), ignore_eos=True,
        )  # fmt: skip
        assert core.add_request(request) is None
    steps = 0
    # CPU time of the whole process (the exporter's thread included), not wall time: what
    # tracing costs, whatever a busy neighbour does to the wall clock.
    started = time.process_time()
    while core.has_work():
        if tracer is not None:
            tracer.start_tick("w")
        plan = core.schedule()
        if plan is not None:
            context = tracer.step_sent(plan) if tracer is not None else None
            result = _result(plan)
            if tel.exporting and context is not None:
                now = time.time_ns()
                worker_spans.step(plan, context, result, (now, now), [])
            core.update_from_output(plan, result)
            steps += 1
        core.end_tick()
        if tracer is not None:
            tracer.end_tick({"spillway.step.rows": len(plan.rows) if plan else 0})
    worker_spans.flush()
    tel.provider.force_flush()  # the export's encoding counts too
    elapsed = time.process_time() - started
    tel.shutdown()
    return elapsed / max(steps, 1), steps, exporter.num_spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    modes = ("none", "no-exporter", "exporter")
    per_step: dict[str, list[float]] = {m: [] for m in modes}
    spans = 0
    steps = 0
    for _ in range(args.rounds):
        for mode in modes:  # interleaved, so that a busy neighbour hits every mode alike
            seconds, steps, exported = run(args, mode)
            per_step[mode].append(seconds)
            spans = exported or spans
    base = statistics.median(per_step["none"])
    print(
        f"{args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output "
        f"tokens): {steps} steps, {spans} spans exported per run ({spans / steps:.1f} a step)"
    )
    print(f"{'observer':<14} {'cpu us/step':>11} {'overhead us':>12} {'ratio':>7}")
    for mode in modes:
        us = 1e6 * statistics.median(per_step[mode])
        print(f"{mode:<14} {us:11.1f} {us - 1e6 * base:12.1f} {us / (1e6 * base):7.2f}")


if __name__ == "__main__":
    main()
