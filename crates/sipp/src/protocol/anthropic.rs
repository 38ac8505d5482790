//! Anthropic's Messages API wire types (`POST /v1/messages`,
//! `POST /v1/messages/count_tokens`), how a request becomes sipp's chat
//! messages and [`ToolSpec`], and how an answer's [`TurnEvent`]s become
//! Anthropic's content blocks and stream events.
//!
//! The conversion:
//! - `system` (text or text blocks) is one system message;
//! - a user message's `text` blocks are a user message (consecutive ones, and
//!   consecutive user turns, joined by newlines, as Anthropic merges them);
//!   each `tool_result` block is a `tool` message answering its `tool_use_id`
//!   (an `is_error` result's text is prefixed with `Error: `);
//! - an assistant message (consecutive ones merged) is one assistant message:
//!   `text` blocks its content, `tool_use` blocks its calls (arguments: the
//!   `input` object as JSON text), `thinking` blocks its `reasoning_content`
//!   (`redacted_thinking` is dropped);
//! - `tool_choice` `auto` is auto, `any` required, `tool` that function,
//!   `none` none; `disable_parallel_tool_use` turns parallel calls off;
//! - `thinking` `enabled`/`adaptive` sets the template variable
//!   `enable_thinking: true`, `disabled` sets it false (templates such as
//!   Qwen3's read it); reasoning the model writes anyway is still split into
//!   `thinking` blocks. `budget_tokens` caps the reasoning: at that many
//!   tokens inside the block the engine closes it (the engine's reasoning
//!   budget) and the answer follows.
//!
//! Errors name the field as the request wrote it
//! (`messages[2].content[0].tool_use_id`, `tools[1].input_schema`).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::chat::{ChatMessage, MessageContent, Role};
use crate::text::FinishReason;
use crate::tools::{FunctionDef, Tool, ToolCall, ToolChoice, ToolError, ToolSpec};
use crate::tools::{TurnEvent, TurnOutput};

/// Who wrote an input message (Anthropic has no system or tool role).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MessageRole {
    /// The user (and tool results).
    User,
    /// The model.
    Assistant,
}

/// Content: a string, or a list of blocks.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed blocks.
    Blocks(Vec<ContentBlock>),
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match Value::deserialize(d)? {
            Value::String(s) => Ok(Content::Text(s)),
            v @ Value::Array(_) => serde_json::from_value(v)
                .map(Content::Blocks)
                .map_err(D::Error::custom),
            _ => Err(D::Error::custom(
                "must be a string or a list of content blocks",
            )),
        }
    }
}

/// A content block, in a request or a response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// A call the model made.
    ToolUse {
        /// Its id (a `tool_result` answers it by this id).
        id: String,
        /// The tool's name.
        name: String,
        /// The arguments, a JSON object.
        input: Value,
    },
    /// A tool's result (user messages only).
    ToolResult {
        /// The call it answers.
        tool_use_id: String,
        /// What the tool returned: text or text blocks.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        content: Option<Content>,
        /// The tool failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        is_error: Option<bool>,
    },
    /// The model's reasoning.
    Thinking {
        /// The reasoning text.
        thinking: String,
        /// Anthropic's integrity signature; sipp writes and reads it empty.
        #[serde(default)]
        signature: String,
    },
    /// Reasoning Anthropic encrypted (read and dropped).
    RedactedThinking {
        /// The encrypted reasoning.
        #[serde(default)]
        data: String,
    },
    /// An image: `source` is `{"type": "base64", "media_type", "data"}` or
    /// `{"type": "url", "url"}`.
    Image {
        /// Where the image is.
        #[serde(default)]
        source: Value,
    },
    /// A document (not supported: refused naming the block).
    Document {
        /// Where the document is.
        #[serde(default)]
        source: Value,
    },
}

/// An input message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputMessage {
    /// `user` or `assistant`.
    pub role: MessageRole,
    /// What it says.
    pub content: Content,
}

/// A tool definition: `{name, description, input_schema}` (`type` absent or
/// `custom`; Anthropic's server tools are refused).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDef {
    /// The tool's name.
    pub name: String,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema of its input (an object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<Value>,
    /// `custom` (or absent) for a client tool.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolChoiceParam {
    /// Text or calls, as the model chooses.
    Auto {
        /// At most one call.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// At least one call, of any tool.
    Any {
        /// Exactly one call.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// A call of this tool.
    Tool {
        /// The tool.
        name: String,
        /// Exactly one call.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// No calls.
    None,
}

/// `thinking`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ThinkingConfig {
    /// Think first (`enable_thinking: true` for the template).
    Enabled {
        /// Most tokens the reasoning may take (the engine closes the block there).
        budget_tokens: i64,
    },
    /// The model decides (as `enabled`).
    Adaptive,
    /// Do not think (`enable_thinking: false` for the template).
    Disabled,
}

/// The body of `POST /v1/messages`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessagesRequest {
    /// The model (the server's default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Most tokens to generate (required).
    pub max_tokens: i64,
    /// The conversation.
    pub messages: Vec<InputMessage>,
    /// Instructions: text or text blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<Content>,
    /// Tools the model may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<ToolDef>>,
    /// Whether and which tool must be called.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoiceParam>,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_sequences: Option<Vec<String>>,
    /// Temperature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    /// Top-k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    /// Stream server-sent events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Request metadata (recorded, not used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// Extended thinking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<ThinkingConfig>,
    /// LoRA adapters (llama-server's extension, local models):
    /// `[{"id": 0, "scale": 1.0}]`, the others off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<Vec<crate::engine::LoraScale>>,
}

/// The body of `POST /v1/messages/count_tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CountTokensRequest {
    /// The model (the server's default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<InputMessage>,
    /// Instructions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<Content>,
    /// Tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<ToolDef>>,
    /// The tool choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoiceParam>,
    /// Extended thinking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<ThinkingConfig>,
}

