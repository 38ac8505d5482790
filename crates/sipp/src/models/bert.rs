//! Converts a Hugging Face BERT checkpoint (safetensors, `vocab.txt`,
//! `config.json`) into a GGUF file llama.cpp loads as `bert`: WordPiece vocabulary
//! in llama.cpp's phantom-space form, special tokens, mean pooling, F32 weights.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};

/// A metadata value to write.
enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
}

/// A minimal GGUF (version 3) writer: metadata, then F32 tensors aligned to 32.
struct GgufWriter {
    meta: Vec<(String, Meta)>,
    tensors: Vec<(String, Vec<u64>, Vec<u8>)>,
}

const ALIGN: u64 = 32;

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl GgufWriter {
    fn new() -> Self {
        Self {
            meta: Vec::new(),
            tensors: Vec::new(),
        }
    }

    fn meta(&mut self, key: &str, value: Meta) {
        self.meta.push((key.to_string(), value));
    }

    /// Adds an F32 tensor; `shape` is row-major (numpy order), stored reversed
    /// as GGUF expects (innermost dimension first).
    fn tensor_f32(&mut self, name: &str, shape: &[usize], data: Vec<u8>) {
        let dims = shape.iter().rev().map(|&d| d as u64).collect();
        self.tensors.push((name.to_string(), dims, data));
    }

    fn write(&self, path: &Path) -> std::io::Result<()> {
        let mut head = Vec::new();
        head.extend(b"GGUF");
        head.extend(3u32.to_le_bytes());
        head.extend((self.tensors.len() as u64).to_le_bytes());
        head.extend((self.meta.len() as u64).to_le_bytes());
        for (k, v) in &self.meta {
            write_str(&mut head, k);
            match v {
                Meta::U32(x) => {
                    head.extend(4u32.to_le_bytes());
                    head.extend(x.to_le_bytes());
                }
                Meta::F32(x) => {
                    head.extend(6u32.to_le_bytes());
                    head.extend(x.to_le_bytes());
                }
                Meta::Bool(x) => {
                    head.extend(7u32.to_le_bytes());
                    head.push(u8::from(*x));
                }
                Meta::Str(s) => {
                    head.extend(8u32.to_le_bytes());
                    write_str(&mut head, s);
                }
                Meta::StrArray(a) => {
                    head.extend(9u32.to_le_bytes());
                    head.extend(8u32.to_le_bytes());
                    head.extend((a.len() as u64).to_le_bytes());
                    for s in a {
                        write_str(&mut head, s);
                    }
                }
                Meta::I32Array(a) => {
                    head.extend(9u32.to_le_bytes());
                    head.extend(5u32.to_le_bytes());
                    head.extend((a.len() as u64).to_le_bytes());
                    for x in a {
                        head.extend(x.to_le_bytes());
                    }
                }
            }
        }
        let mut offset = 0u64;
        for (name, dims, data) in &self.tensors {
            write_str(&mut head, name);
            head.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                head.extend(d.to_le_bytes());
            }
            head.extend(0u32.to_le_bytes()); // GGML_TYPE_F32
            head.extend(offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(ALIGN) * ALIGN;
        }
        while head.len() as u64 % ALIGN != 0 {
            head.push(0);
        }
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        f.write_all(&head)?;
        for (_, _, data) in &self.tensors {
            f.write_all(data)?;
            let pad = (data.len() as u64).div_ceil(ALIGN) * ALIGN - data.len() as u64;
            f.write_all(&vec![0u8; pad as usize])?;
        }
        f.flush()
    }
}

/// The Hugging Face name of each llama.cpp BERT tensor (`{}` is the layer).
const LAYER_TENSORS: &[(&str, &str)] = &[
    ("attention.self.query", "attn_q"),
    ("attention.self.key", "attn_k"),
    ("attention.self.value", "attn_v"),
    ("attention.output.dense", "attn_output"),
    ("attention.output.LayerNorm", "attn_output_norm"),
    ("intermediate.dense", "ffn_up"),
    ("output.dense", "ffn_down"),
    ("output.LayerNorm", "layer_output_norm"),
];

