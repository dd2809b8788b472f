"""Mamba2 prefill: the worker's mixer (`mamba2_mixer`, its chunked scan over every
prefill row of a step at once) against transformers' Mamba2 layer (Granite 4.0-H's, its
torch chunked scan) on the same weights, in the same run.

    python -m bench.ssd_scan [--shapes 4096x1 128x16] [--rounds 3] [--threads N]

Each shape LxR is R prompts of L tokens from zero states: ours in one call (the rows
packed), transformers' on an [R, L] batch. Prints the median time of each (rounds
alternate), the ratio, and the largest difference of the outputs. Float32 on the CPU;
the machines are shared and noisy: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from spillway.kernels.cpu.ops import CpuOps
from spillway.services.worker.layers.mamba2 import Mamba2Weights, mamba2_dims, mamba2_mixer
from spillway.services.worker.models.registry import load_model_config
from spillway.shared.model_files import resolve_model

# Granite 4.0-H-like mixer proportions at a small width.
CONFIG = dict(
    vocab_size=256, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
    layer_types=["mamba"], num_attention_heads=4, num_key_value_heads=2,
    mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4,
    mamba_expand=1, mamba_chunk_size=256, num_local_experts=0, shared_intermediate_size=64,
    max_position_embeddings=8192, initializer_range=0.2, position_embedding_type="rope",
)  # fmt: skip


def reference_layer(folder: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("granitemoehybrid", **CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return model.model.layers[0].mamba


def weights(layer) -> Mamba2Weights:
    return Mamba2Weights(
        in_proj=layer.in_proj.weight.detach(),
        conv_weight=layer.conv1d.weight.detach().squeeze(1),
        conv_bias=layer.conv1d.bias.detach(),
        dt_bias=layer.dt_bias.detach(),
        A=-torch.exp(layer.A_log.detach().float()),
        D=layer.D.detach(),
        norm=layer.norm.weight.detach(),
        out_proj=layer.out_proj.weight.detach(),
    )


def ours(c, eps: float, w: Mamba2Weights, h: torch.Tensor) -> torch.Tensor:
    rows, length, hidden = h.shape
    _inner, conv_dim = mamba2_dims(c)
    conv = torch.zeros(rows, conv_dim, c.conv_width - 1)
    ssm = torch.zeros(rows, c.mamba_heads, c.mamba_head_dim, c.mamba_state)
    qs = (torch.arange(rows + 1) * length).to(torch.int32)
    y = mamba2_mixer(
        CpuOps(native=None), c, eps, h.reshape(-1, hidden), w, conv, ssm, qs,
        torch.arange(rows), length,
    )  # fmt: skip
    return y.view(rows, length, hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["4096x1", "128x16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="bench-ssd-"))
    layer = reference_layer(folder)
    config = load_model_config(resolve_model(str(folder)))
    assert config.hybrid is not None
    w = weights(layer)
    print(f"Mamba2 prefill, {torch.get_num_threads()} threads (median of {args.rounds})")
    print("| prompts | ours ms | transformers ms | ratio | max abs diff |")
    print("| --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        length, rows = (int(v) for v in shape.split("x"))
        h = torch.randn(
            rows, length, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(1)
        )
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        outs = {}
        for r in range(args.rounds):
            for which in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
                start = time.perf_counter()
                with torch.inference_mode():
                    if which == "ours":
                        outs[which] = ours(config.hybrid, config.rms_norm_eps, w, h)
                    else:
                        outs[which] = layer(h)
                times[which].append(time.perf_counter() - start)
        a, b = statistics.median(times["ours"]), statistics.median(times["theirs"])
        diff = (outs["ours"] - outs["theirs"]).abs().max().item()
        print(f"| {rows} x {length} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
