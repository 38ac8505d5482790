"""OpenAI's Responses API through the official openai package against a running `sipp serve`.

    python responses_client.py BASE_URL API_KEY MODEL
Exits non-zero (with a message) on the first failed expectation. What the
135M default model says is not asserted; what sipp guarantees is: the SDK
parses every response and event, forced calls are calls whose arguments
validate against the schema, a call's output continues the conversation by
`previous_response_id`, streamed deltas add up to the final text and
arguments, stored responses come back by id, and bad input is an error
naming the field.
"""
import json
import sys

import jsonschema
import openai

base, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
SCHEMA = WEATHER["parameters"]
FORCE = {"type": "function", "name": "get_weather"}
ASK = "What is the weather in Paris right now?"


def check_ended(r, limit):
    assert r.object == "response" and r.id.startswith("resp_"), r
    assert r.status in ("completed", "incomplete"), r.status
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens", r.incomplete_details
    assert isinstance(r.output_text, str)
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= limit, u
    assert u.total_tokens == u.input_tokens + u.output_tokens, u
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens >= 0, u
    for item in r.output:
        assert item.type in ("message", "function_call", "reasoning"), item
        if item.type == "message":
            assert item.role == "assistant" and item.id.startswith("msg_"), item
            assert all(c.type == "output_text" and isinstance(c.text, str) for c in item.content), item


def calls_of(r):
    """The whole calls of a response, each valid against the schema; a call
    that max_output_tokens cut is `incomplete` (only in an incomplete response)."""
    calls = [o for o in r.output if o.type == "function_call"]
    for c in calls:
        assert c.name == "get_weather" and c.call_id and c.id.startswith("fc_"), c
        if c.status == "incomplete":
            assert r.status == "incomplete", r
            continue
        assert c.status == "completed", c
        jsonschema.validate(json.loads(c.arguments), SCHEMA)
    return [c for c in calls if c.status == "completed"]


# 1. Text in, text out; the SDK's output_text is the message's text.
r = client.responses.create(model=model, input="What is the capital of France?", max_output_tokens=16)
check_ended(r, 16)
assert any(o.type == "message" for o in r.output), r.output
plain = r

# 2. Instructions are in the prompt (longer ones, a longer prompt), echoed back.
short = client.responses.create(model=model, instructions="Answer in one word.",
                                input="What is the capital of France?", max_output_tokens=16)
check_ended(short, 16)
assert short.instructions == "Answer in one word.", short.instructions
r = client.responses.create(model=model, instructions="Answer in one word, and spell that word with care.",
                            input="What is the capital of France?", max_output_tokens=16)
check_ended(r, 16)
assert r.usage.input_tokens > short.usage.input_tokens, (r.usage, short.usage)

# 3. Stored: retrieve gives the same response.
got = client.responses.retrieve(plain.id)
assert got.id == plain.id and got.output_text == plain.output_text and got.usage == plain.usage, got

# 4. A forced call, then its output by previous_response_id: the follow-up
#    sees the exchange (a longer prompt) and answers with a message.
r = client.responses.create(model=model, input=ASK, tools=[WEATHER], tool_choice=FORCE, parallel_tool_calls=False,
                       max_output_tokens=200)
check_ended(r, 200)
calls = calls_of(r)
assert calls and r.status == "completed", r
assert r.tool_choice.type == "function" and r.tool_choice.name == "get_weather", r.tool_choice
assert r.tools[0].name == "get_weather", r.tools
outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"temperature": 18, "sky": "clear"})}
           for c in calls]
r2 = client.responses.create(model=model, previous_response_id=r.id, input=outputs, tools=[WEATHER],
                             tool_choice="none", max_output_tokens=60)
check_ended(r2, 60)
assert r2.previous_response_id == r.id, r2.previous_response_id
# The same turn without the exchange is shorter.
alone = client.responses.create(model=model, input=ASK, tools=[WEATHER], tool_choice="none", max_output_tokens=1)
assert r2.usage.input_tokens > alone.usage.input_tokens, (r2.usage, alone.usage)
assert not calls_of(r2) and any(o.type == "message" for o in r2.output), r2.output

# 4b. The same history sent as items (no previous_response_id).
items = [{"role": "user", "content": ASK}] + [c.model_dump(exclude_none=True) for c in calls] + outputs
r3 = client.responses.create(model=model, input=items, tools=[WEATHER], max_output_tokens=60)
check_ended(r3, 60)
calls_of(r3)


# 5. Streamed text: typed events in order, deltas add up to the final text.
def stream(**kwargs):
    events = list(client.responses.create(model=model, stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert [e.sequence_number for e in events] == list(range(len(events))), types
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.status == types[-1].split(".")[1], (final.status, types[-1])
    opened, closed = set(), set()
    for e in events:
        if e.type == "response.output_item.added":
            assert e.output_index == len(opened), (e, opened)
            opened.add(e.output_index)
        elif e.type == "response.output_item.done":
            assert e.output_index in opened and e.output_index not in closed, e
            closed.add(e.output_index)
            assert e.item == final.output[e.output_index], (e.item, final.output)
        elif hasattr(e, "output_index"):
            assert e.output_index in opened and e.output_index not in closed, e
    assert opened == closed == set(range(len(final.output))), (opened, closed, final.output)
    return events, final


events, final = stream(input="What is the capital of France?", max_output_tokens=16)
check_ended(final, 16)
text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert text == final.output_text, (text, final.output_text)
assert [e.text for e in events if e.type == "response.output_text.done"] == [final.output_text]
assert client.responses.retrieve(final.id).output_text == text

# 6. A streamed forced call: argument deltas add up to the done arguments
#    and the final call; then its output, streamed, with `auto`.
events, final = stream(input=ASK, tools=[WEATHER], tool_choice=FORCE, parallel_tool_calls=False, max_output_tokens=200)
check_ended(final, 200)
calls = calls_of(final)
assert calls and final.status == "completed", final
for c in calls:
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == c.id)
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done" and e.item_id == c.id]
    assert pieces == c.arguments and done == [c.arguments], (pieces, done, c.arguments)
outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "18 C, clear"} for c in calls]
events, final2 = stream(previous_response_id=final.id, input=outputs, tools=[WEATHER], max_output_tokens=60)
check_ended(final2, 60)
calls_of(final2)
alone = client.responses.create(model=model, input=ASK, tools=[WEATHER], max_output_tokens=1)
assert final2.usage.input_tokens > alone.usage.input_tokens, (final2.usage, alone.usage)

# 7. Errors name the field.
def refused(kind, param, call):
    try:
        call()
    except kind as e:
        assert e.param == param, (e.param, param, e.message)
        return
    raise AssertionError(f"expected {kind.__name__} naming {param}")


refused(openai.NotFoundError, "previous_response_id",
        lambda: client.responses.create(model=model, previous_response_id="resp_missing", input="hi"))
refused(openai.BadRequestError, "tool_choice",
        lambda: client.responses.create(model=model, input=ASK, tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}))
refused(openai.BadRequestError, "input[1].call_id",
        lambda: client.responses.create(model=model, input=[{"role": "user", "content": ASK},
                                                            {"type": "function_call_output", "call_id": "call_missing", "output": "x"}]))
try:
    client.responses.retrieve("resp_missing")
    raise AssertionError("unknown id retrieved")
except openai.NotFoundError as e:
    assert e.status_code == 404

# 8. Deleted responses are gone.
client.responses.delete(plain.id)
try:
    client.responses.retrieve(plain.id)
    raise AssertionError("deleted response retrieved")
except openai.NotFoundError:
    pass

print("ok")
