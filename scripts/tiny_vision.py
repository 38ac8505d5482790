#!/usr/bin/env python3
"""A vision projector for tests: a tiny random-weight LLaVA-1.5-style "mmproj"
for the default model (SmolLM2-135M-Instruct, arch `llama`, n_embd 576),
written as llama.cpp's libmtmd reads one (see llama.cpp's tools/mtmd/clip.cpp,
clip-impl.h, models/llava.cpp, mtmd-image.cpp, and conversion/base.py's
MmprojModel):

    general.architecture = "clip", general.type = "mmproj",
    clip.projector_type = "mlp", clip.has_vision_encoder = true,
    clip.use_gelu = false (the ViT's FFN uses gelu_quick),
    clip.vision.{image_size = 64, patch_size = 8, embedding_length = 64,
    feed_forward_length = 256, block_count = 3, attention.head_count = 4,
    attention.layer_norm_epsilon = 1e-5, projection_dim = the LM's n_embd,
    image_mean, image_std (CLIP's)};
    tensors, F32, names and ggml ne as clip.cpp loads them:
      v.patch_embd.weight      [8, 8, 3, 64]   (conv2d, stride 8, no bias)
      v.position_embd.weight   [64, 64]        (one row per patch)
      v.pre_ln.{weight,bias}   [64]
      v.blk.N.{ln1,ln2}.{weight,bias}                     [64]
      v.blk.N.{attn_q,attn_k,attn_v,attn_out}.weight      [64, 64], .bias [64]
      v.blk.N.ffn_up.weight [64, 256], .bias [256]
      v.blk.N.ffn_down.weight [256, 64], .bias [64]
      mm.0.weight [64, n_embd], mm.0.bias [n_embd]
      mm.2.weight [n_embd, n_embd], mm.2.bias [n_embd]
    (no v.class_embd, no v.post_ln, no image_grid_pinpoints).

What llama.cpp then does with an image (projector "mlp", no pinpoints, so
mtmd_image_preprocessor_fixed_size): the RGB image (PNG alpha dropped by
stb_image) is resized to 64x64 unless it already is 64x64: scaled by
min(64/w, 64/h), new size ceil()ed, with a Pillow-compatible fixed-point
BICUBIC (a = -0.5) resample, pasted centred (offset (64 - new) / 2, integer
division) on a 64x64 canvas filled with RGB (122, 116, 104); then each value
becomes (v / 255 - mean[c]) / std[c]. The graph (clip_graph_llava): patch
embedding, + position rows 0..63, pre_ln, then the pre-norm ViT blocks
    x += attn_out(softmax(q k^T / sqrt(16)) v)   (4 heads, no mask)  of ln1(x)
    x += ffn_down(gelu_quick(ffn_up(ln2(x))))
for blocks 0 .. block_count - 2 only: LLaVA takes the penultimate layer, so
the last block (v.blk.2) is loaded but never run. Then, per patch,
    mm.2 @ gelu(mm.0 @ x + b0) + b2
(ggml_gelu, the tanh form). So one image is always 64 embeddings of n_embd,
in patch row-major order, and the LM sees them with ordinary causal
attention and plain 1-D positions (no M-RoPE, no begin/end-of-image tokens;
mtmd_decode_use_non_causal and mtmd_decode_use_mrope are false for "mlp").

Values come from numpy.random.default_rng(SEED) only (default 1), so a seed
gives the same file everywhere; the LM GGUF is read only for n_embd and its
token embeddings' mean row norm. Weights are N(0, 1/fan_in) (norm weights
near 1, biases small); the position rows are 0.3 the size of the patch
embedding's so that content, not position, dominates. mm.2 is then scaled
so that the projector's outputs (computed here by forward(), the same graph
in numpy, which matches llama.cpp's output to about 1e-3, on a few fixed
calibration images) have a mean row norm of SCALE = 3 times the LM's mean
token-embedding row norm (3.2 for SmolLM2, so about 10): at 1x to 2x some
different images still gave the same greedy reply, at 3x (seed 1) six
different test images give six different replies to each of two prompts,
and the replies still read as English. About 2.1 MB.

    python3 scripts/tiny_vision.py SMOLLM2.gguf OUT_MMPROJ.gguf [SEED]
"""
import os
import sys

import numpy as np
import gguf
from gguf.quants import dequantize

IMAGE_SIZE = 64
PATCH = 8
N_EMBD = 64
N_HEAD = 4
N_FF = 256  # must differ from N_EMBD: clip.cpp swaps ffn_up/down when ffn_down's ne[0] == n_embd
N_BLOCK = 3  # the "mlp" graph runs blocks 0 .. N_BLOCK - 2
EPS = 1e-5
MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]
POS_STRENGTH = 0.3
SCALE = 3.0
N_PATCH = (IMAGE_SIZE // PATCH) ** 2


def _layer_norm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + EPS) * w + b


