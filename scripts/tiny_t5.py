#!/usr/bin/env python3
"""A tiny random-weight T5 encoder-decoder for tests, arch `t5`, with a real
SentencePiece unigram (UGM) tokenizer. Nonsense text, but the real
architecture and the real tokenizer format: llama.cpp's own tools load it and
generate from it as from google/flan-t5-small.

The format is what llama.cpp's convert_hf_to_gguf.py (conversion/t5.py, class
T5Model) writes and src/models/t5.cpp plus src/llama-vocab.cpp read:

  hparams: t5.context_length, embedding_length (d_model), feed_forward_length
    (d_ff), block_count (encoder layers), decoder_block_count, head_count,
    key_length = value_length (d_kv), attention.layer_norm_epsilon and
    layer_norm_rms_epsilon, attention.relative_buckets_count,
    decoder_start_token_id (= pad = 0, as in real T5);
  tensors (ggml ne order, F32): token_embd [d_model, n_vocab] (shared by
    encoder and decoder), output [d_model, n_vocab] (an untied lm_head, as
    flan-T5), enc.output_norm, dec.output_norm, and per layer
    enc.blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_o, ffn_norm, ffn_gate,
    ffn_up, ffn_down} and dec.blk.N.{the same, plus cross_attn_norm,
    cross_attn_q, cross_attn_k, cross_attn_v, cross_attn_o}; attn_rel_b
    [n_head, n_buckets] only in layer 0 of each stack (HF T5 has it only
    there; llama.cpp falls back to layer 0's), no cross_attn_rel_b (HF has
    none). With ffn_gate present llama.cpp runs the flan-T5 FFN,
    down(gelu(gate x) * up x); attention is unscaled (kq_scale 1), as in T5;
  tokenizer: tokenizer.ggml.model = "t5" (UGM), pre = "default", tokens,
    scores, token_type, add_space_prefix and remove_extra_whitespaces from the
    model proto's normalizer_spec, precompiled_charsmap (its nmt_nfkc
    normalizer), eos 1 ("</s>"), unk 2 ("<unk>"), pad 0 ("<pad>"), no bos,
    add_bos_token false, add_eos_token true.

The tokenizer is trained here, at generation time, by SentencePiece (unigram,
VOCAB_SIZE = 400 pieces, default nmt_nfkc normalization, one thread, no
shuffling: the same model proto, byte for byte, on every run) from the fixed
English TEXT below; ids 0-2 are <pad>/</s>/<unk> as in T5, no byte fallback,
no <extra_id_N> sentinels. The weights come from numpy.random.default_rng(SEED)
only: embeddings N(0, 1), projections N(0, gain^2/n_in) with a per-kind gain,
norm weights 1, relative bias N(0, 1); the lm_head rows of <pad> and <unk> are
then zeroed, so greedy text never holds them (</s> stays possible). The gains
(Q_GAIN 2 standing in for T5's unscaled attention, ATTN_GAIN 1, FFN_GAIN 1.5,
OUT_GAIN 4) were picked by trying a few: with them greedy output differs
between prompts from its first token and seldom repeats itself. About 1.2 MB,
0.24 MB of it the charsmap.

llama.cpp encodes the prompt with the </s> that add_eos_token appends, then
decodes from decoder_start_token_id (0, <pad>). The normalizer fields are read
from the model proto by a few lines of protobuf wire decoding below, so the
protobuf package (which sentencepiece_model_pb2 needs) is not required.

    python3 scripts/tiny_t5.py OUT.gguf [SEED]   (SEED defaults to 1)

Needs numpy, gguf and sentencepiece (scripts/requirements-test.txt).
"""
import io
import os
import sys

import numpy as np
import gguf
import sentencepiece as spm

D_MODEL = 64
N_HEAD = 4
D_KV = 16
D_FF = 128
N_ENC = 2
N_DEC = 2
N_BUCKETS = 32
N_CTX = 512
EPS = 1e-6
VOCAB_SIZE = 400

ATTN_GAIN = 1.0
Q_GAIN = 2.0
FFN_GAIN = 1.5
OUT_GAIN = 4.0

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2

