"""Fixtures shared by every test folder: private NATS and Redis servers on free ports.

Without CUDA, Triton kernels run in Triton's CPU interpreter. Triton fixes the mode of a
`@triton.jit` function when it is defined, and any test may be the first to import a
kernel module, so the switch is set here, before every test module.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
