"""A tiny MoE model: the worker's runner against transformers' batched `generate` on the
same weights, in the same run.

    python -m bench.moe [--family qwen3_moe|mixtral|deepseek_v3] [--size tiny|mid]
                        [--batch 16] [--prompt 128] [--new 64] [--rounds 3]
                        [--threads N]

`--size tiny` (the default): hidden 256, 4 layers, 16 experts top-2. `--size mid`: hidden
512, 8 layers, 32 experts top-4 (expert intermediate 256), the size at which a decode
step of 16-64 rows reads most experts' weights once.

Saves a random model of the family (transformers writes the folder), then per round:
B greedy sequences of P prompt tokens and N new tokens each, through the runner (one
prefill step for all rows, then one decode step per token) and through
`model.generate` on a [B, P] batch. Prints generated tok/s of each (median over rounds,
alternating A B), their ratio, and whether the greedy tokens agree. Float32 on the CPU;
the machines are shared and noisy: read the ratio within one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from spillway.services.worker.loading import load_runner
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import load_settings
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow

GREEDY = SamplingParams(temperature=0.0)
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
MID = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=1024,
    tie_word_embeddings=False, initializer_range=0.2,
)  # fmt: skip
MID_FAMILY = {
    "qwen3_moe": dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=32, num_experts_per_tok=4, intermediate_size=256),
    "deepseek_v3": dict(
        n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, n_group=4,
        topk_group=2, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=192,
        qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, num_key_value_heads=8,
        head_dim=32,  # transformers rotates head_dim dims: the rope part
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
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


def runner_generate(runner: ModelRunner, prompts: list[list[int]], new: int) -> list[list[int]]:
    """All rows prefilled in one step, then one decode step per token."""
    bs = runner.block_size
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences)))
    per_seq = (len(prompts[0]) + new + bs - 1) // bs
    new_seqs = [
        NewSequence(seq_id=f"s{i}", sampling=GREEDY,
                    block_ids=list(range(i * per_seq, (i + 1) * per_seq)))
        for i in range(len(prompts))
    ]  # fmt: skip
    rows = [
        StepRow(seq_id=f"s{i}", token_ids=p, start_pos=0, sample=True, output_index=0)
        for i, p in enumerate(prompts)
    ]
    outputs: list[list[int]] = [[] for _ in prompts]
    plan = StepPlan(step_id=1, new_seqs=new_seqs, rows=rows)
    for step in range(new):
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
    return outputs


def hf_generate(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="qwen3_moe", choices=sorted(TINY_FAMILY))
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
        model=str(folder), kv_blocks=blocks, device="cpu", dtype="float32", threads=args.threads
    )
    runner, _ = load_runner(settings)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.batch)]
    ours_s, theirs_s = [], []
    ours_out = theirs_out = None
    for r in range(args.rounds):
        for which in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
            start = time.perf_counter()
            if which == "ours":
                ours_out = runner_generate(runner, prompts, args.new)
                ours_s.append(time.perf_counter() - start)
            else:
                theirs_out = hf_generate(reference, prompts, args.new)
                theirs_s.append(time.perf_counter() - start)
    tokens = args.batch * args.new
    ours, theirs = tokens / statistics.median(ours_s), tokens / statistics.median(theirs_s)
    same = sum(a == b for a, b in zip(ours_out or [], theirs_out or [], strict=True))
    print(
        f"{args.family} ({args.size}): batch {args.batch}, prompt {args.prompt},"
        f" {args.new} new tokens,"
        f" {torch.get_num_threads()} threads, float32 CPU"
    )
    print(f"  spillway runner       {ours:8.1f} tok/s")
    print(f"  transformers generate {theirs:8.1f} tok/s")
    print(f"  ratio                 {ours / theirs:8.2f}x")
    print(f"  greedy sequences equal: {same}/{args.batch}")


if __name__ == "__main__":
    main()
