//! OpenAI's Responses API wire types (`POST /v1/responses`): the request, its
//! input items, the response object and its output items, and the typed
//! stream events. Shapes follow the official SDK's `types/responses` models;
//! fields sipp does not use are accepted and ignored (unknown keys are never
//! refused, so a client may send whatever OpenAI accepts).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::openai::SamplingFields;
use crate::tools::ToolChoice;

/// POST /v1/responses.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResponsesRequest {
    /// Model id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The new turn: a user text, or a list of items.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<ResponseInput>,
    /// A system message placed first (not carried over to follow-ups).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Functions the model may call (Responses' flat shape).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<ResponsesTool>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "name": ...}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// Several calls in one answer (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// Continue the conversation of a stored response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_response_id: Option<String>,
    /// Keep the response for `GET /v1/responses/{id}` and follow-ups
    /// (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<bool>,
    /// Stream typed server-sent events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Most tokens to generate (reasoning included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<i64>,
    /// The output format.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextConfig>,
    /// Key-value pairs kept with the response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Map<String, Value>>,
    /// Reasoning options (accepted and echoed; `effort` is not used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Value>,
    /// `"auto"` or `"disabled"` (accepted; a too-long input is always an error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncation: Option<String>,
    /// Extra chat-template variables, e.g. `{"enable_thinking": false}`
    /// (extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Sampling fields (`temperature`, `top_p`, and llama-server's extensions).
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `input`: a text (one user message) or a list of items.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ResponseInput {
    /// One user message.
    Text(String),
    /// Messages, calls, call outputs, reasoning.
    Items(Vec<InputItem>),
}

impl<'de> Deserialize<'de> for ResponseInput {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match Value::deserialize(d)? {
            Value::String(s) => Ok(ResponseInput::Text(s)),
            Value::Array(items) => items
                .into_iter()
                .enumerate()
                .map(|(i, v)| {
                    serde_json::from_value(v)
                        .map_err(|e| D::Error::custom(format!("input[{i}]: {e}")))
                })
                .collect::<Result<_, _>>()
                .map(ResponseInput::Items),
            _ => Err(D::Error::custom(
                "input must be a string or a list of items",
            )),
        }
    }
}

/// One input item. A message's `type` may be left out (OpenAI's "easy"
/// message).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InputItem {
    /// A message.
    Message(InputMessage),
    /// A call the model made earlier.
    FunctionCall(FunctionCallItem),
    /// The result of a call.
    FunctionCallOutput(FunctionCallOutputItem),
    /// Reasoning the model did earlier.
    Reasoning(ReasoningItem),
}

impl<'de> Deserialize<'de> for InputItem {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let v = Value::deserialize(d)?;
        let kind = match v.get("type") {
            None | Some(Value::Null) => "message".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(D::Error::custom("`type` must be a string")),
        };
        let e = |e: serde_json::Error| D::Error::custom(e.to_string());
        match kind.as_str() {
            "message" => serde_json::from_value(v).map(InputItem::Message).map_err(e),
            "function_call" => serde_json::from_value(v).map(InputItem::FunctionCall).map_err(e),
            "function_call_output" => serde_json::from_value(v)
                .map(InputItem::FunctionCallOutput)
                .map_err(e),
            "reasoning" => serde_json::from_value(v).map(InputItem::Reasoning).map_err(e),
            other => Err(D::Error::custom(format!(
                "items of type {other:?} are not supported (only message, function_call, function_call_output and reasoning)"
            ))),
        }
    }
}

/// A message item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputMessage {
    /// `user`, `assistant`, `system` or `developer`.
    pub role: String,
    /// Text, or text parts.
    pub content: InputContent,
    /// Its id (messages from an earlier output have one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Its status (messages from an earlier output have one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// A message's content: text or parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum InputContent {
    /// Plain text.
    Text(String),
    /// Typed parts.
    Parts(Vec<ContentPart>),
}

