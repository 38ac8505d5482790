//! OpenAI's Responses API: `POST /v1/responses` (streamed as typed events or
//! not), `GET` and `DELETE /v1/responses/{id}`.
//!
//! A request becomes a chat turn the way `/v1/chat/completions` runs one:
//! `instructions` a system message first, then the stored conversation of
//! `previous_response_id`, then the input items (calls merged into assistant
//! messages, call outputs tool messages); `tools` and `tool_choice` a
//! [`ToolSpec`]; `text.format` the same constraint as `response_format`. The
//! answer's events ([`TurnEvent`]) become output items: reasoning, messages,
//! function calls, in the order the model wrote them.
//!
//! On a remote provider target the same conversation and tools go to the
//! provider through the target's client (`TurnSource::Remote`); its run's
//! events map one to one onto [`TurnEvent`]s, so the output is built the
//! same way. Only the sampling every provider understands passes (max
//! tokens, `temperature`, `top_p`, `stop`, `user`); local-only fields
//! (`grammar`, `json_schema`, a JSON `text.format`, the other samplers,
//! `chat_template_kwargs`) are refused with a 400 naming them.
//!
//! Stored responses live in memory in a [`ResponseStore`] bounded by count
//! (`[server] responses_store`), oldest evicted first; each keeps the
//! conversation through it (its parent's, shared, plus its own input and
//! output), so a follow-up continues it even after the parent is evicted.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream};
use sipp::chat::{ChatMessage, Role};
use sipp::client::{ChatRequest, Response as ClientResponse, Run as ClientRun, RunEvent};
use sipp::engine::{Completion, RequestEvent, RequestHandle, Usage};
use sipp::protocol::openai::{ResponseFormat, SamplingFields, StopField};
use sipp::protocol::request_from_openai;
use sipp::protocol::responses::*;
use sipp::protocol::FieldNames;
use sipp::text::FinishReason;
use sipp::tools::turn::{ChatTurn, ReasoningFormat, TurnOutput};
use sipp::tools::{OutputParser, Tool, ToolCall, ToolChoice, ToolError, ToolSpec, TurnEvent};
use sipp::Engine;

use super::openai::named;
use super::{new_id, now_secs, ApiJson};
use crate::error::ApiError;
use crate::state::{AppState, RemoteTarget, Target};

/// How many responses the store keeps by default.
pub const DEFAULT_STORED_RESPONSES: usize = 1000;

/// A conversation as a chain: a response's own input and output messages
/// after its parent's.
#[derive(Debug)]
struct Conversation {
    parent: Option<Arc<Conversation>>,
    messages: Vec<ChatMessage>,
}

impl Conversation {
    /// Every message, oldest first.
    fn messages(self: &Arc<Self>) -> Vec<ChatMessage> {
        let mut chain = Vec::new();
        let mut at = Some(self);
        while let Some(c) = at {
            chain.push(c);
            at = c.parent.as_ref();
        }
        chain
            .iter()
            .rev()
            .flat_map(|c| c.messages.iter().cloned())
            .collect()
    }
}

/// A stored response and the conversation through it.
#[derive(Debug)]
struct Stored {
    response: ResponseObject,
    conversation: Arc<Conversation>,
}

/// Stored responses, at most `capacity`, oldest evicted first.
pub struct ResponseStore {
    capacity: usize,
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    by_id: HashMap<String, Arc<Stored>>,
    order: VecDeque<String>,
}

impl std::fmt::Debug for ResponseStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseStore")
            .field("capacity", &self.capacity)
            .field("len", &self.len())
            .finish()
    }
}

impl ResponseStore {
    /// A store keeping at most `capacity` responses (0: none).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            inner: Mutex::new(StoreInner::default()),
        }
    }

    /// How many responses it holds.
    pub fn len(&self) -> usize {
        self.inner.lock().map_or(0, |s| s.by_id.len())
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.inner.lock().ok()?.by_id.get(id).cloned()
    }

    fn insert(&self, stored: Stored) {
        if self.capacity == 0 {
            return;
        }
        let Ok(mut s) = self.inner.lock() else {
            return;
        };
        while s.by_id.len() >= self.capacity {
            match s.order.pop_front() {
                Some(old) => {
                    s.by_id.remove(&old);
                }
                None => break,
            }
        }
        let id = stored.response.id.clone();
        s.order.push_back(id.clone());
        s.by_id.insert(id, Arc::new(stored));
    }

    fn remove(&self, id: &str) -> bool {
        let Ok(mut s) = self.inner.lock() else {
            return false;
        };
        if s.by_id.remove(id).is_none() {
            return false;
        }
        s.order.retain(|x| x != id);
        true
    }
}

/// `resp_...`, `msg_...`: a fresh id in OpenAI's style.
fn item_id(prefix: &str) -> String {
    new_id(prefix).replacen('-', "_", 1)
}

fn not_found(message: String, param: Option<&str>) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message,
        kind: "invalid_request_error",
        code: Some(if param.is_some() {
            "previous_response_not_found"
        } else {
            "not_found"
        }),
        param: param.map(str::to_string),
        retry_after_secs: None,
    }
}

/// A tool error named as Responses' flat tools are (`tools[0].name`, not
/// `tools[0].function.name`).
fn tool_error(e: ToolError) -> ApiError {
    ApiError::bad_field(&e.field.replace(".function.", "."), e.message)
}

