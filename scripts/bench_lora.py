#!/usr/bin/env python3
"""One round of scripts/bench-lora.sh against a running server (sipp serve or
llama-server with the same two adapters loaded): SLOTS concurrent greedy
streams of TOKENS tokens each through /v1/completions with a `lora` list, in
three scenarios: no adapters, every stream on adapter A, and the streams
spread over none, A and B. Prints {scenario: generated tokens per second}.

    python3 scripts/bench_lora.py http://127.0.0.1:PORT SLOTS TOKENS
"""
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

NONE = [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
A = [{"id": 0, "scale": 1.0}]
B = [{"id": 1, "scale": 1.0}]


def complete(base, prompt, lora, tokens):
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "lora": lora}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["usage"]["completion_tokens"]


def scenario(base, name, loras, tokens):
    # Prompts of their own per scenario: no server reuses another scenario's
    # KV (llama-server would, even across adapter sets).
    prompts = [f"{name} story {i}: once upon a time, in a town by the sea,"
               for i in range(len(loras))]
    start = time.monotonic()
    with ThreadPoolExecutor(len(loras)) as pool:
        done = sum(pool.map(lambda a: complete(base, a[0], a[1], tokens), zip(prompts, loras)))
    return done / (time.monotonic() - start)


def main():
    base, slots, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    complete(base, "warm up", A, 4)
    mixed = [[NONE, A, B][i % 3] for i in range(slots)]
    out = {
        "no adapters": scenario(base, "Plain", [NONE] * slots, tokens),
        "one set (A)": scenario(base, "Adapted", [A] * slots, tokens),
        "three sets mixed": scenario(base, "Mixed", mixed, tokens),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
