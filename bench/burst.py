"""A burst of prompts against the real model in one process, policy by policy:

    python -m bench.burst [--streams 16] [--input-len 128] [--output-len 32]
                          [--quantize int8] [--policies 512,512:60] [--repeats 2]

The scheduler core plans, the model runner executes each plan at once, in order (no bus,
no HTTP, no run-ahead overlap): what is left is the scheduling policy against this CPU's
real step costs. All requests arrive at time 0; a request's TTFT is the end of the step
that sampled its first token, its inter-token latencies the gaps between the steps that
sampled its next ones. `--streams-first N` starts N of the streams first and sends the
rest once those decode (new prompts beside running streams). A policy is a token budget
(`max_num_batched_tokens`), optionally with a step target in ms (`512:60`: itl_target_s
0.06, see services/scheduler/prefill_budget.py). Prints, per policy, TTFT and ITL
medians, the steps' count and the prefill rate (prompt tokens per second of steps that
only prefilled), with the load average. Policies alternate within each repeat, so a busy
machine costs each alike.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from spillway.services.cli.worker_env import apply_openmp_environment
from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.shared.clock import MonotonicClock
from spillway.shared.config import DEFAULT_MODEL, load_settings
from spillway.shared.protocol import SamplingParams, SubmitRequest


@dataclass
class BurstRun:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    steps: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)

    def line(self, name: str) -> str:
        rate = self.prefill_tokens / self.prefill_s if self.prefill_s else float("nan")
        itl = statistics.median(self.itl_s)
        return (
            f"{name:<14} TTFT median {statistics.median(self.ttft_s) * 1e3:7.0f} ms  "
            f"max {max(self.ttft_s) * 1e3:7.0f}  ITL median {itl * 1e3:6.1f} ms  "
            f"p90 {_quantile(self.itl_s, 0.9) * 1e3:6.1f}  steps {self.steps:4d}  "
            f"prefill {rate:6.0f} tok/s  load {os.getloadavg()[0]:.1f}"
        )


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def burst(runner, prompts: list[list[int]], output_len: int, policy: str, first: int = 0):
    budget, _, itl_ms = policy.partition(":")
    config = SchedulerConfig(
        max_batch=64,
        max_num_batched_tokens=int(budget),
        itl_target_s=float(itl_ms) / 1e3 if itl_ms else None,
    )
    from spillway.services.worker.info import worker_info

    core = SchedulerCore(MonotonicClock(), config)
    core.attach_worker(worker_info("w", "m", runner))
    tag = next(_runs)

    def submit(i: int, prompt: list[int]) -> None:
        error = core.add_request(
            SubmitRequest(
                request_id=f"r{tag}-{i}",
                gateway_id="g",
                prompt_token_ids=prompt,
                sampling=SamplingParams(temperature=0.0),
                max_tokens=output_len,
                ignore_eos=True,
            )
        )
        assert error is None, error

    for i, prompt in enumerate(prompts[: first or len(prompts)]):
        submit(i, prompt)
    run = BurstRun()
    start = time.perf_counter()
    last: dict[str, float] = {}
    sent = first or len(prompts)
    late: set[str] = set()
    start_rest = 0.0
    done = 0
    while done < len(prompts):
        if sent < len(prompts) and len(last) == sent:  # the first ones decode: the rest come
            for i in range(sent, len(prompts)):
                submit(i, prompts[i])
            sent = len(prompts)
            start_rest = time.perf_counter() - start
            late = {f"r{tag}-{i}" for i in range(first, len(prompts))}
        plan = core.schedule()
        assert plan is not None
        t0 = time.perf_counter()
        result = runner.execute(plan)
        t1 = time.perf_counter()
        run.steps += 1
        run.step_s.append(t1 - t0)
        if all(len(row.token_ids) > 1 for row in plan.rows):
            run.prefill_tokens += sum(len(row.token_ids) for row in plan.rows)
            run.prefill_s += t1 - t0
        now = t1 - start
        for delta in core.update_from_output(plan, result):
            if delta.token_ids:
                before = last.get(delta.request_id)
                if before is None and (not first or delta.request_id in late):
                    run.ttft_s.append(now - start_rest)
                elif before is not None:
                    run.itl_s.append((now - before) / len(delta.token_ids))
                last[delta.request_id] = now
            if delta.finish_reason is not None:
                done += 1
        core.sweep_deadlines()
        core.finish_tick()
    return run


_runs = itertools.count()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--quantize", default="int8")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--streams-first", type=int, default=0)
    ap.add_argument("--policies", default="512,512:60")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    # Before torch loads (the worker's way): OpenMP reads its wait policy once, and
    # spinning threads on a busy 2-core machine lose most of their speed.
    apply_openmp_environment(load_settings())
    from spillway.services.worker.loading import load_runner

    settings = load_settings(model=args.model, device="cpu", quantize=args.quantize or None)
    runner, model_id = load_runner(settings)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.streams)
    ]
    policies = args.policies.split(",")
    burst(runner, prompts[:2], 2, policies[0])  # warm
    print(f"{model_id}, {args.streams} x {args.input_len} + {args.output_len}, {args.quantize}")
    for _ in range(args.repeats):
        for policy in policies:
            run = burst(runner, prompts, args.output_len, policy, args.streams_first)
            print(run.line(f"policy {policy}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
