//! What callers send to the engine and what comes back.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::UnboundedSender;

use crate::runtime::{Pooling, SampledLogprobs, Token};
use crate::sampling::{OutputConstraint, SamplingError, SamplingParams};
use crate::scheduler::RequestId;
use crate::text::FinishReason;

/// A prompt as text or as token ids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// Text, tokenized by the engine's model.
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<Token>),
    /// A prompt with images, as the model's projector prepared it (made by
    /// the chat preparation; never sent over the wire).
    #[serde(skip)]
    Media(MediaPrompt),
}

/// A tokenized prompt with images: placeholder tokens where each image's
/// embeddings go ([`crate::media::placeholder_tokens`]), and the images.
#[derive(Debug, Clone, PartialEq)]
pub struct MediaPrompt {
    /// Text tokens and image placeholders.
    pub tokens: Vec<Token>,
    /// The images, in order, each at its placeholders.
    pub media: Vec<crate::runtime::MediaSpan>,
}

impl From<&str> for PromptInput {
    fn from(s: &str) -> Self {
        PromptInput::Text(s.to_string())
    }
}

impl From<String> for PromptInput {
    fn from(s: String) -> Self {
        PromptInput::Text(s)
    }
}

/// A text generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// The prompt.
    pub prompt: PromptInput,
    /// Most tokens to generate; `None` uses the engine default (or the context).
    pub max_tokens: Option<u32>,
    /// Stop strings; the text ends before the first match.
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Sampling settings; `None` uses the engine's defaults.
    pub sampling: Option<SamplingParams>,
    /// Grammar, JSON mode or JSON schema.
    pub constraint: Option<OutputConstraint>,
    /// Log-probabilities: `Some(n)` returns the chosen token's and the top n.
    pub logprobs: Option<u32>,
    /// Session affinity: later requests with the same key continue this one.
    pub context_key: Option<String>,
    /// Reuse and keep KV for this prompt (default true).
    pub cache_prompt: bool,
    /// Compute this request exactly as on an idle, freshly started engine, so
    /// a seeded or greedy request repeats its text whatever ran before or
    /// around it: it waits for the running requests to finish, runs alone
    /// (later requests wait for it), and its prompt is computed from scratch
    /// into a cleared KV cache (idle prefixes are snapshotted first, when
    /// snapshots are on). Default false.
    pub repeatable: bool,
    /// Add BOS (and other special tokens the model wants) to a text prompt.
    pub add_special: bool,
    /// Turn special-token text in a text prompt into special tokens.
    pub parse_special: bool,
    /// A cap on `<think>` reasoning (see [`ReasoningBudget`]).
    pub reasoning_budget: Option<ReasoningBudgetRequest>,
    /// Speculative decoding for this request; unset fields take the engine's.
    pub speculative: Option<SpeculativeRequest>,
    /// Special tokens the model generates render as nothing (default true);
    /// false writes their text (`<|im_start|>`, `<tool_call>` ...). End-of-
    /// generation tokens that end the answer are never written.
    pub skip_special_tokens: bool,
    /// A matched stop string stays at the end of the text (default false:
    /// it is trimmed). SGLang's `no_stop_trim`, vLLM's
    /// `include_stop_str_in_output`.
    pub include_stop: bool,
    /// LoRA adapters for this request (llama-server's `lora`): the listed
    /// ones at their scales, the others off. `None` (or, as in llama-server,
    /// an empty list): the engine's choice (an adapter named in the model,
    /// else every adapter at its global scale).
    pub lora: Option<Vec<LoraScale>>,
}

/// One adapter of a request's `lora` list.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraScale {
    /// The adapter's id (`GET /lora-adapters`).
    pub id: usize,
    /// Its scale (0 turns it off).
    pub scale: f32,
}