/// The tools of a request: `auto` when tools are given, calls off without
/// them; parallel calls unless turned off.
fn tool_spec(req: &ResponsesRequest) -> Result<ToolSpec, ApiError> {
    let tools: Vec<Tool> = req.tools.iter().flatten().map(Tool::from).collect();
    let choice = match (&req.tool_choice, tools.is_empty()) {
        (Some(c), _) => c.clone(),
        (None, false) => ToolChoice::Auto,
        (None, true) => ToolChoice::None,
    };
    let spec = ToolSpec {
        tools,
        choice,
        parallel: req.parallel_tool_calls.unwrap_or(true),
    };
    spec.validate().map_err(tool_error)?;
    let json_format = req
        .text
        .as_ref()
        .and_then(|t| t.format.as_ref())
        .is_some_and(|f| !matches!(f, TextFormat::Text));
    let constrained =
        json_format || req.sampling.grammar.is_some() || req.sampling.json_schema.is_some();
    if spec.may_call() && constrained {
        return Err(ApiError::bad_field(
            "tools",
            "cannot be combined with a JSON `text.format`, `grammar` or `json_schema` unless `tool_choice` is \"none\"",
        ));
    }
    Ok(spec)
}

/// The chat messages of a request's input, after `history` (whose calls the
/// input's call outputs may answer).
fn input_messages(
    input: Option<&ResponseInput>,
    history: &[ChatMessage],
) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match input {
        None => return Err(ApiError::bad_field("input", "is required")),
        Some(ResponseInput::Text(s)) => return Ok(vec![ChatMessage::user(s.clone())]),
        Some(ResponseInput::Items(v)) if v.is_empty() => {
            return Err(ApiError::bad_field("input", "must not be an empty list"))
        }
        Some(ResponseInput::Items(v)) => v,
    };
    // Call id -> function name, of every call made so far.
    let mut calls: HashMap<String, String> = history
        .iter()
        .flat_map(|m| m.tool_calls.iter().flatten())
        .map(|c| (c.id.clone(), c.function.name.clone()))
        .collect();
    let mut out: Vec<ChatMessage> = Vec::new();
    // Reasoning items go to the next assistant message.
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        match item {
            InputItem::Message(m) => {
                let role = match m.role.as_str() {
                    "user" => Role::User,
                    "assistant" => Role::Assistant,
                    "system" | "developer" => Role::System,
                    other => {
                        return Err(ApiError::bad_field(
                            &format!("input[{i}].role"),
                            format!(
                                "must be \"user\", \"assistant\", \"system\" or \"developer\", got {other:?}"
                            ),
                        ))
                    }
                };
                let mut msg = ChatMessage::new(role, m.content.to_message_content());
                if role == Role::Assistant {
                    msg.reasoning_content = reasoning.take();
                }
                out.push(msg);
            }
            InputItem::FunctionCall(c) => {
                if c.call_id.is_empty() {
                    return Err(ApiError::bad_field(
                        &format!("input[{i}].call_id"),
                        "must not be empty",
                    ));
                }
                let args: Result<serde_json::Value, _> = serde_json::from_str(&c.arguments);
                match args {
                    Ok(v) if v.is_object() => {}
                    Ok(_) => {
                        return Err(ApiError::bad_field(
                            &format!("input[{i}].arguments"),
                            "must be a JSON object",
                        ))
                    }
                    Err(e) => {
                        return Err(ApiError::bad_field(
                            &format!("input[{i}].arguments"),
                            format!("is not JSON: {e}"),
                        ))
                    }
                }
                calls.insert(c.call_id.clone(), c.name.clone());
                let call = ToolCall::new(c.call_id.clone(), c.name.clone(), c.arguments.clone());
                match out.last_mut() {
                    Some(m) if m.role == Role::Assistant => {
                        m.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => {
                        let mut m = ChatMessage::tool_calls(None, vec![call]);
                        m.reasoning_content = reasoning.take();
                        out.push(m);
                    }
                }
            }
            InputItem::FunctionCallOutput(o) => {
                let Some(name) = calls.get(&o.call_id) else {
                    return Err(ApiError::bad_field(
                        &format!("input[{i}].call_id"),
                        format!(
                            "no function_call with call_id {:?} comes before it (in `input` or the previous response)",
                            o.call_id
                        ),
                    ));
                };
                let mut m = ChatMessage::tool_result(o.call_id.clone(), o.output.text());
                m.name = Some(name.clone());
                out.push(m);
            }
            InputItem::Reasoning(r) => {
                let text = r.text();
                if !text.is_empty() {
                    reasoning.get_or_insert_with(String::new).push_str(&text);
                }
            }
        }
    }
    Ok(out)
}

/// The assistant message of an answer, for the stored conversation. Calls
/// cut off before their arguments were whole are left out (a follow-up
/// could not render them).
fn assistant_message(o: &sipp::tools::TurnOutput) -> ChatMessage {
    let calls: Vec<ToolCall> = o
        .calls
        .iter()
        .filter(|c| {
            serde_json::from_str::<serde_json::Value>(&c.function.arguments)
                .is_ok_and(|v| v.is_object())
        })
        .cloned()
        .collect();
    let mut m = if calls.is_empty() {
        ChatMessage::assistant(o.content.clone())
    } else {
        ChatMessage::tool_calls((!o.content.is_empty()).then(|| o.content.clone()), calls)
    };
    m.reasoning_content = o.reasoning.clone();
    m
}

/// The item open for more text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Message(usize),
    Reasoning(usize),
}

