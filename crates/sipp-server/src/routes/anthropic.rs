//! Anthropic's Messages API: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`, over local engines.
//!
//! Every failure on these routes (the body, the key, the method, the engine)
//! is answered in Anthropic's shape `{"type": "error", "error": {"type",
//! "message"}}` with the same status the OpenAI routes use. A streamed answer
//! is Anthropic's event sequence: `message_start`, `ping`, per block
//! `content_block_start` / `content_block_delta`s / `content_block_stop`,
//! then `message_delta` (stop reason, usage) and `message_stop`; a failure
//! mid-stream is an `error` event.
//!
//! Choices: ids are `msg_` and 16 hex digits; `tool_use` ids are the
//! engine's call ids (`call_...`, or 9 characters for Mistral templates,
//! which refuse others), so they come back unchanged in `tool_result`s.
//! `thinking` blocks carry an empty `signature`. `stop_sequence` names the
//! stop sequence found where the text ends in the text of all the generated
//! tokens. A remote provider target runs the conversation through its
//! client (tools forwarded; `top_k` and extended `thinking` refused by name);
//! there `stop_sequence` stays null (a provider does not say which matched)
//! and a streamed `message_start` counts 0 input tokens (the final
//! `message_delta` has the provider's count). `count_tokens` refuses remote
//! targets: there is no tokenizer for them.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::extract::{FromRequest, Request, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream;
use sipp::client::ChatRequest;
use sipp::engine::{Completion, PreparedTurn, PromptInput};
use sipp::protocol::anthropic::*;
use sipp::protocol::openai::{SamplingFields, StopField};
use sipp::protocol::{request_from_openai, FieldNames};
use sipp::tools::turn::{ChatTurn, ReasoningFormat};
use sipp::tools::TurnOutput;
use sipp::Engine;

use super::openai::named;
use super::remote::options as provider_options;
use super::responses::{remote_only_error, Finished, Step, TurnSource};
use super::{new_id, ApiJson};
use crate::error::ApiError;
use crate::state::{AppState, RemoteTarget, Target};

/// An error answered in Anthropic's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

/// Anthropic's error type for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The Anthropic body of an error.
pub fn error_body(e: &ApiError) -> ErrorResponse {
    ErrorResponse::new(error_type(e.status), e.message.clone())
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let e = self.0;
        let mut resp = (e.status, Json(error_body(&e))).into_response();
        e.add_headers(&mut resp);
        resp
    }
}

/// A JSON body read as [`ApiJson`] reads it, refused in Anthropic's shape.
pub struct AnthropicJson<T>(pub T);

impl<T: serde::de::DeserializeOwned> FromRequest<AppState> for AnthropicJson<T> {
    type Rejection = AnthropicError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        ApiJson::<T>::from_request(req, state)
            .await
            .map(|ApiJson(v)| AnthropicJson(v))
            .map_err(AnthropicError)
    }
}

/// Known route, wrong method.
pub async fn method_not_allowed() -> AnthropicError {
    AnthropicError(super::ops::method_not_allowed().await)
}

/// The local engine of a request's model.
fn local_engine(state: &AppState, model: Option<&str>) -> Result<(String, Engine), ApiError> {
    let (id, target) = state.target(model)?;
    match target {
        Target::Local(e) => Ok((id, e)),
        Target::Remote(_) => Err(ApiError::bad_field(
            "model",
            format!("`{id}` is a remote target: it has no tokenizer here, so count_tokens serves local models only"),
        )),
    }
}

/// Renders a conversation as the messages route does.
fn prepare(engine: &Engine, conv: Conversation<'_>) -> Result<PreparedTurn, ApiError> {
    let parts = conv
        .to_chat()
        .map_err(|e| ApiError::bad_field(&e.field, e.message))?;
    if let Some(e) = ApiError::cannot_generate(engine) {
        return Err(e);
    }
    let heavy = crate::images::heavy(engine, &parts.messages);
    crate::images::prepare(heavy, || {
        engine.prepare_turn(&ChatTurn {
            messages: &parts.messages,
            tools: &parts.tools,
            reasoning: ReasoningFormat::Split,
            kwargs: parts.kwargs.as_ref(),
            // A last assistant message with text is a prefill: the answer
            // continues it, as Anthropic's API does.
            continue_final: parts.messages.last().is_some_and(|m| {
                m.role == sipp::chat::Role::Assistant
                    && m.tool_calls.as_ref().is_none_or(Vec::is_empty)
                    && !m.text().trim().is_empty()
            }),
        })
    })
    .map_err(|e| {
        let mut e = ApiError::from(e);
        if let Some(p) = e.param.take() {
            let named = anthropic_field(&p);
            e.message = e.message.replace(&p, &named);
            e.param = Some(named);
        }
        e
    })
}

