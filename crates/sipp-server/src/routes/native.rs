//! sipp's first-party profile: /v1/query, /v1/chat, /v1/embed.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use sipp::engine::{Completion, EmbedRequest, PromptInput};
use sipp::protocol::native::*;
use sipp::protocol::request_from_text_options;
use sipp::Engine;

use super::{json_event, sse, ApiJson, StreamItem};
use crate::error::ApiError;
use crate::state::{AppState, Target};

fn body_of(model: &str, c: Completion) -> GenerationBody {
    GenerationBody {
        model: model.to_string(),
        text: c.text,
        finish_reason: c.finish_reason.as_str().to_string(),
        usage: c.usage,
        stats: c.stats,
        logprobs: c
            .logprobs
            .into_iter()
            .map(|l| LogprobEntry {
                token: l.token,
                text: l.text,
                logprob: l.logprobs.chosen.logprob,
                top: l
                    .logprobs
                    .top
                    .iter()
                    .map(|t| (t.token, t.logprob))
                    .collect(),
            })
            .collect(),
    }
}

/// Runs one generation; `prompt_field` is what the request calls its prompt
/// (errors about the prompt name it).
async fn generate(
    state: AppState,
    model: String,
    engine: Engine,
    (prompt, prompt_field): (PromptInput, &str),
    options: &TextOptions,
    stream: bool,
) -> Result<Response, ApiError> {
    let req = request_from_text_options(options, &engine.info().sampling, prompt)?;
    let handle = engine
        .generate(req)
        .map_err(|e| ApiError::from(e).renamed_param("prompt", prompt_field))?;
    if stream {
        let st = state.clone();
        let render = move |item: StreamItem| match item {
            StreamItem::Delta(_, d) if d.text.is_empty() => Vec::new(),
            StreamItem::Delta(_, d) => vec![json_event(&StreamEvent::Delta { text: d.text })],
            StreamItem::Finished(_, c) => {
                st.metrics.record_ttft(&model, &c.stats);
                vec![json_event(&StreamEvent::Done(body_of(&model, c)))]
            }
            StreamItem::Failed(_, e) => vec![json_event(&StreamEvent::Error {
                error: e.body().error,
            })],
        };
        return Ok(sse(vec![handle], render, Vec::new).into_response());
    }
    let c = handle
        .completion()
        .await
        .map_err(|e| ApiError::from(e).renamed_param("prompt", prompt_field))?;
    state.metrics.record_ttft(&model, &c.stats);
    Ok(Json(body_of(&model, c)).into_response())
}

/// POST /v1/query.
pub async fn query(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<QueryBody>,
) -> Result<Response, ApiError> {
    let (model, target) = state.target(req.model.as_deref())?;
    let engine = match target {
        Target::Local(e) => e,
        Target::Remote(r) => return super::remote::query(model, r, req).await,
    };
    generate(
        state,
        model,
        engine,
        (PromptInput::Text(req.prompt), "prompt"),
        &req.options,
        req.stream,
    )
    .await
}

/// POST /v1/chat.
pub async fn chat(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatBody>,
) -> Result<Response, ApiError> {
    let (model, target) = state.target(req.model.as_deref())?;
    let engine = match target {
        Target::Local(e) => e,
        Target::Remote(r) => {
            return super::remote::chat(model, r, req.messages, req.options, req.stream).await
        }
    };
    if let Some(e) = ApiError::cannot_generate(&engine) {
        return Err(e);
    }
    let prompt = engine.chat_prompt(&req.messages)?;
    generate(
        state,
        model,
        engine,
        (prompt, "messages"),
        &req.options,
        req.stream,
    )
    .await
}

/// POST /v1/embed.
pub async fn embed(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<EmbedBody>,
) -> Result<Response, ApiError> {
    let (model, target) = state.target(req.model.as_deref())?;
    let engine = match target {
        Target::Local(e) => e,
        Target::Remote(r) => return super::remote::embed(model, r, req).await,
    };
    let inputs = req.input.into_vec();
    if inputs.is_empty() {
        return Err(ApiError::bad_field("input", "must not be empty"));
    }
    let normalize = req.normalize.unwrap_or(true);
    let handles = inputs
        .into_iter()
        .map(|t| {
            engine.embed(EmbedRequest {
                input: PromptInput::Text(t),
                normalize,
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ApiError::from(e).renamed_param("prompt", "input"))?;
    let mut data = Vec::with_capacity(handles.len());
    let mut prompt_tokens = 0;
    for (index, h) in handles.into_iter().enumerate() {
        let e = h
            .embedding()
            .await
            .map_err(|e| ApiError::from(e).renamed_param("prompt", "input"))?;
        prompt_tokens += e.prompt_tokens;
        data.push(EmbeddingItem {
            index,
            values: e.values,
            pooling: e.pooling,
            normalized: e.normalized,
        });
    }
    Ok(Json(EmbedResponseBody {
        model,
        data,
        usage: sipp::engine::Usage {
            prompt_tokens,
            completion_tokens: 0,
            cached_tokens: 0,
        },
    })
    .into_response())
}
