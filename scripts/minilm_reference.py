#!/usr/bin/env python3
"""An independent reference for the MiniLM embeddings: WordPiece tokenization
and a numpy forward pass of the BERT encoder written from config.json, with
mean pooling and L2 normalization. Reads sentences (JSON list) on stdin, prints
{"tokens": [...], "embeddings": [...]} as JSON.

    python3 scripts/minilm_reference.py CHECKPOINT_DIR < sentences.json
"""
import json
import math
import sys
import unicodedata
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def basic_tokens(text):
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    out, word = [], ""
    for c in text:
        cat = unicodedata.category(c)
        if c.isspace():
            if word:
                out.append(word)
            word = ""
        elif cat.startswith("P") or (33 <= ord(c) <= 47) or (58 <= ord(c) <= 64) or (91 <= ord(c) <= 96) or (123 <= ord(c) <= 126):
            if word:
                out.append(word)
            out.append(c)
            word = ""
        else:
            word += c
    if word:
        out.append(word)
    return out


def wordpiece(word, vocab):
    pieces, start = [], 0
    while start < len(word):
        end, cur = len(word), None
        while start < end:
            sub = word[start:end] if start == 0 else "##" + word[start:end]
            if sub in vocab:
                cur = sub
                break
            end -= 1
        if cur is None:
            return ["[UNK]"]
        pieces.append(cur)
        start = end
    return pieces


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


erf = np.vectorize(math.erf)


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def embed(ids, W, cfg):
    m = hidden(ids, W, cfg).mean(0)
    return m / np.linalg.norm(m)


def hidden(ids, W, cfg, act=gelu):
    """The encoder's last hidden states, one row per token (token type 0
    throughout, as llama.cpp's BERT graph computes)."""
    n = len(ids)
    eps = cfg["layer_norm_eps"]
    h = W["embeddings.word_embeddings.weight"][ids] + W["embeddings.position_embeddings.weight"][:n] + W["embeddings.token_type_embeddings.weight"][0]
    h = layer_norm(h, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], eps)
    heads = cfg["num_attention_heads"]
    d = cfg["hidden_size"] // heads
    for l in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{l}."
        lin = lambda x, name: x @ W[p + name + ".weight"].T + W[p + name + ".bias"]
        q = lin(h, "attention.self.query").reshape(n, heads, d).transpose(1, 0, 2)
        k = lin(h, "attention.self.key").reshape(n, heads, d).transpose(1, 0, 2)
        v = lin(h, "attention.self.value").reshape(n, heads, d).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(n, heads * d)
        h = layer_norm(h + lin(a, "attention.output.dense"), W[p + "attention.output.LayerNorm.weight"], W[p + "attention.output.LayerNorm.bias"], eps)
        f = lin(act(lin(h, "intermediate.dense")), "output.dense")
        h = layer_norm(h + f, W[p + "output.LayerNorm.weight"], W[p + "output.LayerNorm.bias"], eps)
    return h


def main():
    d = Path(sys.argv[1])
    cfg = json.loads((d / "config.json").read_text())
    vocab = {t: i for i, t in enumerate((d / "vocab.txt").read_text().splitlines())}
    W = {k: v.astype(np.float64) for k, v in load_file(str(d / "model.safetensors")).items() if v.dtype != np.int64}
    sentences = json.load(sys.stdin)
    tokens, embeddings = [], []
    for s in sentences:
        pieces = ["[CLS]"] + [p for w in basic_tokens(s) for p in wordpiece(w, vocab)] + ["[SEP]"]
        ids = [vocab[p] for p in pieces]
        tokens.append(ids)
        embeddings.append(embed(ids, W, cfg).tolist())
    json.dump({"tokens": tokens, "embeddings": embeddings}, sys.stdout)


if __name__ == "__main__":
    main()
