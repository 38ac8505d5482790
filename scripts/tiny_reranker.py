#!/usr/bin/env python3
"""A tiny cross-encoder reranker for tests: the MiniLM BERT GGUF with a seeded
random classification head (`cls.weight`, `cls.bias`, `cls.output.weight`,
`cls.output.bias`, read by llama.cpp's BERT graph under rank pooling) and
`bert.pooling_type = 4` (rank). Deterministic nonsense, but the real
architecture: llama.cpp's own tools score it as they score a real reranker.

    python3 scripts/tiny_reranker.py MINILM.gguf OUT.gguf [--seed 7] [--rerank-template]

With --rerank-template the file also carries `tokenizer.chat_template.rerank`
(a BERT pair written out: "[CLS]{query}[SEP]{document}[SEP]").
"""
import argparse
import os

import numpy as np
import gguf

from gguf_copy import copy_field

# Scores spread over about [-1, 1]: wide enough to rank, small enough that
# f32 rounding and llama.cpp's f16 GELU table move them by well under 1e-3.
HEAD_SCALE = 1.0
OUT_SCALE = 1.0
RERANK_TEMPLATE = "[CLS]{query}[SEP]{document}[SEP]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--rerank-template", action="store_true")
    args = ap.parse_args()

    reader = gguf.GGUFReader(args.src)
    arch = reader.fields["general.architecture"].contents()
    assert arch == "bert", f"expected a BERT GGUF, got {arch}"
    n_embd = int(reader.fields[f"{arch}.embedding_length"].contents())

    tmp = args.out + ".part"
    writer = gguf.GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == f"{arch}.pooling_type":
            continue
        if name == "general.name":
            writer.add_name("minilm-tiny-reranker")
            continue
        copy_field(writer, field)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    if args.rerank_template:
        writer.add_string("tokenizer.chat_template.rerank", RERANK_TEMPLATE)

    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)

    rng = np.random.default_rng(args.seed)
    std = 1.0 / np.sqrt(n_embd)
    head = {
        # numpy shapes are ggml's reversed: cls.weight is {n_embd, n_embd},
        # cls.output.weight {n_embd, n_cls_out = 1}.
        "cls.weight": rng.normal(0, HEAD_SCALE * std, (n_embd, n_embd)),
        "cls.bias": rng.normal(0, 0.1, (n_embd,)),
        "cls.output.weight": rng.normal(0, OUT_SCALE * std, (1, n_embd)),
        "cls.output.bias": rng.normal(0, 0.1, (1,)),
    }
    for name, value in head.items():
        writer.add_tensor(name, value.astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
