"""Speculative decoding on one stream: spillway with each kind of drafts against itself
without speculation, and llama.cpp's prompt-lookup decoding on the same GGUF weights.

    python -m bench.speculative [--repeats 3] [--max-tokens 128] [--k 3]
        [--modes none,ngram,draft] [--quantize none,int8] [--llama PYTHON]

Two workloads, greedy, one request at a time:
  copy     a code file to edit ("rename x to y"), and a text to answer with quotes from:
           the answer copies long runs of the prompt (prompt lookup's best case);
  nothing  short creative prompts: nothing to copy (its cost when it does not pay).

Modes: `none` (no speculation), `ngram` (prompt lookup), `draft` (the model as its own
draft model: every draft stands, each costs a draft forward), `mtp` (only for a model
with an MTP layer), and `none-no-run-ahead` (no speculation, no run-ahead: what a
speculating sequence gives up by waiting for each verify). For each quantization the
modes' systems run side by side, each request sent to one after the other, so the
machine's load weighs on all alike. For each workload: tokens per second (completion
tokens / request time, median of the repeats) and its ratio to `none` and to llama.cpp's
prompt lookup, and from spillway's /metrics the acceptance rate (accepted / drafted),
the mean tokens a verifying row emits (1 + accepted / verify steps) and the mean draft /
verify / accept phase times. Every mode must produce the same tokens as `none` (greedy
outputs are exact). llama.cpp runs in the Python given by --llama (one with
llama-cpp-python), greedy, with and without `LlamaPromptLookupDecoding`; a machine
without one skips it and says so. Run it alone on the machine: ratios within one run
are what count; each figure is printed with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from spillway.services.cli.launcher import System
from spillway.shared.model_files import resolve_model

CODE = '''def parse_config(path):
    """Reads a key = value file into a dict, skipping comments and blank lines."""
    config = {}
    with open(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"{path}:{line_number}: expected key = value")
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config


def merge_configs(base, override):
    """A new dict: base's entries, replaced by override's where both have a key."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged
