"""Drives a running `sipp serve` with the official anthropic package.

    python anthropic_client.py BASE_URL API_KEY MODEL
Exits non-zero (with a message) on the first failed expectation. What the
135M default model says is not asserted; what sipp guarantees is: Anthropic's
message and event shapes, stop reasons, usage that adds up to count_tokens,
forced tool calls whose input validates against the tool's schema (whole and
streamed), a tool loop that ends in an answer, and errors mapped onto the
client's exception types.
"""
import sys

import anthropic

try:
    import jsonschema
except ImportError:  # pragma: no cover - checked by hand below
    jsonschema = None

base, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
SYSTEM = "You are terse."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# This client has no sampling keywords (newer Claude models dropped them);
# sipp reads `temperature`, `top_p` and `top_k` all the same.
GREEDY = {"temperature": 0}


def check_input(value):
    if jsonschema is not None:
        jsonschema.validate(value, WEATHER_SCHEMA)
        return
    assert isinstance(value, dict), value
    assert isinstance(value.get("city"), str), value
    assert set(value) <= {"city", "unit"}, value
    assert value.get("unit", "celsius") in ("celsius", "fahrenheit"), value


def check_usage(usage, max_tokens):
    assert 0 < usage.output_tokens <= max_tokens, usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0, usage


def check_answer(m, max_tokens):
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), m
    assert m.stop_reason in ("end_turn", "max_tokens"), m
    assert m.stop_sequence is None, m
    texts = [b for b in m.content if b.type == "text"]
    assert texts, m
    check_usage(m.usage, max_tokens)
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == max_tokens, m.usage


def forced_call(m):
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1, m.content
    use = uses[0]
    assert use.name == "get_weather" and use.id, use
    check_input(use.input)
    return use


# messages.create, and count_tokens of the same conversation.
m = client.messages.create(model=model, max_tokens=16, extra_body=GREEDY, system=SYSTEM, messages=QUESTION)
check_answer(m, 16)
assert m.content[0].text, m
counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=QUESTION).input_tokens
assert counted == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), (counted, m.usage)
with_tools = client.messages.count_tokens(model=model, system=SYSTEM, messages=QUESTION, tools=TOOLS).input_tokens
assert with_tools > counted, (with_tools, counted)

# Streamed: the text stream adds up to the final message, whose usage is whole.
with client.messages.stream(model=model, max_tokens=16, extra_body=GREEDY, system=SYSTEM, messages=QUESTION) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
check_answer(final, 16)
assert text and text == final.content[0].text, (text, final.content)
assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == counted, final.usage

# Raw events, in Anthropic's order (the client drops `ping`s).
kinds = [e.type for e in client.messages.create(model=model, max_tokens=8, extra_body=GREEDY, messages=QUESTION, stream=True)]
assert kinds[:2] == ["message_start", "content_block_start"], kinds
assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds

# Stop sequences: any vowel ends a 16-token answer; the text stops before it.
vowels = list("aeiouAEIOU")
s = client.messages.create(model=model, max_tokens=16, extra_body=GREEDY, messages=QUESTION, stop_sequences=vowels)
assert s.stop_reason == "stop_sequence" and s.stop_sequence in vowels, s
assert not any(v in s.content[0].text for v in vowels), s.content

# Thinking switched off is accepted (the template may ignore it).
t = client.messages.create(model=model, max_tokens=8, messages=QUESTION, thinking={"type": "disabled"})
assert t.stop_reason in ("end_turn", "max_tokens"), t

# A tool loop: a forced call, its result, then an answer; whole and streamed.
force = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
for streamed in (False, True):
    if streamed:
        with client.messages.stream(model=model, max_tokens=128, extra_body=GREEDY, tools=TOOLS, tool_choice=force, messages=ASK) as st:
            events = [e for e in st]
            first = st.get_final_message()
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
        assert "input_json_delta" in deltas, deltas
    else:
        first = client.messages.create(model=model, max_tokens=128, extra_body=GREEDY, tools=TOOLS, tool_choice=force, messages=ASK)
    use = forced_call(first)
    loop = ASK + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}]},
    ]
    args = dict(model=model, max_tokens=32, extra_body=GREEDY, tools=TOOLS, tool_choice={"type": "none"}, messages=loop)
    if streamed:
        with client.messages.stream(**args) as st:
            answer_text = "".join(st.text_stream)
            answer = st.get_final_message()
        assert answer_text == "".join(b.text for b in answer.content if b.type == "text"), (answer_text, answer.content)
    else:
        answer = client.messages.create(**args)
    check_answer(answer, 32)
    assert not any(b.type == "tool_use" for b in answer.content), answer.content

# `any` also forces a call.
forced_call(client.messages.create(model=model, max_tokens=128, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=ASK))

# Errors map onto the client's exception types, in Anthropic's shape.
try:
    client.messages.create(model="no-such-model", max_tokens=4, messages=QUESTION)
    raise SystemExit("unknown model accepted")
except anthropic.NotFoundError as err:
    assert err.status_code == 404 and err.body["error"]["type"] == "not_found_error", err.body
try:
    client.messages.create(model=model, max_tokens=4, messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    raise SystemExit("unknown tool_choice accepted")
except anthropic.BadRequestError as err:
    assert err.body["type"] == "error" and err.body["error"]["type"] == "invalid_request_error", err.body
    assert "tool_choice" in err.body["error"]["message"], err.body
try:
    client.messages.create(model=model, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    raise SystemExit("unanswerable tool_result accepted")
except anthropic.BadRequestError as err:
    assert "tool_use_id" in err.body["error"]["message"], err.body
try:
    client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "word " * 5000}])
    raise SystemExit("too long prompt accepted")
except anthropic.BadRequestError as err:
    assert "context" in err.body["error"]["message"], err.body
bad = anthropic.Anthropic(base_url=base, api_key="wrong-key", max_retries=0)
try:
    bad.messages.create(model=model, max_tokens=4, messages=QUESTION)
    raise SystemExit("wrong key accepted")
except anthropic.AuthenticationError as err:
    assert err.status_code == 401 and err.body["error"]["type"] == "authentication_error", err.body
print("ok")
