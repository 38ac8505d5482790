//! Routes for targets that forward to a remote provider (the server acting as a
//! gateway with its own credentials). Only options every provider understands
//! pass through; the rest are refused with a clear 400.

use std::convert::Infallible;

use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream;
use sipp::client::{
    ChatRequest, ClientError, EmbedRequest, QueryRequest, RequestOptions,
    Response as ClientResponse, Run, RunEvent, TextOptions,
};
use sipp::engine::Usage;
use sipp::protocol::native as nv;
use sipp::protocol::openai as oa;
use sipp::tools::turn::ReasoningFormat;

use super::{json_event, new_id, now_secs};
use crate::error::ApiError;
use crate::state::RemoteTarget;

impl From<ClientError> for ApiError {
    fn from(e: ClientError) -> Self {
        match &e {
            ClientError::Remote {
                status, message, ..
            } => ApiError {
                status: StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY),
                message: format!("upstream: {message}"),
                kind: "upstream_error",
                code: None,
                param: None,
                retry_after_secs: None,
            },
            ClientError::Invalid { .. } | ClientError::Unsupported { .. } => {
                ApiError::bad_request(e.to_string())
            }
            ClientError::Engine(inner) => inner.clone().into(),
            _ => ApiError {
                status: StatusCode::BAD_GATEWAY,
                message: e.to_string(),
                kind: "upstream_error",
                code: Some("bad_gateway"),
                param: None,
                retry_after_secs: None,
            },
        }
    }
}

fn unsupported(field: &str) -> ApiError {
    ApiError::bad_field(
        field,
        "is not supported when the model is a remote provider",
    )
}

fn check_sampling(s: &oa::SamplingFields) -> Result<(), ApiError> {
    let set = [
        ("top_k", s.top_k.is_some()),
        ("min_p", s.min_p.is_some()),
        ("typical_p", s.typical_p.is_some()),
        ("presence_penalty", s.presence_penalty.is_some()),
        ("frequency_penalty", s.frequency_penalty.is_some()),
        ("repeat_penalty", s.repeat_penalty.is_some()),
        ("repeat_last_n", s.repeat_last_n.is_some()),
        ("mirostat", s.mirostat.is_some()),
        ("seed", s.seed.is_some()),
        ("logit_bias", s.logit_bias.is_some()),
        ("samplers", s.samplers.is_some()),
        ("ignore_eos", s.ignore_eos.is_some()),
        ("grammar", s.grammar.is_some()),
        ("json_schema", s.json_schema.is_some()),
        ("lora", s.lora.is_some()),
    ];
    match set.iter().find(|(_, on)| *on) {
        Some((name, _)) => Err(unsupported(name)),
        None => Ok(()),
    }
}

/// The options of a provider request: the sampling every provider
/// understands (max tokens, temperature, top_p, stop, user).
pub(super) fn options(
    max_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    stop: Vec<String>,
    user: Option<String>,
    stream: bool,
) -> Result<RequestOptions, ApiError> {
    // The engine's rule for max_tokens, without an endpoint limit: the
    // provider applies its own.
    let max_tokens = match max_tokens {
        None => None,
        Some(n) => {
            let n = sipp::protocol::wire_count("max_tokens", n)?;
            sipp::engine::validate::max_tokens(n, 0)?;
            Some(n)
        }
    };
    let mut o = RequestOptions {
        text: TextOptions {
            max_tokens,
            temperature,
            top_p,
            stop,
        },
        stream,
        ..RequestOptions::default()
    };
    o.provider.user = user;
    Ok(o)
}

/// The options an OpenAI request carries that every provider understands.
fn openai_options(
    s: &oa::SamplingFields,
    max_tokens: Option<i64>,
    stream: bool,
) -> Result<RequestOptions, ApiError> {
    let stop = s
        .stop
        .clone()
        .map(oa::StopField::into_vec)
        .unwrap_or_default();
    options(
        max_tokens,
        s.temperature,
        s.top_p,
        stop,
        s.user.clone(),
        stream,
    )
}

fn openai_reason(r: &str) -> String {
    match r {
        "eos" => "stop".into(),
        other => other.into(),
    }
}

