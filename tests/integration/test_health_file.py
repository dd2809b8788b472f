"""`spillway serve ... --health-file` with `spillway healthcheck`: the probe of a container
whose service listens on no port (a real spill store on private NATS and Redis)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from spillway.shared.health import HealthBeat, write_beat

SPILLWAY = str(Path(sys.executable).with_name("spillway"))


def healthcheck(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SPILLWAY, "healthcheck", "--file", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_healthcheck_exit_code_follows_the_beat_age(tmp_path):
    path = tmp_path / "health"
    missing = healthcheck(path)
    assert missing.returncode == 1 and "no beat yet" in missing.stderr
    write_beat(path, HealthBeat(service="worker", pid=1, time=time.time()))
    fresh = healthcheck(path, "--max-age", "30")
    assert fresh.returncode == 0, fresh.stderr
    assert "worker (pid 1)" in fresh.stdout
    write_beat(path, HealthBeat(service="worker", pid=1, time=time.time() - 3600))
    stale = healthcheck(path, "--max-age", "30")
    assert stale.returncode == 1 and "more than 30 s" in stale.stderr


def test_a_serving_spill_store_beats_until_it_stops(tmp_path, nats_url, redis_url):
    path = tmp_path / "health"
    env = {**os.environ, "SPILLWAY_NAMESPACE": "health"}
    args = ["serve", "spillstore", "--nats-url", nats_url, "--redis-url", redis_url]
    proc = subprocess.Popen(
        [SPILLWAY, *args, "--health-file", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        assert "spillway-spillstore ready" in ready, ready
        # The first beat follows readiness at once; allow a slow machine its time.
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        check = healthcheck(path)
        assert check.returncode == 0, check.stderr
        assert "spillstore" in check.stdout
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert not path.exists()  # a stopped service is not healthy
    assert healthcheck(path).returncode == 1
