"""Where a batch-1 decode step's time goes outside the forward, piece by piece:

    python -m bench.step_overhead [--reps 400] [--quantize int8] [--no-model]

Each piece is what one step of one decoding sequence costs it, measured on its own in
this process (microseconds, the minimum and the median of --reps runs: the minimum is the
cost on a quiet core, the median what this machine's load made of it):

  scheduler   the core's tick (plan, apply the result, end of tick) and the tick report
              (built, encoded) it publishes after every tick;
  codec       the step plan encoded by the scheduler and validated by the worker, the
              result back, and the news (a DeltaBatch) to the gateway and validated there;
  bus         a NATS request/reply of those bodies through a private nats-server: raw
              (nats-py alone) and through `Bus` (headers, validation, the handler task);
  worker      `ModelRunner.execute` less its forward (plan applied, batch built, result
              made), with the real model (skipped with --no-model); its sampling (one
              row's argmax over the vocabulary, timed inside the forward's time); and the
              whole execute with the forward replaced by fixed logits, in the thread's CPU
              time (what the host work costs, whatever the machine's load);
  gateway     the incremental detokenizer's push of one token and one SSE chunk's JSON.

With run-ahead the scheduler's part runs while the worker computes the next step; on a
2-core machine it still takes a core's time from the forward's threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable

from spillway.services.cli.worker_env import apply_openmp_environment
from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.shared.clock import MonotonicClock
from spillway.shared.config import load_settings
from spillway.shared.protocol import (
    DeltaBatch,
    RowResult,
    SamplingParams,
    StepPlan,
    StepResult,
    SubmitRequest,
    WorkerInfo,
    decode,
    encode,
)

Timing = tuple[float, float]  # (min, median) microseconds


def timed(fn: Callable[[], object], reps: int) -> Timing:
    fn()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return 1e6 * min(xs), 1e6 * statistics.median(xs)


def _info(vocab: int = 49152) -> WorkerInfo:
    return WorkerInfo(
        worker_id="w1", model_id="bench", num_kv_blocks=4096, block_size=16,
        max_model_len=8192, vocab_size=vocab, eos_token_ids=[2], device="cpu",
        dtype="float32", block_bytes=1 << 16,
    )  # fmt: skip


def _submit(core: SchedulerCore, request_id: str, max_tokens: int) -> None:
    error = core.add_request(
        SubmitRequest(
            request_id=request_id, gateway_id="g", prompt_token_ids=list(range(3, 131)),
            sampling=SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True,
        )
    )  # fmt: skip
    assert error is None, error


def scheduler_pieces(reps: int) -> tuple[dict[str, Timing], StepPlan, StepResult, DeltaBatch]:
    core = SchedulerCore(MonotonicClock(), SchedulerConfig(max_batch=8))
    core.attach_worker(_info())
    _submit(core, "r0", 1_000_000)
    plan = core.schedule()  # the prefill
    assert plan is not None
    core.update_from_output(plan, StepResult(step_id=plan.step_id, rows=_rows(plan)))
    core.end_tick()
    last: dict[str, object] = {}

    def tick() -> None:
        plan = core.schedule()
        assert plan is not None
        result = StepResult(step_id=plan.step_id, rows=_rows(plan), forward_s=0.008)
        last["deltas"] = core.update_from_output(plan, result)
        last["deltas"] = [*last["deltas"], *core.end_tick()]  # type: ignore[misc]
        last["plan"], last["result"] = plan, result

    pieces = {"scheduler: core tick (plan, apply, end)": timed(tick, reps)}
    pieces["scheduler: tick report built and encoded"] = timed(
        lambda: encode(core.tick_report("s1", "w1", time.time())), reps
    )
    plan, result = last["plan"], last["result"]
    assert isinstance(plan, StepPlan) and isinstance(result, StepResult)
    batch = DeltaBatch(deltas=last["deltas"])  # type: ignore[arg-type]
    return pieces, plan, result, batch


def _rows(plan: StepPlan) -> list[RowResult]:
    return [RowResult(seq_id=r.seq_id, token_id=1000 + i) for i, r in enumerate(plan.rows)]


def codec_pieces(plan: StepPlan, result: StepResult, batch: DeltaBatch, reps: int):
    plan_b, result_b, batch_b = encode(plan), encode(result), encode(batch)
    return {
        f"codec: plan encoded ({len(plan_b)} B)": timed(lambda: encode(plan), reps),
        "codec: plan validated (worker)": timed(lambda: decode(StepPlan, plan_b), reps),
        f"codec: result encoded ({len(result_b)} B)": timed(lambda: encode(result), reps),
        "codec: result validated (scheduler)": timed(lambda: decode(StepResult, result_b), reps),
        f"codec: news encoded ({len(batch_b)} B)": timed(lambda: encode(batch), reps),
        "codec: news validated (gateway)": timed(lambda: decode(DeltaBatch, batch_b), reps),
    }


async def bus_pieces(plan: StepPlan, result: StepResult, reps: int) -> dict[str, Timing]:
    from spillway.services.cli.servers import start_nats
    from spillway.shared.bus import Bus

    server = start_nats()
    try:
        a = await Bus.connect(server.url, "bench", "bench-a", sender="s")
        b = await Bus.connect(server.url, "bench", "bench-b", sender="w")
        result_b = encode(result)

        async def raw_reply(msg) -> None:
            await msg.respond(result_b)

        await b.nc.subscribe("raw.step", cb=raw_reply)

        async def handler(p: StepPlan, ctx, raw) -> StepResult:
            return result

        await b.serve("bus.step", StepPlan, handler, overlap=True)
        await b.settle()
        plan_b = encode(plan)
        out: dict[str, Timing] = {}
        for name, call in (
            ("bus: NATS request/reply, raw bytes", lambda: a.nc.request("raw.step", plan_b, 5)),
            ("bus: Bus.request -> Bus.serve (codec in)", lambda: a.request(
                "bus.step", plan, StepResult, 5)),
        ):  # fmt: skip
            xs = []
            for i in range(reps + 20):
                t0 = time.perf_counter()
                await call()
                if i >= 20:
                    xs.append(time.perf_counter() - t0)
            out[name] = (1e6 * min(xs), 1e6 * statistics.median(xs))
        await a.close()
        await b.close()
        return out
    finally:
        server.stop()


def worker_pieces(quantize: str, reps: int) -> dict[str, Timing]:
    import torch

    from spillway.services.worker.info import worker_info
    from spillway.services.worker.loading import load_runner
    from spillway.shared.config import load_settings

    settings = load_settings(device="cpu", quantize=quantize)
    runner, model_id = load_runner(settings)
    core = SchedulerCore(MonotonicClock(), SchedulerConfig(max_batch=8, run_ahead=True))
    core.attach_worker(worker_info("w", model_id, runner))
    _submit(core, "r0", 2 * reps + 100)
    steps = _decode_steps(core, runner, reps + 10)[10:]
    # The same steps with the forward replaced by logits of its shape: what is left is
    # the worker's own host work (sampling over the vocabulary included), in CPU time.
    vocab = runner.model.config.vocab_size
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 3
    runner.logits = lambda batch: logits.expand(batch.logits_indices.numel(), vocab)  # type: ignore[method-assign]
    host = _decode_steps(core, runner, reps + 10)[10:]

    def us(xs: list[float]) -> Timing:
        return 1e-3 * min(xs), 1e-3 * statistics.median(xs)

    return {
        "worker: of which the host batch (prepare_s)": us(
            [1e9 * (r.prepare_s or 0.0) for _, _, r in steps]
        ),
        f"worker: execute less forward ({model_id}, {quantize})": us(
            [wall - 1e9 * r.forward_s for wall, _, r in steps]
        ),
        "worker: sampling (sample_s, part of the forward's time)": us(
            [1e9 * (r.sample_s or 0.0) for _, _, r in steps]
        ),
        "worker: execute, forward left out: CPU time (thread)": us([cpu for _, cpu, _ in host]),
        "worker: execute, forward left out: wall": us([wall for wall, _, _ in host]),
        "(worker: whole execute, forward included)": us([wall for wall, _, _ in steps]),
    }


def _decode_steps(core: SchedulerCore, runner, count: int) -> list[tuple[int, int, StepResult]]:
    """Runs the request's steps (run-ahead: the next plan before the last result is in)
    until `count` batch-1 decode steps ran; each one's (wall ns, thread CPU ns, result)."""
    out: list[tuple[int, int, StepResult]] = []
    inflight: list[tuple[StepPlan, StepResult]] = []
    while len(out) < count:
        while core.can_schedule():
            plan = core.schedule()
            if plan is None:
                break
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            result = runner.execute(plan)
            cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
            if len(plan.rows) == 1 and len(plan.rows[0].token_ids) <= 1:
                out.append((wall, cpu, result))
            inflight.append((plan, result))
        assert inflight, "the request ended before the steps were measured"
        core.update_from_output(*inflight.pop(0))
        core.end_tick()
    for plan, result in inflight:
        core.update_from_output(plan, result)
        core.end_tick()
    return out