/// Builds the output items from an answer's events, and the stream events
/// that tell it.
#[derive(Debug, Default)]
struct OutputBuilder {
    output: Vec<OutputItem>,
    open: Option<Open>,
    /// Call index -> output index, of calls still open.
    calls: HashMap<usize, usize>,
    events: Vec<ResponseEvent>,
}

impl OutputBuilder {
    fn push(&mut self, e: TurnEvent) {
        match e {
            TurnEvent::Content(s) => self.text(s),
            TurnEvent::Reasoning(s) => self.reasoning(s),
            TurnEvent::CallStart { index, id, name } => {
                self.close_open("completed");
                let output_index = self.output.len();
                let item = OutputItem::FunctionCall(FunctionCallItem {
                    id: Some(item_id("fc")),
                    call_id: id,
                    name,
                    arguments: String::new(),
                    status: Some("in_progress".into()),
                });
                self.output.push(item.clone());
                self.calls.insert(index, output_index);
                self.events
                    .push(ResponseEvent::OutputItemAdded { output_index, item });
            }
            TurnEvent::CallArguments { index, fragment } => {
                let Some(&output_index) = self.calls.get(&index) else {
                    return;
                };
                if let Some(OutputItem::FunctionCall(c)) = self.output.get_mut(output_index) {
                    c.arguments.push_str(&fragment);
                    let item_id = c.id.clone().unwrap_or_default();
                    self.events.push(ResponseEvent::FunctionCallArgumentsDelta {
                        item_id,
                        output_index,
                        delta: fragment,
                    });
                }
            }
            TurnEvent::CallEnd { index } => {
                if let Some(output_index) = self.calls.remove(&index) {
                    // A call that max_tokens cut ends with partial arguments.
                    let whole = matches!(self.output.get(output_index),
                        Some(OutputItem::FunctionCall(c)) if serde_json::from_str::<serde_json::Value>(&c.arguments).is_ok_and(|v| v.is_object()));
                    self.close_call(output_index, if whole { "completed" } else { "incomplete" });
                }
            }
        }
    }

    fn text(&mut self, s: String) {
        let output_index = match self.open {
            Some(Open::Message(i)) => i,
            _ => {
                self.close_open("completed");
                let i = self.output.len();
                let id = item_id("msg");
                let item = OutputItem::Message(OutputMessage {
                    id: id.clone(),
                    status: "in_progress".into(),
                    role: "assistant".into(),
                    content: Vec::new(),
                });
                self.output.push(item.clone());
                self.events.push(ResponseEvent::OutputItemAdded {
                    output_index: i,
                    item,
                });
                if let Some(OutputItem::Message(m)) = self.output.get_mut(i) {
                    m.content.push(OutputText::new(""));
                }
                self.events.push(ResponseEvent::ContentPartAdded {
                    item_id: id,
                    output_index: i,
                    content_index: 0,
                    part: StreamPart::Text(OutputText::new("")),
                });
                self.open = Some(Open::Message(i));
                i
            }
        };
        if s.is_empty() {
            return;
        }
        if let Some(OutputItem::Message(m)) = self.output.get_mut(output_index) {
            if let Some(part) = m.content.first_mut() {
                part.text.push_str(&s);
            }
            self.events.push(ResponseEvent::OutputTextDelta {
                item_id: m.id.clone(),
                output_index,
                content_index: 0,
                delta: s,
                logprobs: Vec::new(),
            });
        }
    }

    fn reasoning(&mut self, s: String) {
        let output_index = match self.open {
            Some(Open::Reasoning(i)) => i,
            _ => {
                self.close_open("completed");
                let i = self.output.len();
                let id = item_id("rs");
                let item = OutputItem::Reasoning(ReasoningItem {
                    id: id.clone(),
                    summary: Vec::new(),
                    content: Some(Vec::new()),
                    encrypted_content: None,
                    status: Some("in_progress".into()),
                });
                self.output.push(item.clone());
                self.events.push(ResponseEvent::OutputItemAdded {
                    output_index: i,
                    item,
                });
                if let Some(OutputItem::Reasoning(r)) = self.output.get_mut(i) {
                    r.content = Some(vec![ReasoningText::new("")]);
                }
                self.events.push(ResponseEvent::ContentPartAdded {
                    item_id: id,
                    output_index: i,
                    content_index: 0,
                    part: StreamPart::Reasoning(ReasoningText::new("")),
                });
                self.open = Some(Open::Reasoning(i));
                i
            }
        };
        if let Some(OutputItem::Reasoning(r)) = self.output.get_mut(output_index) {
            if let Some(part) = r.content.iter_mut().flatten().next() {
                part.text.push_str(&s);
            }
            self.events.push(ResponseEvent::ReasoningTextDelta {
                item_id: r.id.clone(),
                output_index,
                content_index: 0,
                delta: s,
            });
        }
    }

