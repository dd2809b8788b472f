"""What reading tool calls as they stream costs the gateway, per format:

    python -m bench.tool_parsing [--lines 400 1600] [--piece 4]

One call whose arguments hold a source file of --lines lines (about 50 characters each,
as an agent writing a file sends it) is written in each format and fed to the parser in
pieces of --piece characters (about a token each), as the stream brings it. Printed: the
CPU time of the whole call and per piece (the thread's CPU clock: the machine's load does
not count), and whether the arguments came out whole. A cost per piece that stays flat as
the argument grows means the parser reads each piece once.
"""

from __future__ import annotations

import argparse
import json
import time

from spillway.services.gateway.tool_call_parser import ToolCallParser
from spillway.services.gateway.tool_formats import tool_format
from spillway.shared.output_formats import TOOL_CALL_PARSERS


def source_file(lines: int) -> str:
    return "".join(f'def f{i}(x):\n    return "v{i}" + x  # line {i}\n' for i in range(lines))


def measure(name: str, arguments: dict, piece: int) -> tuple[int, float, bool]:
    """(pieces, CPU seconds, arguments whole) for one call in format `name`."""
    fmt = tool_format(name, None)
    text = fmt.write("write_file", arguments)
    parser = ToolCallParser(fmt)
    start = time.thread_time()
    for at in range(0, len(text), piece):
        parser.feed(text[at : at + piece])
    parser.finish()
    seconds = time.thread_time() - start
    whole = [json.loads(c.arguments) for c in parser.calls] == [arguments]
    return -(-len(text) // piece), seconds, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[400, 1600])
    parser.add_argument("--piece", type=int, default=4)
    args = parser.parse_args()
    print(f"{'format':12} {'argument':>9} {'pieces':>7} {'CPU s':>7} {'us/piece':>9}  whole")
    for lines in args.lines:
        arguments = {"path": "a.py", "content": source_file(lines)}
        size = len(json.dumps(arguments))
        for name in TOOL_CALL_PARSERS:
            pieces, seconds, whole = measure(name, arguments, args.piece)
            per = seconds / pieces * 1e6
            print(f"{name:12} {size:>8}B {pieces:>7} {seconds:>7.2f} {per:>9.1f}  {whole}")


if __name__ == "__main__":
    main()