TEXT = """\
The old lighthouse stood at the edge of the harbour, and every evening the keeper climbed its narrow stairs to light the lamp.
Ships coming home from the north could see the beam long before they saw the land, and sailors said it was the kindest light in the world.
In the spring the fishermen mended their nets on the stones of the quay while children ran between the boats.
A small bakery opened early in the morning, and the smell of warm bread drifted along the street towards the market square.
The market sold apples, pears, cheese, honey, wool, candles, and bright ribbons that the traders brought from distant towns.
On Sundays a brass band played in the park, and families sat on the grass to listen and to eat their lunch.
Mathematics is the study of numbers, shapes, patterns, and the rules that connect them.
A prime number has exactly two divisors: one and itself. Two, three, five, seven, and eleven are the first prime numbers.
The sum of the angles of a triangle is one hundred and eighty degrees, but only on a flat surface.
Computers store every number as a pattern of bits, and a program is a list of instructions that tells the machine what to do.
When the program runs, the processor fetches each instruction from memory, decodes it, and executes it.
A good programmer writes tests, reads error messages carefully, and keeps functions short and simple.
Water boils at one hundred degrees at sea level, and it freezes at zero degrees.
Plants turn sunlight, water, and carbon dioxide into sugar and oxygen; this process is called photosynthesis.
The moon has no light of its own: it reflects the light of the sun, and its shape seems to change through the month.
Birds fly south in the autumn because food becomes scarce when the weather turns cold.
The river flows from the mountains through the forest and the farms until it reaches the sea.
Rain falls on the hills, collects in streams, and the streams join together to form the river.
Last week my brother and I walked to the top of the hill and watched the sunset over the valley.
We carried sandwiches, a flask of tea, a map, and a small camera in a green bag.
My sister is learning to play the piano, and she practises for an hour every afternoon.
Our neighbour has a large grey cat that sleeps on the wall in the sun and ignores everybody.
Translate English to German: the house is wonderful. Summarize: the meeting was long and nobody agreed on anything.
Question: what is the capital of France? Answer: Paris is the capital of France.
Question: how many legs does a spider have? Answer: a spider has eight legs.
Please write a short story about a dragon who was afraid of the dark.
Once upon a time there was a king who had three daughters, and the youngest was the cleverest of them all.
The library is open from nine in the morning until six in the evening, except on public holidays.
Please return your books on time, and do not write in them or fold the pages.
The train to the city leaves every thirty minutes from platform two, and the journey takes about an hour.
Tickets can be bought at the station, online, or from the conductor on the train.
The weather today will be cloudy with some sunshine in the afternoon and light rain in the evening.
Tomorrow the wind will be stronger, and temperatures will fall towards the weekend.
Hello, my name is Anna. I live in a small house near the river with my family and our dog.
What time is it? It is half past four, and the shops will close soon.
I would like a cup of coffee with milk, please, and a slice of lemon cake.
Thank you very much for your help; I could not have finished the work without you.
The quick brown fox jumps over the lazy dog, and the dog does not even notice.
Scientists measure the speed of light, the mass of the electron, and the age of the universe with great care.
History teaches us how people lived, what they believed, and why their empires rose and fell.
Music, painting, poetry, and dance are ways in which people share feelings that words alone cannot express.
"""


def train_tokenizer():
    """Trains the unigram model on TEXT; returns its serialized ModelProto."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines()),
        model_writer=out,
        model_type="unigram",
        vocab_size=VOCAB_SIZE,
        character_coverage=1.0,
        pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
        pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
        num_threads=1,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return out.getvalue()


def _varint(buf, i):
    v = shift = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v, i


def _fields(buf):
    """The (field number, value) pairs of one protobuf message: ints for
    varints, bytes for length-delimited fields (enough for ModelProto)."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            val, i = buf[i:i + n], i + n
        elif wire == 5:
            val, i = buf[i:i + 4], i + 4
        elif wire == 1:
            val, i = buf[i:i + 8], i + 8
        else:
            raise ValueError(f"unexpected protobuf wire type {wire}")
        yield num, val


def normalizer_spec(proto):
    """ModelProto.normalizer_spec (field 3): precompiled_charsmap (2),
    add_dummy_prefix (3) and remove_extra_whitespaces (4), proto2 defaults
    true; also asserts trainer_spec.model_type (2.3) is UNIGRAM (1)."""
    charsmap, add_prefix, remove_ws, model_type = b"", True, True, 1
    for num, val in _fields(proto):
        if num == 2:
            for n, v in _fields(val):
                if n == 3:
                    model_type = v
        elif num == 3:
            for n, v in _fields(val):
                if n == 2:
                    charsmap = bytes(v)
                elif n == 3:
                    add_prefix = bool(v)
                elif n == 4:
                    remove_ws = bool(v)
    assert model_type == 1, f"expected a unigram model, got type {model_type}"
    return charsmap, add_prefix, remove_ws