    /// Closes the open message or reasoning item.
    fn close_open(&mut self, status: &str) {
        let Some(open) = self.open.take() else {
            return;
        };
        match open {
            Open::Message(i) => {
                let Some(OutputItem::Message(m)) = self.output.get_mut(i) else {
                    return;
                };
                m.status = status.into();
                let text = m
                    .content
                    .first()
                    .map(|p| p.text.clone())
                    .unwrap_or_default();
                let id = m.id.clone();
                self.events.push(ResponseEvent::OutputTextDone {
                    item_id: id.clone(),
                    output_index: i,
                    content_index: 0,
                    text: text.clone(),
                    logprobs: Vec::new(),
                });
                self.events.push(ResponseEvent::ContentPartDone {
                    item_id: id,
                    output_index: i,
                    content_index: 0,
                    part: StreamPart::Text(OutputText::new(text)),
                });
            }
            Open::Reasoning(i) => {
                let Some(OutputItem::Reasoning(r)) = self.output.get_mut(i) else {
                    return;
                };
                r.status = Some(status.into());
                let text = r.text();
                let id = r.id.clone();
                self.events.push(ResponseEvent::ReasoningTextDone {
                    item_id: id.clone(),
                    output_index: i,
                    content_index: 0,
                    text: text.clone(),
                });
                self.events.push(ResponseEvent::ContentPartDone {
                    item_id: id,
                    output_index: i,
                    content_index: 0,
                    part: StreamPart::Reasoning(ReasoningText::new(text)),
                });
            }
        }
        let i = match open {
            Open::Message(i) | Open::Reasoning(i) => i,
        };
        self.events.push(ResponseEvent::OutputItemDone {
            output_index: i,
            item: self.output[i].clone(),
        });
    }

    fn close_call(&mut self, output_index: usize, status: &str) {
        let Some(OutputItem::FunctionCall(c)) = self.output.get_mut(output_index) else {
            return;
        };
        c.status = Some(status.into());
        let (item_id, arguments) = (c.id.clone().unwrap_or_default(), c.arguments.clone());
        self.events.push(ResponseEvent::FunctionCallArgumentsDone {
            item_id,
            output_index,
            arguments,
        });
        self.events.push(ResponseEvent::OutputItemDone {
            output_index,
            item: self.output[output_index].clone(),
        });
    }

    /// Closes everything still open; an answer with neither text nor calls
    /// gets an empty message (so there is always something to read).
    fn finish(&mut self, status: &str) {
        self.close_open(status);
        let mut open: Vec<usize> = self.calls.drain().map(|(_, i)| i).collect();
        open.sort_unstable();
        for i in open {
            self.close_call(i, status);
        }
        let answered = self
            .output
            .iter()
            .any(|o| matches!(o, OutputItem::Message(_) | OutputItem::FunctionCall(_)));
        if !answered {
            self.text(String::new());
            self.close_open(status);
        }
    }
}

/// How an answer ended: why, its usage, and (local engines) the completion
/// itself.
pub(super) struct Finished {
    pub reason: FinishReason,
    pub usage: Usage,
    pub completion: Option<Completion>,
}

/// What an answer's source yields next.
pub(super) enum Step {
    /// Answer events.
    Events(Vec<TurnEvent>),
    /// The last events, and how the answer ended.
    Done(Vec<TurnEvent>, Finished),
    /// It failed.
    Failed(ApiError),
    /// It ended without a result.
    Closed,
}

/// Where an answer's events come from: a local engine's request (its text
/// parsed as it streams) or a provider's run (its events mapped one to one).
pub(super) enum TurnSource {
    Local {
        handle: RequestHandle,
        parser: Box<OutputParser>,
    },
    Remote {
        run: ClientRun,
        /// Calls started, to end when the run is done.
        started: Vec<usize>,
        /// Whether any event came (a run that streamed nothing is told by its
        /// final response).
        seen: bool,
    },
}

/// The finish reason of a provider's answer.
pub(super) fn remote_reason(r: &str) -> FinishReason {
    match r {
        "length" | "max_tokens" => FinishReason::Length,
        "cancelled" => FinishReason::Cancelled,
        "stop_sequence" => FinishReason::Stop,
        _ => FinishReason::Eos,
    }
}

/// The events of a provider's whole answer: reasoning, text, then each call.
pub(super) fn response_events(r: &ClientResponse) -> Vec<TurnEvent> {
    let mut out = Vec::new();
    if let Some(t) = r.reasoning.as_ref().filter(|t| !t.is_empty()) {
        out.push(TurnEvent::Reasoning(t.clone()));
    }
    if !r.text.is_empty() {
        out.push(TurnEvent::Content(r.text.clone()));
    }
    for (index, c) in r.tool_calls.iter().enumerate() {
        out.push(TurnEvent::CallStart {
            index,
            id: c.id.clone(),
            name: c.function.name.clone(),
        });
        out.push(TurnEvent::CallArguments {
            index,
            fragment: c.function.arguments.clone(),
        });
        out.push(TurnEvent::CallEnd { index });
    }
    out
}

impl TurnSource {
    pub(super) fn local(handle: RequestHandle, parser: OutputParser) -> Self {
        Self::Local {
            handle,
            parser: Box::new(parser),
        }
    }

    pub(super) fn remote(run: ClientRun) -> Self {
        Self::Remote {
            run,
            started: Vec::new(),
            seen: false,
        }
    }

