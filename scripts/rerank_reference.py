#!/usr/bin/env python3
"""An independent reference for the tiny reranker (scripts/tiny_reranker.py):
the numpy BERT encoder of scripts/minilm_reference.py on MiniLM's own
checkpoint (safetensors, vocab.txt), then the classification head read from
the reranker's GGUF: score = out_w . tanh(cls_w @ h[CLS] + cls_b) + out_b.
Pairs are tokenized as llama-server's format_prompt_rerank does for a BERT
vocabulary: with the GGUF's `tokenizer.chat_template.rerank`, that template
filled in, its special-token text ([CLS], [SEP], ...) read as those tokens;
without one (add BOS, add SEP, no EOS), [CLS] query [SEP] document. Token type
0 throughout, as llama.cpp computes BERT. The feed-forward activation is
llama.cpp's GELU as its CPU backend computes it (`ggml_vec_gelu_f32` with
GGML_GELU_FP16): the tanh approximation, looked up at the input rounded to
f16 and stored as f16. With transformers' exact erf GELU instead, scores move
by up to ~1e-3 on this head, which is the tolerance the tests hold to.

Reads {"query": Q, "documents": [...]} (or a list of them) on stdin, prints
{"tokens": [[...]], "scores": [...]} (pairs in order) as JSON.

    python3 scripts/rerank_reference.py CHECKPOINT_DIR RERANKER.gguf < pairs.json
"""
import json
import re
import sys
from pathlib import Path

import numpy as np
import gguf
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minilm_reference import basic_tokens, hidden, wordpiece  # noqa: E402


def gelu_ggml(x):
    """llama.cpp's CPU GELU: a table of the tanh approximation over f16 inputs."""
    h = x.astype(np.float16).astype(np.float32)
    y = 0.5 * h * (1.0 + np.tanh(np.float32(0.7978845608028654) * h * (1.0 + np.float32(0.044715) * h * h)))
    y = y.astype(np.float16).astype(np.float64)
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, y))


def main():
    d = Path(sys.argv[1])
    cfg = json.loads((d / "config.json").read_text())
    vocab = {t: i for i, t in enumerate((d / "vocab.txt").read_text().splitlines())}
    W = {k: v.astype(np.float64) for k, v in load_file(str(d / "model.safetensors")).items() if v.dtype != np.int64}
    reader = gguf.GGUFReader(sys.argv[2])
    head = {t.name: np.array(t.data, dtype=np.float64) for t in reader.tensors if t.name.startswith("cls.")}
    template = reader.fields.get("tokenizer.chat_template.rerank")
    template = template.contents() if template is not None else None
    specials = re.compile("(" + "|".join(re.escape(t) for t in vocab if re.fullmatch(r"\[[A-Z]+\]", t)) + ")")
    requests = json.load(sys.stdin)
    if isinstance(requests, dict):
        requests = [requests]

    def words(s):
        return [vocab[p] for w in basic_tokens(s) for p in wordpiece(w, vocab)]

    def pair(query, doc):
        if template is None:
            return [vocab["[CLS]"]] + words(query) + [vocab["[SEP]"]] + words(doc)
        text = template.replace("{query}", query).replace("{document}", doc)
        ids = []
        for part in specials.split(text):
            ids += [vocab[part]] if specials.fullmatch(part) else words(part)
        return ids

    tokens, scores = [], []
    for r in requests:
        for doc in r["documents"]:
            ids = pair(r["query"], doc)
            h = hidden(ids, W, cfg, gelu_ggml)[0]
            x = np.tanh(head["cls.weight"] @ h + head["cls.bias"])
            s = head["cls.output.weight"] @ x + head["cls.output.bias"]
            tokens.append(ids)
            scores.append(float(s[0]))
    json.dump({"tokens": tokens, "scores": scores}, sys.stdout)


if __name__ == "__main__":
    main()