/// Streams a run as SSE: `piece` renders each streamed event (text,
/// reasoning, call pieces), `done` the final answer.
fn run_sse<D, F>(run: Run, piece: D, done: F, trailer: Option<&'static str>) -> Response
where
    D: FnMut(RunEvent) -> Vec<Event> + Send + 'static,
    F: Fn(ClientResponse) -> Vec<Event> + Send + 'static,
{
    let events = stream::unfold(
        (run, piece, done, false),
        move |(mut run, mut piece, done, finished)| async move {
            if finished {
                return None;
            }
            let mut out = Vec::new();
            let mut end = false;
            match run.next().await {
                Some(RunEvent::Done(r)) => {
                    out.extend(done(r));
                    end = true;
                }
                Some(RunEvent::Error(e)) => {
                    out.push(json_event(&ApiError::from(e).body()));
                    end = true;
                }
                Some(ev) => out.extend(piece(ev)),
                None => end = true,
            }
            if end {
                if let Some(t) = trailer {
                    out.push(Event::default().data(t));
                }
            }
            Some((
                stream::iter(out.into_iter().map(Ok::<_, Infallible>)),
                (run, piece, done, end),
            ))
        },
    );
    use futures::StreamExt;
    Sse::new(events.flatten())
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// /v1/completions on a remote target.
pub async fn completions(
    model: String,
    r: RemoteTarget,
    req: oa::CompletionRequest,
) -> Result<Response, ApiError> {
    check_sampling(&req.sampling)?;
    if req.n.is_some_and(|n| n != 1) {
        return Err(unsupported("n"));
    }
    if req.logprobs.is_some() {
        return Err(unsupported("logprobs"));
    }
    if req.echo == Some(true) {
        return Err(unsupported("echo"));
    }
    let prompt = match req.prompt {
        Some(oa::PromptField::Text(t)) => t,
        Some(_) => {
            return Err(ApiError::bad_field(
                "prompt",
                "must be one text when the model is a remote provider",
            ))
        }
        None => return Err(ApiError::bad_field("prompt", "is required")),
    };
    let stream = req.stream.unwrap_or(false);
    let o = openai_options(&req.sampling, req.max_tokens, stream)?;
    let run = r
        .client
        .query(&r.endpoint, QueryRequest { prompt, options: o })
        .await?;
    let (id, created) = (new_id("cmpl"), now_secs());
    let chunk = {
        let (id, model) = (id.clone(), model.clone());
        move |text: String, finish: Option<String>, usage: Option<oa::UsageBody>| {
            oa::CompletionResponse {
                id: id.clone(),
                object: "text_completion".into(),
                created,
                model: model.clone(),
                choices: if usage.is_some() && finish.is_none() {
                    Vec::new()
                } else {
                    vec![oa::CompletionChoice {
                        index: 0,
                        text,
                        logprobs: None,
                        finish_reason: finish,
                    }]
                },
                usage,
                timings: None,
            }
        }
    };
    if stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        let c2 = chunk.clone();
        return Ok(run_sse(
            run,
            move |ev| match ev {
                RunEvent::Delta(t) => vec![json_event(&chunk(t, None, None))],
                _ => Vec::new(),
            },
            move |r| {
                let mut v = vec![json_event(&c2(
                    String::new(),
                    Some(openai_reason(&r.finish_reason)),
                    None,
                ))];
                if include_usage {
                    v.push(json_event(&c2(String::new(), None, Some(r.usage.into()))));
                }
                v
            },
            Some("[DONE]"),
        ));
    }
    let resp = run.response().await?;
    let reason = openai_reason(&resp.finish_reason);
    Ok(Json(chunk(resp.text, Some(reason), Some(resp.usage.into()))).into_response())
}

/// /v1/chat/completions on a remote target.
pub async fn chat_completions(
    model: String,
    r: RemoteTarget,
    req: oa::ChatCompletionRequest,
) -> Result<Response, ApiError> {
    check_sampling(&req.sampling)?;
    if req.n.is_some_and(|n| n != 1) {
        return Err(unsupported("n"));
    }
    if req.logprobs == Some(true) || req.top_logprobs.is_some() {
        return Err(unsupported("logprobs"));
    }
    if req
        .response_format
        .as_ref()
        .is_some_and(|f| *f != oa::ResponseFormat::Text)
    {
        return Err(unsupported("response_format"));
    }
    let stream = req.stream.unwrap_or(false);
    let o = openai_options(
        &req.sampling,
        req.max_completion_tokens.or(req.max_tokens),
        stream,
    )
    .map_err(|e| super::openai::named(e, &sipp::protocol::FieldNames::openai_chat(&req)))?;
    // Tools, the choice and parallel calls go to the provider as given.
    let run = r
        .client
        .chat(
            &r.endpoint,
            ChatRequest {
                messages: req.messages,
                options: o,
                tools: req.tools.unwrap_or_default(),
                tool_choice: req.tool_choice,
                parallel_tool_calls: req.parallel_tool_calls,
            },
        )
        .await?;
    let (id, created) = (new_id("chatcmpl"), now_secs());
    let chunk = {
        let (id, model) = (id.clone(), model.clone());
        move |object: &str, choice: Option<oa::ChatChoice>, usage: Option<oa::UsageBody>| {
            oa::ChatCompletionResponse {
                id: id.clone(),
                object: object.into(),
                created,
                model: model.clone(),
                choices: choice.into_iter().collect(),
                usage,
                timings: None,
            }
        }
    };
    let delta_choice = |delta: oa::ResponseMessage, finish: Option<String>| oa::ChatChoice {
        index: 0,
        message: None,
        delta: Some(delta),
        logprobs: None,
        finish_reason: finish,
    };
    if stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        let c2 = chunk.clone();
        let mut first = true;
        return Ok(run_sse(
            run,
            move |ev| {
                let Some(mut delta) = openai_delta(ev) else {
                    return Vec::new();
                };
                if std::mem::take(&mut first) {
                    delta.role = Some("assistant".into());
                }
                vec![json_event(&chunk(
                    "chat.completion.chunk",
                    Some(delta_choice(delta, None)),
                    None,
                ))]
            },
            move |r| {
                let mut v = vec![json_event(&c2(
                    "chat.completion.chunk",
                    Some(delta_choice(
                        oa::ResponseMessage::default(),
                        Some(openai_reason(&r.finish_reason)),
                    )),
                    None,
                ))];
                if include_usage {
                    v.push(json_event(&c2(
                        "chat.completion.chunk",
                        None,
                        Some(r.usage.into()),
                    )));
                }
                v
            },
            Some("[DONE]"),
        ));
    }
    let resp = run.response().await?;
    let calls = (!resp.tool_calls.is_empty()).then(|| {
        resp.tool_calls
            .iter()
            .map(oa::ResponseToolCall::from)
            .collect()
    });
    let choice = oa::ChatChoice {
        index: 0,
        message: Some(oa::ResponseMessage {
            role: Some("assistant".into()),
            // null in an answer that only calls tools, as OpenAI sends it.
            content: (calls.is_none() || !resp.text.is_empty()).then_some(resp.text),
            reasoning_content: resp.reasoning,
            tool_calls: calls,
        }),
        delta: None,
        logprobs: None,
        finish_reason: Some(openai_reason(&resp.finish_reason)),
    };
    Ok(Json(chunk(
        "chat.completion",
        Some(choice),
        Some(resp.usage.into()),
    ))
    .into_response())
}