    /// The next step of a streamed answer.
    pub(super) async fn next(&mut self) -> Step {
        match self {
            Self::Local { handle, parser } => loop {
                return match handle.next_event().await {
                    Some(RequestEvent::Delta(t)) => Step::Events(parser.push(&t.text)),
                    Some(RequestEvent::Finished(c)) => Step::Done(
                        parser.finish(),
                        Finished {
                            reason: c.finish_reason,
                            usage: c.usage,
                            completion: Some(c),
                        },
                    ),
                    Some(RequestEvent::Failed(e)) => Step::Failed(e.into()),
                    Some(RequestEvent::Started) => continue,
                    Some(RequestEvent::Embedding(_)) => {
                        Step::Failed(ApiError::bad_request("unexpected embedding"))
                    }
                    None => Step::Closed,
                };
            },
            Self::Remote { run, started, seen } => loop {
                let ev = match run.next().await {
                    Some(RunEvent::Delta(t)) => TurnEvent::Content(t),
                    Some(RunEvent::Reasoning(t)) => TurnEvent::Reasoning(t),
                    Some(RunEvent::ToolCallStart { index, id, name }) => {
                        started.push(index);
                        TurnEvent::CallStart { index, id, name }
                    }
                    Some(RunEvent::ToolCallArguments { index, fragment }) => {
                        TurnEvent::CallArguments { index, fragment }
                    }
                    Some(RunEvent::Done(r)) => {
                        let events = if *seen {
                            started
                                .drain(..)
                                .map(|index| TurnEvent::CallEnd { index })
                                .collect()
                        } else {
                            response_events(&r)
                        };
                        return Step::Done(
                            events,
                            Finished {
                                reason: remote_reason(&r.finish_reason),
                                usage: r.usage,
                                completion: None,
                            },
                        );
                    }
                    Some(RunEvent::Error(e)) => return Step::Failed(e.into()),
                    None => return Step::Closed,
                };
                if matches!(&ev, TurnEvent::Content(s) | TurnEvent::Reasoning(s) if s.is_empty()) {
                    continue;
                }
                *seen = true;
                return Step::Events(vec![ev]);
            },
        }
    }

    /// A whole (not streamed) answer.
    pub(super) async fn complete(self) -> Result<(Vec<TurnEvent>, Finished), ApiError> {
        match self {
            Self::Local { handle, mut parser } => {
                let c = handle.completion().await.map_err(ApiError::from)?;
                let mut events = parser.push(&c.text);
                events.extend(parser.finish());
                Ok((
                    events,
                    Finished {
                        reason: c.finish_reason,
                        usage: c.usage,
                        completion: Some(c),
                    },
                ))
            }
            Self::Remote { run, .. } => {
                let r = run.response().await?;
                Ok((
                    response_events(&r),
                    Finished {
                        reason: remote_reason(&r.finish_reason),
                        usage: r.usage,
                        completion: None,
                    },
                ))
            }
        }
    }
}

/// A field a provider target cannot honour.
pub(super) fn remote_only_error(field: &str) -> ApiError {
    ApiError::bad_field(
        field,
        "is not supported when the model is a remote provider",
    )
}

/// The first sampling field set that only a local engine understands.
fn local_only_sampling(s: &SamplingFields) -> Option<&'static str> {
    [
        ("top_k", s.top_k.is_some()),
        ("min_p", s.min_p.is_some()),
        ("typical_p", s.typical_p.is_some()),
        ("presence_penalty", s.presence_penalty.is_some()),
        ("frequency_penalty", s.frequency_penalty.is_some()),
        ("repeat_penalty", s.repeat_penalty.is_some()),
        ("repeat_last_n", s.repeat_last_n.is_some()),
        ("mirostat", s.mirostat.is_some()),
        ("mirostat_tau", s.mirostat_tau.is_some()),
        ("mirostat_eta", s.mirostat_eta.is_some()),
        ("seed", s.seed.is_some()),
        ("logit_bias", s.logit_bias.is_some()),
        ("samplers", s.samplers.is_some()),
        ("ignore_eos", s.ignore_eos.is_some()),
        ("grammar", s.grammar.is_some()),
        ("json_schema", s.json_schema.is_some()),
    ]
    .into_iter()
    .find(|(_, on)| *on)
    .map(|(name, _)| name)
}

/// What one request needs after generation: the response's fixed fields,
/// the answer so far, and what to store.
struct Run {
    skeleton: ResponseObject,
    builder: OutputBuilder,
    /// The answer's events so far, gathered.
    output: TurnOutput,
    /// The local engine (to count reasoning tokens); none for a provider.
    engine: Option<Engine>,
    state: AppState,
    /// The conversation through the previous response.
    parent: Option<Arc<Conversation>>,
    /// This request's input as chat messages.
    input: Vec<ChatMessage>,
}

impl Run {
    fn push(&mut self, events: Vec<TurnEvent>) {
        for e in events {
            self.output.apply(&e);
            self.builder.push(e);
        }
    }

    /// The whole response of a finished answer (its last events pushed);
    /// stores it when asked.
    fn finish(&mut self, f: &Finished) -> ResponseObject {
        if let Some(c) = &f.completion {
            self.state.finished(&self.skeleton.model, c);
        }
        let (status, details) = match f.reason {
            FinishReason::Length => (
                "incomplete",
                Some(IncompleteDetails {
                    reason: "max_output_tokens".into(),
                }),
            ),
            FinishReason::Cancelled => ("cancelled", None),
            FinishReason::Stop | FinishReason::Eos => ("completed", None),
        };
        self.builder.finish(if status == "completed" {
            "completed"
        } else {
            "incomplete"
        });
        let usage = &f.usage;
        let reasoning_tokens = match (&self.engine, self.output.reasoning.as_deref()) {
            (Some(engine), Some(r)) => engine
                .vocab()
                .tokenize(r, false, false)
                .map_or(0, |t| t.len())
                .min(usage.completion_tokens),
            _ => 0,
        };
        let mut r = self.skeleton.clone();
        r.status = status.into();
        r.incomplete_details = details;
        r.output = self.builder.output.clone();
        r.usage = Some(ResponseUsage {
            input_tokens: usage.prompt_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens: usage.cached_tokens,
            },
            output_tokens: usage.completion_tokens,
            output_tokens_details: OutputTokensDetails { reasoning_tokens },
            total_tokens: usage.total_tokens(),
        });
        if r.store {
            let mut messages = std::mem::take(&mut self.input);
            messages.push(assistant_message(&self.output));
            self.state.responses.insert(Stored {
                response: r.clone(),
                conversation: Arc::new(Conversation {
                    parent: self.parent.take(),
                    messages,
                }),
            });
        }
        r
    }

    /// The response of a failed generation.
    fn failed(&mut self, e: &ApiError) -> ResponseObject {
        self.builder.finish("incomplete");
        let mut r = self.skeleton.clone();
        r.status = "failed".into();
        r.output = self.builder.output.clone();
        r.error = Some(ResponseError {
            code: match e.status.as_u16() {
                429 => "rate_limit_exceeded",
                400..=499 => "invalid_prompt",
                _ => "server_error",
            }
            .into(),
            message: e.message.clone(),
        });
        r
    }
}

