#!/usr/bin/env python3
"""Encoder-decoder waves, measured: ten /v1/completions requests (64 greedy
tokens each, EOS ignored) sent one after another, then all at once, against a
`sipp serve` running a T5 (e.g. scripts/tiny_t5.py's), three rounds. Run it
against `--parallel 8` (waves of up to eight, one encode each) and
`--parallel 1` (one request at a time). Standard library only.

    python3 scripts/bench_t5.py BASE_URL
"""
import json
import sys
import threading
import time
import urllib.request

base = sys.argv[1]


def one(i):
    body = {"prompt": f"Input number {i}: the quick brown fox jumps over the lazy dog.",
            "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())["usage"]


for rnd in range(3):
    t = time.monotonic()
    for i in range(10):
        one(i)
    seq = time.monotonic() - t
    t = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for x in threads:
        x.start()
    for x in threads:
        x.join()
    conc = time.monotonic() - t
    print(f"round {rnd}: 10 x 64 tokens one after another {seq * 1000:.0f} ms, at once {conc * 1000:.0f} ms")