impl InputContent {
    /// The text of the content (parts joined by newlines).
    pub fn text(&self) -> String {
        match self {
            InputContent::Text(t) => t.clone(),
            InputContent::Parts(parts) => parts
                .iter()
                .map(ContentPart::text)
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// A part of a message's content (text only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// Text the user (or system) wrote.
    InputText {
        /// The text.
        text: String,
    },
    /// Text the model wrote.
    OutputText {
        /// The text.
        text: String,
        /// Citations (always empty here).
        #[serde(default)]
        annotations: Vec<Value>,
    },
    /// A refusal the model wrote.
    Refusal {
        /// The refusal.
        refusal: String,
    },
    /// An image the user sent, by URL (a data URL, or http(s)).
    InputImage {
        /// The image's URL.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        image_url: Option<String>,
        /// OpenAI's `auto`, `low` or `high` (accepted; the projector decides).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
}

impl ContentPart {
    /// The part's text (an image: its marker).
    pub fn text(&self) -> &str {
        match self {
            ContentPart::InputText { text } | ContentPart::OutputText { text, .. } => text,
            ContentPart::Refusal { refusal } => refusal,
            ContentPart::InputImage { .. } => crate::media::IMAGE_MARKER,
        }
    }
}

impl InputContent {
    /// As a chat message's content: text, or parts when it has images (an
    /// image part without a URL becomes an empty URL, refused later).
    pub fn to_message_content(&self) -> crate::chat::MessageContent {
        use crate::chat::{ContentPart as Chat, MessageContent};
        match self {
            InputContent::Parts(parts)
                if parts
                    .iter()
                    .any(|p| matches!(p, ContentPart::InputImage { .. })) =>
            {
                MessageContent::Parts(
                    parts
                        .iter()
                        .map(|p| match p {
                            ContentPart::InputImage { image_url, .. } => {
                                Chat::image(image_url.clone().unwrap_or_default())
                            }
                            other => Chat::Text {
                                text: other.text().to_string(),
                            },
                        })
                        .collect(),
                )
            }
            other => MessageContent::Text(other.text()),
        }
    }
}

/// A function call (an input item, or an output item).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCallItem {
    /// The item's id (`fc_...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The call's id; a `function_call_output` answers it by this id.
    pub call_id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
    /// `in_progress`, `completed` or `incomplete`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// The result of a call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCallOutputItem {
    /// The item's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The call it answers.
    pub call_id: String,
    /// The result: text, or text parts.
    pub output: InputContent,
    /// Its status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// Reasoning (an input item, or an output item).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReasoningItem {
    /// Its id (`rs_...`).
    #[serde(default)]
    pub id: String,
    /// Summaries (none are written here).
    #[serde(default)]
    pub summary: Vec<SummaryText>,
    /// The reasoning text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Vec<ReasoningText>>,
    /// OpenAI's encrypted reasoning (never written here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encrypted_content: Option<String>,
    /// Its status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

impl ReasoningItem {
    /// The reasoning's text: its content, else its summaries.
    pub fn text(&self) -> String {
        match &self.content {
            Some(c) if !c.is_empty() => c.iter().map(|t| t.text.as_str()).collect(),
            _ => self
                .summary
                .iter()
                .map(|s| s.text.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// A summary of reasoning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryText {
    /// "summary_text".
    #[serde(rename = "type", default = "summary_text")]
    pub kind: String,
    /// The summary.
    pub text: String,
}

fn summary_text() -> String {
    "summary_text".into()
}

/// A piece of reasoning text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReasoningText {
    /// "reasoning_text".
    #[serde(rename = "type", default = "reasoning_text")]
    pub kind: String,
    /// The text.
    pub text: String,
}

fn reasoning_text() -> String {
    "reasoning_text".into()
}

impl ReasoningText {
    /// A reasoning text part.
    pub fn new(text: impl Into<String>) -> Self {
        Self {
            kind: reasoning_text(),
            text: text.into(),
        }
    }
}

/// A function tool in Responses' flat shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponsesTool {
    /// "function" (the only kind served).
    #[serde(rename = "type")]
    pub kind: String,
    /// The function's name.
    #[serde(default)]
    pub name: String,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema of its arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    /// OpenAI's strict flag (arguments are always schema-valid here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

impl From<&ResponsesTool> for crate::tools::Tool {
    fn from(t: &ResponsesTool) -> Self {
        crate::tools::Tool {
            kind: t.kind.clone(),
            function: crate::tools::FunctionDef {
                name: t.name.clone(),
                description: t.description.clone(),
                parameters: t.parameters.clone(),
                strict: t.strict,
            },
        }
    }
}

/// `text`: the output format.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TextConfig {
    /// Free text (the default), any JSON object, or JSON valid against a schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<TextFormat>,
    /// `low`, `medium` or `high` (accepted, not used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<String>,
}

/// `text.format`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TextFormat {
    /// Free text.
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against a schema.
    JsonSchema {
        /// A name for the schema.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// The schema.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        schema: Option<Value>,
        /// What the format is for.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        description: Option<String>,
        /// OpenAI's strict flag (schemas are always enforced here).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
    },
}

impl From<&TextFormat> for super::openai::ResponseFormat {
    fn from(f: &TextFormat) -> Self {
        use super::openai::{JsonSchemaSpec, ResponseFormat};
        match f {
            TextFormat::Text => ResponseFormat::Text,
            TextFormat::JsonObject => ResponseFormat::JsonObject,
            TextFormat::JsonSchema {
                name,
                schema,
                strict,
                ..
            } => ResponseFormat::JsonSchema {
                json_schema: JsonSchemaSpec {
                    name: name.clone(),
                    schema: schema.clone(),
                    strict: *strict,
                },
            },
        }
    }
}

/// A response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseObject {
    /// `resp_...`.
    pub id: String,
    /// "response".
    pub object: String,
    /// Unix seconds.
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: String,
    /// Why it failed.
    #[serde(default)]
    pub error: Option<ResponseError>,
    /// Why it is incomplete.
    #[serde(default)]
    pub incomplete_details: Option<IncompleteDetails>,
    /// The request's instructions.
    #[serde(default)]
    pub instructions: Option<String>,
    /// The request's `max_output_tokens`.
    #[serde(default)]
    pub max_output_tokens: Option<i64>,
    /// Model id.
    pub model: String,
    /// What the model produced, in order.
    pub output: Vec<OutputItem>,
    /// Whether several calls were allowed.
    pub parallel_tool_calls: bool,
    /// The response this one continues.
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// The request's reasoning options.
    #[serde(default)]
    pub reasoning: Option<Value>,
    /// Whether it is stored.
    pub store: bool,
    /// The temperature used.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// The output format.
    pub text: TextConfig,
    /// The tool choice, in Responses' shape.
    pub tool_choice: Value,
    /// The tools.
    pub tools: Vec<ResponsesTool>,
    /// The top-p used.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// "disabled" or "auto".
    pub truncation: String,
    /// Token counts (null until it ends).
    #[serde(default)]
    pub usage: Option<ResponseUsage>,
    /// The end-user id, when given.
    #[serde(default)]
    pub user: Option<String>,
    /// The request's metadata.
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

impl ResponseObject {
    /// The concatenated text of every `output_text` part (the SDK's
    /// `output_text`).
    pub fn output_text(&self) -> String {
        let mut out = String::new();
        for item in &self.output {
            if let OutputItem::Message(m) = item {
                for c in &m.content {
                    out.push_str(&c.text);
                }
            }
        }
        out
    }
}

/// The Responses `tool_choice` of a choice: a string, or
/// `{"type": "function", "name": ...}`.
pub fn tool_choice_value(c: &ToolChoice) -> Value {
    match c {
        ToolChoice::None => "none".into(),
        ToolChoice::Auto => "auto".into(),
        ToolChoice::Required => "required".into(),
        ToolChoice::Function(name) => serde_json::json!({"type": "function", "name": name}),
    }
}

/// Why a response failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseError {
    /// e.g. "server_error".
    pub code: String,
    /// What happened.
    pub message: String,
}

/// Why a response is incomplete.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IncompleteDetails {
    /// "max_output_tokens".
    pub reason: String,
}

/// Token counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ResponseUsage {
    /// Prompt tokens.
    pub input_tokens: usize,
    /// Cached prompt tokens.
    pub input_tokens_details: InputTokensDetails,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Reasoning among them.
    pub output_tokens_details: OutputTokensDetails,
    /// Both.
    pub total_tokens: usize,
}

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct InputTokensDetails {
    /// Prompt tokens served from the KV cache.
    pub cached_tokens: usize,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct OutputTokensDetails {
    /// Generated tokens that were reasoning.
    pub reasoning_tokens: usize,
}

/// One output item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// An assistant message.
    Message(OutputMessage),
    /// A call.
    FunctionCall(FunctionCallItem),
    /// Reasoning.
    Reasoning(ReasoningItem),
}

