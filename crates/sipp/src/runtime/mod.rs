//! The runtime boundary: the only layer that touches llama.cpp.
//!
//! [`Vocab`] is the thread-safe half of a model (tokenizer, metadata) that any
//! thread may use; [`Backend`] is the half that owns a context and runs batches,
//! used only by the engine thread. [`llama`] implements both on `llama-cpp-2`;
//! [`fake`] implements both in plain Rust so the scheduler and the KV bookkeeping
//! can be tested without a model.

#[cfg(feature = "llama")]
pub mod cpu_kernels;
pub mod fake;
pub mod gguf;
#[cfg(feature = "llama")]
pub mod llama;
pub mod lora;
#[cfg(feature = "llama")]
pub mod mtmd;
pub mod placement;
#[cfg(feature = "llama")]
pub mod rpc;

use serde::{Deserialize, Serialize};
use std::sync::Arc;

pub use lora::{AdapterSet, LoraAdapterInfo};

use crate::sampling::{OutputConstraint, SamplingError, SamplingParams};

/// A token id in the model's vocabulary.
pub type Token = i32;
/// A KV cache sequence id.
pub type SeqId = i32;

/// How per-token embeddings are pooled into one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// One vector per token (the last token's is returned).
    None,
    /// Mean over the tokens.
    Mean,
    /// The first token's vector.
    Cls,
    /// The last token's vector.
    Last,
    /// A reranker score.
    Rank,
}

impl Pooling {
    /// The name used in APIs and metadata.
    pub fn as_str(self) -> &'static str {
        match self {
            Pooling::None => "none",
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
            Pooling::Rank => "rank",
        }
    }
}

/// How a reranker's (query, document) pair becomes tokens, read from the
/// model as llama-server's `format_prompt_rerank` reads it: the GGUF's
/// `tokenizer.chat_template.rerank` when it has one, else
/// `[BOS] query [EOS] [SEP] document [EOS]` with each special token only where
/// the tokenizer adds it (BERT: `[CLS] query [SEP] document`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RerankFormat {
    /// `tokenizer.chat_template.rerank`, with `{query}` and `{document}`.
    pub template: Option<String>,
    /// BOS, when the tokenizer adds it.
    pub bos: Option<Token>,
    /// EOS (SEP when the model has no EOS), when the tokenizer adds EOS.
    pub eos: Option<Token>,
    /// SEP, when the tokenizer adds it.
    pub sep: Option<Token>,
}

impl RerankFormat {
    /// The tokens of one pair.
    pub fn pair_tokens(
        &self,
        vocab: &dyn Vocab,
        query: &str,
        document: &str,
    ) -> Result<Vec<Token>, RuntimeError> {
        if let Some(t) = &self.template {
            let text = t.replace("{query}", query).replace("{document}", document);
            return vocab.tokenize(&text, false, true);
        }
        let words = |s: &str| -> Result<Vec<Token>, RuntimeError> {
            if s.is_empty() {
                Ok(Vec::new())
            } else {
                vocab.tokenize(s, false, false)
            }
        };
        let mut out: Vec<Token> = self.bos.into_iter().collect();
        out.extend(words(query)?);
        out.extend(self.eos);
        out.extend(self.sep);
        out.extend(words(document)?);
        out.extend(self.eos);
        Ok(out)
    }
}

