"""The tiny random Llama folder every worker service test serves."""

from __future__ import annotations

import pytest

from tests.unit.worker.tiny_llama import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-service"))