/// The answer of `count_tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CountTokensResponse {
    /// Tokens of the rendered prompt (tools included).
    pub input_tokens: usize,
}

/// Why an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model ended its turn.
    EndTurn,
    /// `max_tokens` (or the context) ran out.
    MaxTokens,
    /// A stop sequence matched.
    StopSequence,
    /// The model called tools.
    ToolUse,
}

impl StopReason {
    /// The stop reason of an answer that ended for `reason`, having called
    /// tools or not: `tool_use` when it called and ended by itself.
    pub fn of(reason: FinishReason, called: bool) -> Self {
        match reason {
            FinishReason::Eos | FinishReason::Stop if called => StopReason::ToolUse,
            FinishReason::Eos | FinishReason::Cancelled => StopReason::EndTurn,
            FinishReason::Stop => StopReason::StopSequence,
            FinishReason::Length => StopReason::MaxTokens,
        }
    }
}

/// Token counts, as Anthropic reports them: `input_tokens` are the prompt
/// tokens computed, `cache_read_input_tokens` those reused from the KV cache
/// (their sum is the prompt).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens not served from the cache.
    pub input_tokens: usize,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Prompt tokens served from the cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_input_tokens: Option<usize>,
}

impl From<crate::engine::Usage> for Usage {
    fn from(u: crate::engine::Usage) -> Self {
        Self {
            input_tokens: u.prompt_tokens.saturating_sub(u.cached_tokens),
            output_tokens: u.completion_tokens,
            cache_read_input_tokens: Some(u.cached_tokens),
        }
    }
}

/// A response message (and the message of `message_start`, with no content
/// yet).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessagesResponse {
    /// `msg_...`.
    pub id: String,
    /// Always "message".
    #[serde(rename = "type")]
    pub kind: String,
    /// Always "assistant".
    pub role: String,
    /// The model that answered.
    pub model: String,
    /// The answer's blocks.
    pub content: Vec<ContentBlock>,
    /// Why it ended (null in `message_start`).
    pub stop_reason: Option<StopReason>,
    /// The stop sequence that matched, if one did.
    pub stop_sequence: Option<String>,
    /// Token counts.
    pub usage: Usage,
}

impl MessagesResponse {
    /// A message with these blocks.
    pub fn new(id: String, model: String, content: Vec<ContentBlock>, usage: Usage) -> Self {
        Self {
            id,
            kind: "message".into(),
            role: "assistant".into(),
            model,
            content,
            stop_reason: None,
            stop_sequence: None,
            usage,
        }
    }
}

/// A piece of a streamed block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    /// More text.
    TextDelta {
        /// The text.
        text: String,
    },
    /// More of a call's input, as JSON text.
    InputJsonDelta {
        /// The piece.
        partial_json: String,
    },
    /// More reasoning.
    ThinkingDelta {
        /// The reasoning.
        thinking: String,
    },
    /// A thinking block's signature (empty here).
    SignatureDelta {
        /// The signature.
        signature: String,
    },
}

/// The top-level change of `message_delta`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageDelta {
    /// Why the answer ended.
    pub stop_reason: Option<StopReason>,
    /// The stop sequence that matched.
    pub stop_sequence: Option<String>,
}

/// The usage of `message_delta` (totals so far).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaUsage {
    /// Generated tokens.
    pub output_tokens: usize,
    /// Prompt tokens not served from the cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<usize>,
    /// Prompt tokens served from the cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_input_tokens: Option<usize>,
}

/// An error's details.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `request_too_large`, `rate_limit_error`, `api_error`, `overloaded_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Human-readable message.
    pub message: String,
}

/// An error body: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// Always "error".
    #[serde(rename = "type")]
    pub kind: String,
    /// The error.
    pub error: ErrorDetail,
}

impl ErrorResponse {
    /// An error of this type.
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            kind: "error".into(),
            error: ErrorDetail {
                kind: kind.into(),
                message: message.into(),
            },
        }
    }
}

