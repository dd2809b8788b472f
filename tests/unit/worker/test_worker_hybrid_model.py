"""The hybrid families (Granite 4.0-H, Qwen3-Next) end to end in the worker's hybrid model:
several rows of mixed lengths through the paged KV cache and the state pool, chunked prefill then
greedy decode, against transformers token for token and logit for logit."""

from __future__ import annotations

import pytest
import torch

from spillway.kernels.cpu import ssm as cpu_ssm
from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.forward_batch import ForwardBatch
from spillway.services.worker.kv_cache import KVCache, block_table_tensor, slot_mapping_tensor
from spillway.services.worker.models.hybrid import HybridModel
from spillway.services.worker.models.registry import load_hybrid_model, load_model_config
from spillway.services.worker.state_pool import StatePool
from spillway.shared.model_files import resolve_model
from tests.unit.worker.tiny_families import (
    load_reference,
    reference_greedy,
    reference_logits,
    save_tiny_family,
)

BS = 4  # KV block size
PROMPTS = ([5, 17, 99, 3, 42, 8, 77, 120, 9], [33, 6, 200, 14], [61, 2, 250, 7, 19, 88])
NEW_TOKENS = 4


# Qwen3-Next with a dense layer among the MoE ones (`mlp_only_layers`): its plain MLP.
WITH_DENSE = {"mlp_only_layers": [1], "intermediate_size": 40}
CASES = {"granitemoehybrid": {}, "qwen3_next": {}, "qwen3_next_dense": WITH_DENSE}
# "+native": the CPU backend with its native kernels (the recurrent layers' prefill scans
# and conv of `kernels.cpu.chunk_scan` among them), else plain torch.
PARAMS = [*CASES, "granitemoehybrid+native", "qwen3_next+native"]


