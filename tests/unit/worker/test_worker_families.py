"""Each supported family served from a Hugging Face folder equals transformers on the same
weights in float32: greedy tokens of concurrent rows (chunked prefill, staggered starts)
and every position's logits."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv_cache import block_table_tensor, slot_mapping_tensor
from services.worker.model import ForwardBatch
from tests.unit.worker.plans import generate
from tests.unit.worker.tiny_families import (
    FAMILIES,
    load_reference,
    reference_greedy,
    reference_logits,
    save_tiny_family,
)
from tests.unit.worker.tiny_llama import tiny_runner

PROMPTS = [[1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5], [1, 200], [1, 64, 65, 66, 67, 68, 9]]
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    family = request.param
    return save_tiny_family(tmp_path_factory.mktemp(family), family)


def test_concurrent_greedy_rows_equal_transformers(family_dir):
    reference = load_reference(family_dir)
    expected = []
    for prompt in PROMPTS:
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > 1e-3, "a near tie would make the comparison meaningless"
        expected.append(tokens)
    runner = tiny_runner(family_dir)
    assert generate(runner, PROMPTS, NEW_TOKENS, chunk=4, start_steps=[0, 1, 3]) == expected


def test_logits_of_packed_rows_equal_transformers(family_dir):
    reference = load_reference(family_dir)
    runner = tiny_runner(family_dir)
    prompts = PROMPTS[::2]
    bs = runner.block_size
    tables, block = [], 0
    for p in prompts:
        n = (len(p) + bs - 1) // bs
        tables.append(list(range(block, block + n)))
        block += n
    lens = torch.tensor([len(p) for p in prompts])
    rows = torch.repeat_interleave(torch.arange(len(prompts)), lens)
    query_start = torch.zeros(len(prompts) + 1, dtype=torch.int64)
    query_start[1:] = lens.cumsum(0)
    positions = torch.arange(int(lens.sum())) - query_start[rows]
    block_tables = block_table_tensor(tables, torch.device("cpu"))
    batch = ForwardBatch(
        token_ids=torch.tensor([t for p in prompts for t in p]),
        positions=positions,
        slot_mapping=slot_mapping_tensor(block_tables, rows, positions, bs),
        block_tables=block_tables,
        context_lens=lens.to(torch.int32),
        query_start=query_start.to(torch.int32),
        logits_indices=None,
        max_query_len=int(lens.max()),
        max_context_len=int(lens.max()),
    )
    with torch.inference_mode():
        got = runner.model.forward(batch, runner.kv_cache)  # [T, V]
    want = torch.cat([reference_logits(reference, p) for p in prompts])
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4
