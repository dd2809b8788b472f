"""`spillway bench --perplexity`: the quality an inexact mode costs, on a fixed text.

The worker's own model code runs in this process on the CPU, once per mode, over the
same weights: float32 (the exact mode, the yardstick) and each weight quantization.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.model_files import ModelSource


def perplexities(
    source: ModelSource, token_ids: Sequence[int], modes: Sequence[str] = ("none", "int8")
) -> dict[str, float]:
    """Perplexity of token_ids under each quantization mode ("none": float32)."""
    import torch

    from kernels.ops import TorchOps
    from services.worker.loader import load_model
    from services.worker.model import LlamaModel
    from services.worker.quality import perplexity

    config, weights = load_model(source, torch.device("cpu"), torch.float32)
    return {
        mode: perplexity(LlamaModel(config, weights, TorchOps(quantize=mode)), token_ids)
        for mode in modes
    }


def perplexity_lines(results: dict[str, float], num_tokens: int) -> str:
    base = results.get("none")
    parts = []
    for mode, value in results.items():
        name = "float32" if mode == "none" else mode
        change = f" ({100 * (value / base - 1):+.2f}%)" if base and mode != "none" else ""
        parts.append(f"{name} {value:.3f}{change}")
    return f"perplexity of the fixed text ({num_tokens} tokens): " + ", ".join(parts)
