"""A tiny-ish hybrid model (Granite 4.0-H or Qwen3-Next): the worker's runner against
transformers' batched `generate` on the same weights, in the same run.

    python -m bench.hybrid [--family granitemoehybrid|qwen3_next] [--size tiny|mid]
                           [--batch 16] [--prompt 128] [--new 64] [--rounds 3]
                           [--threads N] [--vllm PYTHON]

`--size tiny` (the default): hidden 256, 4 layers (one attention), 8 experts top-2.
`--size mid`: hidden 512, 8 layers, three recurrent to one attention (attention at layers
3 and 7), and the MoE layers of `bench.moe --size mid` (32 experts top-4, expert
intermediate 256).

Saves a random model of the family (transformers writes the folder), then per round:
B greedy sequences of P prompt tokens and N new tokens each, through the runner (one
prefill step for all rows, then one decode step per token, rows in slots 0..B-1: the
batched path) and through `model.generate` on a [B, P] batch. Decode is timed apart on
both sides: the runner's decode steps, and transformers' N-token generate minus its
1-token generate (its prefill). The runner also runs with its rows in slots 0, 2, 4, ...
(never one run: the per-sequence fallback) to show what the fallback costs. Prints tok/s
(median over rounds, alternating), the ratios, and whether the greedy tokens agree.
`--vllm PYTHON`: vLLM's offline generate of the same batch (end to end), as in `bench.moe`.
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
from spillway.kernels.cpu import ssm as cpu_ssm

TINY = dict(
    vocab_size=4096, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
    head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False,
    initializer_range=0.2, rms_norm_eps=1e-6,
)  # fmt: skip
TINY_FAMILY = {
    "granitemoehybrid": dict(
        num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"],
        position_embedding_type="rope", num_local_experts=8, num_experts_per_tok=2,
        intermediate_size=128, shared_intermediate_size=256, mamba_n_heads=8,
        mamba_d_head=32, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_expand=1,
        mamba_chunk_size=64,
    ),
    "qwen3_next": dict(
        num_hidden_layers=4, layer_types=["linear_attention", "linear_attention",
        "linear_attention", "full_attention"], num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=256,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
    ),
}  # fmt: skip
# Mid: twice the width and the layers (three recurrent to one attention), the MoE layers
# of `bench.moe --size mid`.
MID = {**TINY, "hidden_size": 512, "head_dim": 64}
MID_FAMILY = {
    "granitemoehybrid": {
        **TINY_FAMILY["granitemoehybrid"], "num_hidden_layers": 8,
        "layer_types": (["mamba"] * 3 + ["attention"]) * 2, "num_local_experts": 32,
        "num_experts_per_tok": 4, "intermediate_size": 256, "shared_intermediate_size": 512,
        "mamba_n_heads": 16,
    },
    "qwen3_next": {
        **TINY_FAMILY["qwen3_next"], "num_hidden_layers": 8,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
        "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 512, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
    },
}  # fmt: skip
SIZES: Sizes = {"tiny": (TINY, TINY_FAMILY), "mid": (MID, MID_FAMILY)}


def main() -> None:
    args = parser(__doc__, SIZES, "granitemoehybrid").parse_args()
    runner, reference, prompts = setup(args, SIZES, state_slots=2 * args.batch, state_snapshots=0)
    ours_s, ours_decode_s, theirs_s, theirs_decode_s, scattered_s = [], [], [], [], []
    ours_out = theirs_out = None
    paths: dict[str, int] = {}
    for r in range(args.rounds):
        order = ("ours", "theirs", "scattered") if r % 2 == 0 else ("scattered", "theirs", "ours")
        for which in order:
            if which == "scattered":
                (_, decode_s), _ = timed(runner_generate, runner, prompts, args.new, 2)
                scattered_s.append(decode_s)
            elif which == "ours":
                cpu_ssm.PATHS.clear()
                (ours_out, decode_s), total = timed(runner_generate, runner, prompts, args.new, 1)
                ours_s.append(total)
                ours_decode_s.append(decode_s)
                paths = dict(cpu_ssm.PATHS)  # this run's recurrent steps
            else:
                theirs_out, total = timed(hf_generate, reference, prompts, args.new)
                _, prefill = timed(hf_generate, reference, prompts, 1)
                theirs_s.append(total)
                theirs_decode_s.append(total - prefill)
    tokens, decode_tokens = args.batch * args.new, args.batch * (args.new - 1)
    ours, theirs = tokens / statistics.median(ours_s), tokens / statistics.median(theirs_s)
    ours_dec = decode_tokens / statistics.median(ours_decode_s)
    theirs_dec = decode_tokens / statistics.median(theirs_decode_s)
    scattered = decode_tokens / statistics.median(scattered_s)
    same = sum(a == b for a, b in zip(ours_out or [], theirs_out or [], strict=True))
    pool = runner.state_pool
    assert pool is not None
    print(f"{headline(args)}; state {pool.slot_bytes() / 1024:.1f} KiB per sequence")
    print(f"  decode      spillway {ours_dec:8.1f} tok/s   transformers {theirs_dec:8.1f} tok/s"
          f"   ratio {ours_dec / theirs_dec:5.2f}x")  # fmt: skip
    print(f"  end to end  spillway {ours:8.1f} tok/s   transformers {theirs:8.1f} tok/s"
          f"   ratio {ours / theirs:5.2f}x")  # fmt: skip
    print(f"  recurrent steps: batched (contiguous slots) {paths.get('view', 0)},"
          f" per-sequence fallback {paths.get('gather', 0)}")  # fmt: skip
    print(f"  decode in slots 0, 2, 4, ... (the fallback) {scattered:8.1f} tok/s"
          f"   {scattered / ours_dec:5.2f}x of the batched path")  # fmt: skip
    print(f"  greedy sequences equal: {same}/{args.batch}")
    if args.vllm:
        print(
            vllm_lines(
                args.vllm, reference, prompts, args.new, ours_out, ours, "end to end, ratio to vLLM"
            )
        )


if __name__ == "__main__":
    main()
