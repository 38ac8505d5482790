#!/usr/bin/env python3
"""Renders the chat-template fixtures with Hugging Face transformers' own chat
template renderer (`transformers.utils.chat_template_utils.render_jinja_template`,
the code behind `tokenizer.apply_chat_template`) and prints the expected outputs
as JSON.

    python3 scripts/chat_golden.py crates/sipp/tests/fixtures/chat > expected.json
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


def main():
    root = Path(sys.argv[1])
    spec = json.loads((root / "cases.json").read_text())
    out = {}
    for name, t in spec["templates"].items():
        source = (root / t["file"]).read_text()
        out[name] = {}
        for case, c in spec["cases"].items():
            try:
                rendered, _ = render_jinja_template(
                    conversations=[c["messages"]],
                    chat_template=source,
                    add_generation_prompt=c["add_generation_prompt"],
                    bos_token=t["bos_token"],
                    eos_token=t["eos_token"],
                )
                out[name][case] = {"ok": rendered[0]}
            except jinja2.exceptions.TemplateError as e:
                out[name][case] = {"error": str(e)}
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