/// Special tokens of a BERT WordPiece vocabulary.
const SPECIALS: &[&str] = &["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];

fn config_u32(config: &serde_json::Value, key: &str) -> Result<u32, String> {
    config
        .get(key)
        .and_then(serde_json::Value::as_u64)
        .map(|v| v as u32)
        .ok_or_else(|| format!("config.json has no integer `{key}`"))
}

/// Converts `dir` (model.safetensors, vocab.txt, config.json) to a GGUF at `out`.
pub fn convert_bert(dir: &Path, out: &Path, name: &str) -> Result<(), String> {
    let read =
        |f: &str| std::fs::read(dir.join(f)).map_err(|e| format!("{}: {e}", dir.join(f).display()));
    let config: serde_json::Value =
        serde_json::from_slice(&read("config.json")?).map_err(|e| format!("config.json: {e}"))?;
    let vocab_text =
        String::from_utf8(read("vocab.txt")?).map_err(|e| format!("vocab.txt: {e}"))?;
    let weights = read("model.safetensors")?;
    let st = SafeTensors::deserialize(&weights).map_err(|e| format!("model.safetensors: {e}"))?;

    let n_layer = config_u32(&config, "num_hidden_layers")?;
    let vocab: Vec<&str> = vocab_text.lines().collect();
    let id_of = |t: &str| {
        vocab
            .iter()
            .position(|v| *v == t)
            .map(|i| i as u32)
            .ok_or_else(|| format!("vocab.txt lacks {t}"))
    };

    let mut w = GgufWriter::new();
    w.meta("general.architecture", Meta::Str("bert".into()));
    w.meta("general.name", Meta::Str(name.into()));
    w.meta("general.file_type", Meta::U32(0));
    w.meta(
        "bert.context_length",
        Meta::U32(config_u32(&config, "max_position_embeddings")?),
    );
    w.meta(
        "bert.embedding_length",
        Meta::U32(config_u32(&config, "hidden_size")?),
    );
    w.meta(
        "bert.feed_forward_length",
        Meta::U32(config_u32(&config, "intermediate_size")?),
    );
    w.meta("bert.block_count", Meta::U32(n_layer));
    w.meta(
        "bert.attention.head_count",
        Meta::U32(config_u32(&config, "num_attention_heads")?),
    );
    let eps = config
        .get("layer_norm_eps")
        .and_then(serde_json::Value::as_f64)
        .unwrap_or(1e-12);
    w.meta("bert.attention.layer_norm_epsilon", Meta::F32(eps as f32));
    w.meta("bert.attention.causal", Meta::Bool(false));
    w.meta("bert.pooling_type", Meta::U32(1)); // mean
    w.meta(
        "tokenizer.ggml.token_type_count",
        Meta::U32(config_u32(&config, "type_vocab_size").unwrap_or(2)),
    );
    w.meta("tokenizer.ggml.model", Meta::Str("bert".into()));
    w.meta("tokenizer.ggml.pre", Meta::Str("default".into()));
    // llama.cpp's WordPiece expects "phantom space" tokens: a word start is
    // marked with U+2581 and continuation pieces lose their "##".
    let tokens: Vec<String> = vocab
        .iter()
        .map(|t| {
            if SPECIALS.contains(t) {
                t.to_string()
            } else if let Some(rest) = t.strip_prefix("##") {
                rest.to_string()
            } else {
                format!("\u{2581}{t}")
            }
        })
        .collect();
    let types: Vec<i32> = vocab
        .iter()
        .map(|t| if SPECIALS.contains(t) { 3 } else { 1 })
        .collect();
    w.meta("tokenizer.ggml.tokens", Meta::StrArray(tokens));
    w.meta("tokenizer.ggml.token_type", Meta::I32Array(types));
    w.meta("tokenizer.ggml.bos_token_id", Meta::U32(id_of("[CLS]")?));
    w.meta(
        "tokenizer.ggml.seperator_token_id",
        Meta::U32(id_of("[SEP]")?),
    );
    w.meta(
        "tokenizer.ggml.padding_token_id",
        Meta::U32(id_of("[PAD]")?),
    );
    w.meta(
        "tokenizer.ggml.unknown_token_id",
        Meta::U32(id_of("[UNK]")?),
    );
    w.meta("tokenizer.ggml.mask_token_id", Meta::U32(id_of("[MASK]")?));
    w.meta("tokenizer.ggml.add_bos_token", Meta::Bool(true));
    w.meta("tokenizer.ggml.add_sep_token", Meta::Bool(true));

    let mut names: BTreeMap<String, String> = BTreeMap::new();
    for (hf, gg) in [
        ("embeddings.word_embeddings.weight", "token_embd.weight"),
        (
            "embeddings.token_type_embeddings.weight",
            "token_types.weight",
        ),
        (
            "embeddings.position_embeddings.weight",
            "position_embd.weight",
        ),
        ("embeddings.LayerNorm.weight", "token_embd_norm.weight"),
        ("embeddings.LayerNorm.bias", "token_embd_norm.bias"),
    ] {
        names.insert(hf.into(), gg.into());
    }
    for l in 0..n_layer {
        for (hf, gg) in LAYER_TENSORS {
            for part in ["weight", "bias"] {
                names.insert(
                    format!("encoder.layer.{l}.{hf}.{part}"),
                    format!("blk.{l}.{gg}.{part}"),
                );
            }
        }
    }
    for (hf, gg) in &names {
        // Some checkpoints prefix every name with "bert.".
        let view = st
            .tensor(hf)
            .or_else(|_| st.tensor(&format!("bert.{hf}")))
            .map_err(|_| format!("model.safetensors lacks {hf}"))?;
        if view.dtype() != Dtype::F32 {
            return Err(format!(
                "{hf} is {:?}; only F32 checkpoints are supported",
                view.dtype()
            ));
        }
        w.tensor_f32(gg, view.shape(), view.data().to_vec());
    }
    let tmp = out.with_extension("part");
    w.write(&tmp)
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, out).map_err(|e| e.to_string())
}
