"""The transformers peer of `spillway bench --compare`, in a process of its own:
`python -m spillway.services.cli.bench.transformers_peer < spec.json > result.json`.

Its own process, so that its OpenMP threads wait as transformers' do for a user (in the
environment the bench was started in), not as the worker's. OpenMP reads OMP_WAIT_POLICY
once, when torch loads, and the bench's own process takes the worker's passive policy
before that. On a quiet 2-core Xeon, passive waits cost transformers' batched decode of
mid-size hybrid models about half its speed
(docs/measurements/2026-12-07-intel-xeon-sapphire-rapids.md).

Reads the spec `peers.run_subprocess_peer` writes ({"model", "prompts", "max_tokens",
"batch_size", "threads"}) on stdin. Prints one JSON line {"output_ids", "duration_s",
"note"}; an error goes to stderr with exit code 1.
"""

from __future__ import annotations

import json
import os
import sys

from spillway.services.cli.bench.peers import run_transformers
from spillway.services.cli.bench.workload import BenchRequest
from spillway.shared.model_files import resolve_model


def main() -> int:
    spec = json.load(sys.stdin)
    requests = [
        BenchRequest(index=i, prompt_ids=tuple(prompt), max_tokens=new, arrival_s=0.0)
        for i, (prompt, new) in enumerate(zip(spec["prompts"], spec["max_tokens"], strict=True))
    ]
    result = run_transformers(
        resolve_model(spec["model"]), requests, spec["batch_size"], threads=spec["threads"]
    )
    if result.error is not None:
        print(result.error, file=sys.stderr)
        return 1
    waits = os.environ.get("OMP_WAIT_POLICY") or "OpenMP's default"
    note = f"{result.note}; its own process, OpenMP waits: {waits}"
    answer = {"output_ids": result.output_ids, "duration_s": result.duration_s, "note": note}
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