/// The number of tokens of a prepared prompt.
fn prompt_len(engine: &Engine, prompt: &PromptInput) -> usize {
    match prompt {
        PromptInput::Tokens(t) => t.len(),
        PromptInput::Media(m) => m.tokens.len(),
        PromptInput::Text(s) => engine
            .vocab()
            .tokenize(s, true, true)
            .map_or(0, |t| t.len()),
    }
}

/// The stop sequence that ended a completion, when one did.
fn stop_sequence(engine: &Engine, c: &Completion, stops: &[String]) -> Option<String> {
    let vocab = engine.vocab();
    let bytes: Vec<u8> = c
        .tokens
        .iter()
        .flat_map(|&t| vocab.token_bytes(t))
        .collect();
    matched_stop(&String::from_utf8_lossy(&bytes), stops)
}

fn message_id() -> String {
    new_id("msg").replacen('-', "_", 1)
}

fn sse_event(e: &StreamEvent) -> Event {
    Event::default()
        .event(e.name())
        .data(serde_json::to_string(e).unwrap_or_else(|_| "{}".into()))
}

/// POST /v1/messages.
pub async fn messages(
    State(state): State<AppState>,
    AnthropicJson(mut req): AnthropicJson<MessagesRequest>,
) -> Result<Response, AnthropicError> {
    let (model, target) = state.target(req.model.as_deref())?;
    if matches!(target, Target::Local(_)) {
        let urls = crate::images::anthropic_urls(&mut req.messages);
        crate::images::fetch_remote(&state, urls, "messages").await?;
    }
    if req.max_tokens < 1 {
        return Err(ApiError::bad_field(
            "max_tokens",
            format!("must be at least 1, got {}", req.max_tokens),
        )
        .into());
    }
    let stops = req.stop_sequences.clone().unwrap_or_default();
    let stream = req.stream.unwrap_or(false);
    let (source, engine, input_tokens) = match target {
        Target::Local(engine) => {
            let (source, input_tokens) = local_source(&engine, &req, stream)?;
            (source, Some(engine), input_tokens)
        }
        Target::Remote(r) => (remote_source(&r, &req, stream).await?, None, 0),
    };
    let id = message_id();
    if stream {
        return Ok(
            stream_answer(state, engine, model, id, input_tokens, stops, source).into_response(),
        );
    }
    let (events, f) = source
        .complete()
        .await
        .map_err(|e| e.renamed_param("prompt", "messages"))?;
    let mut output = TurnOutput::default();
    for e in &events {
        output.apply(e);
    }
    if let Some(c) = &f.completion {
        state.finished(&model, c);
    }
    let reason = StopReason::of(f.reason, !output.calls.is_empty());
    let mut msg = MessagesResponse::new(id, model, response_content(&output), f.usage.into());
    msg.stop_reason = Some(reason);
    if reason == StopReason::StopSequence {
        msg.stop_sequence = stop_sequence_of(engine.as_ref(), &f, &stops);
    }
    Ok(Json(msg).into_response())
}

/// The stop sequence that ended an answer, when one did and a local engine
/// can tell which.
fn stop_sequence_of(engine: Option<&Engine>, f: &Finished, stops: &[String]) -> Option<String> {
    match (engine, &f.completion) {
        (Some(engine), Some(c)) => stop_sequence(engine, c, stops),
        _ => None,
    }
}

/// A request on a local engine: the conversation rendered with the model's
/// template and submitted; the prompt's length when streamed.
fn local_source(
    engine: &Engine,
    req: &MessagesRequest,
    stream: bool,
) -> Result<(TurnSource, usize), ApiError> {
    let turn = prepare(engine, req.conversation())?;
    let fields = SamplingFields {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req.stop_sequences.clone().map(StopField::Many),
        lora: req.lora.clone(),
        ..SamplingFields::default()
    };
    let names = FieldNames::new().rename("stop", "stop_sequences");
    let mut gen = request_from_openai(
        &fields,
        Some(req.max_tokens),
        None,
        None,
        &engine.info().sampling,
        turn.prompt.clone(),
    )
    .map_err(|e| named(e, &names))?;
    gen.constraint = turn.constraint.clone();
    if let Some(sipp::protocol::anthropic::ThinkingConfig::Enabled { budget_tokens }) =
        &req.thinking
    {
        gen.reasoning_budget = turn.reasoning_budget(*budget_tokens);
    }
    let handle = engine
        .generate(gen)
        .map_err(|e| named(e, &names).renamed_param("prompt", "messages"))?;
    let input_tokens = if stream {
        prompt_len(engine, &turn.prompt)
    } else {
        0
    };
    Ok((TurnSource::local(handle, turn.parser), input_tokens))
}

