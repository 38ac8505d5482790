"""Drives a running `sipp serve` with the official openai package.

    python openai_client.py BASE_URL API_KEY
Exits non-zero (with a message) on the first failed expectation.
"""
import json
import sys
import urllib.request

import openai

base, key = sys.argv[1], sys.argv[2]


def is_json_prefix(text):
    """True when text, as cut off by max_tokens, can still be completed into JSON."""
    closers, in_str, esc = [], False, None  # esc: an unfinished escape's chars
    for ch in text:
        if in_str:
            if esc is not None:
                esc += ch
                if esc[0] != "u" or len(esc) == 5:
                    esc = None
            elif ch == "\\":
                esc = ""
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]" and closers:
            closers.pop()
    tail = ""
    if in_str:
        tail = ("n" if esc == "" else "0" * (5 - len(esc)) if esc else "") + '"'
    # Whatever the cut left half-written: a value, a key's colon, a literal.
    for mid in ["", "0", ":0", '"":0', "e", "ue", "rue", "se", "lse", "alse", "l", "ll", "ull"]:
        try:
            json.loads(text + tail + mid + "".join(reversed(closers)))
            return True
        except json.JSONDecodeError:
            pass
    return False


client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)

# Models.
ids = [m.id for m in client.models.list().data]
assert ids == ["minilm", "smol"], ids

# Completions. " Paris" is this raw prompt's greedy first token on every kernel
# set; ignore_eos makes the count exact; cache_prompt=False makes the streamed run
# below compute the prompt the same way, so greedy text cannot diverge at a near-tie.
fresh = {"ignore_eos": True, "cache_prompt": False}
c = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0, extra_body=fresh)
assert "Paris" in c.choices[0].text, c
assert c.usage.completion_tokens == 8 and c.usage.prompt_tokens > 0, c.usage
assert c.choices[0].finish_reason == "length"

# llama-server's `timings` ride along: what the prompt and the generation cost.
t = c.model_extra["timings"]
assert t["predicted_n"] == 8 and t["prompt_n"] + t["cache_n"] == c.usage.prompt_tokens, t
assert t["cache_n"] == 0 and t["prompt_ms"] > 0 and t["predicted_ms"] > 0, t
assert "draft_n" not in t, t  # nothing drafted

# Completions, streamed: the last chunk of the choice carries its timings.
text, last = "", None
for chunk in client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True, extra_body=fresh):
    if chunk.choices:
        text += chunk.choices[0].text
        if chunk.choices[0].finish_reason:
            last = chunk
assert text == c.choices[0].text, (text, c.choices[0].text)
assert last is not None and last.model_extra["timings"]["predicted_n"] == 8, last


def draft_counters():
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": "Bearer " + key})
    body = urllib.request.urlopen(req, timeout=10).read().decode()
    def total(name):
        return sum(float(l.rsplit(" ", 1)[1]) for l in body.splitlines() if l.startswith(name + "{") and 'model="smol"' in l)
    return total("sipp_draft_tokens_total"), total("sipp_draft_accepted_tokens_total")


# With n-gram drafts on a prompt that repeats itself, the timings report
# exactly the drafts the engine counted for this request (drafting itself is
# adaptive: the engine drafts only where it expects drafts to pay).
before = draft_counters()
counted = client.completions.create(model="smol", prompt="1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", max_tokens=48,
                                    temperature=0, extra_body={"ignore_eos": True, "speculative": {"mode": "ngram"}})
after = draft_counters()
t = counted.model_extra["timings"]
drafted, accepted = after[0] - before[0], after[1] - before[1]
assert (t.get("draft_n", 0), t.get("draft_n_accepted", 0)) == (drafted, accepted), (t, drafted, accepted)
assert accepted <= drafted and t["predicted_n"] == 48, t

# Chat. Both runs compute the prompt afresh, so the streamed one gives the same text.
messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
r = client.chat.completions.create(model="smol", messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3,
                                   extra_body={"cache_prompt": False})
msg = r.choices[0].message
assert msg.role == "assistant" and msg.content, r
lp = r.choices[0].logprobs.content
assert len(lp) == r.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in lp)
assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in lp)

# Chat, streamed, with usage.
parts, usage, finish = [], None, None
for chunk in client.chat.completions.create(model="smol", messages=messages, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"cache_prompt": False}):
    if chunk.usage:
        usage = chunk.usage
    for ch in chunk.choices:
        if ch.delta.content:
            parts.append(ch.delta.content)
        if ch.finish_reason:
            finish = ch.finish_reason
assert "".join(parts) == msg.content, ("".join(parts), msg.content)
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage
assert finish in ("stop", "length")

# Structured output. The schema bounds the object, so 400 tokens normally close
# it; an answer cut by max_tokens is still the start of valid JSON.
schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}}, "required": ["city", "population"], "additionalProperties": False}
r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Give a city as JSON"}], max_tokens=400, temperature=0,
                                   response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
content = r.choices[0].message.content
if r.choices[0].finish_reason == "stop":
    obj = json.loads(content)
    assert set(obj) == {"city", "population"} and isinstance(obj["population"], int), obj
else:
    assert r.choices[0].finish_reason == "length" and is_json_prefix(content), r

# Embeddings (the client asks for base64 by default and decodes it).
e = client.embeddings.create(model="minilm", input=["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."])
vecs = [d.embedding for d in e.data]
assert len(vecs) == 3 and len(vecs[0]) == 384
dot = lambda a, b: sum(x * y for x, y in zip(a, b))
assert dot(vecs[0], vecs[1]) > dot(vecs[0], vecs[2])
e2 = client.embeddings.create(model="minilm", input="hello", encoding_format="float")
assert len(e2.data[0].embedding) == 384

# Errors map onto the client's exception types.
try:
    client.chat.completions.create(model="no-such-model", messages=messages)
    raise SystemExit("unknown model accepted")
except openai.NotFoundError as err:
    assert err.status_code == 404
try:
    client.completions.create(model="smol", prompt="word " * 5000)
    raise SystemExit("too long prompt accepted")
except openai.BadRequestError as err:
    assert "context" in str(err), err
try:
    client.completions.create(model="smol", prompt="x", top_p=3)
    raise SystemExit("bad top_p accepted")
except openai.BadRequestError as err:
    assert "top_p" in str(err), err
bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong-key", max_retries=0)
try:
    bad.models.list()
    raise SystemExit("wrong key accepted")
except openai.AuthenticationError as err:
    assert err.status_code == 401
print("ok")
