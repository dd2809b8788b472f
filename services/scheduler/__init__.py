"""The scheduler: queues, the KV block allocator and continuous batching.

Pure cores (no bus, no asyncio, no torch):
    fleet.py          Fleet: every worker together, events in, effects out (placement,
                      membership, migration, rebalancing, drains, hangs, outages,
                      gateways, lease, stats)
    fleet_events.py   what happens to a scheduler (submitted, step returned, ticked, ...)
    fleet_effects.py  what the fleet asks of the shell (send step, send deltas, drop spills)
    fleet_stats.py    FleetStats: the lease and sched.stats' reply (the lanes' counts and
                      KV pooled, ended lanes' counters, step timings, tick phases)
    migration.py      where a sequence goes; a lost worker's sequences and those waiting
                      behind a full batch moved to other lanes
    lane.py           Lane: one worker's core, its steps in flight and its ticks; returns
                      the steps to send and each tick's news and report
    core.py           SchedulerCore: the tick's state machine (schedule, results, phases)
    places.py         Places: every sequence of a core and the place (queue) it is in
    kv_pool.py        KVPool: the worker's blocks, state slots, snapshots, prefix cache
    residency.py      Residency: blocks got and lost (admission, preemption, swap-in,
                      resume) and what a step did with its KV orders
    endings.py        Endings: finish, retire
    membership.py     Membership: the worker attached, detached, evacuated; sequences
                      adopted, rebalanced, handed back
    stats.py          CoreStats: a core's counters; RowCap: the batch after an OOM
    kv_orders.py      KVOrders: forgets, spills, prefix stores, loads, state copies,
                      drops; their outcomes
    sequence.py       Sequence: tokens, computed tokens, blocks, what the worker knows
    inflight.py       InflightStep: what the core remembers of a step until its result
    block_manager.py  BlockManager: logical KV blocks, one free queue in eviction order
    prefix_hash.py    chained block hashes (the prefix cache's and the shared tier's keys)
    slots.py          SlotAllocator: the smallest free integer
    state_slots.py    StateSlots: a hybrid worker's state slots, held while blocks are
    state_snapshots.py StateSnapshots: states at block boundaries (hybrid prefix hits)
    request_queue.py  RequestQueue: priority, then arrival
    admission.py      why a submit is refused (400 / 429 / 503)
    preemption.py     PreemptionPolicy: spill or recompute a victim, the store's health
    placement.py      which worker a new sequence goes to (several workers)
    stopping.py       stop conditions after a token
    speculation.py    speculative decoding: n-gram (or the worker's MTP) drafts, how many
                      pay, what stood
    step_plan.py      the step plan: rows and block-table diffs for the worker
    deltas.py         News: one delta per request per tick; merged for a gateway
    observer.py       SchedulerObserver: what the core reports (spans, timings)
    registry.py       WorkerRegistry: heartbeats and expiry
    gateway_watch.py  GatewayWatch: which gateways holding requests here have died
    step_timing.py    rolling medians of where a step's time goes
    phase_stats.py    PhaseStats: tick phases timed in-process (for /metrics)
    config.py         SchedulerConfig
Shell (the only code on the bus):
    service.py        serve(): the NATS subjects, turned into fleet events; the effects
                      carried out in order (a step's trip to its worker and its reply
                      back among them); the timers, the spill store's health
    tracing.py        SpanObserver: OpenTelemetry spans from the observer calls

No torch, and no import of another service (`lint-imports` checks both).
"""