def add_vocab(writer, proto):
    """As T5Model.set_vocab in llama.cpp's conversion/t5.py."""
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(proto)
    charsmap, add_prefix, remove_ws = normalizer_spec(proto)
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i).encode("utf-8"))
        scores.append(sp.GetScore(i))
        if sp.IsUnknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.IsControl(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.IsUnused(i):
            types.append(gguf.TokenType.UNUSED)
        elif sp.IsByte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    assert tokens[PAD_ID] == b"<pad>" and tokens[EOS_ID] == b"</s>" and tokens[UNK_ID] == b"<unk>"
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(add_prefix)
    writer.add_remove_extra_whitespaces(remove_ws)
    if charsmap:
        writer.add_precompiled_charsmap(charsmap)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(True)
    return len(tokens)


def make(out, seed=1):
    proto = train_tokenizer()
    rng = np.random.default_rng(seed)

    tmp = out + ".part"
    writer = gguf.GGUFWriter(tmp, "t5")
    writer.add_name(f"tiny-t5-random-seed{seed}")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(D_MODEL)
    writer.add_feed_forward_length(D_FF)
    writer.add_block_count(N_ENC)
    writer.add_decoder_block_count(N_DEC)
    writer.add_head_count(N_HEAD)
    writer.add_key_length(D_KV)
    writer.add_value_length(D_KV)
    writer.add_layer_norm_eps(EPS)
    writer.add_relative_attn_buckets_count(N_BUCKETS)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_decoder_start_token_id(PAD_ID)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = add_vocab(writer, proto)

    def lin(name, n_in, n_out, gain):
        # numpy shape (n_out, n_in) is ggml ne [n_in, n_out].
        w = rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))
        writer.add_tensor(name, w.astype(np.float32))

    def ones(name):
        writer.add_tensor(name, np.ones(D_MODEL, dtype=np.float32))

    hd = N_HEAD * D_KV
    emb = rng.standard_normal((n_vocab, D_MODEL))
    writer.add_tensor("token_embd.weight", emb.astype(np.float32))
    # The lm_head rows of <pad> and <unk> are zero (logit 0, far below the
    # top logits), so greedy output never holds them; </s> stays reachable.
    out_w = rng.standard_normal((n_vocab, D_MODEL)) * (OUT_GAIN / np.sqrt(D_MODEL))
    out_w[[PAD_ID, UNK_ID]] = 0.0
    writer.add_tensor("output.weight", out_w.astype(np.float32))
    ones("enc.output_norm.weight")
    ones("dec.output_norm.weight")

    def attn(prefix, kind):
        ones(f"{prefix}.{kind}_norm.weight")
        lin(f"{prefix}.{kind}_q.weight", D_MODEL, hd, Q_GAIN)
        lin(f"{prefix}.{kind}_k.weight", D_MODEL, hd, ATTN_GAIN)
        lin(f"{prefix}.{kind}_v.weight", D_MODEL, hd, ATTN_GAIN)
        lin(f"{prefix}.{kind}_o.weight", hd, D_MODEL, ATTN_GAIN)

    def ffn(prefix):
        ones(f"{prefix}.ffn_norm.weight")
        lin(f"{prefix}.ffn_gate.weight", D_MODEL, D_FF, FFN_GAIN)
        lin(f"{prefix}.ffn_up.weight", D_MODEL, D_FF, FFN_GAIN)
        lin(f"{prefix}.ffn_down.weight", D_FF, D_MODEL, FFN_GAIN)

    def rel_b(name):
        # numpy (n_buckets, n_head) is ggml ne [n_head, n_buckets].
        writer.add_tensor(name, rng.standard_normal((N_BUCKETS, N_HEAD)).astype(np.float32))

    for i in range(N_ENC):
        p = f"enc.blk.{i}"
        attn(p, "attn")
        if i == 0:
            rel_b(f"{p}.attn_rel_b.weight")
        ffn(p)
    for i in range(N_DEC):
        p = f"dec.blk.{i}"
        attn(p, "attn")
        if i == 0:
            rel_b(f"{p}.attn_rel_b.weight")
        attn(p, "cross_attn")
        ffn(p)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: tiny_t5.py OUT.gguf [SEED]")
    make(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 1)


if __name__ == "__main__":
    main()
