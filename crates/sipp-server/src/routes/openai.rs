//! OpenAI's API: /v1/completions, /v1/chat/completions, /v1/embeddings.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use sipp::engine::{
    Completion, EmbedRequest, GenerateRequest, PromptInput, RequestHandle, TokenLogprobs, Usage,
};
use sipp::protocol::openai::*;
use sipp::protocol::{request_from_openai, FieldNames};
use sipp::tools::turn::ChatTurn;
use sipp::tools::{ToolChoice, ToolSpec, TurnEvent, TurnOutput};
use sipp::Engine;

use super::{json_event, new_id, now_secs, sse, ApiJson, StreamItem};
use crate::error::ApiError;
use crate::state::{AppState, Target};

/// Most choices one request may ask for (`n` is the server's alone: it submits
/// one engine request per choice).
const MAX_CHOICES: i64 = 16;

/// The error naming the engine's fields as the request called them (the
/// engine owns each field's rule and names the field its own way).
pub(super) fn named(e: impl Into<ApiError>, names: &FieldNames) -> ApiError {
    names
        .iter()
        .fold(e.into(), |e, (engine, wire)| e.renamed_param(engine, wire))
}

fn tokens_from_i64(v: &[i64], field: &str) -> Result<Vec<i32>, ApiError> {
    v.iter()
        .map(|&t| {
            i32::try_from(t)
                .map_err(|_| ApiError::bad_field(field, format!("token id {t} is out of range")))
        })
        .collect()
}

fn choices_n(n: Option<i64>) -> Result<usize, ApiError> {
    match n.unwrap_or(1) {
        n if (1..=MAX_CHOICES).contains(&n) => Ok(n as usize),
        n => Err(ApiError::bad_field(
            "n",
            format!("must be between 1 and {MAX_CHOICES}, got {n}"),
        )),
    }
}

/// The usage of a response with `n` choices per prompt, from each choice's
/// (index, usage).
fn usage_body(choices: impl IntoIterator<Item = (usize, Usage)>, n: usize) -> UsageBody {
    let mut total = Usage::default();
    for (i, u) in choices {
        // The prompt counts once per prompt, not once per choice.
        if i % n == 0 {
            total.prompt_tokens += u.prompt_tokens;
            total.cached_tokens += u.cached_tokens;
        }
        total.completion_tokens += u.completion_tokens;
    }
    total.into()
}

/// llama-server's `timings` of a non-streamed answer: its one choice's (it
/// has no `n`; several choices carry none).
fn one_timings(completions: &[Completion]) -> Option<Timings> {
    match completions {
        [c] => Some(Timings::from(&c.stats)),
        _ => None,
    }
}

/// The usage of a streamed response's choices as they finish, for the usage
/// chunk `stream_options.include_usage` asks for at the end.
#[derive(Clone, Default)]
struct StreamUsage(Arc<Mutex<Vec<(usize, Usage)>>>);

impl StreamUsage {
    fn record(&self, index: usize, usage: Usage) {
        if let Ok(mut v) = self.0.lock() {
            v.push((index, usage));
        }
    }

    fn body(&self, n: usize) -> UsageBody {
        let v = self.0.lock().map(|v| v.clone()).unwrap_or_default();
        usage_body(v, n)
    }
}

/// The end of an OpenAI stream: the usage chunk when there is one, then `[DONE]`.
fn stream_end<T: serde::Serialize>(usage_chunk: Option<T>) -> Vec<Event> {
    let mut out: Vec<Event> = usage_chunk.iter().map(json_event).collect();
    out.push(Event::default().data("[DONE]"));
    out
}

/// Submits `n` copies of each request (distinct seeds when one is given).
fn submit_all(
    engine: &Engine,
    reqs: Vec<GenerateRequest>,
    n: usize,
) -> Result<Vec<RequestHandle>, ApiError> {
    let mut handles = Vec::with_capacity(reqs.len() * n);
    for r in reqs {
        for j in 0..n {
            let mut r = r.clone();
            if let Some(s) = r.sampling.as_mut().and_then(|s| s.seed.as_mut()) {
                *s = s.wrapping_add(j as u32);
            }
            handles.push(engine.generate(r)?);
        }
    }
    Ok(handles)
}

