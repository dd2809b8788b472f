"""What structured output costs: the grammar engine's mask time per token, and throughput
with and without `response_format` at 16 concurrent requests, in the same run.

    python -m bench.structured_output [--concurrency 16] [--url URL] [--compare-engines]

1. Mask time: the worker's GrammarEngine (xgrammar) on the SmolLM2 vocabulary, the
   gateway's grammar for a 5-field JSON schema, fed valid documents token by token: the
   time to bring the matcher up to date and fill the next token's mask, per token. With
   --compare-engines, llguidance and outlines-core (when installed) on the same schema and
   tokens: the measurement that chose xgrammar.
2. Throughput: N concurrent chats asking for that schema (temperature 1, seeded), then the
   same chats without it, each generating as many tokens as its constrained twin
   (ignore_eos), through a fresh system's HTTP API; alternated for a few rounds. Output
   tokens per second, and the ratio.

Writes bench-results/structured_output.json. The machines are shared and noisy: read the
ratio, not the absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from spillway.services.cli.launcher import System
from spillway.services.cli.servers import start_nats, start_redis
from spillway.services.gateway.structured_output import GrammarBuilder
from spillway.services.gateway.tokenizer import ModelTokenizer, load_tokenizer
from spillway.services.worker.grammar import GrammarEngine
from spillway.shared.config import DEFAULT_MODEL, Settings
from spillway.shared.model_files import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "London", "Tokyo", "New York"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "tags", "active"],
    "additionalProperties": False,
}
DOCUMENTS = [
    {"name": "Ada Lovelace", "age": 36, "city": "London", "tags": ["math", "poetry"],
     "active": True},
    {"name": "Matsuo Basho, poet", "age": 50, "city": "Tokyo", "tags": [], "active": False},
    {"name": "Marie", "age": 66, "city": "Paris", "tags": ["physics", "chemistry", "x-rays"],
     "active": True},
]  # fmt: skip
EOS = 2


def mask_times(tokenizer: ModelTokenizer, rounds: int = 20) -> list[float]:
    """Seconds per token to sync the matcher and fill the next mask (the worker's work)."""
    engine = GrammarEngine(
        tokenizer.token_bytes, tokenizer.vocab_size, [EOS], special_ids=tokenizer.special_ids
    )
    compiled = engine.compile(str(GrammarBuilder().json_schema(SCHEMA, True, "schema"))).result()
    times = []
    for _ in range(rounds):
        for doc in DOCUMENTS:
            ids = tokenizer.encode(json.dumps(doc), add_special_tokens=False)
            matcher = engine.matcher(compiled)
            for token in [*ids, EOS]:
                start = time.perf_counter()
                engine.fill([matcher])
                times.append(time.perf_counter() - start)
                assert matcher.accept_token(token), token
    engine.close()
    return times


def other_engines(tokenizer: ModelTokenizer, folder: Path) -> dict[str, dict]:
    """llguidance and outlines-core on the same documents, where installed."""
    results: dict[str, dict] = {}
    docs = [tokenizer.encode(json.dumps(d), add_special_tokens=False) for d in DOCUMENTS]
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as llt
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        lltok = llguidance.hf.from_tokenizer(hf, n_vocab=tokenizer.vocab_size)
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults=options
        )
        mask = llt.allocate_token_bitmask(1, tokenizer.vocab_size)
        times = []
        for _ in range(20):
            for ids in docs:
                matcher = llguidance.LLMatcher(lltok, grammar)
                for token in ids:
                    start = time.perf_counter()
                    llt.fill_next_token_bitmask(matcher, mask, 0)
                    times.append(time.perf_counter() - start)
                    matcher.consume_token(token)
        results["llguidance"] = summary(times)
    except ImportError:
        pass
    try:
        import torch
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        table: dict[str, list[int]] = {}
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.token_bytes(i)
            if i != EOS and piece:
                table.setdefault(piece.decode("utf-8", errors="replace"), []).append(i)
        start = time.perf_counter()
        index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(EOS, table))
        compile_s = time.perf_counter() - start
        mask = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        times = []
        for _ in range(20):
            for ids in docs:
                guide = Guide(index)
                for token in ids:
                    start = time.perf_counter()
                    guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
                    times.append(time.perf_counter() - start)
                    guide.advance(token)
        results["outlines-core"] = {**summary(times), "compile_s": compile_s}
    except ImportError:
        pass
    return results


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {
        "tokens": len(times),
        "mean_us": statistics.mean(times) * 1e6,
        "median_us": statistics.median(times) * 1e6,
        "p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
    }


async def throughput(url: str, concurrency: int, rounds: int) -> dict:
    format_ = {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
    }
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:

        async def one(i: int, **fields) -> int:
            body = {
                "messages": [{"role": "user", "content": f"Describe person #{i} as JSON."}],
                "temperature": 1.0,
                "seed": i,
                **fields,
            }
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        async def timed(calls) -> tuple[list[int], float]:
            start = time.perf_counter()
            counts = await asyncio.gather(*calls)
            return list(counts), time.perf_counter() - start

        await one(-1, max_tokens=4)  # warm up
        await one(-2, max_tokens=4, response_format=format_)
        # Alternated rounds, so that a busy spell of a shared machine hits both kinds.
        constrained_s = free_s = 0.0
        tokens = 0
        for r in range(rounds):
            seeds = range(r * concurrency, (r + 1) * concurrency)
            calls = [one(i, max_tokens=160, response_format=format_) for i in seeds]
            counts, seconds = await timed(calls)
            constrained_s += seconds
            free = [
                one(i, max_tokens=n, ignore_eos=True) for i, n in zip(seeds, counts, strict=True)
            ]
            free_counts, seconds = await timed(free)
            free_s += seconds
            assert free_counts == counts
            tokens += sum(counts)
    return {
        "concurrency": concurrency,
        "rounds": rounds,
        "output_tokens": tokens,
        "structured_tokens_per_s": tokens / constrained_s,
        "free_tokens_per_s": tokens / free_s,
        "ratio_structured_over_free": free_s / constrained_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--url", help="a running system's HTTP URL (default: start one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare-engines", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--out", default="bench-results/structured_output.json")
    args = ap.parse_args()

    source = resolve_model(DEFAULT_MODEL)
    tokenizer = load_tokenizer(source, Settings().cache_dir)
    report: dict = {"xgrammar_mask": summary(mask_times(tokenizer))}
    if args.compare_engines:
        from spillway.shared.tokenizer_files import cache_folder

        report["other_engines_mask"] = other_engines(
            tokenizer, cache_folder(source, Settings().cache_dir)
        )
    if not args.skip_throughput:
        servers, system, url = [], None, args.url
        if not url:
            servers = [start_nats(), start_redis()]
            system = System(
                "--namespace", "bench", "--nats-url", servers[0].url,
                "--redis-url", servers[1].url, "--max-batch", str(args.concurrency),
            )  # fmt: skip
            url = system.url
        try:
            report["throughput"] = asyncio.run(throughput(url, args.concurrency, args.rounds))
        finally:
            if system:
                system.stop()
            for s in servers:
                s.stop()
    print(json.dumps(report, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