/// What a model is, read once at load.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelInfo {
    /// Where the model came from.
    pub path: String,
    /// Whether a multimodal projector is loaded (the model takes images).
    pub takes_images: bool,
    /// `general.architecture` (llama, bert, gemma3, ...).
    pub architecture: String,
    /// `general.name`, when present.
    pub name: Option<String>,
    /// llama.cpp's description (architecture, size, quantization).
    pub description: String,
    /// Parameter count.
    pub n_params: u64,
    /// Size of the weights in bytes.
    pub size_bytes: u64,
    /// Quantization (file type), e.g. "Q4_1".
    pub quantization: String,
    /// Training context length.
    pub n_ctx_train: u32,
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Embedding width.
    pub n_embd: usize,
    /// Layer count.
    pub n_layer: u32,
    /// Beginning-of-sequence token, when the model has one.
    pub bos: Option<Token>,
    /// End-of-sequence token, when the model has one.
    pub eos: Option<Token>,
    /// End-of-turn token, when the model has one.
    pub eot: Option<Token>,
    /// Whether the tokenizer adds BOS to a prompt.
    pub add_bos: bool,
    /// Whether the model has a decoder (can generate).
    pub has_decoder: bool,
    /// Whether the model has an encoder (BERT-like encoder-only models, and
    /// encoder-decoder models such as T5).
    pub has_encoder: bool,
    /// The token an encoder-decoder model's decoder starts from.
    pub decoder_start: Option<Token>,
    /// Pooling declared in the GGUF metadata.
    pub pooling: Option<Pooling>,
    /// `tokenizer.chat_template`, when present (or the family's template for
    /// base models that ship without one: see [`crate::chat::family_template`]).
    pub chat_template: Option<String>,
    /// The window of sliding-window attention layers
    /// (`{architecture}.attention.sliding_window`), when the model has them:
    /// llama.cpp may drop those layers' KV of positions the window no longer
    /// sees, which limits prefix reuse (see `session::mirror`).
    pub sliding_window: Option<u32>,
    /// A stable identity of the weights (file size and a hash of the header),
    /// used to refuse KV snapshots from another model.
    pub fingerprint: String,
    /// Where the layers went (devices, offloaded layer count).
    pub placement: placement::Placement,
    /// Fill-in-the-middle tokens, as llama.cpp's vocabulary reports them
    /// (from `tokenizer.ggml.fim_*_token_id` or found by their text).
    pub fim: FimTokens,
}

/// Fill-in-the-middle tokens of a vocabulary (`None` where it has none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct FimTokens {
    /// Before the prefix.
    pub pre: Option<Token>,
    /// Before the suffix.
    pub suf: Option<Token>,
    /// Before the middle (generated) part.
    pub mid: Option<Token>,
    /// Padding.
    pub pad: Option<Token>,
    /// Repository name.
    pub rep: Option<Token>,
    /// File separator.
    pub sep: Option<Token>,
}

impl FimTokens {
    /// The names of the tokens infill needs (prefix, suffix, middle) that the
    /// vocabulary lacks; empty when infill is possible.
    pub fn missing(&self) -> Vec<&'static str> {
        [
            ("prefix", self.pre),
            ("suffix", self.suf),
            ("middle", self.mid),
        ]
        .into_iter()
        .filter(|(_, t)| t.is_none())
        .map(|(n, _)| n)
        .collect()
    }
}

impl ModelInfo {
    /// Text form of a special token, for display.
    pub fn special_tokens(&self, vocab: &dyn Vocab) -> Vec<(String, Token, String)> {
        let mut out = Vec::new();
        for (name, tok) in [("bos", self.bos), ("eos", self.eos), ("eot", self.eot)] {
            if let Some(t) = tok {
                out.push((name.to_string(), t, vocab.token_text(t)));
            }
        }
        out
    }

    /// Whether generation is possible.
    pub fn can_generate(&self) -> bool {
        self.has_decoder
    }

    /// Whether the model encodes its input once and decodes from it with
    /// cross-attention (T5).
    pub fn is_encoder_decoder(&self) -> bool {
        self.has_encoder && self.has_decoder
    }
}

/// Errors of the runtime layer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RuntimeError {
    /// The model file is missing or not a usable GGUF.
    #[error(transparent)]
    InvalidModel(#[from] gguf::GgufError),
    /// llama.cpp failed to load the model.
    #[error("failed to load model {path}: {message}")]
    Load {
        /// The file.
        path: String,
        /// What llama.cpp said.
        message: String,
    },
    /// llama.cpp failed to create a context.
    #[error("failed to create a context: {0}")]
    Context(String),
    /// The placement cannot work on this machine: a GPU that does not exist,
    /// or a model and context that do not fit (llama.cpp's fitting said so).
    #[error("bad placement: {0}")]
    Placement(String),
    /// Tokenization failed.
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    /// A LoRA adapter could not be loaded or applied.
    #[error("LoRA adapter: {0}")]
    Lora(String),
    /// A KV state blob could not be restored.
    #[error("KV state restore failed: {0}")]
    StateRestore(String),
    /// The multimodal projector could not be loaded, or an image not
    /// turned into model input.
    #[error("{0}")]
    Media(String),
}