/// A server-sent event of a streamed answer (its SSE `event:` is
/// [`StreamEvent::name`], its `data:` the JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    /// The message, with no content yet.
    MessageStart {
        /// The message.
        message: MessagesResponse,
    },
    /// A block opens.
    ContentBlockStart {
        /// Its index in `content`.
        index: usize,
        /// The block, empty.
        content_block: ContentBlock,
    },
    /// More of a block.
    ContentBlockDelta {
        /// The block's index.
        index: usize,
        /// The piece.
        delta: BlockDelta,
    },
    /// A block is complete.
    ContentBlockStop {
        /// The block's index.
        index: usize,
    },
    /// The answer's stop reason and usage.
    MessageDelta {
        /// Stop reason and sequence.
        delta: MessageDelta,
        /// Totals.
        usage: DeltaUsage,
    },
    /// The end.
    MessageStop,
    /// Keep-alive.
    Ping,
    /// A failure mid-stream.
    Error {
        /// The error.
        error: ErrorDetail,
    },
}

impl StreamEvent {
    /// The SSE event name (the `type`).
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
            StreamEvent::Ping => "ping",
            StreamEvent::Error { .. } => "error",
        }
    }
}

/// A conversation as a request gives it (both routes render it alike).
#[derive(Debug, Clone, Copy)]
pub struct Conversation<'a> {
    /// Instructions.
    pub system: Option<&'a Content>,
    /// The messages.
    pub messages: &'a [InputMessage],
    /// Tools.
    pub tools: Option<&'a [ToolDef]>,
    /// The tool choice.
    pub tool_choice: Option<&'a ToolChoiceParam>,
    /// Extended thinking.
    pub thinking: Option<&'a ThinkingConfig>,
}

impl MessagesRequest {
    /// Its conversation.
    pub fn conversation(&self) -> Conversation<'_> {
        Conversation {
            system: self.system.as_ref(),
            messages: &self.messages,
            tools: self.tools.as_deref(),
            tool_choice: self.tool_choice.as_ref(),
            thinking: self.thinking.as_ref(),
        }
    }
}

impl CountTokensRequest {
    /// Its conversation.
    pub fn conversation(&self) -> Conversation<'_> {
        Conversation {
            system: self.system.as_ref(),
            messages: &self.messages,
            tools: self.tools.as_deref(),
            tool_choice: self.tool_choice.as_ref(),
            thinking: self.thinking.as_ref(),
        }
    }
}

/// A conversation in sipp's terms.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatParts {
    /// The messages.
    pub messages: Vec<ChatMessage>,
    /// The tools and how they may be used.
    pub tools: ToolSpec,
    /// Template variables (`enable_thinking`), when `thinking` was given.
    pub kwargs: Option<serde_json::Map<String, Value>>,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ToolError {
    ToolError::new(field, message)
}

/// The text of content that may only hold text blocks.
fn text_only(c: &Content, field: &str) -> Result<String, ToolError> {
    match c {
        Content::Text(s) => Ok(s.clone()),
        Content::Blocks(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (j, b) in blocks.iter().enumerate() {
                match b {
                    ContentBlock::Text { text } => parts.push(text.as_str()),
                    other => {
                        return Err(err(
                            format!("{field}[{j}].type"),
                            format!(
                                "only `text` blocks are supported here, got `{}`",
                                block_type(other)
                            ),
                        ))
                    }
                }
            }
            Ok(parts.join("\n"))
        }
    }
}

fn block_type(b: &ContentBlock) -> &'static str {
    match b {
        ContentBlock::Text { .. } => "text",
        ContentBlock::ToolUse { .. } => "tool_use",
        ContentBlock::ToolResult { .. } => "tool_result",
        ContentBlock::Thinking { .. } => "thinking",
        ContentBlock::RedactedThinking { .. } => "redacted_thinking",
        ContentBlock::Image { .. } => "image",
        ContentBlock::Document { .. } => "document",
    }
}

fn append(content: &mut Option<MessageContent>, text: &str) {
    match content {
        Some(MessageContent::Text(t)) => {
            t.push('\n');
            t.push_str(text);
        }
        Some(MessageContent::Parts(parts)) => parts.push(crate::chat::ContentPart::Text {
            text: text.to_string(),
        }),
        _ => *content = Some(MessageContent::Text(text.to_string())),
    }
}

/// Adds an image part (the content becomes parts).
fn append_image(content: &mut Option<MessageContent>, url: String) {
    let mut parts = match content.take() {
        Some(MessageContent::Parts(p)) => p,
        Some(MessageContent::Text(t)) => vec![crate::chat::ContentPart::Text { text: t }],
        None => Vec::new(),
    };
    parts.push(crate::chat::ContentPart::image(url));
    *content = Some(MessageContent::Parts(parts));
}