async fn collect(handles: Vec<RequestHandle>) -> Result<Vec<Completion>, ApiError> {
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.completion().await?);
    }
    Ok(out)
}

/// Where the tokens of a choice start in its text (in bytes), following the
/// text as the engine decodes it: a character split across tokens is placed
/// at its start for each of its tokens, and bytes that never became a
/// character (U+FFFD in the text) come before the token that ended them.
#[derive(Default)]
struct TextOffset {
    /// The length of the text decoded so far.
    offset: usize,
    carry: sipp::text::Utf8Carry,
}

impl TextOffset {
    /// Text that starts at `offset` (after an echoed prompt).
    fn at(offset: usize) -> Self {
        Self {
            offset,
            ..Self::default()
        }
    }

    /// The offset of a token with these bytes, moving past it.
    fn next(&mut self, bytes: &[u8]) -> usize {
        let out = self.carry.push(bytes);
        // A token that is whole characters ends the text it produced; what
        // came before it there belongs to earlier tokens.
        let start = match std::str::from_utf8(bytes) {
            Ok(own) if !own.is_empty() && out.ends_with(own) => self.offset + out.len() - own.len(),
            _ => self.offset,
        };
        self.offset += out.len();
        start
    }
}

/// Legacy logprobs of `lps`, their `text_offset` from `at`, which moves past
/// the last.
fn completion_logprobs(
    lps: &[TokenLogprobs],
    at: &mut TextOffset,
    vocab: &dyn sipp::runtime::Vocab,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for lp in lps {
        out.tokens.push(lp.text.clone());
        out.token_logprobs.push(lp.logprobs.chosen.logprob);
        // Keyed by text, so tokens that are parts of characters (all U+FFFD)
        // share a key: it keeps the most likely of them (the alternatives come
        // most likely first), not the last.
        let mut top = std::collections::BTreeMap::new();
        for t in &lp.logprobs.top {
            top.entry(String::from_utf8_lossy(&vocab.token_bytes(t.token)).into_owned())
                .or_insert(t.logprob);
        }
        out.top_logprobs.push(top);
        out.text_offset.push(at.next(&vocab.token_bytes(lp.token)));
    }
    out
}

