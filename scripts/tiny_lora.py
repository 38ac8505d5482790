#!/usr/bin/env python3
"""A LoRA adapter for tests: random rank-4 low-rank updates for the default
model (SmolLM2-135M-Instruct, arch `llama`), written as llama.cpp reads a LoRA
GGUF (see llama.cpp's src/llama-adapter.cpp and convert_lora_to_gguf.py):

    general.type = "adapter", adapter.type = "lora", adapter.lora.alpha (f32),
    general.architecture = the base model's;
    for each adapted base tensor W (ggml ne = [n_in, n_out]) a pair
    `<W's name>.lora_a` (ne = [n_in, rank]) and `<W's name>.lora_b`
    (ne = [rank, n_out]), F32.

llama.cpp then computes W x + scale * (alpha / rank) * B (A x), `scale` being
the adapter's scale in the request (or --lora-scaled).

The adapter touches attn_q, attn_v and ffn_down in every layer, rank 4,
alpha 8 (so alpha / rank = 2: a runtime that ignores alpha gets other tokens).
A's rows are random unit-ish vectors (N(0, 1/n_in)), B's columns have norm
about STRENGTH = 3 (N(0, STRENGTH^2/n_out)), so each update has a spectral
norm of about 2 * 3 = 6, next to the base weights' 3 to 80. With that, greedy
text changes from the base's within a few tokens, and changes between seeds,
and still reads as text (not one token repeated). The values come from
numpy.random.default_rng(SEED) only, so a seed gives the same file
everywhere; the base model is read only for its tensor shapes. About 2 MB.

    python3 scripts/tiny_lora.py SMOLLM2.gguf OUT.gguf SEED
"""
import os
import sys

import numpy as np
import gguf

RANK = 4
ALPHA = 8.0
STRENGTH = 3.0
TARGETS = ("attn_q.weight", "attn_v.weight", "ffn_down.weight")


def make(src, out, seed, strength=STRENGTH):
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    rng = np.random.default_rng(seed)
    tmp = out + ".part"
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_name(f"smollm2-tiny-lora-seed{seed}")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    for t in reader.tensors:
        if not (t.name.startswith("blk.") and t.name.endswith(TARGETS)):
            continue
        # t.shape is ggml's ne: [n_in, n_out]; numpy shapes are reversed.
        n_in, n_out = int(t.shape[0]), int(t.shape[1])
        a = rng.standard_normal((RANK, n_in)) / np.sqrt(n_in)
        b = rng.standard_normal((n_out, RANK)) * (strength / np.sqrt(n_out))
        writer.add_tensor(t.name + ".lora_a", a.astype(np.float32))
        writer.add_tensor(t.name + ".lora_b", b.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: tiny_lora.py BASE.gguf OUT.gguf SEED")
    make(sys.argv[1], sys.argv[2], int(sys.argv[3]))


if __name__ == "__main__":
    main()
