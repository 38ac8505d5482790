#!/usr/bin/env python3
"""Renders the chat-template fixtures with Hugging Face transformers' own chat
template renderer (`transformers.utils.chat_template_utils.render_jinja_template`,
the code behind `tokenizer.apply_chat_template`) and prints the expected outputs
as JSON.

    python3 scripts/chat_golden.py crates/sipp/tests/fixtures/chat > expected.json

A case without `tools` is rendered as it is (what `ChatTemplate::render` does).
A case with `tools` (possibly empty) is a chat turn as sipp's OpenAI endpoint
prepares it (`RequestPreparer::render_turn`): when the template renders tools
(a probe tool's name shows in its output) and writes a known call format, the
tools, the calls and the tool results go to the template as they are (with each
call's `arguments` JSON text parsed into an object, as vLLM and llama.cpp hand
them over); otherwise the conversation is first rewritten by the documented
fallback, re-implemented here from its documentation
(`crates/sipp/src/tools/format.rs`), and rendered without tools. The path each
template takes is checked against `tools_path`, `tool_format` and `system_role`
in cases.json.
"""
import json
import logging
import os
import sys
from pathlib import Path

# transformers warns that no deep-learning framework is installed; templates need none.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
logging.disable(logging.WARNING)

import jinja2  # noqa: E402
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

PROBE_TOOL = "sipp_probe_tool_7f3a"
PROBE_SYSTEM = "sipp-probe-system"


def compact(value):
    """JSON as serde_json writes it: no spaces, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def text(message):
    """A message's content as one text: parts joined by newlines, "" when null."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


def tool_value(tool):
    """A tool as sipp holds and serializes it (absent fields left out)."""
    f = tool["function"]
    function = {"name": f["name"]}
    for key in ("description", "parameters", "strict"):
        if f.get(key) is not None:
            function[key] = f[key]
    return {"type": tool.get("type", "function"), "function": function}


def message_value(m):
    """A message as templates see it: role, content (null when absent), then
    name, tool_call_id, reasoning_content and tool_calls when present, each
    call's `arguments` parsed from JSON text."""
    out = {"role": m["role"], "content": None if m.get("content") is None else text(m)}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if m.get(key) is not None:
            out[key] = m[key]
    if m.get("tool_calls") is not None:
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": c.get("type", "function"),
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.loads(c["function"]["arguments"]),
                },
            }
            for c in m["tool_calls"]
        ]
    return out


# ---- the fallback for templates without tools (tools/format.rs) ----


def detect_format(source):
    """The family of a template source, by its markers, first match wins."""
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<tool_call>" in source:
        return "hermes"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3"
    if "<start_of_turn>" in source:
        return "pythonic"
    return "generic"


