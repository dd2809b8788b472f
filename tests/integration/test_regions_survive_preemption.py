"""A sequence preempted inside a think block continues in it: the real scheduler core drives
the real runner with the scripted think model (tests/unit/worker/think_llama.py) under KV
pressure, and every sequence's tokens equal those of a run without pressure.

The sequences sample at temperature 1 inside the think block (adaptive sampling) and
greedily outside it: a sequence that came back in the wrong region would decode greedily
and leave the tokens it had without preemption. (Spilled sequences come back the same
way, as a NewSequence with their tokens; until spilling exists, victims are recomputed.)
"""

from __future__ import annotations

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.worker.runner import load_runner
from services.worker.service import worker_info
from shared.clock import FakeClock
from shared.config import load_settings
from shared.protocol import RegionSampling, SamplingParams, SubmitRequest
from tests.unit.worker.think_llama import save_think_llama

PROMPTS = [[(7 * i + j) % 400 + 300 for j in range(6 + 9 * i)] for i in range(6)]
NEW_TOKENS = 40
THINKING = SamplingParams(
    temperature=0.0,
    initial_region="think",
    region_sampling={"think": RegionSampling(temperature=1.0)},
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_think_llama(tmp_path_factory.mktemp("think"))


def _serve_all(model_dir, kv_blocks: int, sampling: SamplingParams):
    settings = load_settings(model=str(model_dir), kv_blocks=kv_blocks, device="cpu")
    runner, _ = load_runner(settings)
    core = SchedulerCore(FakeClock(), SchedulerConfig(max_batch=6, max_num_batched_tokens=24))
    core.attach_worker(worker_info("w", "think", runner))
    for i, prompt in enumerate(PROMPTS):
        request = SubmitRequest(
            request_id=f"r{i}",
            gateway_id="g",
            prompt_token_ids=prompt,
            sampling=sampling.model_copy(update={"seed": 100 + i}),
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
        )
        assert core.add_request(request) is None
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    finished = set()
    regions_when_preempted: list[str] = []
    for _ in range(2000):
        before = core.preemptions["recompute"]
        plan = core.schedule()
        if core.preemptions["recompute"] > before:
            # The victims' states are still on the worker until this plan reaches it.
            regions_when_preempted += [
                runner.sampling.get(seq_id).region
                for seq_id in plan.finished_seq_ids
                if runner.sampling.get(seq_id) is not None
            ]
        deltas = core.update_from_output(plan, runner.execute(plan)) if plan else []
        for d in [*deltas, *core.end_tick()]:
            outputs[d.request_id] += d.token_ids
            if d.finish_reason is not None:
                finished.add(d.request_id)
        core.check_integrity()
        if len(finished) == len(PROMPTS):
            break
    return outputs, core, regions_when_preempted


def test_a_sequence_preempted_inside_a_think_block_continues_in_it(model_dir):
    roomy, roomy_core, _ = _serve_all(model_dir, kv_blocks=64, sampling=THINKING)
    tight, tight_core, regions = _serve_all(model_dir, kv_blocks=10, sampling=THINKING)
    assert roomy_core.preemptions["recompute"] == 0
    assert tight_core.preemptions["recompute"] > 0
    assert "think" in regions  # some victims were inside their think block
    assert all(len(tokens) == NEW_TOKENS for tokens in roomy.values())
    assert tight == roomy
    # Were the region lost (plain), decoding would be greedy: other tokens.
    plain, _, _ = _serve_all(
        model_dir, kv_blocks=64, sampling=THINKING.model_copy(update={"initial_region": "plain"})
    )
    assert plain != roomy