/// One image of a prompt, made ready for the model by its projector: how many
/// prompt positions it takes, and the backend's own handle to encode it.
#[derive(Clone)]
pub struct MediaChunk {
    /// The image's hash ([`crate::media::Image::hash`]).
    pub hash: u64,
    /// Prompt positions (and KV cells) its embeddings take.
    pub n_tokens: usize,
    /// What the backend encodes (a libmtmd chunk for llama.cpp).
    pub handle: Arc<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for MediaChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MediaChunk")
            .field("hash", &format_args!("{:016x}", self.hash))
            .field("n_tokens", &self.n_tokens)
            .finish()
    }
}

impl PartialEq for MediaChunk {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.n_tokens == other.n_tokens
    }
}

impl Eq for MediaChunk {}

/// An image's place in a prompt: its chunk starts at prompt position `start`
/// and takes `chunk.n_tokens` positions (placeholder tokens in the prompt).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaSpan {
    /// First position.
    pub start: usize,
    /// The image.
    pub chunk: MediaChunk,
}

impl MediaSpan {
    /// One past the last position.
    pub fn end(&self) -> usize {
        self.start + self.chunk.n_tokens
    }
}

/// `n` moved back to the start of the image it falls inside, if any: a
/// prefix of a prompt is reusable only up to an image boundary.
pub fn media_floor(media: &[MediaSpan], n: usize) -> usize {
    media
        .iter()
        .find(|m| m.start < n && n < m.end())
        .map_or(n, |m| m.start)
}

/// A piece of a multimodal prompt, in order.
#[derive(Debug, Clone)]
pub enum MediaPiece {
    /// Text tokens.
    Text(Vec<Token>),
    /// An image.
    Image(MediaChunk),
}

/// The half of a multimodal projector any thread may use: it turns a
/// rendered prompt (text with [`crate::media::IMAGE_MARKER`] where each image
/// goes) and its images into text tokens and image chunks.
pub trait MediaTokenizer: Send + Sync {
    /// Splits the prompt at the markers and prepares each image (resizing,
    /// normalizing) as the projector wants it.
    fn tokenize(
        &self,
        text: &str,
        images: &[Arc<crate::media::Image>],
    ) -> Result<Vec<MediaPiece>, RuntimeError>;
}

/// Why a batch failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// The KV cache has no room for the batch; freeing cells and retrying may work.
    #[error("no KV cache space for the batch")]
    NoKvSpace,
    /// llama.cpp reported another failure.
    #[error("llama.cpp batch failed with code {0}")]
    Failed(i32),
}

/// One token of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchRow {
    /// The token.
    pub token: Token,
    /// Its position in its sequence.
    pub pos: u32,
    /// The sequence it belongs to.
    pub seq: SeqId,
    /// Whether logits (or an embedding) are needed for this row.
    pub output: bool,
}

/// The thread-safe half of a model: tokenizer and metadata.
pub trait Vocab: Send + Sync {
    /// Metadata read at load.
    fn info(&self) -> &ModelInfo;
    /// Tokenizes text. `add_special` adds BOS (and EOS/SEP where the model
    /// wants them); `parse_special` turns special-token text into special tokens.
    fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, RuntimeError>;
    /// The bytes a token contributes to generated text (special tokens render as
    /// nothing). May be part of a UTF-8 character.
    fn token_bytes(&self, token: Token) -> Vec<u8>;
    /// The token's text as stored in the vocabulary (special tokens included).
    fn token_text(&self, token: Token) -> String;
    /// The bytes a token contributes when special tokens are written out
    /// (`skip_special_tokens: false`). May be part of a UTF-8 character.
    fn token_bytes_special(&self, token: Token) -> Vec<u8> {
        self.token_text(token).into_bytes()
    }
    /// Whether the token ends generation (EOS, EOT and the like).
    fn is_eog(&self, token: Token) -> bool;
    /// How a reranker's (query, document) pair is tokenized. The default:
    /// BOS where the tokenizer adds it, nothing else.
    fn rerank_format(&self) -> RerankFormat {
        let info = self.info();
        RerankFormat {
            bos: info.bos.filter(|_| info.add_bos),
            ..RerankFormat::default()
        }
    }
    /// Checks that a grammar or schema can be built, without a context.
    fn check_constraint(
        &self,
        constraint: &OutputConstraint,
        bounds: &crate::sampling::JsonBounds,
    ) -> Result<(), SamplingError>;
    /// The model's image tokenizer, when it has a multimodal projector.
    fn media(&self) -> Option<&dyn MediaTokenizer> {
        None
    }

