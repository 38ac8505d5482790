"""An agent framework from PyPI (openai-agents) runs tool loops against a
running `sipp serve`, unmodified: only its client points at sipp, and tracing
export is off (no vendor endpoint is reachable).

    python agents_client.py BASE_URL API_KEY MODEL
Exits non-zero (with a message) on the first failed expectation. The model's
words are not asserted: that the framework called the tool with arguments it
could parse into the function's signature, fed the result back, and ended is.
"""
import asyncio
import sys

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

base, key, model_id = sys.argv[1], sys.argv[2], sys.argv[3]
set_tracing_disabled(True)
client = AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
calls = []


@function_tool
def get_weather(city: str) -> str:
    """Current weather in a city.

    Args:
        city: The city's name.
    """
    assert isinstance(city, str), city
    calls.append(city)
    return f"18 C and clear in {city}"


def agent(**settings):
    return Agent(
        name="weather",
        instructions="You answer questions about the weather. Use the tool.",
        model=OpenAIChatCompletionsModel(model=model_id, openai_client=client),
        tools=[get_weather],
        model_settings=ModelSettings(
            tool_choice="get_weather", parallel_tool_calls=False, max_tokens=120, **settings
        ),
    )


async def main():
    # 1. The tool's result is the final output: the framework parsed the
    #    forced call, ran the function and stopped.
    a = agent()
    a.tool_use_behavior = "stop_on_first_tool"
    result = await Runner.run(a, "What is the weather in Paris?", max_turns=2)
    assert calls, "the tool was never called"
    assert len(calls) == 1, calls
    assert result.final_output == f"18 C and clear in {calls[0]}", result.final_output

    # 2. The full loop: forced call, result fed back, the model answers (the
    #    framework resets tool_choice after a call, so the next turn is free).
    before = len(calls)
    a = agent(temperature=0)
    try:
        result = await Runner.run(a, "What is the weather in Rome?", max_turns=4)
        assert isinstance(result.final_output, str), result.final_output
    except MaxTurnsExceeded:
        # A 135M model may keep calling in `auto` mode; every call still has
        # to have gone through the framework's argument parsing.
        pass
    assert len(calls) > before, "the second run never called the tool"

    # 3. Streamed through the framework.
    before = len(calls)
    a = agent()
    a.tool_use_behavior = "stop_on_first_tool"
    run = Runner.run_streamed(a, "Weather in Oslo?", max_turns=2)
    kinds = set()
    async for ev in run.stream_events():
        kinds.add(ev.type)
    assert len(calls) > before, "the streamed run never called the tool"
    assert run.final_output == f"18 C and clear in {calls[-1]}", run.final_output
    assert "run_item_stream_event" in kinds, kinds
    print("ok", len(calls), "calls")


asyncio.run(main())