def gateway_pieces(reps: int) -> dict[str, Timing]:
    from spillway.services.gateway.detokenizer import IncrementalDetokenizer
    from spillway.shared.config import DEFAULT_MODEL, load_settings
    from spillway.shared.model_files import resolve_model
    from spillway.shared.tokenizer_files import load_tokenizer

    tok = load_tokenizer(resolve_model(DEFAULT_MODEL), load_settings().cache_dir)
    detok = IncrementalDetokenizer(lambda ids: tok.decode(ids))
    ids = iter(range(1000, 1000 + 10 * reps))
    chunk = {
        "id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1700000000,
        "model": "SmolLM2-135M-Instruct",
        "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}],
    }  # fmt: skip
    return {
        "gateway: detokenizer push (one token)": timed(lambda: detok.push(next(ids)), reps),
        "gateway: SSE chunk JSON": timed(lambda: f"data: {json.dumps(chunk)}\n\n".encode(), reps),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--quantize", default="int8")
    ap.add_argument("--no-model", action="store_true")
    args = ap.parse_args()
    # Before torch loads (the worker's way): OpenMP reads its wait policy once.
    apply_openmp_environment(load_settings())
    pieces, plan, result, batch = scheduler_pieces(args.reps)
    pieces.update(codec_pieces(plan, result, batch, args.reps))
    pieces.update(asyncio.run(bus_pieces(plan, result, args.reps)))
    pieces.update(gateway_pieces(args.reps))
    if not args.no_model:
        pieces.update(worker_pieces(args.quantize, args.reps))
    print(f"batch-1 decode step, outside the forward (us; load {os.getloadavg()[0]:.1f})")
    print(f"{'piece':<58} {'min':>8} {'median':>8}")
    for name, (lo, med) in pieces.items():
        print(f"{name:<58} {lo:8.1f} {med:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
