#!/usr/bin/env python3
"""Renders the chat-template fixtures exactly as Hugging Face transformers does
(jinja2 sandbox, trim_blocks, lstrip_blocks, loopcontrols, its raise_exception,
strftime_now and tojson) and prints the expected outputs as JSON.

    python3 scripts/chat_golden.py crates/sipp/tests/fixtures/chat > expected.json
"""
import json
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_template(source):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def main():
    root = Path(sys.argv[1])
    spec = json.loads((root / "cases.json").read_text())
    out = {}
    for name, t in spec["templates"].items():
        template = compile_template((root / t["file"]).read_text())
        out[name] = {}
        for case, c in spec["cases"].items():
            try:
                text = template.render(
                    messages=c["messages"],
                    add_generation_prompt=c["add_generation_prompt"],
                    bos_token=t["bos_token"],
                    eos_token=t["eos_token"],
                )
                out[name][case] = {"ok": text}
            except jinja2.exceptions.TemplateError as e:
                out[name][case] = {"error": str(e)}
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