def write_calls(fmt, calls):
    """Calls (name, arguments) written as the family writes them."""
    if fmt == "hermes":
        return "\n".join(
            "<tool_call>\n" + compact({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in calls
        )
    if fmt == "llama3":
        return "; ".join(compact({"name": n, "parameters": a}) for n, a in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS]" + compact([{"name": n, "arguments": a} for n, a in calls])
    if fmt == "pythonic":

        def one(n, a):
            args = ", ".join(f"{k}={compact(v)}" for k, v in a.items()) if isinstance(a, dict) else ""
            return f"{n}({args})"

        return "[" + ", ".join(one(n, a) for n, a in calls) + "]"
    return compact({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]})


def fallback_tool_text(fmt, tools, parallel):
    """The tools and how to call them, for the system message."""
    s = "You can call these functions, described as JSON schemas:\n"
    for t in tools:
        s += compact(tool_value(t)) + "\n"
    example = write_calls(fmt, [("function_name", {"argument": "value"})])
    more = (
        " To call several functions at once, list them all in that form."
        if parallel
        else " Call at most one function at a time."
    )
    return s + (
        "To call a function, answer with only this, and nothing else:\n"
        f"{example}\n"
        "with the function's name and an arguments object that matches its parameters."
        f"{more} Otherwise, answer normally."
    )


def fallback_messages(messages, tools, fmt, parallel, system_role):
    """The conversation for a template that does not render tools: earlier
    calls become their assistant message's text (in the family's format),
    tool results become user messages naming the call they answer and are
    joined with the user turns next to them, and the tools (when there are any)
    go into the system message, a new system message, or the first user
    message when the template refuses the system role."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in (m.get("tool_calls") or [])}
    out, from_tool = [], []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
            body = text(m)
            if body:
                body += "\n"
            converted = {"role": "assistant", "content": body + write_calls(fmt, calls)}
        elif m["role"] == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id"))
            call_id = m.get("tool_call_id")
            if name and call_id:
                head = f"Result of {name} (call {call_id}):"
            elif name:
                head = f"Result of {name}:"
            elif call_id:
                head = f"Result of call {call_id}:"
            else:
                head = "Tool result:"
            converted = {"role": "user", "content": f"{head}\n{text(m)}"}
        else:
            converted = {k: v for k, v in m.items() if k != "tool_calls"}
        is_tool = m["role"] == "tool"
        if out and out[-1]["role"] == "user" and converted["role"] == "user" and (is_tool or from_tool[-1]):
            out[-1] = dict(out[-1], content=f"{text(out[-1])}\n\n{text(converted)}")
            from_tool[-1] = True
        else:
            out.append(converted)
            from_tool.append(is_tool)
    if tools:
        tool_text = fallback_tool_text(fmt, tools, parallel)
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=f"{text(out[0])}\n\n{tool_text}")
        elif system_role:
            out.insert(0, {"role": "system", "content": tool_text})
        else:
            i = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
            if i is None:
                out.insert(0, {"role": "user", "content": tool_text})
            else:
                out[i] = dict(out[i], content=f"{tool_text}\n\n{text(out[i])}")
    return out


# ---- rendering ----


def render(source, t, messages, add_generation_prompt, tools=None, kwargs=None):
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=source,
        add_generation_prompt=add_generation_prompt,
        bos_token=t["bos_token"],
        eos_token=t["eos_token"],
        **(kwargs or {}),
    )
    return rendered[0]


def probe(source, t, messages, tools, needle):
    try:
        return needle in render(source, t, messages, True, tools)
    except Exception:  # a template that fails on the probe does not support it
        return False


def caps(source, t):
    """What sipp finds out about a template (TemplateCaps::of)."""
    fmt = detect_format(source)
    probe_tool = tool_value(
        {
            "type": "function",
            "function": {
                "name": PROBE_TOOL,
                "description": "probe",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    )
    renders_tools = probe(source, t, [{"role": "user", "content": "hi"}], [probe_tool], PROBE_TOOL)
    system_role = probe(
        source,
        t,
        [{"role": "system", "content": PROBE_SYSTEM}, {"role": "user", "content": "hi"}],
        None,
        PROBE_SYSTEM,
    )
    native = renders_tools and fmt not in ("generic", "pythonic")
    return native, fmt, system_role


def render_case(source, t, spec, c, native, fmt, system_role):
    add = c["add_generation_prompt"]
    if "tools" not in c:
        return render(source, t, c["messages"], add)
    tools = [spec["tool_definitions"][n] for n in c["tools"]]
    kwargs = c.get("kwargs")
    if native:
        msgs = [message_value(m) for m in c["messages"]]
        shown = [tool_value(x) for x in tools] or None
        return render(source, t, msgs, add, shown, kwargs)
    msgs = [message_value(m) for m in fallback_messages(c["messages"], tools, fmt, True, system_role)]
    return render(source, t, msgs, add, None, kwargs)


def main():
    root = Path(sys.argv[1])
    spec = json.loads((root / "cases.json").read_text())
    out = {}
    for name, t in spec["templates"].items():
        source = (root / t["file"]).read_text()
        native, fmt, system_role = caps(source, t)
        found = ("native" if native else "fallback", fmt, system_role)
        declared = (t["tools_path"], t["tool_format"], t["system_role"])
        if found != declared:
            sys.exit(f"{name}: found (tools_path, tool_format, system_role) = {found}, cases.json says {declared}")
        out[name] = {}
        for case, c in spec["cases"].items():
            try:
                out[name][case] = {"ok": render_case(source, t, spec, c, native, fmt, system_role)}
            except jinja2.exceptions.TemplateError as e:
                out[name][case] = {"error": str(e)}
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
