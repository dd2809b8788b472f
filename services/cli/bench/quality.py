"""`spillway bench --perplexity`: the quality an inexact mode costs, on a fixed text.

The worker's own model code runs in this process on the CPU, once per mode, over the
same weights: float32 (the exact mode, the yardstick), each weight quantization, and each
of them over a bfloat16 KV cache (`--kv-cache-dtype bfloat16`)
(`services.worker.quality.perplexities`, the one worker entry the CLI calls in-process).
"""

from __future__ import annotations


def perplexity_lines(results: dict[str, float], num_tokens: int) -> str:
    base = results.get("none")
    parts = []
    for mode, value in results.items():
        name = "float32" if mode == "none" else mode.replace("none+", "float32 weights+")
        change = f" ({100 * (value / base - 1):+.2f}%)" if base and mode != "none" else ""
        parts.append(f"{name} {value:.3f}{change}")
    return f"perplexity of the fixed text ({num_tokens} tokens): " + ", ".join(parts)
