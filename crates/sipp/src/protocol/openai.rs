//! OpenAI's wire types (completions, chat completions, embeddings, models),
//! with llama-server's extensions. The server parses them; the client's
//! OpenAI-compatible provider sends them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::chat::ChatMessage;
use crate::tools::turn::ReasoningFormat;
use crate::tools::{Tool, ToolChoice};

/// `prompt`: text, texts, token ids, or lists of token ids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    /// One text.
    Text(String),
    /// Several texts (one choice each).
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<i64>),
    /// Several token-id prompts.
    TokenLists(Vec<Vec<i64>>),
}

/// `stop`: one string or several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl StopField {
    /// As a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// `response_format`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against a schema.
    JsonSchema {
        /// The schema and its name.
        json_schema: JsonSchemaSpec,
    },
}

/// The `json_schema` member of `response_format`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonSchemaSpec {
    /// A name for the schema.
    #[serde(default)]
    pub name: Option<String>,
    /// The schema.
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
    /// OpenAI's strict flag (schemas are always enforced here).
    #[serde(default)]
    pub strict: Option<bool>,
}

/// Sampling fields every generation request accepts, with llama-server's
/// extensions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingFields {
    /// Temperature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Top-k (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    /// Min-p (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Typical-p (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub typical_p: Option<f32>,
    /// Presence penalty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// Repetition penalty (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat_penalty: Option<f32>,
    /// Look-back of the penalties (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat_last_n: Option<i32>,
    /// Mirostat mode (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirostat: Option<u8>,
    /// Mirostat tau (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirostat_tau: Option<f32>,
    /// Mirostat eta (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirostat_eta: Option<f32>,
    /// Random seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Token biases: token id (as a string) to bias.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f32>>,
    /// Sampler order (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samplers: Option<Vec<String>>,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopField>,
    /// Keep generating past end-of-generation tokens (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// A GBNF grammar (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammar: Option<String>,
    /// A JSON schema (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<serde_json::Value>,
    /// Reuse KV across requests (extension; default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_prompt: Option<bool>,
    /// Compute as on a fresh engine, alone, so seeded text repeats
    /// (extension; default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeatable: Option<bool>,
    /// Speculative decoding (extension): `{"mode": "ngram" | "off", "n_max": N}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<crate::engine::SpeculativeRequest>,
    /// LoRA adapters (llama-server's extension): `[{"id": 0, "scale": 1.0}]`,
    /// the others off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<Vec<crate::engine::LoraScale>>,
    /// Bounds on JSON mode and open JSON schemas (extension): `false` turns
    /// them off, `true` keeps the target's, an object overrides some.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_bounds: Option<JsonBoundsField>,
    /// OpenAI's end-user id (recorded, not used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `false` writes the text of special tokens the model generates
    /// (vLLM / SGLang; default true: they render as nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
    /// `true` keeps a matched stop string at the end of the text (SGLang;
    /// default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_stop_trim: Option<bool>,
    /// vLLM's name for `no_stop_trim`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_stop_str_in_output: Option<bool>,
}

/// `json_bounds` on a request: on/off, or some bounds over the target's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum JsonBoundsField {
    /// `false`: no bounds; `true`: the target's.
    Switch(bool),
    /// These bounds over the target's (0 turns one off).
    Limits(JsonBoundsPatch),
}

/// Some of `JsonBounds`' fields.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonBoundsPatch {
    /// Longest open string, in characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_string_chars: Option<u32>,
    /// Most items in an open array.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_array_items: Option<u32>,
    /// JSON mode: most members in one object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_object_members: Option<u32>,
    /// JSON mode: deepest nesting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_depth: Option<u32>,
    /// At most one space between JSON tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compact_whitespace: Option<bool>,
}

impl JsonBoundsField {
    /// The bounds in effect over `base`.
    pub fn over(&self, base: crate::sampling::JsonBounds) -> crate::sampling::JsonBounds {
        match self {
            JsonBoundsField::Switch(false) => crate::sampling::JsonBounds::unbounded(),
            JsonBoundsField::Switch(true) => base,
            JsonBoundsField::Limits(p) => crate::sampling::JsonBounds {
                max_string_chars: p.max_string_chars.unwrap_or(base.max_string_chars),
                max_array_items: p.max_array_items.unwrap_or(base.max_array_items),
                max_object_members: p.max_object_members.unwrap_or(base.max_object_members),
                max_depth: p.max_depth.unwrap_or(base.max_depth),
                compact_whitespace: p.compact_whitespace.unwrap_or(base.compact_whitespace),
            },
        }
    }
}

