#!/usr/bin/env python3
"""A fill-in-the-middle model for tests: a copy of the default model
(SmolLM2-135M-Instruct) whose metadata names FIM tokens. SmolLM2's vocabulary
has no `<fim_prefix>`-like tokens, so existing control tokens stand in:

    prefix <issue_start> (8), suffix <issue_comment> (9), middle <issue_closed> (10),
    pad <empty_output> (16), repo <repo_name> (3), file separator <file_sep> (5)

The weights are unchanged (the model was not trained for FIM, so what it writes
is nonsense), but llama.cpp reads the ids as it reads a real FIM model's.

    python3 scripts/tiny_fim.py SMOLLM2.gguf OUT.gguf
"""
import os
import sys

import numpy as np
import gguf

from gguf_copy import copy_field

FIM = {
    "tokenizer.ggml.fim_pre_token_id": "<issue_start>",
    "tokenizer.ggml.fim_suf_token_id": "<issue_comment>",
    "tokenizer.ggml.fim_mid_token_id": "<issue_closed>",
    "tokenizer.ggml.fim_pad_token_id": "<empty_output>",
    "tokenizer.ggml.fim_rep_token_id": "<repo_name>",
    "tokenizer.ggml.fim_sep_token_id": "<file_sep>",
}


def main():
    src, out = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    tmp = out + ".part"
    writer = gguf.GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in FIM:
            continue
        if name == "general.name":
            writer.add_name("smollm2-tiny-fim")
            continue
        copy_field(writer, field)
    for key, text in FIM.items():
        writer.add_uint32(key, tokens.index(text))
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