/// An image block's source as a URL (base64 data becomes a data URL).
fn image_url(source: &Value, field: &str) -> Result<String, ToolError> {
    let s = |k: &str| source.get(k).and_then(Value::as_str);
    match s("type") {
        Some("base64") => {
            let media = s("media_type").unwrap_or("image/png");
            let data = s("data").ok_or_else(|| {
                err(
                    format!("{field}.source.data"),
                    "a base64 image needs `data`",
                )
            })?;
            Ok(format!("data:{media};base64,{data}"))
        }
        Some("url") => s("url")
            .map(str::to_string)
            .ok_or_else(|| err(format!("{field}.source.url"), "a url image needs `url`")),
        _ => Err(err(
            format!("{field}.source.type"),
            "an image source is `base64` (with media_type and data) or `url`",
        )),
    }
}

/// The field name of a [`ToolSpec::validate`] error as Anthropic's request
/// names it (`tools[1].function.parameters` is `tools[1].input_schema`).
pub fn anthropic_field(field: &str) -> String {
    field
        .replace(".function.parameters", ".input_schema")
        .replace(".function.name", ".name")
}

impl Conversation<'_> {
    /// The conversation as sipp's messages and tool spec, checked: blocks in
    /// the wrong role, unsupported blocks, a `tool_result` answering no
    /// earlier `tool_use`, a `tool_use` input that is not an object, bad
    /// tools and a `tool_choice` naming no tool are refused, naming the field.
    pub fn to_chat(&self) -> Result<ChatParts, ToolError> {
        if self.messages.is_empty() {
            return Err(err("messages", "must contain at least one message"));
        }
        let mut out: Vec<ChatMessage> = Vec::new();
        if let Some(s) = self.system {
            let text = text_only(s, "system")?;
            if !text.is_empty() {
                out.push(ChatMessage::system(text));
            }
        }
        // Calls made so far: id to the tool's name.
        let mut made: HashMap<String, String> = HashMap::new();
        for (i, m) in self.messages.iter().enumerate() {
            let own;
            let blocks: &[ContentBlock] = match &m.content {
                Content::Text(s) => {
                    own = [ContentBlock::Text { text: s.clone() }];
                    &own
                }
                Content::Blocks(b) => b,
            };
            let field = |j: usize| format!("messages[{i}].content[{j}]");
            match m.role {
                MessageRole::User => {
                    for (j, b) in blocks.iter().enumerate() {
                        match b {
                            ContentBlock::Text { text } => match out.last_mut() {
                                Some(last) if last.role == Role::User => {
                                    append(&mut last.content, text)
                                }
                                _ => out.push(ChatMessage::user(text.as_str())),
                            },
                            ContentBlock::Image { source } => {
                                let url = image_url(source, &field(j))?;
                                match out.last_mut() {
                                    Some(last) if last.role == Role::User => {
                                        append_image(&mut last.content, url)
                                    }
                                    _ => {
                                        let mut m = ChatMessage {
                                            content: None,
                                            ..ChatMessage::user("")
                                        };
                                        append_image(&mut m.content, url);
                                        out.push(m);
                                    }
                                }
                            }
                            ContentBlock::ToolResult {
                                tool_use_id,
                                content,
                                is_error,
                            } => {
                                let Some(name) = made.get(tool_use_id) else {
                                    return Err(err(
                                        format!("{}.tool_use_id", field(j)),
                                        format!("no earlier `tool_use` block has the id {tool_use_id:?}"),
                                    ));
                                };
                                let mut text = match content {
                                    Some(c) => text_only(c, &format!("{}.content", field(j)))?,
                                    None => String::new(),
                                };
                                if *is_error == Some(true) {
                                    text = format!("Error: {text}");
                                }
                                let mut msg = ChatMessage::tool_result(tool_use_id.as_str(), text);
                                msg.name = Some(name.clone());
                                out.push(msg);
                            }
                            other => {
                                let t = block_type(other);
                                let why = match other {
                                    ContentBlock::Image { .. } | ContentBlock::Document { .. } => {
                                        format!("`{t}` blocks are not supported")
                                    }
                                    _ => format!("`{t}` blocks belong in assistant messages"),
                                };
                                return Err(err(format!("{}.type", field(j)), why));
                            }
                        }
                    }
                }
                MessageRole::Assistant => {
                    let mut msg = match out.pop() {
                        Some(last) if last.role == Role::Assistant => last,
                        other => {
                            out.extend(other);
                            ChatMessage {
                                content: None,
                                ..ChatMessage::assistant("")
                            }
                        }
                    };
                    for (j, b) in blocks.iter().enumerate() {
                        match b {
                            ContentBlock::Text { text } => append(&mut msg.content, text),
                            ContentBlock::ToolUse { id, name, input } => {
                                if !input.is_object() {
                                    return Err(err(
                                        format!("{}.input", field(j)),
                                        "must be a JSON object",
                                    ));
                                }
                                if id.is_empty() {
                                    return Err(err(
                                        format!("{}.id", field(j)),
                                        "must not be empty",
                                    ));
                                }
                                made.insert(id.clone(), name.clone());
                                msg.tool_calls
                                    .get_or_insert_with(Vec::new)
                                    .push(ToolCall::new(
                                        id.as_str(),
                                        name.as_str(),
                                        input.to_string(),
                                    ));
                            }
                            ContentBlock::Thinking { thinking, .. } => {
                                let r = msg.reasoning_content.get_or_insert_with(String::new);
                                if !r.is_empty() {
                                    r.push('\n');
                                }
                                r.push_str(thinking);
                            }
                            ContentBlock::RedactedThinking { .. } => {}
                            other => {
                                let t = block_type(other);
                                let why = match other {
                                    ContentBlock::ToolResult { .. } => {
                                        format!("`{t}` blocks belong in user messages")
                                    }
                                    _ => format!("`{t}` blocks are not supported"),
                                };
                                return Err(err(format!("{}.type", field(j)), why));
                            }
                        }
                    }
                    if msg.content.is_none() && msg.tool_calls.is_none() {
                        msg.content = Some(MessageContent::Text(String::new()));
                    }
                    out.push(msg);
                }
            }
        }
        Ok(ChatParts {
            messages: out,
            tools: self.tool_spec()?,
            kwargs: self.kwargs()?,
        })
    }

    /// The tools and the choice, checked.
    fn tool_spec(&self) -> Result<ToolSpec, ToolError> {
        let defs = self.tools.unwrap_or_default();
        let mut tools = Vec::with_capacity(defs.len());
        for (i, t) in defs.iter().enumerate() {
            if let Some(k) = t.kind.as_deref().filter(|k| *k != "custom") {
                return Err(err(
                    format!("tools[{i}].type"),
                    format!("only custom tools (`name`, `description`, `input_schema`) are supported, got {k:?}"),
                ));
            }
            let Some(schema) = &t.input_schema else {
                return Err(err(format!("tools[{i}].input_schema"), "is required"));
            };
            tools.push(Tool {
                kind: "function".into(),
                function: FunctionDef {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    parameters: Some(schema.clone()),
                    strict: None,
                },
            });
        }
        let (choice, no_parallel) = match self.tool_choice {
            None if tools.is_empty() => (ToolChoice::None, None),
            None => (ToolChoice::Auto, None),
            Some(ToolChoiceParam::Auto {
                disable_parallel_tool_use,
            }) => (ToolChoice::Auto, *disable_parallel_tool_use),
            Some(ToolChoiceParam::Any {
                disable_parallel_tool_use,
            }) => {
                if tools.is_empty() {
                    return Err(err("tool_choice", "is \"any\" but `tools` is empty"));
                }
                (ToolChoice::Required, *disable_parallel_tool_use)
            }
            Some(ToolChoiceParam::Tool {
                name,
                disable_parallel_tool_use,
            }) => {
                if !tools.iter().any(|t| &t.function.name == name) {
                    return Err(err(
                        "tool_choice.name",
                        format!("names the tool {name:?}, which is not in `tools`"),
                    ));
                }
                (
                    ToolChoice::Function(name.clone()),
                    *disable_parallel_tool_use,
                )
            }
            Some(ToolChoiceParam::None) => (ToolChoice::None, None),
        };
        let spec = ToolSpec {
            tools,
            choice,
            parallel: !no_parallel.unwrap_or(false),
        };
        spec.validate()
            .map_err(|e| err(anthropic_field(&e.field), e.message))?;
        Ok(spec)
    }

    fn kwargs(&self) -> Result<Option<serde_json::Map<String, Value>>, ToolError> {
        let on = match self.thinking {
            None => return Ok(None),
            Some(ThinkingConfig::Enabled { budget_tokens }) if *budget_tokens < 1 => {
                return Err(err(
                    "thinking.budget_tokens",
                    format!("must be at least 1, got {budget_tokens}"),
                ))
            }
            Some(ThinkingConfig::Enabled { .. } | ThinkingConfig::Adaptive) => true,
            Some(ThinkingConfig::Disabled) => false,
        };
        let mut m = serde_json::Map::new();
        m.insert("enable_thinking".into(), Value::Bool(on));
        Ok(Some(m))
    }
}