impl OutputItem {
    /// The item's id.
    pub fn id(&self) -> &str {
        match self {
            OutputItem::Message(m) => &m.id,
            OutputItem::FunctionCall(c) => c.id.as_deref().unwrap_or_default(),
            OutputItem::Reasoning(r) => &r.id,
        }
    }
}

/// An assistant message in the output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputMessage {
    /// `msg_...`.
    pub id: String,
    /// `in_progress`, `completed` or `incomplete`.
    pub status: String,
    /// "assistant".
    pub role: String,
    /// Its text parts.
    pub content: Vec<OutputText>,
}

/// An `output_text` part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputText {
    /// "output_text".
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    pub text: String,
    /// Citations (always empty).
    #[serde(default)]
    pub annotations: Vec<Value>,
}

impl OutputText {
    /// An `output_text` part.
    pub fn new(text: impl Into<String>) -> Self {
        Self {
            kind: "output_text".into(),
            text: text.into(),
            annotations: Vec::new(),
        }
    }
}

/// `DELETE /v1/responses/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeletedResponse {
    /// The id.
    pub id: String,
    /// "response".
    pub object: String,
    /// true.
    pub deleted: bool,
}

/// A content part as stream events carry it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StreamPart {
    /// `output_text`.
    Text(OutputText),
    /// `reasoning_text`.
    Reasoning(ReasoningText),
}