/// A request on a provider target: the conversation and the tools go to it
/// as chat messages and function tools, with the sampling every provider
/// understands (`max_tokens`, `temperature`, `top_p`, `stop_sequences`);
/// `top_k` and extended `thinking` are refused by name.
async fn remote_source(
    r: &RemoteTarget,
    req: &MessagesRequest,
    stream: bool,
) -> Result<TurnSource, ApiError> {
    let parts = req
        .conversation()
        .to_chat()
        .map_err(|e| ApiError::bad_field(&e.field, e.message))?;
    if req.top_k.is_some() {
        return Err(remote_only_error("top_k"));
    }
    if req.lora.is_some() {
        return Err(remote_only_error("lora"));
    }
    if matches!(req.thinking, Some(ThinkingConfig::Enabled { .. })) {
        return Err(remote_only_error("thinking"));
    }
    let options = provider_options(
        Some(req.max_tokens),
        req.temperature,
        req.top_p,
        req.stop_sequences.clone().unwrap_or_default(),
        None,
        stream,
    )?;
    let spec = parts.tools;
    let calls = !spec.tools.is_empty();
    let run = r
        .client
        .chat(
            &r.endpoint,
            ChatRequest {
                messages: parts.messages,
                options,
                tool_choice: calls.then(|| spec.choice.clone()),
                parallel_tool_calls: (calls && !spec.parallel).then_some(false),
                tools: spec.tools,
            },
        )
        .await?;
    Ok(TurnSource::remote(run))
}

/// The events of a streamed answer.
fn stream_answer(
    state: AppState,
    engine: Option<Engine>,
    model: String,
    id: String,
    input_tokens: usize,
    stops: Vec<String>,
    source: TurnSource,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    struct Driver {
        source: Option<TurnSource>,
        pending: VecDeque<StreamEvent>,
        blocks: BlockStream,
        state: AppState,
        engine: Option<Engine>,
        model: String,
        stops: Vec<String>,
    }
    let start = MessagesResponse::new(
        id,
        model.clone(),
        Vec::new(),
        Usage {
            input_tokens,
            output_tokens: 0,
            cache_read_input_tokens: None,
        },
    );
    let driver = Driver {
        source: Some(source),
        pending: VecDeque::from([
            StreamEvent::MessageStart { message: start },
            StreamEvent::Ping,
        ]),
        blocks: BlockStream::new(),
        state,
        engine,
        model,
        stops,
    };
    let failed = |e: ApiError| StreamEvent::Error {
        error: error_body(&e).error,
    };
    let s = stream::unfold(driver, move |mut d| async move {
        loop {
            if let Some(e) = d.pending.pop_front() {
                return Some((Ok(sse_event(&e)), d));
            }
            let source = d.source.as_mut()?;
            match source.next().await {
                Step::Events(events) => {
                    d.pending.extend(d.blocks.push(events));
                }
                Step::Done(events, f) => {
                    d.source = None;
                    if let Some(c) = &f.completion {
                        d.state.finished(&d.model, c);
                    }
                    d.pending.extend(d.blocks.push(events));
                    d.pending.extend(d.blocks.finish());
                    let reason = StopReason::of(f.reason, d.blocks.called());
                    let stop_sequence = (reason == StopReason::StopSequence)
                        .then(|| stop_sequence_of(d.engine.as_ref(), &f, &d.stops))
                        .flatten();
                    let usage = Usage::from(f.usage);
                    d.pending.push_back(StreamEvent::MessageDelta {
                        delta: MessageDelta {
                            stop_reason: Some(reason),
                            stop_sequence,
                        },
                        usage: DeltaUsage {
                            output_tokens: usage.output_tokens,
                            input_tokens: Some(usage.input_tokens),
                            cache_read_input_tokens: usage.cache_read_input_tokens,
                        },
                    });
                    d.pending.push_back(StreamEvent::MessageStop);
                }
                Step::Failed(e) => {
                    d.source = None;
                    d.pending
                        .push_back(failed(e.renamed_param("prompt", "messages")));
                }
                Step::Closed => {
                    d.source = None;
                    d.pending.push_back(failed(ApiError::unavailable(
                        "the engine stopped before the answer finished",
                    )));
                }
            }
        }
    });
    Sse::new(s).keep_alive(KeepAlive::default())
}

/// POST /v1/messages/count_tokens: the tokens of the prompt the messages
/// route would render (system, messages and tools).
pub async fn count_tokens(
    State(state): State<AppState>,
    AnthropicJson(req): AnthropicJson<CountTokensRequest>,
) -> Result<Json<CountTokensResponse>, AnthropicError> {
    let (_, engine) = local_engine(&state, req.model.as_deref())?;
    let turn = prepare(&engine, req.conversation())?;
    Ok(Json(CountTokensResponse {
        input_tokens: prompt_len(&engine, &turn.prompt),
    }))
}
