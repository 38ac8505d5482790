"""Tool calls through the official openai package against a running `sipp serve`.

    python tools_client.py BASE_URL API_KEY MODEL
Exits non-zero (with a message) on the first failed expectation. What the
135M default model chooses to say is not asserted; what sipp guarantees is:
forced calls are calls, every call's arguments validate against its tool's
schema, streamed pieces add up to the same calls, `none` never calls, and bad
tool input is a 400 naming the field.
"""
import concurrent.futures
import json
import sys

import jsonschema
import openai

base, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)

WEATHER = {
    "type": "function",
    "function": {
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
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}, "hour24": {"type": "boolean"}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def check_call(name, arguments, only=None):
    assert name in SCHEMAS, f"unknown function {name!r}"
    if only:
        assert name == only, f"called {name!r}, expected {only!r}"
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def check_message_calls(choice, only=None):
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
    assert calls, choice.message
    ids = set()
    for c in calls:
        assert c.type == "function" and c.id and c.id not in ids, c
        ids.add(c.id)
        check_call(c.function.name, c.function.arguments, only)
    return calls


def check_auto(choice):
    """An answer under `auto`: text, or calls. A call that max_tokens cut is
    left out of a non-streamed answer, so every call present is whole even
    when the answer ends by length."""
    if choice.finish_reason == "length":
        for c in choice.message.tool_calls or []:
            check_call(c.function.name, c.function.arguments)
    elif choice.message.tool_calls:
        check_message_calls(choice)
    else:
        assert isinstance(choice.message.content, str), choice


def stream_turn(**kwargs):
    """Collects a streamed answer: content, calls by index, finish reason."""
    content, calls, finish, roles = "", {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            d = ch.delta
            roles += d.role == "assistant"
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    # The first piece of a call names it, as OpenAI sends it.
                    assert tc.id and tc.function and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and (tc.function.name is None), tc
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                assert finish is None, "one finish_reason per choice"
                finish = ch.finish_reason
    assert roles == 1, roles
    assert sorted(calls) == list(range(len(calls))), calls
    return content, [calls[i] for i in sorted(calls)], finish


# 1. `required` over 30 seeds at temperature 1: 30 answers that are calls,
#    every one valid against its schema (sent 8 at a time: the server batches
#    them).
def forced(seed):
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required",
        temperature=1, seed=seed, max_tokens=600,
    )
    return check_message_calls(r.choices[0])


with concurrent.futures.ThreadPoolExecutor(8) as pool:
    assert len(list(pool.map(forced, range(30)))) == 30

# 2. A named function, one call only.
r = client.chat.completions.create(
    model=model, messages=ASK, tools=TOOLS, parallel_tool_calls=False,
    tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=200,
)
calls = check_message_calls(r.choices[0], only="get_time")
assert len(calls) == 1, calls

# 3. The two-turn loop, not streamed: a forced call, its result, an answer.
r = client.chat.completions.create(
    model=model, messages=ASK, tools=TOOLS, max_tokens=600,
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
)
calls = check_message_calls(r.choices[0], only="get_weather")
history = ASK + [r.choices[0].message.model_dump(exclude_none=True)]
for c in calls:
    history.append({"role": "tool", "tool_call_id": c.id, "content": '{"temperature": 18, "sky": "clear"}'})
r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=80)
check_auto(r.choices[0])

# 4. The same loop streamed: the pieces add up to valid calls.
content, calls, finish = stream_turn(
    model=model, messages=ASK, tools=TOOLS, max_tokens=600,
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
)
assert finish == "tool_calls" and calls, (finish, calls, content)
for c in calls:
    check_call(c["name"], c["arguments"], "get_weather")
history = ASK + [{
    "role": "assistant", "content": content or None,
    "tool_calls": [{"id": c["id"], "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls],
}] + [{"role": "tool", "tool_call_id": c["id"], "content": "18 C, clear"} for c in calls]
content, calls, finish = stream_turn(model=model, messages=history, tools=TOOLS, max_tokens=80)
assert finish in ("stop", "length", "tool_calls"), finish
# Streamed pieces of a call that max_tokens cut stop where it was cut.
for c in calls[:-1] if finish == "length" else calls:
    check_call(c["name"], c["arguments"])

# 5. `auto`: well-formed either way (whether a 135M model calls is its choice).
for seed in range(5):
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, temperature=1, seed=seed, max_tokens=120)
    check_auto(r.choices[0])

# 6. `none` never calls.
for seed in range(3):
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none",
        temperature=1, seed=seed, max_tokens=60)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"


# 7. Bad tool input: 400 naming the field.
def refused(param, **kwargs):
    try:
        client.chat.completions.create(model=model, max_tokens=5, **kwargs)
    except openai.BadRequestError as e:
        assert e.param == param, (e.param, param, e.message)
        return
    raise AssertionError(f"expected a 400 naming {param}")


refused("tool_choice", messages=ASK, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "nope"}})
bad = json.loads(json.dumps(WEATHER))
bad["function"]["parameters"]["properties"]["city"]["type"] = "strin"
refused("tools[0].function.parameters", messages=ASK, tools=[bad])
refused("messages[1].tool_call_id", messages=ASK + [
    {"role": "tool", "tool_call_id": "call_missing", "content": "x"}], tools=TOOLS)
refused("messages[1].tool_calls[0].function.arguments", messages=ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "x"}], tools=TOOLS)
refused("tools", messages=ASK, tools=TOOLS, tool_choice="required",
        response_format={"type": "json_object"})
# The server is fine after all that.
r = client.chat.completions.create(model=model, messages=ASK, max_tokens=3)
assert r.choices[0].message.content is not None

print("ok")