    /// Detokenizes a whole sequence (lossy at invalid UTF-8).
    fn detokenize(&self, tokens: &[Token]) -> String {
        let mut bytes = Vec::new();
        for &t in tokens {
            bytes.extend(self.token_bytes(t));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// What a sampler is built from.
#[derive(Debug, Clone, Copy)]
pub struct SamplerSpec<'a> {
    /// Settings.
    pub params: &'a SamplingParams,
    /// Grammar or schema, if any.
    pub constraint: Option<&'a OutputConstraint>,
    /// The seed to use (already drawn when the request gave none).
    pub seed: u32,
}

/// One candidate token and its log-probability.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// The token.
    pub token: Token,
    /// Natural-log probability under the model's distribution.
    pub logprob: f32,
}

/// The chosen token's log-probability and the best alternatives.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SampledLogprobs {
    /// The chosen token.
    pub chosen: TokenLogprob,
    /// The top alternatives, most likely first.
    pub top: Vec<TokenLogprob>,
}

/// A sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: Token,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<SampledLogprobs>,
}

/// Why sampling failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SampleError {
    /// The grammar allows no token here (it cannot be satisfied any more).
    #[error("the grammar cannot be satisfied: no token is allowed at this point")]
    GrammarExhausted,
}

/// The half of a model that owns a context: batches, logits, KV sequences.
/// Used only by the engine thread.
pub trait Backend {
    /// A per-request sampler (a llama.cpp sampler chain, or the fake's).
    type Sampler;

    /// The shared vocabulary.
    fn vocab(&self) -> Arc<dyn Vocab>;
    /// KV cache size in tokens (shared by all sequences).
    fn n_ctx(&self) -> u32;
    /// Number of KV sequences the context was created for.
    fn n_seq_max(&self) -> u32;
    /// Largest batch `decode` accepts.
    fn n_batch(&self) -> u32;
    /// Largest micro-batch (a pooled embedding must fit in one).
    fn n_ubatch(&self) -> u32;
    /// Whether this context produces embeddings, and with which pooling.
    fn embedding_pooling(&self) -> Option<Pooling>;

    /// Runs one throw-away batch so the first request does not pay for
    /// first-touch costs. Called on the engine thread: llama.cpp's OpenMP
    /// thread team belongs to the thread that computes.
    fn warm_up(&mut self) {}
    /// Applies a set of the model's LoRA adapters to the batches that follow
    /// (the empty set: none). A backend without adapters accepts only the
    /// empty set.
    fn set_adapters(&mut self, set: &AdapterSet) -> Result<(), RuntimeError> {
        if set.is_empty() {
            Ok(())
        } else {
            Err(RuntimeError::Lora(
                "this backend has no LoRA adapters".into(),
            ))
        }
    }
    /// Runs the decoder over the rows. On error the KV cache holds none of them.
    fn decode(&mut self, rows: &[BatchRow]) -> Result<(), BatchError>;
    /// Runs the encoder over the rows (encoder models).
    fn encode(&mut self, rows: &[BatchRow]) -> Result<(), BatchError>;
    /// Encodes an image and decodes its embeddings into `seq` at positions
    /// `pos..pos + chunk.n_tokens`, as a batch of its own (a llama.cpp batch
    /// holds tokens or embeddings, never both). No output row is read.
    fn decode_media(&mut self, seq: SeqId, pos: u32, chunk: &MediaChunk) -> Result<(), BatchError> {
        let _ = (seq, pos, chunk);
        Err(BatchError::Failed(-1))
    }
    /// The logits of an output row of the last batch.
    fn logits(&self, row: usize) -> &[f32];
    /// The pooled embedding of a sequence after the last batch (or, without
    /// pooling, the embedding of the given output row).
    fn embedding(&self, seq: SeqId, row: usize) -> Option<Vec<f32>>;

