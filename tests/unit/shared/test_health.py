"""The health file a container's probe reads: fresh, stale, missing, not a beat; written
only from readiness on and removed when the service stops."""

from __future__ import annotations

import asyncio
import os

from spillway.shared.health import (
    HealthBeat,
    Readiness,
    check_health_file,
    keep_health_file,
    write_beat,
)


def test_a_fresh_beat_is_healthy(tmp_path):
    path = tmp_path / "health"
    write_beat(path, HealthBeat(service="scheduler", pid=7, time=100.0))
    healthy, message = check_health_file(path, max_age_s=30, now=112.5)
    assert healthy
    assert "scheduler (pid 7)" in message and "12.5 s ago" in message


def test_a_stale_beat_is_unhealthy(tmp_path):
    path = tmp_path / "health"
    write_beat(path, HealthBeat(service="worker", pid=7, time=100.0))
    healthy, message = check_health_file(path, max_age_s=30, now=130.5)
    assert not healthy
    assert "30.5 s ago" in message


def test_a_missing_file_is_unhealthy(tmp_path):
    healthy, message = check_health_file(tmp_path / "absent", max_age_s=30, now=0.0)
    assert not healthy
    assert "no beat yet" in message


def test_a_file_that_is_not_a_beat_is_unhealthy(tmp_path):
    path = tmp_path / "health"
    path.write_text("ok")
    healthy, message = check_health_file(path, max_age_s=30, now=0.0)
    assert not healthy
    assert "not a health beat" in message


async def test_beats_start_at_readiness_and_the_file_goes_when_the_service_stops(tmp_path):
    path = tmp_path / "health"
    readiness = Readiness()
    task = asyncio.create_task(
        keep_health_file(path, "spillstore", readiness, interval_s=0.01, wall=lambda: 50.0)
    )
    for _ in range(5):  # several intervals pass before readiness: nothing is written
        await asyncio.sleep(0.01)
    assert not path.exists()
    readiness.set_ready()
    async with asyncio.timeout(10):
        while not path.exists():
            await asyncio.sleep(0.01)
    beat = HealthBeat.model_validate_json(path.read_bytes())
    assert (beat.service, beat.pid, beat.time) == ("spillstore", os.getpid(), 50.0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary file left behind
