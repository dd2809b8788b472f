"""Decode-step latency of the worker's runner: `python -m services.worker.benchmark`.

One real prompt is prefilled once and its full blocks are shared by all B sequences (as a
prefix-cache hit would), so every row attends to `context` real tokens; then each step
decodes one sampled token per sequence, fed back the next step, as the scheduler's steady
state does. Prints the median and best ms per step for each batch size.
"""

from __future__ import annotations

import argparse
import statistics
import time

from services.worker.runner import ModelRunner, load_runner
from shared.config import load_settings
from shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow

# A plain English sentence in SmolLM2's vocabulary, repeated up to the context length.
TEXT_TOKENS = [
    504, 1463, 282, 260, 4469, 7057, 5634, 351, 260, 14465, 282, 260, 2240, 282, 7268, 28,
    527, 2289, 288, 9675, 5024, 281, 216, 39, 37, 35, 7636, 645, 260, 22734, 7810, 16884,
    284, 3579, 376,
]  # fmt: skip
SAMPLING = SamplingParams(temperature=0.8, top_p=0.95)


def decode_step_times(
    runner: ModelRunner,
    batch: int,
    context: int,
    steps: int,
    sampling: SamplingParams = SAMPLING,
) -> list[float]:
    bs = runner.block_size
    context -= context % bs  # whole shared blocks: each sequence writes only its own
    shared = list(range(context // bs))
    own = (steps + bs - 1) // bs
    if len(shared) + batch * own > runner.num_kv_blocks:
        raise SystemExit(f"needs {len(shared) + batch * own} KV blocks, has {runner.num_kv_blocks}")
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences)))
    prompt = (TEXT_TOKENS * (context // len(TEXT_TOKENS) + 1))[:context]
    prefill = StepPlan(
        step_id=0,
        new_seqs=[NewSequence(seq_id="prefix", sampling=SAMPLING, block_ids=shared)],
        rows=[StepRow(seq_id="prefix", token_ids=prompt[:-1], start_pos=0, sample=False)],
    )
    runner.execute(prefill)
    first = len(shared)
    new = [
        NewSequence(
            seq_id=f"s{i}",
            sampling=sampling.model_copy(update={"seed": i}),
            block_ids=shared + list(range(first + i * own, first + (i + 1) * own)),
        )
        for i in range(batch)
    ]
    runner.execute(StepPlan(step_id=0, new_seqs=new))
    last = [prompt[-1]] * batch
    times = []
    for s in range(steps):
        rows = [
            StepRow(
                seq_id=f"s{i}",
                token_ids=[last[i]],
                start_pos=context - 1 + s,
                sample=True,
                output_index=s,
            )
            for i in range(batch)
        ]
        start = time.perf_counter()
        result = runner.execute(StepPlan(step_id=s + 1, rows=rows))
        times.append(time.perf_counter() - start)
        if result.error is not None:
            raise SystemExit(result.error.message)
        last = [r.token_id for r in result.rows]
    return times[1:]  # the first step warms the allocator and caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--temperature", type=float, default=SAMPLING.temperature)
    parser.add_argument("--top-p", type=float, default=SAMPLING.top_p)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    settings = load_settings(model=args.model, dtype=args.dtype, device=args.device, kv_blocks=512)
    runner, model_id = load_runner(settings)
    print(
        f"{model_id} on {runner.model.device} ({runner.model.dtype}), context {args.context},"
        f" temperature {args.temperature}, top_p {args.top_p}"
    )
    for batch in args.batch:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
        times = decode_step_times(runner, batch, args.context, args.steps, sampling)
        median, best = statistics.median(times) * 1e3, min(times) * 1e3
        print(
            f"batch {batch:3d}: {median:7.1f} ms/step median, {best:7.1f} best,"
            f" {batch / statistics.median(times):7.1f} tok/s"
        )


if __name__ == "__main__":
    main()
