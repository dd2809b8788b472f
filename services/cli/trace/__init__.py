"""`spillway trace ID [--file PATH | --jaeger URL]`: one request's trace as a timeline.

spans.py     the one span type, and the two shapes it is read from: OTLP JSON lines
             (`--trace-file`) and Jaeger's HTTP query API responses
timeline.py  spans -> the traces that hold a request id or trace id -> indented text
             (pure: no files, no network)
sources.py   reading a trace file; asking Jaeger
command.py   the options and the run
"""
