"""The scheduler: queues, the KV block allocator and continuous batching.

Pure core (no bus, no asyncio, no torch):
    core.py           SchedulerCore: the tick's state machine
    sequence.py       Sequence: tokens, computed tokens, blocks, what the worker knows
    inflight.py       InflightStep: what the core remembers of a step until its result
    block_manager.py  BlockManager: logical KV blocks, one free queue in eviction order
    prefix_hash.py    chained block hashes (the prefix cache's and the shared tier's keys)
    slots.py          SlotAllocator: a sequence's state slot, admission to retirement
    request_queue.py  RequestQueue: priority, then arrival
    admission.py      why a submit is refused (400 / 429 / 503)
    preemption.py     PreemptionPolicy: spill or recompute a victim, the store's health
    placement.py      which worker a new sequence goes to (several workers)
    stopping.py       stop conditions after a token
    speculation.py    speculative decoding: n-gram drafts, how many pay, what stood
    step_plan.py      rows and block-table diffs for the worker
    deltas.py         one delta per request per tick
    observer.py       SchedulerObserver: what the core reports (spans, timings)
    registry.py       WorkerRegistry: heartbeats and expiry
    step_timing.py    rolling medians of where a step's time goes
    phase_stats.py    PhaseStats: tick phases timed in-process (for /metrics)
    config.py         SchedulerConfig
Shell:
    lane.py           Lane: one worker's core, its steps in flight and its tick loop
    tracing.py        SpanObserver: OpenTelemetry spans from the observer calls
    service.py        serve(): the NATS subjects, the lanes, leases and migration

No torch, and no import of another service (`lint-imports` checks both).
"""
