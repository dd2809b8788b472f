"""What a faster, inexact mode costs in quality: perplexity of a fixed text.

The model reads the text in chunks over its own paged KV cache (the serving path, prefill
and all) and scores every next token; the same text under float32 is the yardstick
(`spillway bench --perplexity` prints both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.kv_cache import KVCache, blocks_needed
from spillway.services.worker.loader import load_model
from spillway.services.worker.models.llama import LlamaModel
from spillway.services.worker.runner import ModelRunner
from spillway.shared.model_files import ModelSource
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow

SEQ_ID = "perplexity"


# A mode: the weights' quantization, then "+kv-bfloat16" where the KV cache is bfloat16.
DEFAULT_MODES = ("none", "int8", "none+kv-bfloat16", "int8+kv-bfloat16")
_KV_SUFFIX = "+kv-bfloat16"


def perplexities(
    source: ModelSource, token_ids: Sequence[int], modes: Sequence[str] = DEFAULT_MODES
) -> dict[str, float]:
    """Perplexity of token_ids under each mode ("none": float32 weights and cache), on the
    CPU over the same weights."""
    # int8 modes quantize float32 weights: a GGUF file's then load dequantized for all.
    exact_only = all(mode.removesuffix(_KV_SUFFIX) == "none" for mode in modes)
    config, weights = load_model(
        source, torch.device("cpu"), torch.float32, keep_quantized=exact_only
    )
    out = {}
    for mode in modes:
        quantize = mode.removesuffix(_KV_SUFFIX)
        kv_dtype = torch.bfloat16 if mode.endswith(_KV_SUFFIX) else None
        model = LlamaModel(config, weights, CpuOps(quantize=quantize))
        out[mode] = perplexity(model, token_ids, kv_dtype=kv_dtype)
    return out


def perplexity(
    model: LlamaModel,
    token_ids: Sequence[int],
    chunk: int = 128,
    block_size: int = 16,
    kv_dtype: torch.dtype | None = None,
) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] given the tokens before each,
    over a KV cache of `kv_dtype` (None: the model's)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    num_blocks = blocks_needed(len(token_ids), block_size)
    dtype = model.dtype if kv_dtype is None else kv_dtype
    cache = KVCache(model.config, num_blocks, block_size, dtype, model.device)
    runner = ModelRunner(model, cache)
    blocks = list(range(num_blocks))
    new = NewSequence(seq_id=SEQ_ID, sampling=SamplingParams(), block_ids=blocks)
    runner.execute(StepPlan(step_id=0, new_seqs=[new]))
    total_nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(token_ids) - 1, chunk):
            piece = list(token_ids[start : start + chunk])
            row = StepRow(seq_id=SEQ_ID, token_ids=piece, start_pos=start, sample=False)
            batch = replace(runner.host_batch([row]), logits_indices=None)  # every token
            logits = model.forward(batch.to(model.device), cache)  # [n, V]
            targets = torch.tensor(token_ids[start + 1 : start + 1 + len(piece)])
            log_probs = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
            total_nll -= float(log_probs.gather(1, targets[:, None].to(logits.device)).sum())
            count += len(targets)
    return math.exp(total_nll / count)
