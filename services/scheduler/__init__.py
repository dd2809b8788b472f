"""The scheduler: queues, the KV block allocator and continuous batching.

Pure core (no bus, no asyncio, no torch):
    core.py           SchedulerCore: the tick's state machine
    sequence.py       Sequence: tokens, computed tokens, blocks, what the worker knows
    block_manager.py  BlockManager: logical KV blocks, one free queue in eviction order
    request_queue.py  RequestQueue: priority, then arrival
    admission.py      why a submit is refused (400 / 429 / 503)
    stopping.py       stop conditions after a token
    step_plan.py      rows and block-table diffs for the worker
    deltas.py         one delta per request per tick
    observer.py       SchedulerObserver: what the core reports (spans, timings)
    registry.py       WorkerRegistry: heartbeats and expiry
    step_timing.py    rolling medians of where a step's time goes
    config.py         SchedulerConfig
Shell:
    tracing.py        SpanObserver: OpenTelemetry spans from the observer calls
    service.py        serve(): the NATS subjects and the tick loop
"""