/// The parameter of an error from rendering or submitting the conversation,
/// named as this request names it.
fn input_error(e: ApiError) -> ApiError {
    let mut e = e.renamed_param("prompt", "input");
    if e.param
        .as_deref()
        .is_some_and(|p| p.starts_with("messages"))
    {
        e.param = Some("input".into());
    }
    e
}

/// POST /v1/responses.
pub async fn create(
    State(state): State<AppState>,
    ApiJson(mut req): ApiJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let (model, target) = state.target(req.model.as_deref())?;
    if let Target::Local(engine) = &target {
        if let Some(e) = ApiError::cannot_generate(engine) {
            return Err(e);
        }
        let urls = crate::images::responses_urls(&mut req.input);
        crate::images::fetch_remote(&state, urls, "input").await?;
    }
    let previous = match &req.previous_response_id {
        Some(id) => Some(state.responses.get(id).ok_or_else(|| {
            not_found(
                format!("Previous response with id '{id}' not found."),
                Some("previous_response_id"),
            )
        })?),
        None => None,
    };
    let history = previous
        .as_ref()
        .map(|p| p.conversation.messages())
        .unwrap_or_default();
    let input = input_messages(req.input.as_ref(), &history)?;
    let spec = tool_spec(&req)?;
    let mut messages = Vec::with_capacity(history.len() + input.len() + 1);
    if let Some(i) = &req.instructions {
        messages.push(ChatMessage::system(i.clone()));
    }
    messages.extend(history);
    messages.extend(input.iter().cloned());
    let stream = req.stream.unwrap_or(false);
    let (source, engine, temperature, top_p) = match target {
        Target::Local(engine) => {
            let (source, sampling) = local_source(&engine, &req, &messages, &spec)?;
            (
                source,
                Some(engine),
                Some(sampling.temperature),
                Some(sampling.top_p),
            )
        }
        Target::Remote(r) => {
            let source = remote_source(&r, &req, messages, &spec, stream).await?;
            (source, None, req.sampling.temperature, req.sampling.top_p)
        }
    };
    let skeleton = ResponseObject {
        id: item_id("resp"),
        object: "response".into(),
        created_at: now_secs(),
        status: "in_progress".into(),
        error: None,
        incomplete_details: None,
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        model,
        output: Vec::new(),
        parallel_tool_calls: spec.parallel,
        previous_response_id: req.previous_response_id.clone(),
        reasoning: req.reasoning.clone(),
        store: req.store.unwrap_or(true),
        temperature,
        text: req.text.clone().unwrap_or(TextConfig {
            format: Some(TextFormat::Text),
            verbosity: None,
        }),
        tool_choice: tool_choice_value(req.tool_choice.as_ref().unwrap_or(&ToolChoice::Auto)),
        tools: req.tools.clone().unwrap_or_default(),
        top_p,
        truncation: req.truncation.clone().unwrap_or_else(|| "disabled".into()),
        usage: None,
        user: req.sampling.user.clone(),
        metadata: req.metadata.clone().unwrap_or_default(),
    };
    let mut run = Run {
        skeleton,
        builder: OutputBuilder::default(),
        output: TurnOutput::default(),
        engine,
        state: state.clone(),
        parent: previous.map(|p| p.conversation.clone()),
        input,
    };
    if stream {
        return Ok(stream_response(source, run).into_response());
    }
    let (events, finished) = source.complete().await.map_err(input_error)?;
    run.push(events);
    Ok(Json(run.finish(&finished)).into_response())
}

/// A request on a local engine: the conversation rendered with the model's
/// template, submitted; its sampling (for the response's fields).
fn local_source(
    engine: &Engine,
    req: &ResponsesRequest,
    messages: &[ChatMessage],
    spec: &ToolSpec,
) -> Result<(TurnSource, sipp::sampling::SamplingParams), ApiError> {
    let turn = crate::images::prepare(crate::images::heavy(engine, messages), || {
        engine.prepare_turn(&ChatTurn {
            messages,
            tools: spec,
            reasoning: ReasoningFormat::Split,
            kwargs: req.chat_template_kwargs.as_ref(),
            continue_final: false,
        })
    })
    .map_err(|e| input_error(e.into()))?;
    let format = req
        .text
        .as_ref()
        .and_then(|t| t.format.as_ref())
        .map(ResponseFormat::from);
    let mut names = FieldNames::new()
        .rename("penalty_last_n", "repeat_last_n")
        .rename("max_tokens", "max_output_tokens")
        .rename("response_format", "text.format");
    if matches!(format, Some(ResponseFormat::JsonSchema { .. }))
        && req.sampling.json_schema.is_none()
    {
        names = names.rename("json_schema", "text.format.schema");
    }
    let mut base = request_from_openai(
        &req.sampling,
        req.max_output_tokens,
        None,
        format.as_ref(),
        &engine.info().sampling,
        turn.prompt.clone(),
    )
    .map_err(|e| named(e, &names))?;
    if turn.constraint.is_some() {
        base.constraint = turn.constraint.clone();
    }
    let sampling = base.sampling.clone().unwrap_or_default();
    let handle = engine
        .generate(base)
        .map_err(|e| input_error(named(e, &names)))?;
    Ok((TurnSource::local(handle, turn.parser), sampling))
}

