"""The one typed settings module: defaults, environment variables, command-line overrides.

Nothing else in the project reads the environment. Environment names follow the
contract (NATS_URL, REDIS_URL, SPILLWAY_MODEL, SPILLWAY_API_KEY,
OTEL_EXPORTER_OTLP_ENDPOINT); every other setting may be given as SPILLWAY_<NAME>.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from spillway.shared.output_formats import ReasoningParserName, ToolCallParserName
from spillway.shared.protocol import RegionName, RegionSampling

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    D = TypeVar("D", bound=DataclassInstance)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
AutoDtype = Literal["exact", "fastest"]
CpuWaitPolicy = Literal["passive", "active"]
Quantization = Literal["none", "int8"]
KvCacheDtype = Literal["auto", "float32", "bfloat16"]
PreemptionMode = Literal["auto", "spill", "recompute"]
AttentionBackend = Literal["auto", "torch", "triton"]
LogFormat = Literal["text", "json"]
_DEFAULT_REGION_SAMPLING: dict[RegionName, RegionSampling] = {
    "code": RegionSampling(temperature=0.2),
    "tool_call": RegionSampling(temperature=0.0),
}
SpeculativeMethod = Literal["none", "ngram", "draft", "mtp"]
MarkerName = Literal["think_start", "think_end", "code_fence", "tool_call_start", "tool_call_end"]


class Settings(BaseSettings):
    # SPILLWAY_<FIELD> for every field; the aliases below are the ecosystem's own names.
    # Only those: a stray MODEL or API_KEY in a container's environment configures nothing.
    model_config = SettingsConfigDict(env_prefix="SPILLWAY_", extra="ignore", populate_by_name=True)

    # --- the contract's options (CONTRACT section 1) ---
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    model: str = DEFAULT_MODEL
    workers: int = Field(default=1, ge=1)
    kv_blocks: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=16, ge=1)
    max_batch: int = Field(default=64, ge=1)
    dtype: Dtype = "auto"
    preemption_mode: PreemptionMode = "auto"
    prefix_cache: bool = True
    namespace: str = ""
    api_key: str | None = None
    nats_url: str = Field(default=DEFAULT_NATS_URL, validation_alias="NATS_URL")
    redis_url: str = Field(default=DEFAULT_REDIS_URL, validation_alias="REDIS_URL")
    otlp_endpoint: str | None = Field(default=None, validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT")
    # Speculative decoding (CONTRACT section 7): who proposes drafts, how many per step,
    # the draft model (for "draft"), and the longest n-gram looked up (for "ngram").
    speculative: SpeculativeMethod = "none"
    num_speculative_tokens: int = Field(default=3, ge=1, le=16)
    draft_model: str | None = None
    ngram_max: int = Field(default=4, ge=1, le=16)
    # A draft's cost relative to a decode row's, for how many drafts pay; unset: measured
    # from the steps (SPILLWAY_SPEC_DRAFT_COST pins it, e.g. for tests on a busy machine).
    spec_draft_cost: float | None = Field(default=None, ge=0)
    # Serving options with vLLM's names (CONTRACT section 8): the names the API answers
    # to (the first is the one it reports; unset: the model's), a chat template replacing
    # the model's (a file, or the template itself), the longest context a request may
    # fill (unset: the model's), and the origins browsers may call the API from (CORS;
    # unset: no CORS headers). As environment variables, lists are JSON.
    served_model_name: list[str] | None = None
    chat_template: str | None = None
    max_model_len: int | None = Field(default=None, ge=2)
    allowed_origins: list[str] | None = None

    # --- the project's own knobs ---
    attention_backend: AttentionBackend = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    # CUDA graphs for all-decode steps (CUDA only); SPILLWAY_CUDA_GRAPHS=0 turns them off.
    cuda_graphs: bool = True
    # Batch sizes a decode graph is captured for (a batch runs in the smallest that holds
    # it; larger ones run eagerly); unset: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to
    # max_batch. As an environment variable, a JSON list: SPILLWAY_CUDA_GRAPH_SIZES='[1,8]'.
    cuda_graph_sizes: list[int] | None = None
    # Chunked prefill: tokens one step may compute across all rows.
    max_num_batched_tokens: int = Field(default=512, ge=16)
    # A step with decode rows takes only the prompt tokens that keep its forward within
    # this many milliseconds (measured costs), so that a burst of prompts does not stall
    # the streams already running; unset: every step may take the whole token budget.
    itl_target_ms: float | None = Field(default=None, gt=0)
    # Admission: requests waiting beyond this get 429.
    max_waiting: int = Field(default=1024, ge=1)
    heartbeat_interval_s: float = Field(default=0.5, gt=0)
    # A worker silent this long is dropped (health turns 503 within 5 s of its death).
    worker_timeout_s: float = Field(default=2.0, gt=0)
    step_timeout_s: float = Field(default=120.0, gt=0)
    # A gateway silent past GATEWAY_TIMEOUT_S is suspected (its loop may only be stalled)
    # and its requests keep running; silent this long, it is dead and they are aborted.
    gateway_grace_s: float = Field(default=5.0, gt=0)
    # A worker whose step has not come back within max(this, 20x the time its tokens
    # should take at the observed prefill rate) is hung, heartbeats or not: its scheduler
    # gives it up and moves its requests to its other workers.
    step_hang_s: float = Field(default=10.0, gt=0)
    # Ctrl-C: how long running requests may take to finish before children are stopped.
    drain_timeout_s: float = Field(default=10.0, ge=0)
    # A scheduler publishes its lease this often; one silent for scheduler_timeout_s is
    # gone: gateways move its requests to a live scheduler (replayed, or resumed after
    # the tokens already sent; an error when none takes one within resume_timeout_s)
    # and its workers register elsewhere.
    scheduler_lease_interval_s: float = Field(default=0.5, gt=0)
    scheduler_timeout_s: float = Field(default=5.0, gt=0)
    resume_timeout_s: float = Field(default=30.0, ge=0)
    # This process's own NATS user (each service has one; see `spillway nats-config`).
    # Given, they win over credentials in the URL.
    nats_user: str | None = None
    nats_password: str | None = None
    # `spillway up`: start private nats-server / redis-server even when the default URLs
    # answer (a system of its own, its bus guarded by per-service users).
    private_servers: bool = False
    # `spillway up` restarts a child that dies, after restart_backoff_s (doubling, at most
    # 10 s); a child that dies more than restart_limit times in restart_window_s is a crash
    # loop: the whole system stops with an error.
    restart_limit: int = Field(default=5, ge=0)
    restart_window_s: float = Field(default=60.0, gt=0)
    restart_backoff_s: float = Field(default=0.5, ge=0)
    # HTTP: bodies above this get 413 unread; a client that takes longer than
    # http_client_timeout_s to send its request, or stops reading a stream that long,
    # is cut off (and its request aborted).
    max_request_bytes: int = Field(default=4 << 20, ge=1024)
    http_client_timeout_s: float = Field(default=30.0, gt=0)
    # CPU KV cache budget when --kv-blocks is not given (GPU: sized from free memory).
    cpu_kv_cache_bytes: int = Field(default=1 << 30, ge=1 << 20)
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    # What the spill store may hold in Redis.
    spill_capacity_bytes: int = Field(default=4 << 30, ge=0)
    # A spill store serves this system (`spillway up` always starts one): victims may be
    # spilled, swapped in, and finished prefixes shared through it.
    spill_store: bool = True
    # Blocks per Redis value when a victim's KV is spilled (one pipelined write).
    spill_group_blocks: int = Field(default=16, ge=1)
    # Spilled data of a worker silent this long is deleted by the spill store.
    spill_orphan_timeout_s: float = Field(default=30.0, gt=0)
    # Redis expiry on every spilled key: a backstop when nothing else deletes it.
    spill_ttl_s: int = Field(default=3600, ge=1)
    # The worker's Redis socket timeout: a step never waits on a dead store longer.
    kv_store_timeout_s: float = Field(default=2.0, gt=0)
    # The shared prefix tier's capacity in blocks (oldest evicted first); 0: off.
    prefix_tier_blocks: int = Field(default=1024, ge=0)
    # Plan step N+1 before step N's result is back (hides bus and bookkeeping time).
    run_ahead: bool = True
    # A hybrid model's state pool: slots (one per sequence running at once); unset:
    # max_batch. Taken out of the KV cache's memory budget.
    state_slots: int | None = Field(default=None, ge=1)
    # Its snapshots of states at block boundaries (prefix caching); unset: as many as
    # state slots; 0: no prefix caching for a hybrid model.
    state_snapshots: int | None = Field(default=None, ge=0)
    # --- the worker on the CPU ---
    # Math threads of the worker (--threads); unset: every core this process may run on.
    threads: int | None = Field(default=None, ge=1)
    # How the worker's idle math threads wait (OpenMP's OMP_WAIT_POLICY, unless that is set):
    # passive threads sleep at once, so a busy neighbour costs throughput in proportion to
    # the CPU it takes; active ones spin, a little faster on an idle machine and far slower
    # on a shared one.
    cpu_wait_policy: CpuWaitPolicy = "passive"
    # What --dtype auto picks on the CPU: exact = float32 (greedy outputs equal the float32
    # reference); fastest = whichever of float32 and bfloat16 a start-up measurement finds
    # faster (bfloat16 only on a CPU with bfloat16 units).
    auto_dtype: AutoDtype = "exact"
    # Weight quantization of the projections (--quantize): int8 (per output channel, with
    # activations quantized per step) is faster on the CPU and changes outputs: opt-in only.
    quantize: Quantization = "none"
    # The KV cache's dtype (--kv-cache-dtype): auto = the model's (float32 on the CPU,
    # bfloat16 on CUDA). bfloat16 on the CPU halves the bytes attention reads per step and
    # rounds every cached key and value: opt-in only, like --quantize.
    kv_cache_dtype: KvCacheDtype = "auto"
    # Attention reads the paged KV cache in place through C loops built on first use
    # (a C compiler is needed; without one the torch path gathers the cache instead).
    cpu_native_kernels: bool = True
    # --- expert parallel (a worker as a group of ranks; services/worker/ep_group.py) ---
    # Ranks per worker; each holds 1/N of every MoE layer's experts.
    expert_parallel: int = Field(default=1, ge=1)
    # This process's rank in its group, and the group's rendezvous (tcp://HOST:PORT).
    rank: int = Field(default=0, ge=0)
    dist_url: str | None = None
    # How the ranks combine their experts' outputs: a sum of every rank's partial outputs
    # (all_reduce), or tokens sent to the ranks holding their experts and back (all_to_all).
    ep_exchange: Literal["all_reduce", "all_to_all"] = "all_reduce"
    # A collective of the group not done within this breaks the group (its ranks exit).
    ep_timeout_s: float = Field(default=5.0, gt=0)
    debug_invariants: bool = False
    # Adaptive sampling by region (think block, code fence, tool call): off unless turned
    # on here (server-wide) or per request (`sampling_by_region` in the body). The table
    # maps a region to the settings that replace the request's inside it; as an
    # environment variable, JSON: SPILLWAY_REGION_SAMPLING='{"code": {"temperature": 0.2}}'.
    sampling_by_region: bool = False
    region_sampling: dict[RegionName, RegionSampling] = Field(
        default_factory=lambda: _DEFAULT_REGION_SAMPLING.copy()
    )
    # The model profile's region markers, replacing the ones found in its tokenizer and
    # chat template: {"think_start": "<think>", "think_end": "</think>", "code_fence":
    # "```", "tool_call_start": "<tool_call>", "tool_call_end": "</tool_call>"}; an empty
    # string turns a marker off.
    region_markers: dict[MarkerName, str] = Field(default_factory=dict)
    # How the model writes tool calls and marks its reasoning (vLLM's parser names);
    # unset: chosen from the chat template and vocabulary (shared/output_formats.py).
    tool_call_parser: ToolCallParserName | None = None
    reasoning_parser: ReasoningParserName | None = None
    log_level: str = "INFO"
    # text: one readable line per record; json: one JSON object per line, with the
    # current span's trace_id and span_id (shared/json_logs.py).
    log_format: LogFormat = "text"
    # Log the process's RSS and live Python objects this often (a leak grows both, a
    # heap's high-water mark only the RSS); with PYTHONTRACEMALLOC=1, also the source lines
    # whose allocations grew most (shared/memory_report.py). Unset: never.
    memory_report_s: float | None = Field(default=None, gt=0)
    # Every span also appended to this file as one OTLP JSON line (shared/trace_file.py);
    # all services of a system may share it. `spillway trace` reads it.
    trace_file: str | None = None
    service_id: str | None = None  # the worker / gateway id; random when not set
    # Derived files kept between runs (e.g. a GGUF model's tokenizer, converted once).
    cache_dir: str = "~/.cache/spillway"

    @field_validator(
        "api_key",
        "otlp_endpoint",
        "nats_user",
        "nats_password",
        "trace_file",
        "chat_template",
        mode="before",
    )
    @classmethod
    def _empty_is_unset(cls, v: object) -> object:
        # Compose files pass `VAR=` for "not set".
        return None if v == "" else v

    @field_validator("namespace", "service_id")
    @classmethod
    def _subject_token(cls, v: str | None) -> str | None:
        # Both become one token of NATS subjects.
        if v and not all(c.isalnum() or c in "-_" for c in v):
            raise ValueError("may hold letters, digits, '-' and '_' only")
        return v

    @field_validator("block_size")
    @classmethod
    def _block_size_power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("block size must be a power of two")
        return v

    def with_overrides(self, **overrides: object) -> Settings:
        """A copy with the given (non-None) values replaced and validated."""
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return Settings.model_validate(data)


def load_settings(**overrides: object) -> Settings:
    """Defaults < environment < overrides (the command line)."""
    return Settings().with_overrides(**overrides)


def settings_part(cls: type[D], settings: Settings, **values: Any) -> D:
    """A service's own settings dataclass `cls` from the Settings: each of its fields that
    Settings has by the same name, then `values` (its renamed or derived fields) on top;
    any other field keeps its default."""
    names = {f.name for f in dataclasses.fields(cls)} & set(Settings.model_fields)
    return cls(**{**{n: getattr(settings, n) for n in names}, **values})


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child service process: ours, plus `extra`."""
    env = dict(os.environ)
    env.update(extra or {})
    return env