/// The OpenAI stream delta of a run's streamed event: text, reasoning, a
/// call's start (index, id, type, name) or a piece of its arguments.
fn openai_delta(ev: RunEvent) -> Option<oa::ResponseMessage> {
    let call = |index, id: Option<String>, name: Option<String>, arguments| oa::ResponseMessage {
        tool_calls: Some(vec![oa::ResponseToolCall {
            index: Some(index),
            kind: id.as_ref().map(|_| "function".to_string()),
            id,
            function: oa::FunctionPiece {
                name,
                arguments: Some(arguments),
            },
        }]),
        ..Default::default()
    };
    Some(match ev {
        RunEvent::Delta(t) => oa::ResponseMessage {
            content: Some(t),
            ..Default::default()
        },
        RunEvent::Reasoning(t) => oa::ResponseMessage {
            reasoning_content: Some(t),
            ..Default::default()
        },
        RunEvent::ToolCallStart { index, id, name } => {
            call(index, Some(id), Some(name), String::new())
        }
        RunEvent::ToolCallArguments { index, fragment } => call(index, None, None, fragment),
        _ => return None,
    })
}

/// /v1/embeddings on a remote target.
pub async fn embeddings(
    model: String,
    r: RemoteTarget,
    req: oa::EmbeddingRequest,
) -> Result<Response, ApiError> {
    let inputs = match req.input {
        oa::EmbeddingInput::Text(t) => vec![t],
        oa::EmbeddingInput::Texts(v) => v,
        _ => {
            return Err(ApiError::bad_field(
                "input",
                "must be text when the model is a remote provider",
            ))
        }
    };
    let e = r
        .client
        .embed(&r.endpoint, EmbedRequest::new(inputs))
        .await?;
    Ok(Json(oa::EmbeddingResponse {
        object: "list".into(),
        data: e
            .data
            .into_iter()
            .enumerate()
            .map(|(index, d)| oa::EmbeddingData {
                object: "embedding".into(),
                index,
                embedding: oa::EmbeddingVector::Float(d.values),
            })
            .collect(),
        model,
        usage: oa::UsageBody {
            prompt_tokens: e.prompt_tokens,
            completion_tokens: 0,
            total_tokens: e.prompt_tokens,
            prompt_tokens_details: None,
        },
    })
    .into_response())
}