fn chat_logprobs(lps: &[TokenLogprobs], vocab: &dyn sipp::runtime::Vocab) -> ChatLogprobs {
    ChatLogprobs {
        content: lps
            .iter()
            .map(|lp| ChatTokenLogprob {
                token: lp.text.clone(),
                logprob: lp.logprobs.chosen.logprob,
                bytes: Some(vocab.token_bytes(lp.token)),
                top_logprobs: lp
                    .logprobs
                    .top
                    .iter()
                    .map(|t| {
                        let bytes = vocab.token_bytes(t.token);
                        TopLogprob {
                            token: String::from_utf8_lossy(&bytes).into_owned(),
                            logprob: t.logprob,
                            bytes: Some(bytes),
                        }
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// The prompts of a completion request (a text, texts, token ids or lists
/// of them).
pub(super) fn completion_prompts(req: &CompletionRequest) -> Result<Vec<PromptInput>, ApiError> {
    Ok(match req.prompt.clone() {
        None => return Err(ApiError::bad_field("prompt", "is required")),
        Some(PromptField::Text(s)) => vec![PromptInput::Text(s)],
        Some(PromptField::Texts(v)) if v.is_empty() => {
            return Err(ApiError::bad_field("prompt", "must not be an empty list"))
        }
        Some(PromptField::Texts(v)) => v.into_iter().map(PromptInput::Text).collect(),
        Some(PromptField::Tokens(v)) => vec![PromptInput::Tokens(tokens_from_i64(&v, "prompt")?)],
        Some(PromptField::TokenLists(v)) if v.is_empty() => {
            return Err(ApiError::bad_field("prompt", "must not be an empty list"))
        }
        Some(PromptField::TokenLists(v)) => v
            .iter()
            .map(|t| tokens_from_i64(t, "prompt").map(PromptInput::Tokens))
            .collect::<Result<_, _>>()?,
    })
}

/// POST /v1/completions.
pub async fn completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let (model, target) = state.target(req.model.as_deref())?;
    let engine = match target {
        Target::Local(e) => e,
        Target::Remote(r) => return super::remote::completions(model, r, req).await,
    };
    let prompts = completion_prompts(&req)?;
    let n = choices_n(req.n)?;
    let names = FieldNames::openai_completion(&req);
    // llama-server's n_predict = -1 means "no limit".
    let max_tokens = req.max_tokens.or(req.n_predict.filter(|&n| n >= 0));
    let base = request_from_openai(
        &req.sampling,
        max_tokens,
        req.logprobs,
        None,
        &engine.info().sampling,
        PromptInput::Text(String::new()),
    )
    .map_err(|e| named(e, &names))?;
    let logprobs = base.logprobs;
    let echo = req.echo.unwrap_or(false);
    let echoes: Vec<String> = prompts
        .iter()
        .map(|p| match p {
            PromptInput::Text(t) if echo => t.clone(),
            PromptInput::Tokens(t) if echo => engine.vocab().detokenize(t),
            _ => String::new(),
        })
        .collect();
    let reqs = prompts
        .into_iter()
        .map(|p| GenerateRequest {
            prompt: p,
            ..base.clone()
        })
        .collect();
    let handles = submit_all(&engine, reqs, n).map_err(|e| named(e, &names))?;
    let id = new_id("cmpl");
    let created = now_secs();
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let usage = StreamUsage::default();
        let (id2, model2, model_tail, usage2) =
            (id.clone(), model.clone(), model.clone(), usage.clone());
        let chunk = move |index: usize,
                          text: String,
                          logprobs: Option<CompletionLogprobs>,
                          finish: Option<String>| CompletionResponse {
            id: id.clone(),
            object: "text_completion".into(),
            created,
            model: model.clone(),
            choices: vec![CompletionChoice {
                index,
                text,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
            timings: None,
        };
        let vocab = engine.vocab().clone();
        let st = state.clone();
        let mut echoed = vec![false; echoes.len() * n];
        // Where each choice's next token starts in its text (after the echo).
        let mut offsets: Vec<TextOffset> = (0..echoes.len() * n)
            .map(|i| TextOffset::at(echoes[i / n].len()))
            .collect();
        let render = move |item: StreamItem| -> Vec<Event> {
            match item {
                StreamItem::Delta(i, d) => {
                    let mut text = String::new();
                    if !echoed[i] {
                        echoed[i] = true;
                        text.push_str(&echoes[i / n]);
                    }
                    text.push_str(&d.text);
                    let lp = (!d.logprobs.is_empty())
                        .then(|| completion_logprobs(&d.logprobs, &mut offsets[i], vocab.as_ref()));
                    if text.is_empty() && lp.is_none() {
                        return Vec::new();
                    }
                    vec![json_event(&chunk(i, text, lp, None))]
                }
                StreamItem::Finished(i, c) => {
                    st.finished(&model2, &c);
                    usage2.record(i, c.usage);
                    let reason = c.finish_reason.openai_name().to_string();
                    // A choice that ended before any delta still echoes its prompt.
                    let text = if echoed[i] {
                        String::new()
                    } else {
                        echoed[i] = true;
                        echoes[i / n].clone()
                    };
                    let mut last = chunk(i, text, None, Some(reason));
                    last.timings = Some(Timings::from(&c.stats));
                    vec![json_event(&last)]
                }
                StreamItem::Failed(_, e) => vec![json_event(&e.body())],
            }
        };
        let tail = move || {
            stream_end(include_usage.then(|| CompletionResponse {
                id: id2,
                object: "text_completion".into(),
                created,
                model: model_tail,
                choices: Vec::new(),
                usage: Some(usage.body(n)),
                timings: None,
            }))
        };
        return Ok(sse(handles, render, tail).into_response());
    }
    let completions = collect(handles).await?;
    let vocab = engine.vocab();
    let choices = completions
        .iter()
        .enumerate()
        .map(|(i, c)| {
            state.finished(&model, c);
            let prefix = &echoes[i / n];
            CompletionChoice {
                index: i,
                text: format!("{prefix}{}", c.text),
                logprobs: logprobs.map(|_| {
                    completion_logprobs(
                        &c.logprobs,
                        &mut TextOffset::at(prefix.len()),
                        vocab.as_ref(),
                    )
                }),
                finish_reason: Some(c.finish_reason.openai_name().to_string()),
            }
        })
        .collect();
    Ok(Json(CompletionResponse {
        id,
        object: "text_completion".into(),
        created,
        model,
        choices,
        usage: Some(usage_body(
            completions.iter().map(|c| c.usage).enumerate(),
            n,
        )),
        timings: one_timings(&completions),
    })
    .into_response())
}

/// The tools of a chat request: `auto` when tools are given, calls off
/// without them; parallel calls unless turned off.
fn tool_spec(req: &ChatCompletionRequest) -> Result<ToolSpec, ApiError> {
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
    let constrained = req
        .response_format
        .as_ref()
        .is_some_and(|f| !matches!(f, ResponseFormat::Text))
        || req.sampling.grammar.is_some()
        || req.sampling.json_schema.is_some();
    if spec.may_call() && constrained {
        return Err(ApiError::bad_field(
            "tools",
            "cannot be combined with `response_format`, `grammar` or `json_schema` unless `tool_choice` is \"none\"",
        ));
    }
    Ok(spec)
}

/// Stream deltas of an answer's events: runs of text and of reasoning
/// become one delta each; a call's start carries its index, id, type and
/// name, and each piece of arguments its index and the piece.
fn turn_deltas(events: Vec<TurnEvent>) -> Vec<ResponseMessage> {
    let mut out: Vec<ResponseMessage> = Vec::new();
    for e in events {
        match e {
            TurnEvent::Content(s) => match out.last_mut() {
                Some(m) if m.content.is_some() && m.tool_calls.is_none() => {
                    m.content.get_or_insert_with(String::new).push_str(&s)
                }
                _ => out.push(ResponseMessage {
                    content: Some(s),
                    ..Default::default()
                }),
            },
            TurnEvent::Reasoning(s) => match out.last_mut() {
                Some(m) if m.reasoning_content.is_some() => m
                    .reasoning_content
                    .get_or_insert_with(String::new)
                    .push_str(&s),
                _ => out.push(ResponseMessage {
                    reasoning_content: Some(s),
                    ..Default::default()
                }),
            },
            TurnEvent::CallStart { index, id, name } => out.push(ResponseMessage {
                tool_calls: Some(vec![ResponseToolCall {
                    index: Some(index),
                    id: Some(id),
                    kind: Some("function".into()),
                    function: FunctionPiece {
                        name: Some(name),
                        arguments: Some(String::new()),
                    },
                }]),
                ..Default::default()
            }),
            TurnEvent::CallArguments { index, fragment } => out.push(ResponseMessage {
                tool_calls: Some(vec![ResponseToolCall {
                    index: Some(index),
                    function: FunctionPiece {
                        name: None,
                        arguments: Some(fragment),
                    },
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            TurnEvent::CallEnd { .. } => {}
        }
    }
    out
}

/// OpenAI's finish reason of an answer: `tool_calls` when it called and
/// ended by itself.
fn chat_finish_reason(reason: sipp::text::FinishReason, output: &TurnOutput) -> String {
    match reason {
        sipp::text::FinishReason::Stop | sipp::text::FinishReason::Eos
            if !output.calls.is_empty() =>
        {
            "tool_calls".into()
        }
        r => r.openai_name().into(),
    }
}

/// The message of a whole answer. A call that `max_tokens` cut (its
/// arguments are not a whole JSON object) is left out: every call a
/// non-streamed answer carries is complete (`finish_reason` says `length`).
fn answer_message(output: &TurnOutput) -> ResponseMessage {
    let complete: Vec<ResponseToolCall> = output
        .complete_calls()
        .map(ResponseToolCall::from)
        .collect();
    let calls = (!complete.is_empty()).then_some(complete);
    ResponseMessage {
        role: Some("assistant".into()),
        content: (calls.is_none() || !output.content.is_empty()).then(|| output.content.clone()),
        reasoning_content: output.reasoning.clone(),
        tool_calls: calls,
    }
}

/// The prompt, constraint and output parser of a chat request: its
/// messages through the template with its tools, kwargs and
/// `continue_final_message`.
pub(super) fn chat_turn(
    engine: &Engine,
    req: &ChatCompletionRequest,
) -> Result<sipp::engine::PreparedTurn, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::bad_field(
            "messages",
            "must contain at least one message",
        ));
    }
    let spec = tool_spec(req)?;
    let heavy = crate::images::heavy(engine, &req.messages);
    Ok(crate::images::prepare(heavy, || {
        engine.prepare_turn(&ChatTurn {
            messages: &req.messages,
            tools: &spec,
            reasoning: req.reasoning_format.unwrap_or_default(),
            kwargs: req.chat_template_kwargs.as_ref(),
            continue_final: req.continue_final_message.unwrap_or(false),
        })
    })?)
}

/// POST /v1/chat/completions.
pub async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(mut req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let (model, target) = state.target(req.model.as_deref())?;
    let engine = match target {
        Target::Local(e) => e,
        Target::Remote(r) => return super::remote::chat_completions(model, r, req).await,
    };
    crate::images::fetch_remote(
        &state,
        crate::images::chat_urls(&mut req.messages),
        "messages",
    )
    .await?;
    let n = choices_n(req.n)?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, Some(_)) => {
            return Err(ApiError::bad_field(
                "top_logprobs",
                "requires `logprobs: true`",
            ))
        }
        (false, None) => None,
        (true, k) => Some(k.unwrap_or(0)),
    };
    let names = FieldNames::openai_chat(&req);
    let max_tokens = req.max_completion_tokens.or(req.max_tokens);
    if let Some(e) = ApiError::cannot_generate(&engine) {
        return Err(e);
    }
    let turn = chat_turn(&engine, &req)?;
    let mut base = request_from_openai(
        &req.sampling,
        max_tokens,
        logprobs,
        req.response_format.as_ref(),
        &engine.info().sampling,
        turn.prompt.clone(),
    )
    .map_err(|e| named(e, &names))?;
    if turn.constraint.is_some() {
        base.constraint = turn.constraint.clone();
    }
    base.reasoning_budget = req.reasoning_budget.and_then(|n| turn.reasoning_budget(n));
    let logprobs = base.logprobs;
    let handles = submit_all(&engine, vec![base], n)
        .map_err(|e| named(e, &names).renamed_param("prompt", "messages"))?;
    let id = new_id("chatcmpl");
    let created = now_secs();
    let vocab = engine.vocab().clone();
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let usage = StreamUsage::default();
        let usage2 = usage.clone();
        let (id2, model2) = (id.clone(), model.clone());
        let chunk = move |index: usize,
                          delta: ResponseMessage,
                          logprobs: Option<ChatLogprobs>,
                          finish: Option<String>| {
            ChatCompletionResponse {
                id: id.clone(),
                object: "chat.completion.chunk".into(),
                created,
                model: model.clone(),
                choices: vec![ChatChoice {
                    index,
                    message: None,
                    delta: Some(delta),
                    logprobs,
                    finish_reason: finish,
                }],
                usage: None,
                timings: None,
            }
        };
        let st = state.clone();
        let mut started = vec![false; n];
        let mut parsers = vec![turn.parser.clone(); n];
        let model3 = model2.clone();
        let render = move |item: StreamItem| -> Vec<Event> {
            let mut out = Vec::new();
            let (i, first) = match &item {
                StreamItem::Delta(i, _) | StreamItem::Finished(i, _) | StreamItem::Failed(i, _) => {
                    (*i, !started[*i])
                }
            };
            if first {
                started[i] = true;
                let role = ResponseMessage {
                    role: Some("assistant".into()),
                    content: Some(String::new()),
                    ..Default::default()
                };
                out.push(json_event(&chunk(i, role, None, None)));
            }
            match item {
                StreamItem::Delta(i, d) => {
                    let mut lp = (!d.logprobs.is_empty())
                        .then(|| chat_logprobs(&d.logprobs, vocab.as_ref()));
                    for delta in turn_deltas(parsers[i].push(&d.text)) {
                        out.push(json_event(&chunk(i, delta, lp.take(), None)));
                    }
                    if let Some(lp) = lp {
                        // Tokens whose text is held back still report their
                        // log-probabilities.
                        let delta = ResponseMessage {
                            content: Some(String::new()),
                            ..Default::default()
                        };
                        out.push(json_event(&chunk(i, delta, Some(lp), None)));
                    }
                }
                StreamItem::Finished(i, c) => {
                    st.finished(&model3, &c);
                    usage2.record(i, c.usage);
                    for delta in turn_deltas(parsers[i].finish()) {
                        out.push(json_event(&chunk(i, delta, None, None)));
                    }
                    let reason = chat_finish_reason(c.finish_reason, parsers[i].output());
                    let mut last = chunk(i, ResponseMessage::default(), None, Some(reason));
                    last.timings = Some(Timings::from(&c.stats));
                    out.push(json_event(&last));
                }
                StreamItem::Failed(_, e) => out.push(json_event(&e.body())),
            }
            out
        };
        let tail = move || {
            stream_end(include_usage.then(|| ChatCompletionResponse {
                id: id2,
                object: "chat.completion.chunk".into(),
                created,
                model: model2,
                choices: Vec::new(),
                usage: Some(usage.body(n)),
                timings: None,
            }))
        };
        return Ok(sse(handles, render, tail).into_response());
    }
    let completions = collect(handles)
        .await
        .map_err(|e| e.renamed_param("prompt", "messages"))?;
    let choices = completions
        .iter()
        .enumerate()
        .map(|(i, c)| {
            state.finished(&model, c);
            let output = turn.parser.clone().parse_all(&c.text);
            ChatChoice {
                index: i,
                message: Some(answer_message(&output)),
                delta: None,
                logprobs: logprobs.map(|_| chat_logprobs(&c.logprobs, vocab.as_ref())),
                finish_reason: Some(chat_finish_reason(c.finish_reason, &output)),
            }
        })
        .collect();
    Ok(Json(ChatCompletionResponse {
        id,
        object: "chat.completion".into(),
        created,
        model,
        choices,
        usage: Some(usage_body(
            completions.iter().map(|c| c.usage).enumerate(),
            n,
        )),
        timings: one_timings(&completions),
    })
    .into_response())
}

/// POST /v1/embeddings.
pub async fn embeddings(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<EmbeddingRequest>,
) -> Result<Response, ApiError> {
    let (model, target) = state.target(req.model.as_deref())?;
    let engine = match target {
        Target::Local(e) => e,
        Target::Remote(r) => return super::remote::embeddings(model, r, req).await,
    };
    if req.dimensions.is_some() {
        return Err(ApiError::bad_field(
            "dimensions",
            "truncated dimensions are not supported",
        ));
    }
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_field(
                "encoding_format",
                format!("must be \"float\" or \"base64\", got {other:?}"),
            ))
        }
    };
    let inputs: Vec<PromptInput> = match req.input {
        EmbeddingInput::Text(s) => vec![PromptInput::Text(s)],
        EmbeddingInput::Texts(v) => v.into_iter().map(PromptInput::Text).collect(),
        EmbeddingInput::Tokens(v) => vec![PromptInput::Tokens(tokens_from_i64(&v, "input")?)],
        EmbeddingInput::TokenLists(v) => v
            .iter()
            .map(|t| tokens_from_i64(t, "input").map(PromptInput::Tokens))
            .collect::<Result<_, _>>()?,
    };
    if inputs.is_empty() {
        return Err(ApiError::bad_field("input", "must not be empty"));
    }
    let handles = inputs
        .into_iter()
        .map(|i| {
            engine.embed(EmbedRequest {
                input: i,
                normalize: true,
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
        let embedding = if base64 {
            let bytes: Vec<u8> = e.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            EmbeddingVector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            EmbeddingVector::Float(e.values)
        };
        data.push(EmbeddingData {
            object: "embedding".into(),
            index,
            embedding,
        });
    }
    Ok(Json(EmbeddingResponse {
        object: "list".into(),
        data,
        model,
        usage: UsageBody {
            prompt_tokens,
            completion_tokens: 0,
            total_tokens: prompt_tokens,
            prompt_tokens_details: None,
        },
    })
    .into_response())
}
