"""Benchmarks: figures measured against a baseline in the same run, apart from the tests.

One module per benchmark, plus what they share. For `ninfer bench decode`: `checkpoint`
builds the benchmark model (Qwen3-0.6B shapes, random weights, the real Qwen vocabulary)
once and caches it, `bandwidth` measures memory bandwidth and turns it into a decode
ceiling, and `decode` times ninfer against transformers `generate`. Nothing here is
imported by the engine, and transformers is imported only when a benchmark runs.
"""