fn native_options(o: &nv::TextOptions, stream: bool) -> Result<RequestOptions, ApiError> {
    let local_only = [
        ("seed", o.seed.is_some()),
        ("ignore_eos", o.ignore_eos.is_some()),
        ("grammar", o.grammar.is_some()),
        ("json_schema", o.json_schema.is_some()),
        ("json_mode", o.json_mode.is_some()),
        ("logprobs", o.logprobs.is_some()),
        ("context_key", o.context_key.is_some()),
        ("lora", o.lora.is_some()),
        ("sampling", o.sampling.is_some()),
    ];
    if let Some((name, _)) = local_only.iter().find(|(_, on)| *on) {
        return Err(unsupported(name));
    }
    options(
        o.max_tokens.map(i64::from),
        o.temperature,
        o.top_p,
        o.stop.clone(),
        None,
        stream,
    )
}

/// The native body of an answer; the provider's reasoning only when the
/// request asked for it apart (`reasoning`).
fn native_body(model: &str, r: ClientResponse, reasoning: bool) -> nv::GenerationBody {
    nv::GenerationBody {
        model: model.to_string(),
        text: r.text,
        finish_reason: r.finish_reason,
        tool_calls: r.tool_calls,
        reasoning: r.reasoning.filter(|_| reasoning),
        usage: r.usage,
        stats: r.stats.unwrap_or_default(),
        logprobs: Vec::new(),
    }
}

async fn native_generate(
    model: String,
    run: Run,
    stream: bool,
    reasoning: bool,
) -> Result<Response, ApiError> {
    if stream {
        return Ok(run_sse(
            run,
            move |ev| {
                let e = match ev {
                    RunEvent::Delta(text) => nv::StreamEvent::Delta { text },
                    RunEvent::Reasoning(text) if reasoning => nv::StreamEvent::Reasoning { text },
                    RunEvent::ToolCallStart { index, id, name } => {
                        nv::StreamEvent::ToolCallStart { index, id, name }
                    }
                    RunEvent::ToolCallArguments { index, fragment } => {
                        nv::StreamEvent::ToolCallArguments { index, fragment }
                    }
                    _ => return Vec::new(),
                };
                vec![json_event(&e)]
            },
            move |r| {
                vec![json_event(&nv::StreamEvent::Done(native_body(
                    &model, r, reasoning,
                )))]
            },
            None,
        ));
    }
    let r = run.response().await?;
    Ok(Json(native_body(&model, r, reasoning)).into_response())
}

/// /v1/query on a remote target.
pub async fn query(
    model: String,
    r: RemoteTarget,
    req: nv::QueryBody,
) -> Result<Response, ApiError> {
    let o = native_options(&req.options, req.stream)?;
    let run = r
        .client
        .query(
            &r.endpoint,
            QueryRequest {
                prompt: req.prompt,
                options: o,
            },
        )
        .await?;
    native_generate(model, run, req.stream, false).await
}

/// /v1/chat on a remote target: tools, the choice and parallel calls go to
/// the provider as given.
pub async fn chat(model: String, r: RemoteTarget, req: nv::ChatBody) -> Result<Response, ApiError> {
    let o = native_options(&req.options, req.stream)?;
    let reasoning = req.reasoning_format == Some(ReasoningFormat::Split);
    let run = r
        .client
        .chat(
            &r.endpoint,
            ChatRequest {
                messages: req.messages,
                options: o,
                tools: req.tools.unwrap_or_default(),
                tool_choice: req.tool_choice,
                parallel_tool_calls: req.parallel_tool_calls,
            },
        )
        .await?;
    native_generate(model, run, req.stream, reasoning).await
}

/// /v1/embed on a remote target.
pub async fn embed(
    model: String,
    r: RemoteTarget,
    req: nv::EmbedBody,
) -> Result<Response, ApiError> {
    if req.normalize.is_some() {
        return Err(unsupported("normalize"));
    }
    let e = r
        .client
        .embed(&r.endpoint, EmbedRequest::new(req.input.into_vec()))
        .await?;
    Ok(Json(nv::EmbedResponseBody {
        model,
        data: e
            .data
            .into_iter()
            .enumerate()
            .map(|(index, d)| nv::EmbeddingItem {
                index,
                values: d.values,
                pooling: d.pooling.unwrap_or(sipp::runtime::Pooling::None),
                normalized: d.normalized.unwrap_or(false),
            })
            .collect(),
        usage: Usage {
            prompt_tokens: e.prompt_tokens,
            completion_tokens: 0,
            cached_tokens: 0,
        },
    })
    .into_response())
}
