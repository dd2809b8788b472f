"""The few-row kernels' thread decision is timed once per CPU, build, thread count and
workload, then read back by later starts; a damaged or foreign file is timed afresh."""

from __future__ import annotations

import pytest

from spillway.kernels.cpu import matvec, tuning_cache
from tests.kernels.native_paths import built


@pytest.fixture
def kernels(tmp_path_factory):
    loaded = matvec.load(tmp_path_factory.mktemp("matvec"))
    return built(loaded, "no C compiler here, or this CPU has none of the few-row kernels' paths")


def test_a_decision_is_timed_once_and_read_back(kernels, tmp_path):
    kernels.cache_dir = tmp_path
    calls: list[int] = []

    def run() -> None:
        calls.append(kernels.parallel_min_bytes)

    first = kernels.tune(run, rounds=2, workload=["none", "(576, 576)"])
    assert first in matvec.PARALLEL_MIN_BYTES_CHOICES
    assert len(calls) == 2 * len(matvec.PARALLEL_MIN_BYTES_CHOICES)
    files = list((tmp_path / "tuning").glob("matvec-threads-*.json"))
    assert len(files) == 1
    # Another start (a fresh choice set first) takes the stored decision without timing.
    kernels.parallel_min_bytes = -1
    assert kernels.tune(run, rounds=2, workload=["none", "(576, 576)"]) == first
    assert kernels.parallel_min_bytes == first and len(calls) == 4
    # Another workload is timed, and so is a damaged file.
    kernels.tune(run, rounds=1, workload=["int8", "(576, 576)"])
    assert len(calls) == 6 and len(list((tmp_path / "tuning").iterdir())) == 2
    files[0].write_text("{not json")
    kernels.tune(run, rounds=1, workload=["none", "(576, 576)"])
    assert len(calls) == 8
    # Without a workload (or a cache folder) every call times.
    kernels.tune(run, rounds=1)
    assert len(calls) == 10


def test_a_stored_choice_outside_the_allowed_ones_is_ignored(tmp_path):
    path = tuning_cache.decision_path(tmp_path, "x", ["a", 1])
    assert path == tuning_cache.decision_path(tmp_path, "x", ["a", 1])
    assert path != tuning_cache.decision_path(tmp_path, "x", ["a", 2])
    assert tuning_cache.load_decision(path, [1, 2]) is None  # no file
    tuning_cache.store_decision(path, 3)
    assert tuning_cache.load_decision(path, [1, 2]) is None
    tuning_cache.store_decision(path, 2)
    assert tuning_cache.load_decision(path, [1, 2]) == 2
