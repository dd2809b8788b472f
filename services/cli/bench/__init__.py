"""`spillway bench`: a load generator for any OpenAI-compatible server, and `--compare`.

workload.py   the requests (prompt token ids, output lengths) and their arrival times
client.py     sends them (one asyncio process, streaming httpx), records each chunk's time
metrics.py    the records summarised: throughput, TTFT, ITL, TPOT, end-to-end latency
peers.py      the same workload through transformers (in process) and through
              llama.cpp (its own Python environment, as a subprocess)
machine.py    the CPU it ran on and the rates of its float32 bound (GFLOP/s, read GB/s)
report.py     the result table and the JSON file
command.py    the options and the run
"""
