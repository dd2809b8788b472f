"""`spillway trace ID [--file PATH | --jaeger URL]`: reads the spans and prints the timeline.

Exit codes: 0 when the trace was printed; 1 when the id is unknown to the source or the
source cannot be read (with a message on stderr saying which).
"""

from __future__ import annotations

import argparse
import os
import sys


def add_trace_options(p: argparse.ArgumentParser, default_file: str | None) -> None:
    p.add_argument(
        "id",
        help="a request id (the response's `id`, a NATS request_id, or a scheduler "
        "sequence id) or a 32-digit trace id (from the `traceparent` header)",
    )
    source = p.add_mutually_exclusive_group()
    shown = default_file or "SPILLWAY_TRACE_FILE, unset"
    source.add_argument(
        "--file",
        default=default_file,
        help=f"a trace file written with --trace-file (default: {shown})",
    )
    source.add_argument("--jaeger", help="Jaeger's query URL, e.g. http://127.0.0.1:16686")


def trace_main(args: argparse.Namespace) -> int:
    # Imported here: `spillway up` builds this parser too and needs none of it.
    from spillway.services.cli.trace.sources import (
        JaegerClient,
        SourceError,
        traces_from_file,
        traces_from_jaeger,
    )
    from spillway.services.cli.trace.timeline import render

    ident = args.id.strip()
    try:
        if args.jaeger:
            traces = traces_from_jaeger(JaegerClient(args.jaeger), ident)
            where = f"Jaeger at {args.jaeger}"
        elif args.file:
            traces, unreadable = traces_from_file(args.file, ident)
            where = args.file
            if unreadable:
                print(f"spillway trace: skipped {unreadable} unreadable lines", file=sys.stderr)
        else:
            print("spillway trace: give --file PATH or --jaeger URL", file=sys.stderr)
            return 1
    except SourceError as e:
        print(f"spillway trace: {e}", file=sys.stderr)
        return 1
    if not traces:
        print(f"spillway trace: no trace in {where} has the id {ident!r}", file=sys.stderr)
        return 1
    try:
        print(render(traces, ident), flush=True)
    except BrokenPipeError:
        # The reader (`| head`) has what it wanted; nothing is left to say.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