def _gelu_quick(x):
    return x / (1.0 + np.exp(-1.702 * x))


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def forward(t, pixels):
    """The "mlp" graph in numpy: pixels is the normalized image, [3, 64, 64]
    (channel, row, column); returns the [N_PATCH, n_embd] image embeddings."""
    w = t["v.patch_embd.weight"]  # [N_EMBD, 3, PATCH, PATCH]
    g = IMAGE_SIZE // PATCH
    p = pixels.reshape(3, g, PATCH, g, PATCH).transpose(1, 3, 0, 2, 4).reshape(N_PATCH, -1)
    x = p @ w.reshape(N_EMBD, -1).T + t["v.position_embd.weight"]
    x = _layer_norm(x, t["v.pre_ln.weight"], t["v.pre_ln.bias"])
    d = N_EMBD // N_HEAD
    for i in range(N_BLOCK - 1):
        b = lambda n: t[f"v.blk.{i}.{n}"]
        h = _layer_norm(x, b("ln1.weight"), b("ln1.bias"))
        q, k, v = (h @ b(f"attn_{n}.weight").T + b(f"attn_{n}.bias") for n in "qkv")
        heads = []
        for j in range(N_HEAD):
            s = slice(j * d, (j + 1) * d)
            a = q[:, s] @ k[:, s].T / np.sqrt(d)
            a = np.exp(a - a.max(-1, keepdims=True))
            heads.append((a / a.sum(-1, keepdims=True)) @ v[:, s])
        x = x + np.concatenate(heads, -1) @ b("attn_out.weight").T + b("attn_out.bias")
        h = _layer_norm(x, b("ln2.weight"), b("ln2.bias"))
        h = _gelu_quick(h @ b("ffn_up.weight").T + b("ffn_up.bias"))
        x = x + h @ b("ffn_down.weight").T + b("ffn_down.bias")
    h = _gelu(x @ t["mm.0.weight"].T + t["mm.0.bias"])
    return h @ t["mm.2.weight"].T + t["mm.2.bias"]


def _calibration_images(rng):
    """Normalized [3, 64, 64] inputs: flat colours, gradients, noise."""
    yy, xx = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE] / (IMAGE_SIZE - 1)
    rgb = [
        np.stack([np.full_like(xx, c) for c in col])
        for col in ([1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1], [0, 0, 0])
    ]
    rgb += [np.stack([xx, yy, 1 - xx]), rng.random((3, IMAGE_SIZE, IMAGE_SIZE))]
    mean = np.array(MEAN)[:, None, None]
    std = np.array(STD)[:, None, None]
    return [(im - mean) / std for im in rgb]


def make(src, out, seed=1):
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_text = int(reader.fields[f"{arch}.embedding_length"].contents())
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    emb = dequantize(emb.data, emb.tensor_type).reshape(-1, n_text)
    target = SCALE * float(np.linalg.norm(emb, axis=1).mean())

    rng = np.random.default_rng(seed)
    normal = lambda shape, std: rng.standard_normal(shape) * std
    t = {}
    patch_in = 3 * PATCH * PATCH
    t["v.patch_embd.weight"] = normal((N_EMBD, 3, PATCH, PATCH), 1 / np.sqrt(patch_in))
    t["v.position_embd.weight"] = normal((N_PATCH, N_EMBD), POS_STRENGTH)
    t["v.pre_ln.weight"] = 1 + normal(N_EMBD, 0.1)
    t["v.pre_ln.bias"] = normal(N_EMBD, 0.1)
    for i in range(N_BLOCK):
        p = f"v.blk.{i}."
        for ln in ("ln1", "ln2"):
            t[p + ln + ".weight"] = 1 + normal(N_EMBD, 0.1)
            t[p + ln + ".bias"] = normal(N_EMBD, 0.1)
        for n in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[p + n + ".weight"] = normal((N_EMBD, N_EMBD), 1 / np.sqrt(N_EMBD))
            t[p + n + ".bias"] = normal(N_EMBD, 0.1)
        t[p + "ffn_up.weight"] = normal((N_FF, N_EMBD), 1 / np.sqrt(N_EMBD))
        t[p + "ffn_up.bias"] = normal(N_FF, 0.1)
        t[p + "ffn_down.weight"] = normal((N_EMBD, N_FF), 1 / np.sqrt(N_FF))
        t[p + "ffn_down.bias"] = normal(N_EMBD, 0.1)
    t["mm.0.weight"] = normal((n_text, N_EMBD), 1 / np.sqrt(N_EMBD))
    t["mm.0.bias"] = normal(n_text, 0.1)
    t["mm.2.weight"] = normal((n_text, n_text), 1 / np.sqrt(n_text))
    t["mm.2.bias"] = normal(n_text, 0.1)
    t = {k: v.astype(np.float32) for k, v in t.items()}

    outs = [forward(t, im) for im in _calibration_images(rng)]
    norm = float(np.mean([np.linalg.norm(o, axis=1).mean() for o in outs]))
    t["mm.2.weight"] *= np.float32(target / norm)
    t["mm.2.bias"] *= np.float32(target / norm)

    tmp = out + ".part"
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(f"smollm2-tiny-vision-seed{seed}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type("mlp")
    writer.add_vision_use_gelu(False)
    writer.add_vision_projection_dim(n_text)
    writer.add_vision_image_size(IMAGE_SIZE)
    writer.add_vision_patch_size(PATCH)
    writer.add_vision_embedding_length(N_EMBD)
    writer.add_vision_feed_forward_length(N_FF)
    writer.add_vision_block_count(N_BLOCK)
    writer.add_vision_head_count(N_HEAD)
    writer.add_vision_attention_layernorm_eps(EPS)
    writer.add_vision_image_mean(MEAN)
    writer.add_vision_image_std(STD)
    for name, value in t.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: tiny_vision.py SMOLLM2.gguf OUT_MMPROJ.gguf [SEED]")
    make(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else 1)


if __name__ == "__main__":
    main()
