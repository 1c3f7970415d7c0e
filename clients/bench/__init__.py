"""Benchmarks that drive a server over HTTP, each a program (`python -m clients.bench.<name>`).

`python -m clients.bench` (`kvserve bench`) is the load generator: load.py, over workload.py (what to send),
server_api.py (how it is sent and timed), results.py (the statistics and table) and memory.py. The other
programs: suite (`make bench`: kvserve, llama.cpp and transformers side by side), soak (`make soak`: mixed
load, then a leak check), fairness (latency probes under load), replicas (Ray Serve scale-out), speculative
(speculation on against opted out) and quality (quantized against float32). processes.py starts and stops
the servers they measure.
"""
