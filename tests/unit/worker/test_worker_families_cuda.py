"""Every served family on CUDA (Triton kernels where they apply): the real scheduler core
driving the real runner on the device, concurrent greedy requests through chunked prefill,
equal to transformers on the CPU in float32, and sane in bfloat16."""

from __future__ import annotations

import pytest
import torch

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.worker.info import worker_info
from spillway.services.worker.loading import load_runner
from spillway.shared.clock import FakeClock
from spillway.shared.config import load_settings
from spillway.shared.protocol import SamplingParams, SubmitRequest
from tests.unit.worker.tiny_families import (
    FAMILIES,
    HYBRID_FAMILIES,
    TINY_VOCAB,
    load_reference,
    reference_greedy,
    save_tiny_family,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(4 + 7 * i)] for i in range(3)]
NEW_TOKENS = 8


def _serve(folder, dtype: str) -> list[list[int]]:
    settings = load_settings(
        model=str(folder), kv_blocks=64, block_size=16, state_slots=8, device="cuda",
        dtype=dtype, spill_store=False,
    )  # fmt: skip
    runner, _ = load_runner(settings)
    core = SchedulerCore(FakeClock(), SchedulerConfig(max_batch=8, max_num_batched_tokens=12))
    core.attach_worker(worker_info("w", "tiny", runner))
    for i, prompt in enumerate(PROMPTS):
        request = SubmitRequest(
            request_id=f"r{i}", gateway_id="g", prompt_token_ids=prompt,
            sampling=SamplingParams(temperature=0.0), max_tokens=NEW_TOKENS, ignore_eos=True,
        )  # fmt: skip
        assert core.add_request(request, None) is None
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    done: set[str] = set()
    for _ in range(500):
        plan = core.schedule()
        deltas = [] if plan is None else core.update_from_output(plan, runner.execute(plan))
        for d in [*deltas, *core.end_tick()]:
            out[d.request_id] += d.token_ids
            if d.finish_reason is not None:
                done.add(d.request_id)
        if len(done) == len(PROMPTS) and not core.has_work():
            break
    assert core.kv_usage == 0.0
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("family", sorted({*FAMILIES, *HYBRID_FAMILIES}))
def test_family_on_cuda_equals_transformers(family, tmp_path):
    folder = save_tiny_family(tmp_path / family, family)
    reference = load_reference(folder)
    want = []
    for prompt in PROMPTS:
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > 1e-3, "a near tie would make the comparison meaningless"
        want.append(tokens)
    assert _serve(folder, "float32") == want
    half = _serve(folder, "bfloat16")
    assert all(len(o) == NEW_TOKENS and all(0 <= t < TINY_VOCAB for t in o) for o in half)
