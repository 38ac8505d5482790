"""Drives a running `sipp serve` that has a vision projector, with the
official openai package: chat with an image (data URL), streamed and not;
the same image twice (the second time its tokens are cached); eight
concurrent image requests while a text-only stream keeps producing tokens
(its inter-token gaps while the images are computed are printed).

    python images_client.py BASE_URL IMAGES_JSON
IMAGES_JSON: a file with a list of data URLs (at least nine, all different).
Exits non-zero (with a message) on the first failed expectation.
"""
import json
import sys
import threading
import time

import openai

base, images_file = sys.argv[1], sys.argv[2]
images = json.load(open(images_file))
assert len(images) >= 9, "nine different images"
client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
IMAGE_TOKENS = 64


def ask(url, text="Describe the image.", **kw):
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text},
            ],
        }
    ]


# Not streamed and streamed, computed alike (no cached prefix on either):
# greedy gives one text, up to a near-tie (where the two best tokens are
# within NEAR_TIE, KV placement may tip the choice).
NEAR_TIE = 1.0
whole = client.chat.completions.create(
    model="default", messages=ask(images[0]), max_tokens=12, temperature=0,
    logprobs=True, top_logprobs=2, extra_body={"cache_prompt": False},
)
text = whole.choices[0].message.content
assert text, "an answer"
assert whole.usage.prompt_tokens > IMAGE_TOKENS, whole.usage
chunks = client.chat.completions.create(
    model="default", messages=ask(images[0]), max_tokens=12, temperature=0,
    stream=True, logprobs=True, extra_body={"cache_prompt": False},
)
pieces, streamed = [], []
for c in chunks:
    if not c.choices:
        continue
    pieces.append(c.choices[0].delta.content or "")
    if c.choices[0].logprobs and c.choices[0].logprobs.content:
        streamed.extend(t.token for t in c.choices[0].logprobs.content)
assert len([p for p in pieces if p]) >= 2, pieces
mine = [t.token for t in whole.choices[0].logprobs.content]
gaps = [t.top_logprobs[0].logprob - t.top_logprobs[1].logprob for t in whole.choices[0].logprobs.content]
parted = next((i for i, (a, b) in enumerate(zip(mine, streamed)) if a != b), None)
if parted is None:
    assert "".join(pieces) == text, ("".join(pieces), text)
else:
    assert gaps[parted] <= NEAR_TIE, (mine, streamed, gaps[parted])

# The same image and text twice: the second time the prompt's tokens, the
# image's included, come from the KV cache.
first = client.chat.completions.create(
    model="default", messages=ask(images[1]), max_tokens=4, temperature=0)
again = client.chat.completions.create(
    model="default", messages=ask(images[1]), max_tokens=4, temperature=0)
cached = again.usage.prompt_tokens_details.cached_tokens
assert cached > IMAGE_TOKENS, f"second time cached {cached}"
assert cached >= again.usage.prompt_tokens - 1, again.usage
print(f"same image twice: cached {cached} of {again.usage.prompt_tokens} prompt tokens")

# A text-only stream, and eight image requests sent at once while it runs.
stamps = []
window = {}
done = threading.Event()


def stream_text():
    s = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        max_tokens=300, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for c in s:
        if c.choices and c.choices[0].delta.content:
            stamps.append(time.monotonic())
        if c.usage is not None:
            window["usage"] = c.usage
    done.set()


t = threading.Thread(target=stream_text)
t.start()
while len(stamps) < 5:
    time.sleep(0.01)
results = [None] * 8


def image_request(i):
    r = client.chat.completions.create(
        model="default", messages=ask(images[i + 1], "What colour dominates?"),
        max_tokens=8, temperature=0)
    results[i] = r


window["start"] = time.monotonic()
workers = [threading.Thread(target=image_request, args=(i,)) for i in range(8)]
for w in workers:
    w.start()
for w in workers:
    w.join()
window["end"] = time.monotonic()
t.join()
assert all(r is not None and r.choices[0].message.content for r in results), results
inside = [b - a for a, b in zip(stamps, stamps[1:]) if window["start"] <= b <= window["end"]]
outside = [b - a for a, b in zip(stamps, stamps[1:]) if b > window["end"] + 0.5]
assert inside, "the text stream produced no token while the images were computed"
assert window["usage"].completion_tokens == 300, window["usage"]
ms = lambda xs: 1000 * sum(xs) / len(xs)
# The stream may end within half a second of the images (figures only).
after = (f"after: mean {ms(outside):.1f} ms, max {1000 * max(outside):.1f} ms" if outside
         else "the stream ended within 0.5 s of the images")
print(
    f"text stream while 8 image requests ran ({1000 * (window['end'] - window['start']):.0f} ms): "
    f"{len(inside)} tokens, inter-token gap mean {ms(inside):.1f} ms, max {1000 * max(inside):.1f} ms; "
    + after
)
print("ok")
