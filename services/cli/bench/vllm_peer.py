"""The vLLM peer of `spillway bench --compare`, run by a Python that has vLLM's CPU build
(python vllm_peer.py < spec.json > result.json).

Standalone on purpose: it imports nothing of spillway, so any environment with vLLM can
run it. Reads {"model" (a Hugging Face folder), "prompts", "max_tokens", "batch_size",
"dtype"} on stdin; prints one JSON line {"output_ids", "duration_s", "note"}. Its threads
are vLLM's to place (below).

vLLM's offline `LLM.generate`, greedy, `ignore_eos`, each group of `batch_size` requests
handed over at once (its scheduler batches them continuously, as its server would);
groups one after another. Only the generation is timed: the load, vLLM's compilation and
one short warm-up request come before the clock starts.
"""

from __future__ import annotations

import json
import os
import sys
import time

# vLLM's largest KV block on the CPU, in tokens (a sequence's last block is whole).
BLOCK = 128


def kv_cache_bytes(
    folder: str, dtype: str, prompts: list[list[int]], max_tokens: list[int], size: int
) -> int:
    """Room for the keys and values of the largest group of `size` requests, each rounded
    up a block, with a quarter to spare. vLLM's CPU build otherwise claims a share of the
    machine's whole memory (and refuses to start on a machine others use)."""
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    per_token = 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim
    per_token *= 4 if dtype == "float32" else 2
    lengths = [len(p) + m + BLOCK for p, m in zip(prompts, max_tokens, strict=True)]
    most = max(sum(lengths[i] for i in group) for group in groups(len(lengths), size))
    return int(per_token * most * 1.25) + (64 << 20)


def groups(count: int, size: int) -> list[range]:
    return [range(i, min(i + size, count)) for i in range(0, count, size)]


def generate(llm, sampling_params, prompts: list[list[int]], max_tokens: list[int], size: int):
    """Each request's generated token ids, in order; `size` requests per `LLM.generate`."""
    outputs: list[list[int]] = []
    for group in groups(len(prompts), size):
        answers = llm.generate(
            [{"prompt_token_ids": prompts[i]} for i in group],
            [sampling_params(max_tokens[i]) for i in group],
            use_tqdm=False,
        )
        outputs += [list(a.outputs[0].token_ids) for a in answers]
    return outputs


def main() -> None:
    # vLLM and its engine process log to stdout: the answer goes to the real stdout, kept
    # aside, and everything else (this process's and its children's) to stderr.
    answer_to = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    spec = json.loads(sys.stdin.read())

    import vllm
    from vllm import LLM, SamplingParams

    prompts, max_tokens, size = spec["prompts"], spec["max_tokens"], spec["batch_size"]
    dtype = spec.get("dtype", "float32")
    # Threads: vLLM's own binding (VLLM_CPU_OMP_THREADS_BIND, "auto" unless set) keeps one
    # core for its engine's scheduler loop, which spins; the model's threads sharing that
    # core ran at half the speed or less on a 2-core machine.
    llm = LLM(
        model=spec["model"],
        dtype=dtype,
        max_model_len=max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True)),
        max_num_seqs=max(size, 1),
        kv_cache_memory_bytes=kv_cache_bytes(spec["model"], dtype, prompts, max_tokens, size),
        seed=0,
        # Token ids in, token ids out: a folder without a tokenizer (the benchmarks' random
        # models) loads too.
        skip_tokenizer_init=True,
    )

    def greedy(n: int):
        # min_tokens and ignore_eos: exactly n tokens, as every peer generates.
        return SamplingParams(
            temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False
        )

    generate(llm, greedy, [prompts[0][:4]], [2], 1)  # warm up
    start = time.perf_counter()
    outputs = generate(llm, greedy, prompts, max_tokens, size)
    duration = time.perf_counter() - start
    bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    note = (
        f"vLLM {vllm.__version__} LLM.generate, {dtype}, {size} at a time,"
        f" VLLM_CPU_OMP_THREADS_BIND={bound}"
    )
    answer_to.write(json.dumps({"output_ids": outputs, "duration_s": duration, "note": note}))
    answer_to.write("\n")
    answer_to.flush()


if __name__ == "__main__":
    main()
