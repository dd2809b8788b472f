from __future__ import annotations

import pytest

from tests.unit.worker.think_llama import save_think_llama
from tests.unit.worker.tiny_llama import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def think_llama_dir(tmp_path_factory):
    return save_think_llama(tmp_path_factory.mktemp("think-llama"))