@pytest.fixture(scope="module", params=PARAMS)
def hybrid(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    case, native = request.param.removesuffix("+native"), request.param.endswith("+native")
    family = case.removesuffix("_dense")
    folder = tmp_path_factory.mktemp("hm") / case
    save_tiny_family(folder, family, **CASES[case])
    config = load_model_config(resolve_model(str(folder)))
    assert config.moe is not None
    assert all(config.moe.sparse_layers) == (case != "qwen3_next_dense")
    ops = CpuOps() if native else CpuOps(native=None)
    assert not native or ops.scans is not None
    model = load_hybrid_model(folder, config, ops)
    return model, load_reference(folder)


def _batch(rows: list[tuple[list[int], int]], tables, slots, fresh, sample=True) -> ForwardBatch:
    """rows: (tokens, start position) per row."""
    lens = torch.tensor([len(t) for t, _ in rows])
    which = torch.repeat_interleave(torch.arange(len(rows)), lens)
    qs = torch.zeros(len(rows) + 1, dtype=torch.int64)
    qs[1:] = lens.cumsum(0)
    starts = torch.tensor([s for _, s in rows])
    positions = starts[which] + torch.arange(int(lens.sum())) - qs[which]
    bt = block_table_tensor(tables, torch.device("cpu"))
    ctx = starts + lens
    return ForwardBatch(
        token_ids=torch.tensor([x for t, _ in rows for x in t]),
        positions=positions,
        slot_mapping=slot_mapping_tensor(bt, which, positions, BS),
        block_tables=bt,
        context_lens=ctx.to(torch.int32),
        query_start=qs.to(torch.int32),
        logits_indices=(qs[1:] - 1) if sample else None,
        max_query_len=int(lens.max()),
        max_context_len=int(ctx.max()),
        decode_only=bool((lens == 1).all()),
        state_slots=torch.tensor(slots, dtype=torch.int64),
        state_fresh=torch.tensor(fresh),
    )


def _tables() -> list[list[int]]:
    per = (max(len(p) for p in PROMPTS) + NEW_TOKENS + BS - 1) // BS
    return [list(range(r * per, (r + 1) * per)) for r in range(len(PROMPTS))]


def _generate(model: HybridModel, slots: list[int], pool: StatePool | None = None):
    """Each prompt prefilled over two steps, then NEW_TOKENS greedy steps."""
    kv = KVCache(model.config, 64, BS, torch.float32, torch.device("cpu"))
    pool = pool or model.new_state_pool(8)
    tables = _tables()
    cut = [(len(p) + 1) // 2 for p in PROMPTS]
    out: list[list[int]] = [[] for _ in PROMPTS]
    with torch.inference_mode():
        first = [(p[:c], 0) for p, c in zip(PROMPTS, cut, strict=True)]
        model.forward(_batch(first, tables, slots, [True] * 3), kv, pool)
        rest = [(p[c:], c) for p, c in zip(PROMPTS, cut, strict=True)]
        logits = model.forward(_batch(rest, tables, slots, [False] * 3), kv, pool)
        for step in range(NEW_TOKENS):
            nxt = logits.argmax(-1).tolist()
            for r, t in enumerate(nxt):
                out[r].append(t)
            if step == NEW_TOKENS - 1:
                break
            rows = [([t], len(p) + step) for t, p in zip(nxt, PROMPTS, strict=True)]
            logits = model.forward(_batch(rows, tables, slots, [False] * 3), kv, pool)
    return out, pool


def test_chunked_prefill_and_greedy_decode_equal_transformers(hybrid) -> None:
    model, ref = hybrid
    got, _ = _generate(model, [2, 3, 4])
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        want, gap = reference_greedy(ref, prompt, NEW_TOKENS)
        assert gap > 1e-3  # clear greedy choices: equality is meaningful
        assert tokens == want


def test_full_prompt_logits_within_1e4(hybrid) -> None:
    model, ref = hybrid
    kv = KVCache(model.config, 64, BS, torch.float32, torch.device("cpu"))
    pool = model.new_state_pool(4)
    rows = [(p, 0) for p in PROMPTS]
    with torch.inference_mode():
        logits = model.forward(_batch(rows, _tables(), [0, 1, 2], [True] * 3, False), kv, pool)
    want = torch.cat([reference_logits(ref, p) for p in PROMPTS])
    assert want.std() > 0.1
    # The native backend's projections sum in another order than torch's; this tiny random
    # Qwen3-Next amplifies that to 3.7e-4 on logits up to 5.6 (with or without the native
    # scans), so its bound is relative to the largest logit.
    native = isinstance(model.ops, CpuOps) and model.ops.native is not None
    atol = 1e-4 * max(1.0, float(want.abs().max())) if native else 1e-4
    torch.testing.assert_close(logits, want, atol=atol, rtol=1e-4)


def test_scattered_slots_and_reused_slots_give_the_same_tokens(hybrid) -> None:
    model, _ = hybrid
    cpu_ssm.PATHS.clear()
    contiguous, pool = _generate(model, [2, 3, 4])
    assert cpu_ssm.PATHS["view"] > 0
    cpu_ssm.PATHS.clear()
    scattered, _ = _generate(model, [6, 0, 3])
    assert cpu_ssm.PATHS["view"] == 0 and cpu_ssm.PATHS["gather"] > 0
    assert scattered == contiguous
    # The same slots again, their states left from the first run: zeroed for new sequences.
    assert pool.ssm[0] is not None and pool.ssm[0][2:5].abs().max() > 0
    again, _ = _generate(model, [2, 3, 4], pool)
    assert again == contiguous


def test_granite_without_rope_equals_transformers(tmp_path) -> None:
    folder = save_tiny_family(
        tmp_path / "granite", "granitemoehybrid", position_embedding_type=None
    )
    config = load_model_config(resolve_model(str(folder)))
    assert config.hybrid is not None and not config.hybrid.rope
    model, ref = load_hybrid_model(folder, config, CpuOps(native=None)), load_reference(folder)
    kv = KVCache(model.config, 64, BS, torch.float32, torch.device("cpu"))
    rows = [(p, 0) for p in PROMPTS]
    with torch.inference_mode():
        logits = model.forward(
            _batch(rows, _tables(), [0, 1, 2], [True] * 3, False), kv, model.new_state_pool(3)
        )
    want = torch.cat([reference_logits(ref, p) for p in PROMPTS])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
