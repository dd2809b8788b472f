"""A tiny MoE model: the worker's runner against transformers' batched `generate` on the
same weights, in the same run.

    python -m bench.moe [--family qwen3_moe|mixtral|deepseek_v3] [--size tiny|mid]
                        [--batch 16] [--prompt 128] [--new 64] [--rounds 3]
                        [--threads N] [--vllm PYTHON]

`--size tiny` (the default): hidden 256, 4 layers, 16 experts top-2. `--size mid`: hidden
512, 8 layers, 32 experts top-4 (expert intermediate 256), the size at which a decode
step of 16-64 rows reads most experts' weights once.

Saves a random model of the family (transformers writes the folder), then per round:
B greedy sequences of P prompt tokens and N new tokens each, through the runner (one
prefill step for all rows, then one decode step per token) and through
`model.generate` on a [B, P] batch. Prints generated tok/s of each (median over rounds,
alternating A B), their ratio, and whether the greedy tokens agree. `--vllm PYTHON`: vLLM's
offline generate of the same batch on the same folder in float32 (all rows handed over at
once), run once in that Python (its CPU build, in a venv of its own) after the rounds.
Float32 on the CPU; the machines are shared and noisy: read the ratios within one run.
"""

from __future__ import annotations

import statistics

from bench.greedy import (
    Sizes,
    headline,
    hf_generate,
    parser,
    runner_generate,
    setup,
    timed,
    vllm_lines,
)

TINY = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024,
    tie_word_embeddings=False, initializer_range=0.2,
)  # fmt: skip
TINY_FAMILY = {
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256),
    "deepseek_v3": dict(
        n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=128, n_group=4,
        topk_group=2, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, num_key_value_heads=8,
        head_dim=16,  # transformers rotates head_dim dims: the rope part
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}  # fmt: skip
# Mid: twice the width and the layers, twice the experts (four to a token) of twice the size.
MID = {**TINY, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8,
       "head_dim": 64}  # fmt: skip
MID_FAMILY = {
    "qwen3_moe": {**TINY_FAMILY["qwen3_moe"], "num_experts": 32, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 256},
    "mixtral": dict(num_local_experts=32, num_experts_per_tok=4, intermediate_size=256),
    "deepseek_v3": {
        **TINY_FAMILY["deepseek_v3"], "n_routed_experts": 32, "num_experts_per_tok": 4,
        "moe_intermediate_size": 256, "kv_lora_rank": 128, "q_lora_rank": 192,
        "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "head_dim": 32,  # transformers rotates head_dim dims: the rope part
    },
}  # fmt: skip
SIZES: Sizes = {"tiny": (TINY, TINY_FAMILY), "mid": (MID, MID_FAMILY)}


def main() -> None:
    args = parser(__doc__, SIZES, "qwen3_moe").parse_args()
    runner, reference, prompts = setup(args, SIZES)
    ours_s, theirs_s = [], []
    ours_out = theirs_out = None
    for r in range(args.rounds):
        for which in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
            if which == "ours":
                (ours_out, _), seconds = timed(runner_generate, runner, prompts, args.new)
                ours_s.append(seconds)
            else:
                theirs_out, seconds = timed(hf_generate, reference, prompts, args.new)
                theirs_s.append(seconds)
    tokens = args.batch * args.new
    ours, theirs = tokens / statistics.median(ours_s), tokens / statistics.median(theirs_s)
    same = sum(a == b for a, b in zip(ours_out or [], theirs_out or [], strict=True))
    print(headline(args))
    print(f"  spillway runner       {ours:8.1f} tok/s")
    print(f"  transformers generate {theirs:8.1f} tok/s")
    print(f"  ratio                 {ours / theirs:8.2f}x")
    print(f"  greedy sequences equal: {same}/{args.batch}")
    if args.vllm:
        print(
            vllm_lines(
                args.vllm, reference, prompts, args.new, ours_out, ours, "ratio to vLLM         "
            )
        )


if __name__ == "__main__":
    main()
