"""A tiny-ish hybrid model (Granite 4.0-H or Qwen3-Next): the worker's runner against
transformers' batched `generate` on the same weights, in the same run.

    python -m bench.hybrid [--family granitemoehybrid|qwen3_next] [--size tiny|mid]
                           [--batch 16] [--prompt 128] [--new 64] [--rounds 3]
                           [--threads N]

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
Float32 on the CPU; the machines are shared and noisy: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from spillway.kernels.cpu import ssm as cpu_ssm
from spillway.services.worker.loading import load_runner
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import load_settings
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow

GREEDY = SamplingParams(temperature=0.0)
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
MID = dict(
    vocab_size=4096, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
    head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
    initializer_range=0.2, rms_norm_eps=1e-6,
)  # fmt: skip
MID_FAMILY = {
    "granitemoehybrid": dict(
        num_hidden_layers=8, layer_types=(["mamba"] * 3 + ["attention"]) * 2,
        position_embedding_type="rope", num_local_experts=32, num_experts_per_tok=4,
        intermediate_size=256, shared_intermediate_size=512, mamba_n_heads=16,
        mamba_d_head=32, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_expand=1,
        mamba_chunk_size=64,
    ),
    "qwen3_next": dict(
        num_hidden_layers=8, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
        shared_expert_intermediate_size=512, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
    ),
}  # fmt: skip
SIZES = {"tiny": (TINY, TINY_FAMILY), "mid": (MID, MID_FAMILY)}


def model_config(family: str, size: str = "tiny") -> dict:
    """The transformers config keywords of `family` at `size`."""
    shapes, families = SIZES[size]
    return {**shapes, **families[family]}


def save_model(folder: Path, family: str, size: str = "tiny"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **model_config(family, size))
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def runner_generate(
    runner: ModelRunner, prompts: list[list[int]], new: int, stride: int = 1
) -> tuple[list[list[int]], float]:
    """All rows prefilled in one step, then one decode step per token, row i in slot
    i * stride; the tokens and the decode steps' seconds."""
    bs = runner.block_size
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences)))
    per_seq = (len(prompts[0]) + new + bs - 1) // bs
    new_seqs = [
        NewSequence(seq_id=f"s{i}", sampling=GREEDY, state_slot=i * stride,
                    block_ids=list(range(i * per_seq, (i + 1) * per_seq)))
        for i in range(len(prompts))
    ]  # fmt: skip
    rows = [
        StepRow(seq_id=f"s{i}", token_ids=p, start_pos=0, sample=True, output_index=0)
        for i, p in enumerate(prompts)
    ]
    outputs: list[list[int]] = [[] for _ in prompts]
    plan = StepPlan(step_id=1, new_seqs=new_seqs, rows=rows)
    decode_start = 0.0
    for step in range(new):
        if step == 1:
            decode_start = time.perf_counter()
        result = runner.execute(plan)
        if result.error is not None:
            raise SystemExit(result.error.message)
        for i, row in enumerate(result.rows):
            outputs[i].append(row.token_id)
        plan = StepPlan(
            step_id=step + 2,
            rows=[
                StepRow(seq_id=f"s{i}", token_ids=[out[-1]], start_pos=len(p) + step,
                        sample=True, output_index=step + 1)
                for i, (p, out) in enumerate(zip(prompts, outputs, strict=True))
            ],
        )  # fmt: skip
    return outputs, time.perf_counter() - decode_start


def hf_generate(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="granitemoehybrid", choices=sorted(TINY_FAMILY))
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, help="math threads (default: every core)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{args.family}-"))
    reference = save_model(folder, args.family, args.size)
    vocab = model_config(args.family, args.size)["vocab_size"]
    blocks = args.batch * ((args.prompt + args.new) // 16 + 1) + 1
    settings = load_settings(
        model=str(folder), kv_blocks=blocks, device="cpu", dtype="float32",
        state_slots=2 * args.batch, state_snapshots=0, threads=args.threads,
    )  # fmt: skip
    runner, _ = load_runner(settings)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.batch)]
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
                (ours_out, decode_s), total = timed(runner_generate, runner, prompts, args.new)
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
    print(
        f"{args.family} ({args.size}): batch {args.batch}, prompt {args.prompt},"
        f" {args.new} new tokens,"
        f" {torch.get_num_threads()} threads, float32 CPU;"
        f" state {pool.slot_bytes() / 1024:.1f} KiB per sequence"
    )
    print(f"  decode      spillway {ours_dec:8.1f} tok/s   transformers {theirs_dec:8.1f} tok/s"
          f"   ratio {ours_dec / theirs_dec:5.2f}x")  # fmt: skip
    print(f"  end to end  spillway {ours:8.1f} tok/s   transformers {theirs:8.1f} tok/s"
          f"   ratio {ours / theirs:5.2f}x")  # fmt: skip
    print(f"  recurrent steps: batched (contiguous slots) {paths.get('view', 0)},"
          f" per-sequence fallback {paths.get('gather', 0)}")  # fmt: skip
    print(f"  decode in slots 0, 2, 4, ... (the fallback) {scattered:8.1f} tok/s"
          f"   {scattered / ours_dec:5.2f}x of the batched path")  # fmt: skip
    print(f"  greedy sequences equal: {same}/{args.batch}")


if __name__ == "__main__":
    main()