    /// Builds a sampler; fails on an invalid grammar or schema.
    fn new_sampler(&self, spec: SamplerSpec<'_>) -> Result<Self::Sampler, SamplingError>;
    /// Makes a cached sampler fresh for a new request (new seed, clean state).
    fn reset_sampler(
        &self,
        sampler: &mut Self::Sampler,
        spec: SamplerSpec<'_>,
    ) -> Result<(), SamplingError>;
    /// Shows the sampler tokens it did not pick (the prompt, for penalties).
    fn sampler_accept_prompt(&self, sampler: &mut Self::Sampler, tokens: &[Token]);
    /// Samples from an output row of the last batch and accepts the token.
    fn sample(
        &mut self,
        sampler: &mut Self::Sampler,
        row: usize,
        top_logprobs: Option<usize>,
    ) -> Result<Sampled, SampleError>;

    /// Feeds the sampler a token it did not pick (a forced token) as if it had
    /// picked it from output row `row`, with that row's log-probabilities.
    fn accept_forced(
        &mut self,
        sampler: &mut Self::Sampler,
        row: usize,
        token: Token,
        top_logprobs: Option<usize>,
    ) -> Sampled;

    /// Removes positions `from..` of a sequence.
    fn kv_truncate(&mut self, seq: SeqId, from: u32);
    /// Makes `dst` share `src`'s cells for positions `0..len` (`dst` must be empty).
    fn kv_share_prefix(&mut self, src: SeqId, dst: SeqId, len: u32);
    /// Cells in use (distinct positions held by any sequence), when known.
    fn kv_cells_used(&self) -> Option<u32>;
    /// Empties the whole KV cache (every sequence), as on a fresh context.
    fn kv_clear(&mut self);
    /// The lowest and highest position the backend holds for `seq`, as its
    /// own bookkeeping says (`None` when the sequence is empty).
    fn kv_seq_positions(&self, seq: SeqId) -> Option<(u32, u32)>;
    /// Serializes a sequence's KV state.
    fn seq_state_save(&mut self, seq: SeqId) -> Vec<u8>;
    /// Restores a sequence's KV state into an empty sequence.
    fn seq_state_restore(&mut self, seq: SeqId, state: &[u8]) -> Result<(), RuntimeError>;
}

/// Numerically stable log-softmax of the chosen token and the top `n`.
pub fn logprobs_from_logits(logits: &[f32], chosen: Token, n: usize) -> SampledLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_z = max + sum.ln() as f32;
    let lp = |t: Token| TokenLogprob {
        token: t,
        logprob: logits
            .get(t as usize)
            .map_or(f32::NEG_INFINITY, |&l| l - log_z),
    };
    let mut top: Vec<TokenLogprob> = Vec::with_capacity(n);
    if n > 0 {
        // Partial selection keeps this O(vocab) for small n.
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        let k = n.min(idx.len());
        if k > 0 {
            idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
            idx.truncate(k);
            idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            top = idx.into_iter().map(|i| lp(i as Token)).collect();
        }
    }
    SampledLogprobs {
        chosen: lp(chosen),
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_sorted_normalized_and_contain_argmax() {
        let logits = vec![1.0, 3.0, 2.0, -1.0];
        let lp = logprobs_from_logits(&logits, 2, 3);
        assert_eq!(
            lp.top.iter().map(|t| t.token).collect::<Vec<_>>(),
            vec![1, 2, 0]
        );
        let total: f32 = (0..4)
            .map(|t| logprobs_from_logits(&logits, t, 0).chosen.logprob.exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        assert!(lp.chosen.logprob < 0.0 && lp.chosen.logprob.is_finite());
    }
}