/// POST /v1/completions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// Model id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<PromptField>,
    /// Most tokens to generate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    /// llama-server's name for max_tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_predict: Option<i64>,
    /// Choices per prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<i64>,
    /// Stream as server-sent events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Stream options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Top log-probabilities per token (OpenAI allows 0 to 5; the engine up
    /// to [`crate::engine::MAX_TOP_LOGPROBS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<i64>,
    /// Echo the prompt before the completion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    /// Sampling and extension fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// POST /v1/chat/completions.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    /// Model id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The conversation.
    #[serde(default)]
    pub messages: Vec<ChatMessage>,
    /// Most tokens to generate (deprecated name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    /// Most tokens to generate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<i64>,
    /// Choices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<i64>,
    /// Stream as server-sent events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Stream options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Return log-probabilities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    /// Alternatives per token (0 to [`crate::engine::MAX_TOP_LOGPROBS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<i64>,
    /// Output format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
    /// Functions the model may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    /// Whether and which tool must be called (`auto` when tools are given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// Several calls in one answer (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// `<think>` blocks: `none` leaves them in the content, `split` (or
    /// llama-server's `auto`, `deepseek`) puts them in `reasoning_content`
    /// (extension; default split).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "reasoning_format"
    )]
    pub reasoning_format: Option<ReasoningFormat>,
    /// Most tokens of `<think>` reasoning before the block is closed for the
    /// answer (extension; -1: no cap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_budget: Option<i64>,
    /// Extra chat-template variables, e.g. `{"enable_thinking": false}`
    /// (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Continue the last (assistant) message instead of answering after it
    /// (vLLM / SGLang; default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continue_final_message: Option<bool>,
    /// Sampling and extension fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// Token counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageBody {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: usize,
    /// Both.
    pub total_tokens: usize,
    /// Cached prompt tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl From<crate::engine::Usage> for UsageBody {
    fn from(u: crate::engine::Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.total_tokens(),
            prompt_tokens_details: Some(PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            }),
        }
    }
}

/// llama-server's `timings` (its extension of OpenAI's bodies), on a
/// non-streamed answer with one choice and on each choice's last chunk of a
/// stream: what the prompt and the generation cost, and, when the request
/// drafted (speculative decoding), how many tokens were drafted and accepted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// Prompt tokens reused from the cache.
    pub cache_n: usize,
    /// Prompt tokens computed.
    pub prompt_n: usize,
    /// Milliseconds computing them.
    pub prompt_ms: f64,
    /// Milliseconds per computed prompt token.
    pub prompt_per_token_ms: f64,
    /// Computed prompt tokens per second.
    pub prompt_per_second: f64,
    /// Tokens generated.
    pub predicted_n: usize,
    /// Milliseconds from the first generated token to the last.
    pub predicted_ms: f64,
    /// Milliseconds per generated token after the first.
    pub predicted_per_token_ms: f64,
    /// Generated tokens per second after the first.
    pub predicted_per_second: f64,
    /// Tokens drafted by speculative decoding (absent when none were).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_n: Option<usize>,
    /// Of them, tokens accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_n_accepted: Option<usize>,
}

impl From<&crate::engine::RequestStats> for Timings {
    fn from(s: &crate::engine::RequestStats) -> Self {
        let prompt_n = s.prompt_tokens.saturating_sub(s.cached_tokens);
        let per = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
        let decoded = s.generated_tokens.saturating_sub(1);
        let drafted = (s.drafted_tokens > 0).then_some(s.drafted_tokens);
        Self {
            cache_n: s.cached_tokens,
            prompt_n,
            prompt_ms: s.prefill_ms,
            prompt_per_token_ms: per(s.prefill_ms, prompt_n),
            prompt_per_second: s.prompt_tokens_per_second(),
            predicted_n: s.generated_tokens,
            predicted_ms: s.decode_ms,
            predicted_per_token_ms: per(s.decode_ms, decoded),
            predicted_per_second: s.decode_tokens_per_second(),
            draft_n: drafted,
            draft_n_accepted: drafted.map(|_| s.accepted_tokens),
        }
    }
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the KV cache.
    pub cached_tokens: usize,
}

/// Legacy completion log-probabilities.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities.
    pub token_logprobs: Vec<f32>,
    /// Alternatives per token.
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    /// Where each token starts in the choice's text, in bytes (characters
    /// for ASCII text, as OpenAI counts them).
    pub text_offset: Vec<usize>,
}

/// One completion choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// Index.
    pub index: usize,
    /// Text (or delta).
    pub text: String,
    /// Log-probabilities.
    pub logprobs: Option<CompletionLogprobs>,
    /// Why it ended (null while streaming).
    pub finish_reason: Option<String>,
}