/// A call's input: its arguments as a JSON object (`{}` when they are not
/// one, which happens only to a call cut off by `max_tokens`).
fn call_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => Value::Object(serde_json::Map::new()),
    }
}

/// The blocks of a whole answer: its reasoning (a `thinking` block), its text
/// (always when it made no call; with calls only when it is not blank), then
/// a `tool_use` block per whole call (one that `max_tokens` cut is left out;
/// `stop_reason` says `max_tokens`).
pub fn response_content(output: &TurnOutput) -> Vec<ContentBlock> {
    let mut out = Vec::new();
    if let Some(r) = output.reasoning.as_ref().filter(|r| !r.is_empty()) {
        out.push(ContentBlock::Thinking {
            thinking: r.clone(),
            signature: String::new(),
        });
    }
    let calls: Vec<&crate::tools::ToolCall> = output.complete_calls().collect();
    if calls.is_empty() || !output.content.trim().is_empty() {
        out.push(ContentBlock::Text {
            text: output.content.clone(),
        });
    }
    for c in calls {
        out.push(ContentBlock::ToolUse {
            id: c.id.clone(),
            name: c.function.name.clone(),
            input: call_input(&c.function.arguments),
        });
    }
    out
}

/// The kind of the block a [`BlockStream`] has open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Text,
    Thinking,
    Call(usize),
}

