"""The command-line options of `spillway up` / `spillway serve`, mapped onto Settings.

Defaults shown in --help are the effective ones (environment included); an option left
out keeps the Settings value.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from spillway.shared.config import Settings
from spillway.shared.output_formats import REASONING_PARSERS, TOOL_CALL_PARSERS

# (flag, settings field, kwargs) in the order of the contract.
OPTIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("--host", "host", {"help": "address the HTTP API listens on"}),
    ("--port", "port", {"type": int, "help": "HTTP port (0: any free port)"}),
    ("--model", "model", {"help": "SmolLM2-135M-Instruct, a .gguf file or a HF folder"}),
    ("--workers", "workers", {"type": int, "help": "worker processes"}),
    ("--kv-blocks", "kv_blocks", {"type": int, "help": "KV cache blocks per worker"}),
    ("--block-size", "block_size", {"type": int, "help": "tokens per KV block"}),
    ("--max-batch", "max_batch", {"type": int, "help": "most sequences in one step"}),
    ("--dtype", "dtype", {"choices": ["auto", "float32", "bfloat16", "float16"],
                          "help": "auto: bfloat16 on CUDA, float32 on the CPU"}),
    ("--preemption-mode", "preemption_mode", {"choices": ["auto", "spill", "recompute"],
                                              "help": "what happens to a victim on KV "
                                              "exhaustion"}),
    ("--no-prefix-cache", "prefix_cache", {"action": "store_const", "const": False,
                                           "help": "turn prefix caching off"}),
    ("--namespace", "namespace", {"help": "prefix for every NATS subject and Redis key"}),
    ("--api-key", "api_key", {"help": "require Authorization: Bearer KEY on /v1/ routes"}),
    ("--nats-url", "nats_url", {"help": "NATS server (a private one starts when the default "
                                "is unreachable)"}),
    ("--redis-url", "redis_url", {"help": "Redis server (a private one starts when the default "
                                  "is unreachable)"}),
    ("--otlp-endpoint", "otlp_endpoint", {"help": "OTLP/HTTP base URL for traces"}),
    ("--trace-file", "trace_file", {"help": "also append every span to this file, one OTLP "
                                    "JSON line each (read by `spillway trace`)"}),
    ("--speculative", "speculative", {"choices": ["none", "ngram", "draft", "mtp"],
                                      "help": "speculative decoding: who proposes drafts"}),
    ("--num-speculative-tokens", "num_speculative_tokens", {"type": int,
                                                            "help": "drafts per step (K)"}),
    ("--draft-model", "draft_model", {"help": "--speculative draft: the draft model (same "
                                      "tokenizer)"}),
    ("--ngram-max", "ngram_max", {"type": int, "help": "--speculative ngram: longest n-gram "
                                  "looked up in the sequence so far"}),
    ("--served-model-name", "served_model_name", {"nargs": "+", "metavar": "NAME",
                                                  "help": "the names the API answers to; the "
                                                  "first is reported"}),
    ("--chat-template", "chat_template", {"help": "a chat template replacing the model's: a "
                                          "file, or the template itself"}),
    ("--max-model-len", "max_model_len", {"type": int, "help": "the longest prompt + "
                                          "max_tokens a request may ask for"}),
    ("--allowed-origins", "allowed_origins", {"nargs": "+", "metavar": "ORIGIN",
                                              "type": str, "help": "origins allowed to call "
                                              "the API from a browser (CORS; `*`: any)"}),
    ("--tool-call-parser", "tool_call_parser", {"choices": list(TOOL_CALL_PARSERS),
                                                "help": "how the model writes tool calls "
                                                "(vLLM's names)"}),
    ("--reasoning-parser", "reasoning_parser", {"choices": list(REASONING_PARSERS),
                                                "help": "how the model marks its reasoning "
                                                "(vLLM's names)"}),
    ("--attention-backend", "attention_backend", {"choices": ["auto", "torch", "triton"],
                                                  "help": "worker kernels: auto = Triton on "
                                                  "CUDA, torch elsewhere"}),
    ("--no-run-ahead", "run_ahead", {"action": "store_const", "const": False,
                                     "help": "wait for each step's result before planning "
                                     "the next"}),
    ("--state-slots", "state_slots", {"type": int, "help": "hybrid models: recurrent-state "
                                      "slots per worker (sequences running at once)"}),
    ("--state-snapshots", "state_snapshots", {"type": int, "help": "hybrid models: states "
                                              "kept at block boundaries for prefix caching "
                                              "(0: none)"}),
    ("--itl-target-ms", "itl_target_ms", {"type": float, "help": "a step with decode rows "
                                          "takes only the prompt tokens that keep it within "
                                          "this many ms (default: no cap)"}),
    ("--threads", "threads", {"type": int, "help": "worker math threads on the CPU"}),
    ("--quantize", "quantize", {"choices": ["none", "int8"],
                                "help": "int8 weights for the CPU projections (faster, changes "
                                "outputs)"}),
    ("--kv-cache-dtype", "kv_cache_dtype", {"choices": ["auto", "float32", "bfloat16"],
                                            "help": "KV cache dtype; auto: the model's; "
                                            "bfloat16 on the CPU halves attention's reads "
                                            "(changes outputs)"}),
    ("--no-cuda-graphs", "cuda_graphs", {"action": "store_const", "const": False,
                                         "help": "run decode steps eagerly, without CUDA "
                                         "graphs"}),
    ("--expert-parallel", "expert_parallel", {"type": int, "help": "ranks per worker, each "
                                              "holding 1/N of every MoE layer's experts"}),
    ("--rank", "rank", {"type": int, "help": "serve worker: this process's rank in its "
                        "expert-parallel group"}),
    ("--dist-url", "dist_url", {"help": "serve worker: the expert-parallel group's rendezvous, "
                                "tcp://HOST:PORT (rank 0 listens there)"}),
    ("--log-level", "log_level", {"help": "DEBUG, INFO, WARNING or ERROR"}),
    ("--log-format", "log_format", {"choices": ["text", "json"],
                                    "help": "json: one object per line, with trace and span "
                                    "ids"}),
]  # fmt: skip

SECRET_FIELDS = {"api_key"}
SHOWN_WHEN_UNSET = {
    "kv_blocks": "sized from memory",
    "threads": "every core available",
    "state_slots": "max-batch",
    "state_snapshots": "state-slots",
    "served_model_name": "the model's name",
    "chat_template": "the model's",
    "max_model_len": "the model's context",
    "allowed_origins": "none",
    "tool_call_parser": "from the chat template",
    "reasoning_parser": "from the chat template",
}
# Switches that are on unless their --no-... flag is given.
OFF_SWITCHES = {"prefix_cache", "cuda_graphs", "run_ahead"}


def add_options(parser: argparse.ArgumentParser, defaults: Settings) -> None:
    for flag, field, spec in OPTIONS:
        kwargs = dict(spec)
        shown = getattr(defaults, field)
        if field in SECRET_FIELDS and shown:
            shown = "(set)"
        if field in OFF_SWITCHES:
            shown = "on" if shown else "off"
        if shown in (None, ""):
            shown = SHOWN_WHEN_UNSET.get(field, "none")
        help_text = f"{kwargs.pop('help')} (default: {shown})"
        parser.add_argument(flag, dest=field, default=None, help=help_text, **kwargs)


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    out = {field: getattr(args, field) for _, field, _ in OPTIONS if getattr(args, field, None)
           is not None}  # fmt: skip
    if "allowed_origins" in out:
        out["allowed_origins"] = _origins(out["allowed_origins"])
    return out


def _origins(given: list[str]) -> list[str]:
    """vLLM takes the origins as one JSON list (`'["https://a.example"]'`); a plain list
    of words works too."""
    if len(given) == 1 and given[0].lstrip().startswith("["):
        try:
            parsed = json.loads(given[0])
        except ValueError as e:
            raise SystemExit(f"--allowed-origins: {given[0]!r} is not a JSON list") from e
        if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
            raise SystemExit(f"--allowed-origins: {given[0]!r} is not a list of strings")
        return parsed
    return list(given)


def as_arguments(settings: Settings) -> list[str]:
    """The command line that gives a child process the same settings."""
    out: list[str] = []
    for flag, field, _ in OPTIONS:
        value = getattr(settings, field)
        if value is None:
            continue
        if field in OFF_SWITCHES:
            if not value:
                out.append(flag)
            continue
        if isinstance(value, list):
            out += [flag, *map(str, value)]
            continue
        out += [flag, str(value)]
    return out