/// Speculative decoding as a request asks for it (`"speculative": {"mode":
/// "ngram", "n_max": 8}`); an unset field takes the engine's setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeRequest {
    /// `off`, `ngram` or `draft`.
    #[serde(default)]
    pub mode: Option<crate::config::SpeculativeMode>,
    /// Most tokens drafted per step (0 turns drafting off).
    #[serde(default)]
    pub n_max: Option<u32>,
}

/// Speculative decoding in effect for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculation {
    /// How drafts are made.
    pub mode: crate::config::SpeculativeMode,
    /// Most tokens drafted per step.
    pub n_max: usize,
    /// Shortest n-gram match that drafts.
    pub ngram_min: usize,
    /// Longest n-gram matched.
    pub ngram_max: usize,
}

impl Default for Speculation {
    fn default() -> Self {
        Self {
            mode: crate::config::SpeculativeMode::Off,
            n_max: 0,
            ngram_min: 2,
            ngram_max: 4,
        }
    }
}

impl Speculation {
    /// Whether this request drafts at all.
    pub fn is_on(&self) -> bool {
        self.mode != crate::config::SpeculativeMode::Off && self.n_max > 0
    }
}

impl GenerateRequest {
    /// A request with defaults for everything but the prompt.
    pub fn new(prompt: impl Into<PromptInput>) -> Self {
        Self {
            prompt: prompt.into(),
            max_tokens: None,
            stop: Vec::new(),
            ignore_eos: false,
            sampling: None,
            constraint: None,
            logprobs: None,
            context_key: None,
            cache_prompt: true,
            repeatable: false,
            add_special: true,
            parse_special: true,
            reasoning_budget: None,
            speculative: None,
            skip_special_tokens: true,
            include_stop: false,
            lora: None,
        }
    }

    /// Sets max_tokens.
    pub fn max_tokens(mut self, n: u32) -> Self {
        self.max_tokens = Some(n);
        self
    }

    /// Sets sampling settings.
    pub fn sampling(mut self, s: SamplingParams) -> Self {
        self.sampling = Some(s);
        self
    }

    /// Greedy decoding.
    pub fn greedy(self) -> Self {
        self.sampling(SamplingParams::greedy())
    }

    /// Adds a stop string.
    pub fn stop(mut self, s: impl Into<String>) -> Self {
        self.stop.push(s.into());
        self
    }
}

/// An embedding request.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedRequest {
    /// The input.
    pub input: PromptInput,
    /// L2-normalize the vector (default true).
    pub normalize: bool,
}

impl EmbedRequest {
    /// A normalized embedding of the input.
    pub fn new(input: impl Into<PromptInput>) -> Self {
        Self {
            input: input.into(),
            normalize: true,
        }
    }
}

/// Token counts, as OpenAI reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the KV cache.
    pub cached_tokens: usize,
}

impl Usage {
    /// Prompt plus completion.
    pub fn total_tokens(&self) -> usize {
        self.prompt_tokens + self.completion_tokens
    }
}

/// Per-request timing, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestStats {
    /// Waiting for a slot.
    pub queue_ms: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens reused from cache.
    pub cached_tokens: usize,
    /// From admission to the end of the prompt.
    pub prefill_ms: f64,
    /// From submission to the first generated token.
    pub ttft_ms: f64,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// From the first token to the end.
    pub decode_ms: f64,
    /// Tokens drafted by speculative decoding.
    #[serde(default)]
    pub drafted_tokens: usize,
    /// Of them, tokens accepted (each saved a step).
    #[serde(default)]
    pub accepted_tokens: usize,
}

impl RequestStats {
    /// Prompt tokens computed per second (cached ones excluded).
    pub fn prompt_tokens_per_second(&self) -> f64 {
        let computed = self.prompt_tokens.saturating_sub(self.cached_tokens) as f64;
        if self.prefill_ms > 0.0 {
            computed * 1000.0 / self.prefill_ms
        } else {
            0.0
        }
    }