/// Turns an answer's [`TurnEvent`]s into Anthropic's block events as they
/// stream: runs of text and of reasoning are one `text` / `thinking` block
/// each, each call a `tool_use` block whose input streams as
/// `input_json_delta`s. Blank text before a block opens is held back and
/// dropped when a call follows (as [`response_content`] drops blank text of
/// an answer with calls); an answer that wrote no block and made no call
/// gets one `text` block.
#[derive(Debug, Clone, Default)]
pub struct BlockStream {
    next: usize,
    open: Option<(Open, usize)>,
    calls: HashMap<usize, usize>,
    held: String,
    wrote_text: bool,
    called: bool,
}

impl BlockStream {
    /// A stream with no block yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the answer called a tool.
    pub fn called(&self) -> bool {
        self.called
    }

    fn close(&mut self, out: &mut Vec<StreamEvent>) {
        if let Some((kind, index)) = self.open.take() {
            if kind == Open::Thinking {
                out.push(StreamEvent::ContentBlockDelta {
                    index,
                    delta: BlockDelta::SignatureDelta {
                        signature: String::new(),
                    },
                });
            }
            out.push(StreamEvent::ContentBlockStop { index });
        }
    }

    fn start(&mut self, kind: Open, block: ContentBlock, out: &mut Vec<StreamEvent>) -> usize {
        self.close(out);
        let index = self.next;
        self.next += 1;
        self.open = Some((kind, index));
        out.push(StreamEvent::ContentBlockStart {
            index,
            content_block: block,
        });
        index
    }

    fn open_index(&self, kind: Open) -> Option<usize> {
        self.open.filter(|(k, _)| *k == kind).map(|(_, i)| i)
    }

    /// The events of these answer events.
    pub fn push(&mut self, events: Vec<TurnEvent>) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        for e in events {
            match e {
                TurnEvent::Content(s) => {
                    if let Some(index) = self.open_index(Open::Text) {
                        out.push(StreamEvent::ContentBlockDelta {
                            index,
                            delta: BlockDelta::TextDelta { text: s },
                        });
                    } else if s.trim().is_empty() {
                        self.held.push_str(&s);
                    } else {
                        let text = std::mem::take(&mut self.held) + &s;
                        self.open_text(text, &mut out);
                    }
                }
                TurnEvent::Reasoning(s) => {
                    let index = match self.open_index(Open::Thinking) {
                        Some(i) => i,
                        None => self.start(
                            Open::Thinking,
                            ContentBlock::Thinking {
                                thinking: String::new(),
                                signature: String::new(),
                            },
                            &mut out,
                        ),
                    };
                    out.push(StreamEvent::ContentBlockDelta {
                        index,
                        delta: BlockDelta::ThinkingDelta { thinking: s },
                    });
                }
                TurnEvent::CallStart { index, id, name } => {
                    self.held.clear();
                    self.called = true;
                    let block = self.start(
                        Open::Call(index),
                        ContentBlock::ToolUse {
                            id,
                            name,
                            input: Value::Object(serde_json::Map::new()),
                        },
                        &mut out,
                    );
                    self.calls.insert(index, block);
                }
                TurnEvent::CallArguments { index, fragment } => {
                    if let Some(&block) = self.calls.get(&index) {
                        if !fragment.is_empty() {
                            out.push(StreamEvent::ContentBlockDelta {
                                index: block,
                                delta: BlockDelta::InputJsonDelta {
                                    partial_json: fragment,
                                },
                            });
                        }
                    }
                }
                TurnEvent::CallEnd { index } => {
                    if self.open_index(Open::Call(index)).is_some() {
                        self.close(&mut out);
                    }
                }
            }
        }
        out
    }

    fn open_text(&mut self, text: String, out: &mut Vec<StreamEvent>) {
        self.wrote_text = true;
        let index = self.start(
            Open::Text,
            ContentBlock::Text {
                text: String::new(),
            },
            out,
        );
        if !text.is_empty() {
            out.push(StreamEvent::ContentBlockDelta {
                index,
                delta: BlockDelta::TextDelta { text },
            });
        }
    }

    /// The events that close the answer's blocks (after the parser's last
    /// events were pushed).
    pub fn finish(&mut self) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        if !self.called && !self.wrote_text {
            let text = std::mem::take(&mut self.held);
            self.open_text(text, &mut out);
        }
        self.close(&mut out);
        out
    }
}