/// One stream event, with its place in the stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequencedEvent {
    /// 0, 1, 2... over the stream.
    pub sequence_number: u64,
    /// The event.
    #[serde(flatten)]
    pub event: ResponseEvent,
}

/// A stream event; `type` names it (and the SSE `event:` line repeats it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum ResponseEvent {
    /// The response exists (status `in_progress`, no output).
    #[serde(rename = "response.created")]
    Created {
        /// The response so far.
        response: Box<ResponseObject>,
    },
    /// Generation runs.
    #[serde(rename = "response.in_progress")]
    InProgress {
        /// The response so far.
        response: Box<ResponseObject>,
    },
    /// An output item starts.
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        /// Its place in `output`.
        output_index: usize,
        /// The item, empty.
        item: OutputItem,
    },
    /// An output item is complete.
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        /// Its place in `output`.
        output_index: usize,
        /// The item, whole.
        item: OutputItem,
    },
    /// A content part starts.
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        /// The item.
        item_id: String,
        /// Its place in `output`.
        output_index: usize,
        /// The part's place in the item's content.
        content_index: usize,
        /// The part, empty.
        part: StreamPart,
    },
    /// A content part is complete.
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        /// The item.
        item_id: String,
        /// Its place in `output`.
        output_index: usize,
        /// The part's place in the item's content.
        content_index: usize,
        /// The part, whole.
        part: StreamPart,
    },
    /// More text.
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        /// The message item.
        item_id: String,
        /// Its place in `output`.
        output_index: usize,
        /// The part's place.
        content_index: usize,
        /// The text.
        delta: String,
        /// Log-probabilities (none here).
        logprobs: Vec<Value>,
    },
    /// The text is complete.
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        /// The message item.
        item_id: String,
        /// Its place in `output`.
        output_index: usize,
        /// The part's place.
        content_index: usize,
        /// The whole text.
        text: String,
        /// Log-probabilities (none here).
        logprobs: Vec<Value>,
    },
    /// More reasoning.
    #[serde(rename = "response.reasoning_text.delta")]
    ReasoningTextDelta {
        /// The reasoning item.
        item_id: String,
        /// Its place in `output`.
        output_index: usize,
        /// The part's place.
        content_index: usize,
        /// The text.
        delta: String,
    },
    /// The reasoning is complete.
    #[serde(rename = "response.reasoning_text.done")]
    ReasoningTextDone {
        /// The reasoning item.
        item_id: String,
        /// Its place in `output`.
        output_index: usize,
        /// The part's place.
        content_index: usize,
        /// The whole text.
        text: String,
    },
    /// More of a call's arguments.
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        /// The call item.
        item_id: String,
        /// Its place in `output`.
        output_index: usize,
        /// The next piece of JSON text.
        delta: String,
    },
    /// A call's arguments are complete.
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        /// The call item.
        item_id: String,
        /// Its place in `output`.
        output_index: usize,
        /// The whole arguments.
        arguments: String,
    },
    /// The response ended by itself.
    #[serde(rename = "response.completed")]
    Completed {
        /// The whole response.
        response: Box<ResponseObject>,
    },
    /// The response was cut short (`max_output_tokens`).
    #[serde(rename = "response.incomplete")]
    Incomplete {
        /// The whole response.
        response: Box<ResponseObject>,
    },
    /// The response failed.
    #[serde(rename = "response.failed")]
    Failed {
        /// The response, with its error.
        response: Box<ResponseObject>,
    },
    /// An error.
    #[serde(rename = "error")]
    Error {
        /// Machine-readable code.
        code: Option<String>,
        /// What happened.
        message: String,
        /// The offending field.
        param: Option<String>,
    },
}