    /// Decode speed over the tokens after the first.
    pub fn decode_tokens_per_second(&self) -> f64 {
        if self.decode_ms > 0.0 && self.generated_tokens > 1 {
            (self.generated_tokens - 1) as f64 * 1000.0 / self.decode_ms
        } else {
            0.0
        }
    }

    /// Share of drafted tokens accepted (`None` when nothing was drafted).
    pub fn acceptance(&self) -> Option<f64> {
        (self.drafted_tokens > 0).then(|| self.accepted_tokens as f64 / self.drafted_tokens as f64)
    }
}

/// Log-probabilities of one generated token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprobs {
    /// The token.
    pub token: Token,
    /// Its text (lossy for partial characters).
    pub text: String,
    /// Chosen token and alternatives.
    pub logprobs: SampledLogprobs,
}

/// Newly generated text.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TextDelta {
    /// Text to append (never a partial character; never part of a stop string).
    pub text: String,
    /// Tokens sampled since the last delta.
    pub tokens: Vec<Token>,
    /// Their log-probabilities, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
}

/// A finished generation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Completion {
    /// The whole generated text.
    pub text: String,
    /// Generated token ids.
    pub tokens: Vec<Token>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Token counts.
    pub usage: Usage,
    /// Timing.
    pub stats: RequestStats,
    /// Log-probabilities of every token, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
}

/// A finished embedding.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EmbeddingOutput {
    /// The vector.
    pub values: Vec<f32>,
    /// The pooling that produced it.
    pub pooling: Pooling,
    /// Whether it was L2-normalized.
    pub normalized: bool,
    /// Input tokens.
    pub prompt_tokens: usize,
    /// Timing.
    pub stats: RequestStats,
}

/// An event on a request's stream: deltas, then exactly one final event
/// (`Finished`, `Embedding` or `Failed`).
#[derive(Debug, Clone, PartialEq)]
pub enum RequestEvent {
    /// Left the queue and took a slot.
    Started,
    /// New text.
    Delta(TextDelta),
    /// The generation ended (including by cancellation).
    Finished(Completion),
    /// The embedding is ready.
    Embedding(EmbeddingOutput),
    /// The request failed.
    Failed(EngineError),
}

impl RequestEvent {
    /// Whether this is the last event of its stream.
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            RequestEvent::Finished(_) | RequestEvent::Embedding(_) | RequestEvent::Failed(_)
        )
    }
}

/// Errors of the engine layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt does not fit the context.
    #[error("the prompt has {prompt_tokens} tokens but the context holds {n_ctx} (at most {max} prompt tokens)", max = n_ctx.saturating_sub(1))]
    PromptTooLong {
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Context size.
        n_ctx: u32,
    },
    /// An embedding input longer than one micro-batch.
    #[error("the input has {tokens} tokens but an embedding input may have at most {max}")]
    InputTooLong {
        /// Input tokens.
        tokens: usize,
        /// The limit.
        max: usize,
    },
    /// Refused by the caller's usage meter (a token-rate limit).
    #[error("{message}")]
    RateLimited {
        /// Which limit, and by how much.
        message: String,
        /// Seconds until the request would fit.
        retry_after_secs: u64,
    },
    /// Too many requests are waiting.
    #[error("queue full: {max_queued} requests are already waiting")]
    QueueFull {
        /// The queue limit.
        max_queued: usize,
    },
    /// A field is invalid.
    #[error("invalid `{field}`: {message}")]
    InvalidRequest {
        /// The field.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// Invalid sampling settings, grammar or schema.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The model or context cannot do this.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// No KV space for this request even after freeing everything else.
    #[error("the KV cache is full: {0}")]
    KvCacheFull(String),
    /// llama.cpp failed on this request's batch.
    #[error("decoding failed for this request: {0}")]
    Decode(String),
    /// The grammar allows no further token.
    #[error(
        "the grammar cannot be satisfied: no token is allowed after {generated} generated tokens"
    )]
    GrammarExhausted {
        /// Tokens generated before it stalled.
        generated: usize,
    },
    /// Tokenization failed.
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    /// The conversation could not be rendered.
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    /// Tools, a tool choice or tool history that cannot be used.
    #[error(transparent)]
    Tool(#[from] crate::tools::ToolError),
    /// The engine has stopped.
    #[error("the engine has stopped")]
    EngineStopped,
}