/// A request on a provider target: the conversation and the tools go to it
/// as chat messages and function tools, with the sampling every provider
/// understands; local-only fields are refused by name.
async fn remote_source(
    r: &RemoteTarget,
    req: &ResponsesRequest,
    messages: Vec<ChatMessage>,
    spec: &ToolSpec,
    stream: bool,
) -> Result<TurnSource, ApiError> {
    if let Some(field) = local_only_sampling(&req.sampling) {
        return Err(remote_only_error(field));
    }
    if req
        .text
        .as_ref()
        .and_then(|t| t.format.as_ref())
        .is_some_and(|f| !matches!(f, TextFormat::Text))
    {
        return Err(remote_only_error("text.format"));
    }
    if req.chat_template_kwargs.is_some() {
        return Err(remote_only_error("chat_template_kwargs"));
    }
    let stop = req
        .sampling
        .stop
        .clone()
        .map(StopField::into_vec)
        .unwrap_or_default();
    let options = super::remote::options(
        req.max_output_tokens,
        req.sampling.temperature,
        req.sampling.top_p,
        stop,
        req.sampling.user.clone(),
        stream,
    )
    .map_err(|e| e.renamed_param("max_tokens", "max_output_tokens"))?;
    let calls = !spec.tools.is_empty();
    let run = r
        .client
        .chat(
            &r.endpoint,
            ChatRequest {
                messages,
                options,
                tools: spec.tools.clone(),
                tool_choice: calls.then(|| spec.choice.clone()),
                parallel_tool_calls: req.parallel_tool_calls.filter(|_| calls),
            },
        )
        .await?;
    Ok(TurnSource::remote(run))
}

/// The server-sent events of one response: created and in progress at once,
/// then the items as the model writes them, then completed (or incomplete,
/// or an error and failed). No `[DONE]`. Dropping the stream (the client
/// left) drops the source, which cancels the request.
fn stream_response(
    source: TurnSource,
    run: Run,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    struct Driver {
        source: TurnSource,
        run: Run,
        seq: u64,
        pending: VecDeque<Event>,
        done: bool,
    }
    impl Driver {
        fn emit(&mut self, e: ResponseEvent) {
            let kind = e.kind();
            let data = serde_json::to_string(&SequencedEvent {
                sequence_number: self.seq,
                event: e,
            })
            .unwrap_or_else(|_| "{}".into());
            self.seq += 1;
            self.pending
                .push_back(Event::default().event(kind).data(data));
        }

        fn drain(&mut self) {
            let events = std::mem::take(&mut self.run.builder.events);
            for e in events {
                self.emit(e);
            }
        }

        fn fail(&mut self, e: ApiError) {
            let r = self.run.failed(&e);
            self.run.builder.events.clear();
            self.emit(ResponseEvent::Error {
                code: e.code.map(str::to_string),
                message: e.message.clone(),
                param: e.param.clone(),
            });
            self.emit(ResponseEvent::Failed {
                response: Box::new(r),
            });
            self.done = true;
        }
    }
    let mut d = Driver {
        source,
        run,
        seq: 0,
        pending: VecDeque::new(),
        done: false,
    };
    let start = Box::new(d.run.skeleton.clone());
    d.emit(ResponseEvent::Created {
        response: start.clone(),
    });
    d.emit(ResponseEvent::InProgress { response: start });
    let s = stream::unfold(d, |mut d| async move {
        loop {
            if let Some(e) = d.pending.pop_front() {
                return Some((Ok(e), d));
            }
            if d.done {
                return None;
            }
            match d.source.next().await {
                Step::Events(events) => {
                    d.run.push(events);
                    d.drain();
                }
                Step::Done(events, finished) => {
                    d.run.push(events);
                    let r = Box::new(d.run.finish(&finished));
                    d.drain();
                    d.emit(match r.status.as_str() {
                        "completed" => ResponseEvent::Completed { response: r },
                        _ => ResponseEvent::Incomplete { response: r },
                    });
                    d.done = true;
                }
                Step::Failed(e) => d.fail(input_error(e)),
                Step::Closed => d.fail(ApiError::unavailable("the request ended without a result")),
            }
        }
    });
    Sse::new(s).keep_alive(KeepAlive::default())
}

/// GET /v1/responses/{id}.
pub async fn retrieve(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    match state.responses.get(&id) {
        Some(s) => Ok(Json(&s.response).into_response()),
        None => Err(not_found(
            format!("Response with id '{id}' not found."),
            None,
        )),
    }
}

