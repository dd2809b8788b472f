"""bench.tool_parsing reads a streamed call whole in every format."""

from __future__ import annotations

import pytest

from bench.tool_parsing import measure, source_file
from spillway.shared.output_formats import TOOL_CALL_PARSERS


@pytest.mark.parametrize("name", TOOL_CALL_PARSERS)
def test_every_format_reads_the_streamed_call_whole(name):
    pieces, seconds, whole = measure(name, {"path": "a.py", "content": source_file(20)}, 3)
    assert whole and pieces > 300 and seconds >= 0
