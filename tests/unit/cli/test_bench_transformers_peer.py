"""`spillway bench --compare`'s transformers peer runs by this Python in a process of its
own (`transformers_peer.py`), under the environment it is given: its OpenMP threads wait
as a user's transformers' would, not as the worker's (the bench's own process takes the
worker's passive policy before torch loads). Its outputs are the in-process generate's."""

from __future__ import annotations

import os

from spillway.services.cli.bench.peers import run_transformers, run_transformers_peer
from spillway.services.cli.bench.workload import BenchRequest
from spillway.shared.model_files import resolve_model
from tests.unit.worker.tiny_llama import save_tiny_llama

PROMPTS = [(5, 9, 17, 33, 2), (40, 41, 7), (100, 3, 3, 8, 12, 60)]


def _requests() -> list[BenchRequest]:
    return [BenchRequest(i, p, 6, 0.0) for i, p in enumerate(PROMPTS)]


def test_the_peer_runs_in_its_own_process_under_the_environment_given(tmp_path) -> None:
    source = resolve_model(str(save_tiny_llama(tmp_path / "tiny")))
    here = run_transformers(source, _requests(), batch_size=2)
    assert here.error is None and len(here.output_ids) == len(PROMPTS)

    users = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    theirs = run_transformers_peer(source, _requests(), 2, env=users)
    assert theirs.error is None, theirs.error
    assert theirs.name == "transformers generate (float32)"
    assert theirs.output_ids == here.output_ids  # the same greedy tokens, in order
    assert theirs.output_tokens == 6 * len(PROMPTS) and theirs.duration_s > 0
    assert theirs.note.endswith("OpenMP waits: OpenMP's default")

    passive = run_transformers_peer(
        source, _requests(), 2, env={**users, "OMP_WAIT_POLICY": "PASSIVE"}
    )
    assert passive.note.endswith("OpenMP waits: PASSIVE")


def test_a_synthetic_model_is_refused_without_a_process(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text("{}")
    refused = run_transformers_peer(resolve_model(f"synthetic:{config}"), _requests())
    assert refused.error == "transformers cannot load a synthetic model"
