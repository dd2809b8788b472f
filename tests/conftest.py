"""Fixtures shared by every test folder: private NATS and Redis servers on free ports."""

from __future__ import annotations

import pytest

from services.cli.servers import start_nats, start_redis


@pytest.fixture(scope="session")
def nats_server():
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server():
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url