/// Where a request's events go. A closed channel means the caller left.
pub type EventSink = UnboundedSender<RequestEvent>;

/// Generation settings after validation.
#[derive(Debug, Clone)]
pub struct GenerateSpec {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// The seed in effect.
    pub seed: u32,
    /// Grammar or schema.
    pub constraint: Option<OutputConstraint>,
    /// Top-n log-probabilities, when asked for.
    pub logprobs: Option<usize>,
    /// A cap on the tokens of a `<think>` block.
    pub reasoning_budget: Option<ReasoningBudget>,
    /// Speculative decoding.
    pub speculative: Speculation,
    /// Special tokens render as nothing.
    pub skip_special_tokens: bool,
    /// A matched stop string stays in the text.
    pub include_stop: bool,
}

/// A cap on reasoning: once the generation has `max_tokens` tokens and is
/// still inside a `<think>` block (opened by the prompt, or first thing in
/// the answer), the tokens of `close` are forced, one per step, and the
/// answer follows. The sampler sees them as if it had picked them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningBudget {
    /// Most tokens of reasoning (at least one token is always sampled).
    pub max_tokens: usize,
    /// The tokens that close the block.
    pub close: Vec<crate::runtime::Token>,
    /// The prompt opened the block.
    pub starts_inside: bool,
}

/// A reasoning budget as a request asks for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningBudgetRequest {
    /// Most tokens of reasoning.
    pub max_tokens: u32,
    /// The text that closes the block (`"\n</think>\n\n"`).
    pub close: String,
    /// The prompt opened the block.
    pub starts_inside: bool,
}

/// What a prepared request asks for.
#[derive(Debug, Clone)]
pub enum PreparedKind {
    /// Generate text.
    Generate(GenerateSpec),
    /// Compute an embedding.
    Embed {
        /// L2-normalize.
        normalize: bool,
    },
}

/// A validated, tokenized request on its way to a slot.
#[derive(Debug)]
pub struct PreparedRequest {
    /// Id.
    pub id: RequestId,
    /// What to do.
    pub kind: PreparedKind,
    /// Prompt tokens.
    pub prompt: Vec<Token>,
    /// The prompt's images (their positions hold placeholders).
    pub media: Arc<[crate::runtime::MediaSpan]>,
    /// An encoder-decoder model's input: encoded once at admission; the
    /// prompt is then the decoder's start token.
    pub encoder_input: Option<Arc<[Token]>>,
    /// Session affinity key.
    pub context_key: Option<String>,
    /// The LoRA adapters it runs with.
    pub adapters: crate::runtime::AdapterSet,
    /// Reuse and keep KV.
    pub cache_prompt: bool,
    /// Run alone on a cleared KV cache (see `GenerateRequest::repeatable`).
    pub repeatable: bool,
    /// When it was submitted.
    pub submitted_at: Instant,
    /// Its event stream.
    pub sink: EventSink,
}

/// A place in the engine's queue, counted in a shared gauge from submission
/// until the request leaves the queue (admitted, cancelled or failed): the
/// count drops when this guard does, wherever that happens.
#[derive(Debug)]
pub struct QueuePlace {
    gauge: Arc<AtomicUsize>,
}

impl QueuePlace {
    /// Takes a place when fewer than `max` are taken.
    pub fn reserve(gauge: &Arc<AtomicUsize>, max: usize) -> Option<QueuePlace> {
        gauge
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < max).then_some(q + 1)
            })
            .ok()
            .map(|_| QueuePlace {
                gauge: gauge.clone(),
            })
    }
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        self.gauge.fetch_sub(1, Ordering::AcqRel);
    }
}
