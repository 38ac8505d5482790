#!/usr/bin/env python3
"""One round of the image benchmark against an OpenAI-compatible server with a
vision projector: a text-only stream (greedy, 300 tokens, EOS ignored) runs;
after its fifth token, eight chat requests with eight new images (never sent
before: the round number salts them) go out at once. Prints one JSON object:
the window the images took (first sent to last answered), the stream's
inter-token gaps inside that window and after it, and the image requests'
latencies, in milliseconds. Standard library only.

    python3 bench_images.py BASE_URL ROUND
"""
import base64
import json
import struct
import sys
import threading
import time
import urllib.request
import zlib

base, rnd = sys.argv[1], int(sys.argv[2])


def png(w, h, seed):
    rows = []
    x = seed * 2654435761 % 2**32
    for y in range(h):
        row = bytearray([0])
        for i in range(w):
            x = (x * 1664525 + 1013904223) % 2**32
            row += bytes([(i * 5 + seed) % 256, (y * 7) % 256, x >> 24])
        rows.append(bytes(row))
    raw = b"".join(rows)

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)


stamps = []


def stream_text():
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": 300, "temperature": 0, "stream": True, "ignore_eos": True}
    with post("/v1/chat/completions", body) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"]
            if ch and ch[0]["delta"].get("content"):
                stamps.append(time.monotonic())


latencies = [None] * 8


def image_request(i):
    url = "data:image/png;base64," + base64.b64encode(png(64 + i, 48, 1000 * rnd + i)).decode()
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What colour dominates?"}]}],
        "max_tokens": 8, "temperature": 0}
    t0 = time.monotonic()
    with post("/v1/chat/completions", body) as r:
        json.loads(r.read())
    latencies[i] = time.monotonic() - t0


t = threading.Thread(target=stream_text)
t.start()
while len(stamps) < 5:
    time.sleep(0.005)
start = time.monotonic()
ws = [threading.Thread(target=image_request, args=(i,)) for i in range(8)]
for w in ws:
    w.start()
for w in ws:
    w.join()
end = time.monotonic()
t.join()
gaps = list(zip(stamps, stamps[1:]))
inside = [b - a for a, b in gaps if start <= b <= end]
after = [b - a for a, b in gaps if b > end + 0.5]
ms = lambda v: round(1000 * v, 1)
print(json.dumps({
    "images window": ms(end - start),
    "stream tokens in window": len(inside),
    "gap in window mean": ms(sum(inside) / max(len(inside), 1)),
    "gap in window max": ms(max(inside, default=0)),
    "gap after mean": ms(sum(after) / max(len(after), 1)),
    "image latency mean": ms(sum(latencies) / 8),
    "image latency max": ms(max(latencies)),
}))