'''

TEXT = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour. Every "
    "evening at dusk the keeper climbed the one hundred and twelve steps to the lamp room, "
    "trimmed the wick, polished the great lens and lit the flame. Ships coming home in the "
    "dark steered by its beam, and the fishermen said that as long as the light turned, "
    "nobody on the water was ever truly lost. In the winter of the great storm the keeper "
    "fell ill, and his daughter climbed the steps in his place every night for a month."
)

COPY = [
    f"Here is a Python file:\n\n{CODE}\nRewrite the whole file with the variable `config` "
    "renamed to `settings`. Output only the code.",
    f"Read this text:\n\n{TEXT}\n\nQuote, word for word, the sentences of the text that "
    "describe what the keeper did every evening and what happened in the winter.",
]
NOTHING = [
    "Write a short poem about the colour of the sea at dawn.",
    "Invent a new board game and explain its rules in a few sentences.",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def spec_figures(metrics: str) -> dict[str, float]:
    """The speculative decoding counters and phase sums/counts in a /metrics text."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if not line.startswith("spillway_spec_decode"):
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{")[0]
        if "phase=" in name:
            key += "/" + name.split('phase="')[1].split('"')[0]
        if "_bucket" in key:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _complete(c: httpx.Client, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}  # fmt: skip
    start = time.perf_counter()
    r = c.post("/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    tokens = [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    return tokens, len(tokens) / elapsed


MODEL = "SmolLM2-135M-Instruct"


def mode_args(mode: str, k: int, quantize: str) -> list[str]:
    """`spillway up` arguments of one mode."""
    args = ["--max-batch", "4", "--quantize", quantize, "--num-speculative-tokens", str(k)]
    if mode == "none-no-run-ahead":
        return [*args, "--speculative", "none", "--no-run-ahead"]
    if mode == "draft":
        return [*args, "--speculative", "draft", "--draft-model", MODEL]
    return [*args, "--speculative", mode]


def run_spillway(
    prompts: dict[str, list[list[int]]], modes: list[str], quantize: str, args
) -> dict[str, dict]:
    """The modes' systems up at once, each request sent to one after the other (the
    machine's load moves all alike); one request at a time."""
    systems = {}
    try:
        for mode in modes:
            systems[mode] = System("--namespace", f"bench-spec-{quantize}-{mode}",
                                   *mode_args(mode, args.k, quantize))  # fmt: skip
        results: dict[str, dict] = {mode: {} for mode in modes}
        clients = {mode: httpx.Client(base_url=systems[mode].url, timeout=600) for mode in modes}
        for c in clients.values():
            _complete(c, prompts["copy"][0], 8)  # warm-up
        for name, workload in prompts.items():
            before = {m: spec_figures(clients[m].get("/metrics").text) for m in modes}
            rates: dict[str, list[float]] = {mode: [] for mode in modes}
            outputs: dict[str, list[list[int]]] = {mode: [] for mode in modes}
            for _ in range(args.repeats):
                for prompt in workload:
                    for mode in modes:
                        tokens, rate = _complete(clients[mode], prompt, args.max_tokens)
                        rates[mode].append(rate)
                        outputs[mode].append(tokens)
            load = os.getloadavg()[0]
            for mode in modes:
                after = spec_figures(clients[mode].get("/metrics").text)
                delta = {k: after.get(k, 0.0) - before[mode].get(k, 0.0) for k in after}
                results[mode][name] = {"tok_s": statistics.median(rates[mode]),
                                       "outputs": outputs[mode], "spec": delta,
                                       "load": load}  # fmt: skip
        for c in clients.values():
            c.close()
    finally:
        for system in systems.values():
            system.stop()
    return results


def spec_row(d: dict[str, float]) -> dict[str, float]:
    """Acceptance, tokens per verify and mean phase times from a /metrics delta."""
    drafted = d.get("spillway_spec_decode_draft_tokens_total", 0.0)
    accepted = d.get("spillway_spec_decode_accepted_tokens_total", 0.0)
    verifies = d.get("spillway_spec_decode_phase_seconds_count/verify", 0.0)
    row = {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_tokens_per_verify": 1 + accepted / verifies if verifies else 0.0,
        "verify_steps": verifies,
    }
    for phase in ("draft", "verify", "accept"):
        n = d.get(f"spillway_spec_decode_phase_seconds_count/{phase}", 0.0)
        total = d.get(f"spillway_spec_decode_phase_seconds_sum/{phase}", 0.0)
        row[f"{phase}_ms"] = 1e3 * total / n if n else 0.0
    return row


LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
spec = json.load(sys.stdin)
out = {}
for lookup in (False, True):
    draft = (LlamaPromptLookupDecoding(num_pred_tokens=spec["k"], max_ngram_size=spec["ngram"])
             if lookup else None)
    llm = Llama(model_path=spec["model"], n_ctx=2048, n_threads=spec["threads"], verbose=False,
                draft_model=draft, logits_all=False)
    for name, prompts in spec["prompts"].items():
        rates = []
        for _ in range(spec["repeats"]):
            for p in prompts:
                llm.reset()
                t = time.perf_counter()
                r = llm.create_completion(p, max_tokens=spec["max_tokens"], temperature=0.0)
                rates.append(r["usage"]["completion_tokens"] / (time.perf_counter() - t))
        rates.sort()
        out[f"{name}/{'lookup' if lookup else 'plain'}"] = rates[len(rates) // 2]
print(json.dumps(out))
"""


def run_llama(python: str, prompts: dict[str, list[list[int]]], args) -> dict[str, float] | None:
    if not Path(python).exists():
        print(f"llama.cpp: no Python with llama-cpp-python at {python}: skipped")
        return None
    spec = {"model": str(resolve_model(MODEL).path), "prompts": prompts,
            "k": args.k, "ngram": 4, "repeats": args.llama_repeats or args.repeats,
            "max_tokens": args.max_tokens,
            "threads": len(os.sched_getaffinity(0))}  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(LLAMA_SCRIPT)
    done = subprocess.run([python, f.name], input=json.dumps(spec), capture_output=True,
                          text=True, timeout=3600)  # fmt: skip
    if done.returncode != 0:
        print(f"llama.cpp failed: {done.stderr[-2000:]}")
        return None
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["load"] = os.getloadavg()[0]
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="--num-speculative-tokens (the cap)")
    parser.add_argument("--modes", default="none,ngram,draft,none-no-run-ahead")
    parser.add_argument("--quantize", default="none,int8", help="quantizations, each a run")
    parser.add_argument("--llama", default="/work/peers/llama/bin/python")
    parser.add_argument("--llama-repeats", type=int, help="repeats of llama.cpp's runs")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    src = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    prompts = {"copy": [chat_ids(tokenizer, t) for t in COPY],
               "nothing": [chat_ids(tokenizer, t) for t in NOTHING]}  # fmt: skip
    modes = args.modes.split(",")
    if "none" not in modes:
        modes.insert(0, "none")
    llama = run_llama(args.llama, prompts, args)
    figures: dict = {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "llama": llama}
    print(f"{figures['cpu']}, {figures['cores']} cores; one stream, greedy, "
          f"{args.max_tokens} tokens, K={args.k}, median of {args.repeats}")  # fmt: skip
    if llama is not None:
        print("llama.cpp " + "  ".join(f"{k}={v:.2f}" for k, v in llama.items()))
    for quantize in [q for q in args.quantize.split(",") if q]:  # "": llama.cpp alone
        results = run_spillway(prompts, modes, quantize, args)
        for name in prompts:
            plain = results["none"][name]
            for mode in modes:
                r = results[mode][name]
                row: dict = {"tok_s": r["tok_s"], "vs_none": r["tok_s"] / plain["tok_s"]}
                if llama is not None:
                    row["vs_llama_lookup"] = r["tok_s"] / llama[f"{name}/lookup"]
                    row["vs_llama_plain"] = r["tok_s"] / llama[f"{name}/plain"]
                row["identical_outputs"] = r["outputs"] == plain["outputs"]
                if mode not in ("none", "none-no-run-ahead"):
                    row.update(spec_row(r["spec"]))
                row["load"] = r["load"]
                figures[f"{quantize}/{name}/{mode}"] = row
                print(f"{quantize:5s} {name:8s} {mode:18s} " + "  ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items()
                ))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    sys.exit(main())
