//! sipp's first-party HTTP profile: /v1/query, /v1/chat, /v1/embed. The server
//! answers with these types and the gateway client sends them.

use serde::{Deserialize, Serialize};

use crate::chat::ChatMessage;
use crate::engine::{RequestStats, Usage};
use crate::runtime::Pooling;
use crate::sampling::SamplingParams;
use crate::tools::turn::ReasoningFormat;
use crate::tools::{Tool, ToolCall, ToolChoice};

/// Options shared by query and chat requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TextOptions {
    /// Most tokens to generate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Temperature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// Random seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u32>,
    /// Keep generating past end-of-generation tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// A GBNF grammar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammar: Option<String>,
    /// A JSON schema the output must satisfy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<serde_json::Value>,
    /// Any JSON object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_mode: Option<bool>,
    /// Top-n log-probabilities per token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// Session affinity key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_key: Option<String>,
    /// Reuse KV (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_prompt: Option<bool>,
    /// Compute as on a fresh engine, alone, so seeded text repeats (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeatable: Option<bool>,
    /// Speculative decoding (`{"mode": "ngram" | "off", "n_max": N}`); unset
    /// fields take the endpoint's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<crate::engine::SpeculativeRequest>,
    /// LoRA adapters: `[{"id": 0, "scale": 1.0}]`, the others off (unset:
    /// the endpoint's choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<Vec<crate::engine::LoraScale>>,
    /// Full sampling settings, overriding the endpoint's defaults field by field
    /// where given (temperature, top_p and seed above win).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<SamplingParams>,
}

/// POST /v1/query.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QueryBody {
    /// Model id (the server's default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The prompt.
    pub prompt: String,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Options.
    #[serde(flatten)]
    pub options: TextOptions,
}

/// POST /v1/chat.
///
/// Tools are optional: with them the answer's calls come back in
/// [`GenerationBody::tool_calls`] (streamed as `tool_call_start` and
/// `tool_call_arguments` events) and `finish_reason` is `tool_calls`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatBody {
    /// Model id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The conversation (OpenAI's message shape, with `tool_calls` and
    /// `tool` messages).
    pub messages: Vec<ChatMessage>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Tools the model may call (OpenAI's shape).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    /// Whether and which tool must be called (OpenAI's shape; default `auto`
    /// with tools, `none` without).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// Several calls in one answer (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// `split`: `<think>` blocks go to [`GenerationBody::reasoning`] (and
    /// `reasoning` stream events); `none` (the default, as before these
    /// existed): they stay in the text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_format: Option<ReasoningFormat>,
    /// Options.
    #[serde(flatten)]
    pub options: TextOptions,
}

/// A token's log-probability and alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogprobEntry {
    /// Token id.
    pub token: i32,
    /// Token text.
    pub text: String,
    /// Log-probability.
    pub logprob: f32,
    /// Alternatives: (token id, log-probability).
    pub top: Vec<(i32, f32)>,
}

/// The answer to a query or chat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationBody {
    /// Model id.
    pub model: String,
    /// Generated text (of a chat: the answer, without reasoning and calls).
    pub text: String,
    /// stop, eos, length, cancelled, error, or tool_calls (a chat that
    /// called tools and ended there).
    pub finish_reason: String,
    /// The calls a chat's answer made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The reasoning before the answer (with `reasoning_format: "split"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Token counts.
    pub usage: Usage,
    /// Timing (local endpoints).
    #[serde(default)]
    pub stats: RequestStats,
    /// Log-probabilities, when asked for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<LogprobEntry>,
}

/// One server-sent event of a streamed query or chat. A chat sends
/// `reasoning` events only when asked to split reasoning, and call events
/// only when it has tools.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    /// New text.
    Delta {
        /// The text.
        text: String,
    },
    /// New reasoning text.
    Reasoning {
        /// The text.
        text: String,
    },
    /// Tool call `index` (0, 1, ...) started.
    ToolCallStart {
        /// Which call.
        index: usize,
        /// Its id.
        id: String,
        /// The function's name.
        name: String,
    },
    /// The next piece of call `index`'s arguments (JSON text).
    ToolCallArguments {
        /// Which call.
        index: usize,
        /// The piece.
        fragment: String,
    },
    /// The end, with the whole answer.
    Done(GenerationBody),
    /// The request failed.
    Error {
        /// What went wrong.
        error: super::openai::ErrorDetail,
    },
}

/// One text or several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl OneOrMany {
    /// As a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// POST /v1/embed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbedBody {
    /// Model id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Inputs.
    pub input: OneOrMany,
    /// L2-normalize (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalize: Option<bool>,
}

/// One embedding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingItem {
    /// Input index.
    pub index: usize,
    /// The vector.
    pub values: Vec<f32>,
    /// The pooling that produced it.
    pub pooling: Pooling,
    /// Whether it is L2-normalized.
    pub normalized: bool,
}

/// The answer to /v1/embed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbedResponseBody {
    /// Model id.
    pub model: String,
    /// One per input.
    pub data: Vec<EmbeddingItem>,
    /// Token counts.
    pub usage: Usage,
}
