"""The llama.cpp peer of `spillway bench --compare`, run by a Python that has
`llama-cpp-python` (python llama_cpp_peer.py < spec.json > result.json).

Standalone on purpose: it imports nothing of spillway, so any environment with
llama-cpp-python (and numpy) can run it. Reads {"model", "prompts", "max_tokens",
"batch_size", "threads"} and optionally "extra_bufts" (false: no weights repacked into
llama.cpp's extra buffer types) on stdin; prints one JSON line {"output_ids", "duration_s", "note"}.

Batched greedy decoding through llama.cpp's own API (llama_batch, one sequence id per
request), as llama.cpp's `batched` example does: each group of `batch_size` requests is
prefilled together, then decoded one token per sequence per llama_decode call.
"""

from __future__ import annotations

import json
import os
import sys
import time

import llama_cpp
import numpy as np


def _first(*names: str):
    """The first of these llama_cpp functions that exists (names moved between versions)."""
    for name in names:
        fn = getattr(llama_cpp, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"llama_cpp has none of {names}")


class Batch:
    def __init__(self, capacity: int, num_seqs: int) -> None:
        self.capacity = capacity
        self.raw = llama_cpp.llama_batch_init(capacity, 0, num_seqs)

    def fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence id, wants logits)."""
        b = self.raw
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits else 0

    def free(self) -> None:
        llama_cpp.llama_batch_free(self.raw)


def generate_group(model, prompts: list[list[int]], max_tokens: list[int], threads: int):
    n = len(prompts)
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n * longest
    params.n_batch = 2048
    params.n_ubatch = 512
    params.n_seq_max = n
    params.n_threads = threads
    params.n_threads_batch = threads
    ctx = _first("llama_init_from_model", "llama_new_context_with_model")(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    vocab_size = _vocab_size(model)
    batch = Batch(params.n_batch, n)
    outputs: list[list[int]] = [[] for _ in range(n)]
    try:
        # Prefill: every prompt token, packed into batches; logits for each prompt's last.
        entries = [
            (tok, pos, s, pos == len(p) - 1)
            for s, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        for start in range(0, len(entries), batch.capacity):
            chunk = entries[start : start + batch.capacity]
            batch.fill(chunk)
            if llama_cpp.llama_decode(ctx, batch.raw) != 0:
                raise RuntimeError("llama_decode failed in prefill")
            for i, (_, _, s, logits) in enumerate(chunk):
                if logits:
                    outputs[s].append(_argmax(ctx, i, vocab_size))
        # Decode: one token per unfinished sequence per call.
        while True:
            live = [s for s in range(n) if len(outputs[s]) < max_tokens[s]]
            if not live:
                break
            batch.fill(
                [(outputs[s][-1], len(prompts[s]) + len(outputs[s]) - 1, s, True) for s in live]
            )
            if llama_cpp.llama_decode(ctx, batch.raw) != 0:
                raise RuntimeError("llama_decode failed in decode")
            for i, s in enumerate(live):
                outputs[s].append(_argmax(ctx, i, vocab_size))
    finally:
        batch.free()
        llama_cpp.llama_free(ctx)
    return [o[:m] for o, m in zip(outputs, max_tokens, strict=True)]


def _vocab_size(model) -> int:
    get_vocab = getattr(llama_cpp, "llama_model_get_vocab", None)
    if get_vocab is not None and hasattr(llama_cpp, "llama_vocab_n_tokens"):
        return llama_cpp.llama_vocab_n_tokens(get_vocab(model))
    return llama_cpp.llama_n_vocab(model)


def _argmax(ctx, index: int, vocab_size: int) -> int:
    logits = llama_cpp.llama_get_logits_ith(ctx, index)
    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab_size,))))


def main() -> None:
    spec = json.loads(sys.stdin.read())
    threads = spec.get("threads") or os.cpu_count() or 1
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    if spec.get("extra_bufts") is False and hasattr(params, "use_extra_bufts"):
        params.use_extra_bufts = False
    model = _first("llama_model_load_from_file", "llama_load_model_from_file")(
        spec["model"].encode(), params
    )
    if not model:
        raise SystemExit(f"llama.cpp could not load {spec['model']}")
    prompts, max_tokens, size = spec["prompts"], spec["max_tokens"], spec["batch_size"]
    generate_group(model, [prompts[0][:4]], [2], threads)  # warm up
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), size):
        outputs += generate_group(model, prompts[i : i + size], max_tokens[i : i + size], threads)
    duration = time.perf_counter() - start
    _first("llama_model_free", "llama_free_model")(model)
    note = f"batched decode of {os.path.basename(spec['model'])}, {threads} threads"
    print(json.dumps({"output_ids": outputs, "duration_s": duration, "note": note}))


if __name__ == "__main__":
    main()
