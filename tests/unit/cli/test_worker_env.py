"""The worker's OpenMP environment is derived from the settings, never over the user's."""

from __future__ import annotations

from spillway.services.cli.worker_env import apply_openmp_environment, openmp_environment
from spillway.shared.config import load_settings


def test_passive_waiting_by_default_and_the_thread_count_when_set():
    assert openmp_environment(load_settings()) == {"OMP_WAIT_POLICY": "PASSIVE"}
    settings = load_settings(threads=3, cpu_wait_policy="active")
    assert openmp_environment(settings) == {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "3"}


def test_variables_the_user_set_are_kept():
    environ = {"OMP_WAIT_POLICY": "active"}
    apply_openmp_environment(load_settings(threads=2), environ)
    assert environ == {"OMP_WAIT_POLICY": "active", "OMP_NUM_THREADS": "2"}