impl ResponseEvent {
    /// The event's `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            ResponseEvent::Created { .. } => "response.created",
            ResponseEvent::InProgress { .. } => "response.in_progress",
            ResponseEvent::OutputItemAdded { .. } => "response.output_item.added",
            ResponseEvent::OutputItemDone { .. } => "response.output_item.done",
            ResponseEvent::ContentPartAdded { .. } => "response.content_part.added",
            ResponseEvent::ContentPartDone { .. } => "response.content_part.done",
            ResponseEvent::OutputTextDelta { .. } => "response.output_text.delta",
            ResponseEvent::OutputTextDone { .. } => "response.output_text.done",
            ResponseEvent::ReasoningTextDelta { .. } => "response.reasoning_text.delta",
            ResponseEvent::ReasoningTextDone { .. } => "response.reasoning_text.done",
            ResponseEvent::FunctionCallArgumentsDelta { .. } => {
                "response.function_call_arguments.delta"
            }
            ResponseEvent::FunctionCallArgumentsDone { .. } => {
                "response.function_call_arguments.done"
            }
            ResponseEvent::Completed { .. } => "response.completed",
            ResponseEvent::Incomplete { .. } => "response.incomplete",
            ResponseEvent::Failed { .. } => "response.failed",
            ResponseEvent::Error { .. } => "error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn input_reads_text_easy_messages_and_typed_items() {
        let r: ResponsesRequest = serde_json::from_value(json!({
            "model": "m", "input": "hi", "store": false, "truncation": "auto",
            "temperature": 0.5, "include": ["reasoning.encrypted_content"]
        }))
        .expect("parses");
        assert_eq!(r.input, Some(ResponseInput::Text("hi".into())));
        assert_eq!(r.sampling.temperature, Some(0.5));
        let r: ResponsesRequest = serde_json::from_value(json!({"input": [
            {"role": "developer", "content": "be terse"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "c", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]}
        ], "tool_choice": {"type": "function", "name": "f"},
           "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}],
           "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": true}}}))
        .expect("parses");
        let Some(ResponseInput::Items(items)) = &r.input else {
            panic!("items")
        };
        assert_eq!(items.len(), 6);
        match &items[1] {
            InputItem::Message(m) => assert_eq!(m.content.text(), "a\nb"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(&items[3], InputItem::FunctionCall(c) if c.call_id == "call_1"));
        assert!(matches!(&items[5], InputItem::Reasoning(r) if r.text() == "hmm"));
        assert_eq!(r.tool_choice, Some(ToolChoice::Function("f".into())));
        assert!(matches!(
            r.text.and_then(|t| t.format),
            Some(TextFormat::JsonSchema {
                name: Some(_),
                schema: Some(_),
                ..
            })
        ));
        let e = serde_json::from_value::<ResponsesRequest>(
            json!({"input": [{"type": "web_search_call"}]}),
        )
        .expect_err("refused");
        assert!(e.to_string().contains("input[0]"), "{e}");
    }

    #[test]
    fn events_carry_type_and_sequence_number() {
        let e = SequencedEvent {
            sequence_number: 3,
            event: ResponseEvent::OutputTextDelta {
                item_id: "msg_1".into(),
                output_index: 0,
                content_index: 0,
                delta: "x".into(),
                logprobs: Vec::new(),
            },
        };
        let v = serde_json::to_value(&e).expect("serializes");
        assert_eq!(v["type"], e.event.kind());
        assert_eq!(v["sequence_number"], 3);
        assert_eq!(v["delta"], "x");
        let back: SequencedEvent = serde_json::from_value(v).expect("parses");
        assert_eq!(back, e);
        assert_eq!(
            tool_choice_value(&ToolChoice::Function("f".into())),
            json!({"type": "function", "name": "f"})
        );
    }
}