/// A completion (or a stream chunk of one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// Id.
    pub id: String,
    /// "text_completion".
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Model id.
    pub model: String,
    /// Choices.
    pub choices: Vec<CompletionChoice>,
    /// Usage (final response or last chunk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
    /// llama-server's timings (see [`Timings`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// llama-server's names for the reasoning formats.
fn reasoning_format<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<ReasoningFormat>, D::Error> {
    use serde::de::Error;
    match Option::<String>::deserialize(d)?.as_deref() {
        None => Ok(None),
        Some("none") => Ok(Some(ReasoningFormat::None)),
        Some("split" | "auto" | "deepseek" | "deepseek-legacy") => Ok(Some(ReasoningFormat::Split)),
        Some(other) => Err(D::Error::custom(format!(
            "reasoning_format must be \"none\" or \"split\" (or \"auto\", \"deepseek\"), got {other:?}"
        ))),
    }
}

/// A chat message in a response.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResponseMessage {
    /// "assistant" (only in the first delta when streaming).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Text (null in a message that only calls tools).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// The reasoning before the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Calls (whole in a message, in pieces in stream deltas).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ResponseToolCall>>,
}

/// A call in a response message, or a piece of one in a stream delta: the
/// first piece has the index, id, type and name, later ones more arguments.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResponseToolCall {
    /// Which call (stream deltas only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// Its id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// "function".
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The function, or the piece of it.
    pub function: FunctionPiece,
}

/// A called function, or a piece of one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FunctionPiece {
    /// Its name (first piece).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Arguments (JSON text, or the next piece of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

impl From<&crate::tools::ToolCall> for ResponseToolCall {
    fn from(c: &crate::tools::ToolCall) -> Self {
        Self {
            index: None,
            id: Some(c.id.clone()),
            kind: Some(c.kind.clone()),
            function: FunctionPiece {
                name: Some(c.function.name.clone()),
                arguments: Some(c.function.arguments.clone()),
            },
        }
    }
}

/// One alternative token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    /// Token text.
    pub token: String,
    /// Log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of the token.
    pub bytes: Option<Vec<u8>>,
}

/// One generated token's log-probabilities.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    /// Token text.
    pub token: String,
    /// Log-probability.
    pub logprob: f32,
    /// UTF-8 bytes of the token.
    pub bytes: Option<Vec<u8>>,
    /// Alternatives.
    pub top_logprobs: Vec<TopLogprob>,
}

/// Chat log-probabilities.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    /// Per generated token.
    pub content: Vec<ChatTokenLogprob>,
}

/// One chat choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// Index.
    pub index: usize,
    /// The message (non-streaming).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<ResponseMessage>,
    /// The delta (streaming).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<ResponseMessage>,
    /// Log-probabilities.
    pub logprobs: Option<ChatLogprobs>,
    /// Why it ended (null while streaming).
    pub finish_reason: Option<String>,
}

/// A chat completion (or a stream chunk of one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    /// Id.
    pub id: String,
    /// "chat.completion" or "chat.completion.chunk".
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Model id.
    pub model: String,
    /// Choices.
    pub choices: Vec<ChatChoice>,
    /// Usage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
    /// llama-server's timings (see [`Timings`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// `input` of an embedding request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    /// One text.
    Text(String),
    /// Several texts.
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<i64>),
    /// Several token-id inputs.
    TokenLists(Vec<Vec<i64>>),
}

/// POST /v1/embeddings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingRequest {
    /// Model id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Inputs.
    pub input: EmbeddingInput,
    /// "float" (default) or "base64".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding_format: Option<String>,
    /// Truncated dimensions (not supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<i64>,
    /// End-user id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// An embedding vector, as floats or base64 of little-endian f32.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingVector {
    /// Floats.
    Float(Vec<f32>),
    /// Base64.
    Base64(String),
}

/// One embedding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingData {
    /// "embedding".
    pub object: String,
    /// Input index.
    pub index: usize,
    /// The vector.
    pub embedding: EmbeddingVector,
}

/// Embeddings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingResponse {
    /// "list".
    pub object: String,
    /// One per input.
    pub data: Vec<EmbeddingData>,
    /// Model id.
    pub model: String,
    /// Token counts.
    pub usage: UsageBody,
}

/// One model in GET /v1/models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// Id.
    pub id: String,
    /// "model".
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Owner.
    pub owned_by: String,
}

/// GET /v1/models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    /// "list".
    pub object: String,
    /// Models.
    pub data: Vec<ModelCard>,
}

/// OpenAI's error body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The error itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Human-readable message.
    pub message: String,
    /// Category, e.g. "invalid_request_error".
    #[serde(rename = "type")]
    pub kind: String,
    /// Machine-readable code.
    pub code: Option<String>,
    /// The offending field, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param: Option<String>,
}