/// The stop sequence that ended a generation: the one of `stops` found
/// earliest in the text of all its tokens (the text itself ends where the
/// match began), the shortest when several begin there.
pub fn matched_stop(token_text: &str, stops: &[String]) -> Option<String> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| token_text.find(s.as_str()).map(|at| (at, s.len(), s)))
        .min()
        .map(|(_, _, s)| s.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(v: Value) -> MessagesRequest {
        serde_json::from_value(v).expect("parses")
    }

    fn weather() -> Value {
        json!({"name": "get_weather", "description": "Weather in a city",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
    }

    #[test]
    fn a_tool_loop_becomes_chat_messages() {
        let req = request(json!({
            "model": "m", "max_tokens": 10,
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
            "tools": [weather()],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "user", "content": [{"type": "text", "text": "And quickly."}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Call it.", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lyon"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "down"}], "is_error": true},
                    {"type": "text", "text": "Thanks"}
                ]}
            ]
        }));
        let parts = req.conversation().to_chat().expect("converts");
        let m = &parts.messages;
        assert_eq!(m.len(), 6, "{m:#?}");
        assert_eq!(
            (m[0].role, m[0].text()),
            (Role::System, "Be brief.\nUse tools.".into())
        );
        assert_eq!(
            (m[1].role, m[1].text()),
            (Role::User, "Weather in Paris?\nAnd quickly.".into())
        );
        assert_eq!(m[2].role, Role::Assistant);
        assert_eq!(m[2].text(), "Checking.");
        assert_eq!(m[2].reasoning_content.as_deref(), Some("Call it."));
        let calls = m[2].tool_calls.as_ref().expect("calls");
        assert_eq!(calls[0].id, "toolu_1");
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(
            serde_json::from_str::<Value>(&calls[0].function.arguments).expect("json"),
            json!({"city": "Paris"})
        );
        assert_eq!((m[3].role, m[3].text()), (Role::Tool, "18 C".into()));
        assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[3].name.as_deref(), Some("get_weather"));
        assert_eq!(m[4].text(), "Error: down");
        assert_eq!((m[5].role, m[5].text()), (Role::User, "Thanks".into()));
        assert_eq!(
            parts.tools.choice,
            ToolChoice::Function("get_weather".into())
        );
        assert!(!parts.tools.parallel);
        assert_eq!(parts.tools.tools[0].function.name, "get_weather");
        assert!(parts.kwargs.is_none());
        // The converted history passes the engine's own check.
        crate::tools::format::check_history(m).expect("valid history");
    }

    #[test]
    fn tool_choice_and_thinking_map_onto_sipp() {
        let conv = |extra: Value| {
            let mut v = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [weather()]});
            for (k, x) in extra.as_object().expect("object") {
                v[k] = x.clone();
            }
            request(v).conversation().to_chat()
        };
        let spec = |extra: Value| conv(extra).expect("converts").tools;
        assert_eq!(spec(json!({})).choice, ToolChoice::Auto);
        assert!(spec(json!({})).parallel);
        assert_eq!(
            spec(json!({"tool_choice": {"type": "any"}})).choice,
            ToolChoice::Required
        );
        assert_eq!(
            spec(json!({"tool_choice": {"type": "none"}})).choice,
            ToolChoice::None
        );
        let auto =
            spec(json!({"tool_choice": {"type": "auto", "disable_parallel_tool_use": true}}));
        assert_eq!((auto.choice, auto.parallel), (ToolChoice::Auto, false));
        let e =
            conv(json!({"tool_choice": {"type": "tool", "name": "nope"}})).expect_err("refused");
        assert_eq!(e.field, "tool_choice.name");
        let e = conv(json!({"tools": [{"name": "f"}]})).expect_err("refused");
        assert_eq!(e.field, "tools[0].input_schema");
        let e = conv(json!({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}))
            .expect_err("refused");
        assert_eq!(e.field, "tools[0].input_schema");
        let e = conv(json!({"tools": [{"name": "has space", "input_schema": {"type": "object"}}]}))
            .expect_err("refused");
        assert_eq!(e.field, "tools[0].name");
        let e = conv(json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}))
            .expect_err("refused");
        assert_eq!(e.field, "tools[0].type");
        let e = conv(json!({"tools": [], "tool_choice": {"type": "any"}})).expect_err("refused");
        assert_eq!(e.field, "tool_choice");
        let k = conv(json!({"thinking": {"type": "disabled"}}))
            .expect("converts")
            .kwargs;
        assert_eq!(k.expect("kwargs")["enable_thinking"], false);
        let k = conv(json!({"thinking": {"type": "enabled", "budget_tokens": 2048}}))
            .expect("converts")
            .kwargs;
        assert_eq!(k.expect("kwargs")["enable_thinking"], true);
        let e = conv(json!({"thinking": {"type": "enabled", "budget_tokens": 0}}))
            .expect_err("refused");
        assert_eq!(e.field, "thinking.budget_tokens");
        // No tools: calls off.
        let none =
            request(json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}));
        assert_eq!(
            none.conversation()
                .to_chat()
                .expect("converts")
                .tools
                .choice,
            ToolChoice::None
        );
    }

    #[test]
    fn misplaced_and_unanswerable_blocks_name_their_field() {
        let conv = |messages: Value| {
            request(json!({"max_tokens": 5, "messages": messages}))
                .conversation()
                .to_chat()
                .expect_err("refused")
                .field
        };
        assert_eq!(
            conv(
                json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}])
            ),
            "messages[0].content[0].tool_use_id"
        );
        assert_eq!(
            conv(
                json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": [1]}]}])
            ),
            "messages[1].content[0].input"
        );
        assert_eq!(
            conv(json!([{"role": "user", "content": [{"type": "image", "source": {}}]}])),
            "messages[0].content[0].source.type"
        );
        assert_eq!(
            conv(
                json!([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}])
            ),
            "messages[0].content[0].type"
        );
        assert_eq!(conv(json!([])), "messages");
        let e = serde_json::from_value::<MessagesRequest>(json!({"messages": []}))
            .expect_err("refused");
        assert!(e.to_string().contains("max_tokens"), "{e}");
        let e = serde_json::from_value::<MessagesRequest>(
            json!({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}),
        )
        .expect_err("refused");
        assert!(e.to_string().contains("system"), "{e}");
    }

    #[test]
    fn answers_become_blocks_and_stop_reasons() {
        let out = TurnOutput {
            content: "\n".into(),
            reasoning: Some("hmm".into()),
            calls: vec![ToolCall::new(
                "call_1",
                "get_weather",
                r#"{"city": "Paris"}"#,
            )],
        };
        let blocks = serde_json::to_value(response_content(&out)).expect("json");
        assert_eq!(
            blocks,
            json!([
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
            ])
        );
        let blocks = serde_json::to_value(response_content(&TurnOutput::default())).expect("json");
        assert_eq!(blocks, json!([{"type": "text", "text": ""}]));
        assert_eq!(StopReason::of(FinishReason::Eos, true), StopReason::ToolUse);
        assert_eq!(
            StopReason::of(FinishReason::Eos, false),
            StopReason::EndTurn
        );
        assert_eq!(
            StopReason::of(FinishReason::Stop, false),
            StopReason::StopSequence
        );
        assert_eq!(
            StopReason::of(FinishReason::Length, true),
            StopReason::MaxTokens
        );
        let stops = vec!["zz".to_string(), "b".to_string(), "bc".to_string()];
        assert_eq!(matched_stop("aabcd", &stops).as_deref(), Some("b"));
        assert_eq!(matched_stop("aaa", &stops), None);
    }

    #[test]
    fn stream_events_follow_anthropics_block_order() {
        let mut s = BlockStream::new();
        let mut ev = s.push(vec![
            TurnEvent::Reasoning("think".into()),
            TurnEvent::Content("\n".into()),
            TurnEvent::Content("Sure".into()),
            TurnEvent::Content(" thing".into()),
            TurnEvent::CallStart {
                index: 0,
                id: "call_a".into(),
                name: "f".into(),
            },
            TurnEvent::CallArguments {
                index: 0,
                fragment: "{\"a\":".into(),
            },
        ]);
        ev.extend(s.push(vec![
            TurnEvent::CallArguments {
                index: 0,
                fragment: "1}".into(),
            },
            TurnEvent::CallEnd { index: 0 },
            TurnEvent::Content("\n".into()),
            TurnEvent::CallStart {
                index: 1,
                id: "call_b".into(),
                name: "g".into(),
            },
        ]));
        ev.extend(s.finish());
        assert!(s.called());
        let v: Vec<Value> = ev
            .iter()
            .map(|e| serde_json::to_value(e).expect("json"))
            .collect();
        assert_eq!(
            v,
            vec![
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "think"}}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": ""}}),
                json!({"type": "content_block_stop", "index": 0}),
                json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
                json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "\nSure"}}),
                json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": " thing"}}),
                json!({"type": "content_block_stop", "index": 1}),
                json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "call_a", "name": "f", "input": {}}}),
                json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"a\":"}}),
                json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "1}"}}),
                json!({"type": "content_block_stop", "index": 2}),
                json!({"type": "content_block_start", "index": 3, "content_block": {"type": "tool_use", "id": "call_b", "name": "g", "input": {}}}),
                json!({"type": "content_block_stop", "index": 3}),
            ]
        );
        for (e, j) in ev.iter().zip(&v) {
            assert_eq!(e.name(), j["type"]);
        }
        // Nothing at all: one empty text block.
        let mut s = BlockStream::new();
        assert!(s.push(vec![TurnEvent::Content(" ".into())]).is_empty());
        let v: Vec<Value> = s
            .finish()
            .iter()
            .map(|e| serde_json::to_value(e).expect("json"))
            .collect();
        assert_eq!(
            v,
            vec![
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " "}}),
                json!({"type": "content_block_stop", "index": 0}),
            ]
        );
    }
}