/// DELETE /v1/responses/{id}.
pub async fn delete(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if state.responses.remove(&id) {
        Ok(Json(DeletedResponse {
            id,
            object: "response".into(),
            deleted: true,
        })
        .into_response())
    } else {
        Err(not_found(
            format!("Response with id '{id}' not found."),
            None,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(id: &str, parent: Option<Arc<Conversation>>, text: &str) -> Stored {
        Stored {
            response: ResponseObject {
                id: id.into(),
                object: "response".into(),
                created_at: 0,
                status: "completed".into(),
                error: None,
                incomplete_details: None,
                instructions: None,
                max_output_tokens: None,
                model: "m".into(),
                output: Vec::new(),
                parallel_tool_calls: true,
                previous_response_id: None,
                reasoning: None,
                store: true,
                temperature: None,
                text: TextConfig::default(),
                tool_choice: "auto".into(),
                tools: Vec::new(),
                top_p: None,
                truncation: "disabled".into(),
                usage: None,
                user: None,
                metadata: Default::default(),
            },
            conversation: Arc::new(Conversation {
                parent,
                messages: vec![ChatMessage::user(text)],
            }),
        }
    }

    #[test]
    fn the_store_evicts_oldest_first_and_chains_survive_eviction() {
        let store = ResponseStore::new(2);
        store.insert(stored("a", None, "one"));
        let a = store.get("a").expect("a").conversation.clone();
        store.insert(stored("b", Some(a), "two"));
        let b = store.get("b").expect("b").conversation.clone();
        store.insert(stored("c", Some(b), "three"));
        assert!(store.get("a").is_none());
        assert_eq!(store.len(), 2);
        let texts: Vec<String> = store
            .get("c")
            .expect("c")
            .conversation
            .messages()
            .iter()
            .map(ChatMessage::text)
            .collect();
        assert_eq!(texts, ["one", "two", "three"]);
        assert!(store.remove("b"));
        assert!(!store.remove("b"));
        assert_eq!(store.len(), 1);
        let none = ResponseStore::new(0);
        none.insert(stored("x", None, "x"));
        assert!(none.is_empty());
    }

    #[test]
    fn a_provider_answer_becomes_turn_events() {
        let r = ClientResponse {
            text: "Let me check.".into(),
            finish_reason: "tool_calls".into(),
            tool_calls: vec![ToolCall::new("call_1", "f", "{\"a\":1}")],
            reasoning: Some("think".into()),
            ..Default::default()
        };
        let mut b = OutputBuilder::default();
        let mut out = TurnOutput::default();
        for e in response_events(&r) {
            out.apply(&e);
            b.push(e);
        }
        b.finish("completed");
        assert_eq!(out.content, "Let me check.");
        assert_eq!(out.calls[0].function.arguments, "{\"a\":1}");
        assert!(
            matches!(&b.output[..], [OutputItem::Reasoning(_), OutputItem::Message(_), OutputItem::FunctionCall(c)] if c.status.as_deref() == Some("completed"))
        );
        assert_eq!(remote_reason("tool_calls"), FinishReason::Eos);
        assert_eq!(remote_reason("length"), FinishReason::Length);
        assert_eq!(remote_reason("stop"), FinishReason::Eos);
    }

    #[test]
    fn builder_orders_items_and_closes_them() {
        let mut b = OutputBuilder::default();
        for e in [
            TurnEvent::Reasoning("think".into()),
            TurnEvent::Content("Hi".into()),
            TurnEvent::Content(" there".into()),
            TurnEvent::CallStart {
                index: 0,
                id: "call_1".into(),
                name: "f".into(),
            },
            TurnEvent::CallArguments {
                index: 0,
                fragment: "{\"a\":".into(),
            },
            TurnEvent::CallArguments {
                index: 0,
                fragment: "1}".into(),
            },
            TurnEvent::CallEnd { index: 0 },
        ] {
            b.push(e);
        }
        b.finish("completed");
        let kinds: Vec<&str> = b
            .output
            .iter()
            .map(|o| match o {
                OutputItem::Message(_) => "message",
                OutputItem::FunctionCall(_) => "function_call",
                OutputItem::Reasoning(_) => "reasoning",
            })
            .collect();
        assert_eq!(kinds, ["reasoning", "message", "function_call"]);
        match &b.output[1] {
            OutputItem::Message(m) => {
                assert_eq!(m.content[0].text, "Hi there");
                assert_eq!(m.status, "completed");
            }
            other => panic!("{other:?}"),
        }
        match &b.output[2] {
            OutputItem::FunctionCall(c) => {
                assert_eq!(c.arguments, "{\"a\":1}");
                assert_eq!(c.status.as_deref(), Some("completed"));
            }
            other => panic!("{other:?}"),
        }
        let kinds: Vec<&str> = b.events.iter().map(ResponseEvent::kind).collect();
        assert_eq!(
            kinds,
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        let added = b
            .events
            .iter()
            .filter(|e| matches!(e, ResponseEvent::OutputItemAdded { .. }))
            .count();
        let done = b
            .events
            .iter()
            .filter(|e| matches!(e, ResponseEvent::OutputItemDone { .. }))
            .count();
        assert_eq!((added, done), (3, 3));
        // A call cut off: closed as incomplete.
        let mut b = OutputBuilder::default();
        b.push(TurnEvent::CallStart {
            index: 0,
            id: "call_1".into(),
            name: "f".into(),
        });
        b.push(TurnEvent::CallArguments {
            index: 0,
            fragment: "{\"a\"".into(),
        });
        b.finish("incomplete");
        assert!(
            matches!(&b.output[..], [OutputItem::FunctionCall(c)] if c.status.as_deref() == Some("incomplete"))
        );
        assert_eq!(
            b.events.last().map(ResponseEvent::kind),
            Some("response.output_item.done")
        );
        // Nothing said: one empty message.
        let mut b = OutputBuilder::default();
        b.finish("completed");
        assert!(matches!(&b.output[..], [OutputItem::Message(m)] if m.content[0].text.is_empty()));
    }
}
