//! sipp's first-party profile: /v1/query, /v1/chat, /v1/embed.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use sipp::engine::{Completion, EmbedRequest, PromptInput};
use sipp::protocol::native::*;
use sipp::protocol::request_from_text_options;
use sipp::sampling::OutputConstraint;
use sipp::text::FinishReason;
use sipp::tools::turn::{ChatTurn, ReasoningFormat};
use sipp::tools::{OutputParser, ToolChoice, ToolSpec, TurnEvent, TurnOutput};
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
        tool_calls: Vec::new(),
        reasoning: None,
    }
}

/// The body of a chat's answer, parsed: the answer text, its reasoning and
/// its calls; `tool_calls` when it called and ended by itself.
fn chat_body_of(model: &str, c: Completion, output: TurnOutput) -> GenerationBody {
    let reason = match c.finish_reason {
        FinishReason::Stop | FinishReason::Eos if !output.calls.is_empty() => "tool_calls",
        r => r.as_str(),
    };
    GenerationBody {
        text: output.content,
        finish_reason: reason.to_string(),
        tool_calls: output.calls,
        reasoning: output.reasoning,
        ..body_of(model, c)
    }
}

/// The stream event of an answer's event (a call's end has none).
fn stream_event(e: TurnEvent) -> Option<StreamEvent> {
    Some(match e {
        TurnEvent::Content(text) => StreamEvent::Delta { text },
        TurnEvent::Reasoning(text) => StreamEvent::Reasoning { text },
        TurnEvent::CallStart { index, id, name } => StreamEvent::ToolCallStart { index, id, name },
        TurnEvent::CallArguments { index, fragment } => {
            StreamEvent::ToolCallArguments { index, fragment }
        }
        TurnEvent::CallEnd { .. } => return None,
    })
}

/// The tools of a chat: `auto` when tools are given, calls off without them;
/// parallel calls unless turned off. Calls are constrained by a grammar of
/// their own, so no other constraint may be set while the model may call.
fn tool_spec(req: &ChatBody) -> Result<ToolSpec, ApiError> {
    let tools = req.tools.clone().unwrap_or_default();
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
    let o = &req.options;
    let constrained = o.grammar.is_some() || o.json_schema.is_some() || o.json_mode == Some(true);
    if spec.may_call() && constrained {
        return Err(ApiError::bad_field(
            "tools",
            "cannot be combined with `grammar`, `json_schema` or `json_mode` unless `tool_choice` is \"none\"",
        ));
    }
    Ok(spec)
}

/// How a chat's answer is read: the constraint its calls need and the
/// parser that splits it into answer, reasoning and calls.
struct ChatOutput {
    constraint: Option<OutputConstraint>,
    parser: OutputParser,
}

/// Runs one generation; `prompt_field` is what the request calls its prompt
/// (errors about the prompt name it). A chat with tools or split reasoning
/// has its output parsed.
async fn generate(
    state: AppState,
    model: String,
    engine: Engine,
    (prompt, prompt_field): (PromptInput, &str),
    options: &TextOptions,
    stream: bool,
    chat: Option<ChatOutput>,
) -> Result<Response, ApiError> {
    let mut req = request_from_text_options(options, &engine.info().sampling, prompt)?;
    let mut parser = chat.map(|c| {
        if c.constraint.is_some() {
            req.constraint = c.constraint;
        }
        c.parser
    });
    let handle = engine
        .generate(req)
        .map_err(|e| ApiError::from(e).renamed_param("prompt", prompt_field))?;
    if stream {
        let st = state.clone();
        let render = move |item: StreamItem| match item {
            StreamItem::Delta(_, d) if d.text.is_empty() => Vec::new(),
            StreamItem::Delta(_, d) => match &mut parser {
                Some(p) => p
                    .push(&d.text)
                    .into_iter()
                    .filter_map(stream_event)
                    .map(|e| json_event(&e))
                    .collect(),
                None => vec![json_event(&StreamEvent::Delta { text: d.text })],
            },
            StreamItem::Finished(_, c) => {
                st.finished(&model, &c);
                match parser.take() {
                    Some(mut p) => {
                        let mut out: Vec<_> = p
                            .finish()
                            .into_iter()
                            .filter_map(stream_event)
                            .map(|e| json_event(&e))
                            .collect();
                        let body = chat_body_of(&model, c, p.output().clone());
                        out.push(json_event(&StreamEvent::Done(body)));
                        out
                    }
                    None => vec![json_event(&StreamEvent::Done(body_of(&model, c)))],
                }
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
    state.finished(&model, &c);
    let body = match parser {
        Some(p) => {
            let output = p.parse_all(&c.text);
            chat_body_of(&model, c, output)
        }
        None => body_of(&model, c),
    };
    Ok(Json(body).into_response())
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
        None,
    )
    .await
}

/// POST /v1/chat.
pub async fn chat(
    State(state): State<AppState>,
    ApiJson(mut req): ApiJson<ChatBody>,
) -> Result<Response, ApiError> {
    let (model, target) = state.target(req.model.as_deref())?;
    let engine = match target {
        Target::Local(e) => e,
        Target::Remote(r) => return super::remote::chat(model, r, req).await,
    };
    crate::images::fetch_remote(
        &state,
        crate::images::chat_urls(&mut req.messages),
        "messages",
    )
    .await?;
    if let Some(e) = ApiError::cannot_generate(&engine) {
        return Err(e);
    }
    if req.messages.is_empty() {
        return Err(ApiError::bad_field(
            "messages",
            "must contain at least one message",
        ));
    }
    let spec = tool_spec(&req)?;
    // Reasoning stays in the text unless asked for apart, as before tools.
    let reasoning = req.reasoning_format.unwrap_or(ReasoningFormat::None);
    let heavy = crate::images::heavy(&engine, &req.messages);
    let turn = crate::images::prepare(heavy, || {
        engine.prepare_turn(&ChatTurn {
            messages: &req.messages,
            tools: &spec,
            reasoning,
            kwargs: None,
            continue_final: false,
        })
    })?;
    let parse = spec.may_call() || reasoning == ReasoningFormat::Split;
    let chat = parse.then(|| ChatOutput {
        constraint: turn.constraint,
        parser: turn.parser,
    });
    generate(
        state,
        model,
        engine,
        (turn.prompt, "messages"),
        &req.options,
        req.stream,
        chat,
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
