//! Provider endpoints: OpenAI, any OpenAI-compatible server, and Anthropic.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::gateway::{header_map, protocol, remote_error, transport};
use super::sse::{finish_calls, stream_run, Piece};
use super::{
    ChatRequest, ClientError, EmbedRequest, Embedding, Embeddings, ProviderKind, QueryRequest,
    RequestOptions, Response, Run, RunEvent, Timeouts,
};
use crate::chat::{ChatMessage, Role};
use crate::engine::Usage;
use crate::tools::{new_call_id, ToolCall, ToolChoice, ToolFormat};

const ANTHROPIC_VERSION: &str = "2023-06-01";
/// Anthropic requires max_tokens; this is used when a request gives none.
const ANTHROPIC_DEFAULT_MAX_TOKENS: u32 = 1024;

pub(super) struct ProviderEndpoint {
    id: String,
    kind: ProviderKind,
    base: String,
    model: String,
    client: reqwest::Client,
    timeouts: Timeouts,
    max_retries: u32,
}

impl ProviderEndpoint {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        id: &str,
        kind: ProviderKind,
        base_url: Option<String>,
        api_key: Option<String>,
        model: String,
        headers: Vec<(String, String)>,
        timeouts: Timeouts,
        max_retries: u32,
    ) -> Result<Self, ClientError> {
        let invalid = |m: &str| ClientError::Invalid {
            endpoint: id.to_string(),
            message: m.to_string(),
        };
        let base = match (kind, base_url) {
            (_, Some(b)) => b,
            (ProviderKind::OpenAi, None) => "https://api.openai.com/v1".into(),
            (ProviderKind::Anthropic, None) => "https://api.anthropic.com".into(),
            (ProviderKind::OpenAiCompatible, None) => {
                return Err(invalid("an OpenAI-compatible provider needs a base_url"))
            }
        };
        if model.trim().is_empty() {
            return Err(invalid("a provider endpoint needs a model name"));
        }
        let mut pairs = headers;
        match (kind, api_key) {
            (ProviderKind::Anthropic, Some(k)) => {
                pairs.push(("x-api-key".into(), k));
                pairs.push(("anthropic-version".into(), ANTHROPIC_VERSION.into()));
            }
            (ProviderKind::Anthropic, None) => {
                return Err(invalid("an Anthropic endpoint needs an api_key"))
            }
            (_, Some(k)) => pairs.push(("authorization".into(), format!("Bearer {k}"))),
            (ProviderKind::OpenAi, None) => {
                return Err(invalid("an OpenAI endpoint needs an api_key"))
            }
            (ProviderKind::OpenAiCompatible, None) => {}
        }
        let client = reqwest::Client::builder()
            .default_headers(header_map(id, &pairs)?)
            .connect_timeout(timeouts.connect)
            .build()
            .map_err(|e| transport(id, e))?;
        Ok(Self {
            id: id.to_string(),
            kind,
            base: base.trim_end_matches('/').to_string(),
            model,
            client,
            timeouts,
            max_retries,
        })
    }

    fn unsupported(&self, operation: &'static str, why: &str) -> ClientError {
        ClientError::Unsupported {
            endpoint: self.id.clone(),
            operation,
            why: why.to_string(),
        }
    }

    /// Sends a request, retrying only where nothing can have been generated:
    /// connection failures, 429 and 503 (and Anthropic's 529), honouring
    /// Retry-After.
    async fn send(
        &self,
        path: &str,
        body: &Value,
        stream: bool,
    ) -> Result<reqwest::Response, ClientError> {
        let mut attempt = 0;
        loop {
            let mut req = self.client.post(format!("{}{path}", self.base)).json(body);
            if !stream {
                req = req.timeout(self.timeouts.request);
            }
            let result = req.send().await;
            let retry_after = match &result {
                Err(e) if e.is_connect() => Some(None),
                Ok(r) if matches!(r.status().as_u16(), 429 | 503 | 529) => Some(
                    r.headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<f64>().ok())
                        .map(|s| Duration::from_secs_f64(s.clamp(0.0, 30.0))),
                ),
                _ => None,
            };
            if let (Some(wait), true) = (retry_after, attempt < self.max_retries) {
                let backoff = Duration::from_millis(250 * (1 << attempt.min(6)));
                tokio::time::sleep(wait.unwrap_or(backoff)).await;
                attempt += 1;
                continue;
            }
            let resp = result.map_err(|e| transport(&self.id, e))?;
            return if resp.status().is_success() {
                Ok(resp)
            } else {
                Err(remote_error(&self.id, resp).await)
            };
        }
    }

    fn invalid(&self, message: impl Into<String>) -> ClientError {
        ClientError::Invalid {
            endpoint: self.id.clone(),
            message: message.into(),
        }
    }

    fn common_fields(&self, body: &mut Value, o: &RequestOptions) {
        if let Some(t) = o.text.temperature {
            body["temperature"] = json!(t);
        }
        if let Some(p) = o.text.top_p {
            body["top_p"] = json!(p);
        }
    }

    /// The caller's extra fields, merged last: they win.
    fn extra_fields(body: &mut Value, o: &RequestOptions) {
        for (k, v) in &o.provider.extra {
            body[k] = v.clone();
        }
    }

    fn openai_body(&self, o: &RequestOptions, chat: bool) -> Value {
        let mut body = json!({"model": self.model, "stream": o.stream});
        if let Some(n) = o.text.max_tokens {
            // OpenAI's chat API names it max_completion_tokens now; compatible
            // servers mostly know max_tokens.
            let key = if chat && self.kind == ProviderKind::OpenAi {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            body[key] = json!(n);
        }
        if !o.text.stop.is_empty() {
            body["stop"] = json!(o.text.stop);
        }
        if let Some(u) = &o.provider.user {
            body["user"] = json!(u);
        }
        if o.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        self.common_fields(&mut body, o);
        body
    }

    pub(super) async fn query(&self, req: QueryRequest) -> Result<Run, ClientError> {
        if self.kind == ProviderKind::Anthropic {
            return Err(self.unsupported("query", "Anthropic has no completions API; send a chat"));
        }
        let mut body = self.openai_body(&req.options, false);
        body["prompt"] = json!(req.prompt);
        Self::extra_fields(&mut body, &req.options);
        self.openai_run("/completions", body, req.options.stream, false)
            .await
    }

    pub(super) async fn chat(&self, req: ChatRequest) -> Result<Run, ClientError> {
        if self.kind == ProviderKind::Anthropic {
            return self.anthropic_chat(req).await;
        }
        let mut body = self.openai_body(&req.options, true);
        body["messages"] = self.openai_messages(&req.messages)?;
        if !req.tools.is_empty() {
            body["tools"] = serde_json::to_value(&req.tools).map_err(|e| protocol(&self.id, e))?;
        }
        if let Some(c) = &req.tool_choice {
            body["tool_choice"] = serde_json::to_value(c).map_err(|e| protocol(&self.id, e))?;
        }
        if let Some(p) = req.parallel_tool_calls {
            body["parallel_tool_calls"] = json!(p);
        }
        Self::extra_fields(&mut body, &req.options);
        self.openai_run("/chat/completions", body, req.options.stream, true)
            .await
    }

    /// The conversation in OpenAI's shape: the messages as they are (calls
    /// in `tool_calls`, results as `tool` messages), without the reasoning
    /// of earlier answers, which providers do not take back.
    fn openai_messages(&self, messages: &[ChatMessage]) -> Result<Value, ClientError> {
        let mut v = serde_json::to_value(messages).map_err(|e| protocol(&self.id, e))?;
        for m in v.as_array_mut().into_iter().flatten() {
            if let Some(o) = m.as_object_mut() {
                o.remove("reasoning_content");
            }
        }
        Ok(v)
    }

    async fn openai_run(
        &self,
        path: &str,
        body: Value,
        stream: bool,
        chat: bool,
    ) -> Result<Run, ClientError> {
        let resp = self.send(path, &body, stream).await?;
        if !stream {
            let v: Value = resp.json().await.map_err(|e| protocol(&self.id, e))?;
            let choice = &v["choices"][0];
            let mut r = Response {
                finish_reason: openai_reason(choice["finish_reason"].as_str()),
                usage: openai_usage(&v["usage"]),
                ..Response::default()
            };
            if chat {
                let m = &choice["message"];
                if !m.is_object() {
                    return Err(protocol(&self.id, format!("no message in {v}")));
                }
                r.text = match &m["content"] {
                    Value::Null => String::new(),
                    Value::String(s) => s.clone(),
                    // Content parts: their texts.
                    Value::Array(parts) => {
                        parts.iter().filter_map(|p| p["text"].as_str()).collect()
                    }
                    other => {
                        return Err(protocol(&self.id, format!("content {other} is not text")))
                    }
                };
                r.reasoning = openai_reasoning(m).map(str::to_string);
                for (i, c) in m["tool_calls"].as_array().into_iter().flatten().enumerate() {
                    let name = c["function"]["name"].as_str().ok_or_else(|| {
                        protocol(
                            &self.id,
                            format!("tool_calls[{i}] has no function name: {c}"),
                        )
                    })?;
                    let id = c["id"]
                        .as_str()
                        .map_or_else(|| new_call_id(ToolFormat::Generic), str::to_string);
                    r.tool_calls.push(ToolCall::new(
                        id,
                        name,
                        arguments_text(&c["function"]["arguments"]),
                    ));
                }
            } else {
                r.text = choice["text"]
                    .as_str()
                    .ok_or_else(|| protocol(&self.id, format!("no text in {v}")))?
                    .to_string();
            }
            finish_calls(&mut r);
            let (tx, _, run) = Run::channel();
            let _ = tx.send(RunEvent::Done(r));
            return Ok(run);
        }
        let id = self.id.clone();
        // Streamed calls, by the provider's index: started (with the id and
        // name), or arguments seen before the name.
        let mut calls: HashMap<usize, StreamedCall> = HashMap::new();
        Ok(stream_run(
            &self.id,
            resp,
            self.timeouts.stream_read,
            true,
            move |ev| {
                if ev.data.trim() == "[DONE]" {
                    return Ok(vec![Piece::End]);
                }
                let v: Value = serde_json::from_str(&ev.data)
                    .map_err(|e| protocol(&id, format!("{e}: {}", ev.data)))?;
                if let Some(err) = v.get("error") {
                    return Err(ClientError::Remote {
                        endpoint: id.clone(),
                        status: 200,
                        message: err["message"].as_str().unwrap_or("error").to_string(),
                    });
                }
                let mut out = Vec::new();
                if let Some(c) = v["choices"].get(0) {
                    let d = &c["delta"];
                    if chat {
                        if let Some(t) = openai_reasoning(d) {
                            out.push(Piece::Reasoning(t.to_string()));
                        }
                    }
                    let t = if chat { &d["content"] } else { &c["text"] };
                    if let Some(t) = t.as_str().filter(|t| !t.is_empty()) {
                        out.push(Piece::Text(t.to_string()));
                    }
                    let pieces = d["tool_calls"].as_array().into_iter().flatten();
                    for (pos, tc) in pieces.enumerate() {
                        let index = tc["index"].as_u64().map_or(pos, |i| i as usize);
                        calls.entry(index).or_default().read(index, tc, &mut out);
                    }
                    if let Some(r) = c["finish_reason"].as_str() {
                        out.push(Piece::Finish(openai_reason(Some(r))));
                    }
                }
                if v["usage"].is_object() {
                    out.push(Piece::Usage(openai_usage(&v["usage"])));
                }
                Ok(out)
            },
        ))
    }

    /// The conversation in Anthropic's shape: system messages joined into
    /// `system`; an assistant's calls as `tool_use` blocks; tool results as
    /// `tool_result` blocks of one user message (with the user's text that
    /// follows them).
    fn anthropic_messages(
        &self,
        msgs: &[ChatMessage],
    ) -> Result<(Vec<String>, Vec<Value>), ClientError> {
        let mut system = Vec::new();
        let mut messages: Vec<Value> = Vec::new();
        // Whether the last message is a user turn of tool results.
        let mut results_open = false;
        for (i, m) in msgs.iter().enumerate() {
            let calls = m.tool_calls.as_deref().unwrap_or_default();
            match m.role {
                Role::System => system.push(m.text()),
                Role::User if results_open => {
                    if let Some(blocks) = messages
                        .last_mut()
                        .and_then(|l| l["content"].as_array_mut())
                    {
                        match anthropic_content(m) {
                            Value::Array(parts) => blocks.extend(parts),
                            text => blocks.push(json!({"type": "text", "text": text})),
                        }
                    }
                    results_open = false;
                }
                Role::Assistant if !calls.is_empty() => {
                    let mut blocks = Vec::new();
                    let text = m.text();
                    if !text.is_empty() {
                        blocks.push(json!({"type": "text", "text": text}));
                    }
                    for (j, c) in calls.iter().enumerate() {
                        let args = c.function.arguments.trim();
                        let input: Value = if args.is_empty() {
                            json!({})
                        } else {
                            serde_json::from_str(args).map_err(|e| {
                                self.invalid(format!(
                                    "`messages[{i}].tool_calls[{j}].function.arguments` is not JSON: {e}"
                                ))
                            })?
                        };
                        if !input.is_object() {
                            return Err(self.invalid(format!(
                                "`messages[{i}].tool_calls[{j}].function.arguments` must be a JSON object"
                            )));
                        }
                        blocks.push(json!({
                            "type": "tool_use", "id": c.id, "name": c.function.name, "input": input,
                        }));
                    }
                    messages.push(json!({"role": "assistant", "content": blocks}));
                    results_open = false;
                }
                Role::User | Role::Assistant => {
                    messages
                        .push(json!({"role": m.role.as_str(), "content": anthropic_content(m)}));
                    results_open = false;
                }
                Role::Tool => {
                    let id = m.tool_call_id.as_deref().ok_or_else(|| {
                        self.invalid(format!(
                            "`messages[{i}].tool_call_id` is required: Anthropic answers a call by its id"
                        ))
                    })?;
                    let block =
                        json!({"type": "tool_result", "tool_use_id": id, "content": m.text()});
                    match messages
                        .last_mut()
                        .and_then(|l| l["content"].as_array_mut())
                    {
                        Some(blocks) if results_open => blocks.push(block),
                        _ => messages.push(json!({"role": "user", "content": [block]})),
                    }
                    results_open = true;
                }
            }
        }
        Ok((system, messages))
    }

    /// Tools and the choice in Anthropic's shape.
    fn anthropic_tools(req: &ChatRequest, body: &mut Value) {
        if !req.tools.is_empty() {
            let tools: Vec<Value> = req
                .tools
                .iter()
                .map(|t| {
                    let mut v = json!({"name": t.function.name, "input_schema": t.parameters()});
                    if let Some(d) = &t.function.description {
                        v["description"] = json!(d);
                    }
                    v
                })
                .collect();
            body["tools"] = json!(tools);
        }
        let mut choice = match &req.tool_choice {
            Some(ToolChoice::None) => json!({"type": "none"}),
            Some(ToolChoice::Auto) => json!({"type": "auto"}),
            Some(ToolChoice::Required) => json!({"type": "any"}),
            Some(ToolChoice::Function(name)) => json!({"type": "tool", "name": name}),
            None if req.parallel_tool_calls == Some(false) && !req.tools.is_empty() => {
                json!({"type": "auto"})
            }
            None => return,
        };
        if req.parallel_tool_calls == Some(false) && choice["type"] != "none" {
            choice["disable_parallel_tool_use"] = json!(true);
        }
        body["tool_choice"] = choice;
    }

    async fn anthropic_chat(&self, req: ChatRequest) -> Result<Run, ClientError> {
        let o = &req.options;
        let (system, messages) = self.anthropic_messages(&req.messages)?;
        if messages.is_empty() {
            return Err(ClientError::Invalid {
                endpoint: self.id.clone(),
                message:
                    "Anthropic needs at least one user or assistant message besides system messages"
                        .into(),
            });
        }
        let mut body = json!({
            "model": self.model,
            "max_tokens": o.text.max_tokens.unwrap_or(ANTHROPIC_DEFAULT_MAX_TOKENS),
            "messages": messages,
            "stream": o.stream,
        });
        if !system.is_empty() {
            body["system"] = json!(system.join("\n\n"));
        }
        if !o.text.stop.is_empty() {
            body["stop_sequences"] = json!(o.text.stop);
        }
        if let Some(u) = &o.provider.user {
            body["metadata"] = json!({"user_id": u});
        }
        self.common_fields(&mut body, o);
        Self::anthropic_tools(&req, &mut body);
        Self::extra_fields(&mut body, o);
        let resp = self.send("/v1/messages", &body, o.stream).await?;
        if !o.stream {
            let v: Value = resp.json().await.map_err(|e| protocol(&self.id, e))?;
            let blocks = v["content"]
                .as_array()
                .ok_or_else(|| protocol(&self.id, format!("no content in {v}")))?;
            let mut r = Response {
                finish_reason: anthropic_reason(v["stop_reason"].as_str()),
                usage: anthropic_usage(&v["usage"], None),
                ..Response::default()
            };
            for b in blocks {
                match b["type"].as_str() {
                    Some("text") => r.text.push_str(b["text"].as_str().unwrap_or_default()),
                    Some("thinking") => r
                        .reasoning
                        .get_or_insert_with(String::new)
                        .push_str(b["thinking"].as_str().unwrap_or_default()),
                    Some("tool_use") => r.tool_calls.push(ToolCall::new(
                        b["id"].as_str().unwrap_or_default(),
                        b["name"].as_str().unwrap_or_default(),
                        arguments_text(&b["input"]),
                    )),
                    _ => {}
                }
            }
            finish_calls(&mut r);
            let (tx, _, run) = Run::channel();
            let _ = tx.send(RunEvent::Done(r));
            return Ok(run);
        }
        let id = self.id.clone();
        let mut input: Option<Value> = None;
        Ok(stream_run(
            &self.id,
            resp,
            self.timeouts.stream_read,
            true,
            move |ev| {
                let v: Value = if ev.data.is_empty() {
                    Value::Null
                } else {
                    serde_json::from_str(&ev.data)
                        .map_err(|e| protocol(&id, format!("{e}: {}", ev.data)))?
                };
                let kind = ev
                    .event
                    .clone()
                    .or_else(|| v["type"].as_str().map(str::to_string))
                    .unwrap_or_default();
                Ok(match kind.as_str() {
                    "message_start" => {
                        input = Some(v["message"]["usage"].clone());
                        Vec::new()
                    }
                    "content_block_start" if v["content_block"]["type"] == "tool_use" => {
                        let b = &v["content_block"];
                        vec![Piece::CallStart {
                            index: block_index(&v),
                            id: b["id"].as_str().unwrap_or_default().to_string(),
                            name: b["name"].as_str().unwrap_or_default().to_string(),
                        }]
                    }
                    "content_block_delta" => {
                        let d = &v["delta"];
                        let s = |k: &str| d[k].as_str().unwrap_or_default().to_string();
                        match d["type"].as_str() {
                            Some("text_delta") => vec![Piece::Text(s("text"))],
                            Some("thinking_delta") => vec![Piece::Reasoning(s("thinking"))],
                            Some("input_json_delta") => vec![Piece::CallArguments {
                                index: block_index(&v),
                                fragment: s("partial_json"),
                            }],
                            // signature_delta, citations.
                            _ => Vec::new(),
                        }
                    }
                    "message_delta" => {
                        let mut out = Vec::new();
                        if let Some(r) = v["delta"]["stop_reason"].as_str() {
                            out.push(Piece::Finish(anthropic_reason(Some(r))));
                        }
                        out.push(Piece::Usage(anthropic_usage(&v["usage"], input.as_ref())));
                        out
                    }
                    "message_stop" => vec![Piece::End],
                    "error" => {
                        return Err(ClientError::Remote {
                            endpoint: id.clone(),
                            status: 200,
                            message: v["error"]["message"]
                                .as_str()
                                .unwrap_or("error")
                                .to_string(),
                        })
                    }
                    // ping, content_block_start, content_block_stop.
                    _ => Vec::new(),
                })
            },
        ))
    }

    pub(super) async fn embed(&self, req: EmbedRequest) -> Result<Embeddings, ClientError> {
        if self.kind == ProviderKind::Anthropic {
            return Err(self.unsupported("embed", "Anthropic offers no embeddings API"));
        }
        let mut body =
            json!({"model": self.model, "input": req.inputs, "encoding_format": "float"});
        if let Some(u) = &req.provider.user {
            body["user"] = json!(u);
        }
        for (k, v) in &req.provider.extra {
            body[k] = v.clone();
        }
        let v: Value = self
            .send("/embeddings", &body, false)
            .await?
            .json()
            .await
            .map_err(|e| protocol(&self.id, e))?;
        let mut rows: Vec<(usize, Vec<f32>)> = v["data"]
            .as_array()
            .ok_or_else(|| protocol(&self.id, format!("no data in {v}")))?
            .iter()
            .map(|d| {
                let values = serde_json::from_value(d["embedding"].clone())
                    .map_err(|e| protocol(&self.id, e))?;
                Ok((d["index"].as_u64().unwrap_or(0) as usize, values))
            })
            .collect::<Result<_, ClientError>>()?;
        rows.sort_by_key(|(i, _)| *i);
        Ok(Embeddings {
            prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize,
            data: rows
                .into_iter()
                .map(|(_, values)| Embedding {
                    values,
                    pooling: None,
                    normalized: None,
                })
                .collect(),
        })
    }
}

fn openai_usage(u: &Value) -> Usage {
    Usage {
        prompt_tokens: u["prompt_tokens"].as_u64().unwrap_or(0) as usize,
        completion_tokens: u["completion_tokens"].as_u64().unwrap_or(0) as usize,
        cached_tokens: u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0) as usize,
    }
}

fn anthropic_usage(u: &Value, start: Option<&Value>) -> Usage {
    let input = |v: &Value| v["input_tokens"].as_u64();
    let cached = |v: &Value| v["cache_read_input_tokens"].as_u64();
    Usage {
        prompt_tokens: input(u).or_else(|| start.and_then(input)).unwrap_or(0) as usize,
        completion_tokens: u["output_tokens"].as_u64().unwrap_or(0) as usize,
        cached_tokens: cached(u).or_else(|| start.and_then(cached)).unwrap_or(0) as usize,
    }
}

fn anthropic_reason(r: Option<&str>) -> String {
    match r {
        Some("max_tokens") => "length",
        Some("end_turn" | "stop_sequence") | None => "stop",
        Some("tool_use") => "tool_calls",
        Some(other) => other,
    }
    .to_string()
}

/// The content block an Anthropic stream event is about.
fn block_index(v: &Value) -> usize {
    v["index"].as_u64().unwrap_or(0) as usize
}

fn openai_reason(r: Option<&str>) -> String {
    match r {
        // The legacy name.
        Some("function_call") => "tool_calls",
        Some(other) => other,
        None => "stop",
    }
    .to_string()
}

/// The reasoning of an OpenAI-shaped message or delta: `reasoning_content`
/// (DeepSeek, vLLM, llama.cpp) or `reasoning` (OpenRouter, Ollama).
fn openai_reasoning(m: &Value) -> Option<&str> {
    m["reasoning_content"]
        .as_str()
        .or_else(|| m["reasoning"].as_str())
        .filter(|s| !s.is_empty())
}

/// Arguments as JSON text: a string as it is (OpenAI's shape), any other
/// value (an object, as some compatible servers and Anthropic send them)
/// written out.
fn arguments_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// One call of an OpenAI stream, by the provider's index.
#[derive(Default)]
struct StreamedCall {
    id: Option<String>,
    started: bool,
    /// Arguments that came before the name.
    pending: String,
}

impl StreamedCall {
    /// Reads a `delta.tool_calls` entry: the call starts once its name is
    /// known (with its id, or a fresh one), and its arguments follow.
    fn read(&mut self, index: usize, tc: &Value, out: &mut Vec<Piece>) {
        if let Some(id) = tc["id"].as_str().filter(|s| !s.is_empty()) {
            self.id.get_or_insert_with(|| id.to_string());
        }
        let f = &tc["function"];
        if !self.started {
            if let Some(name) = f["name"].as_str().filter(|s| !s.is_empty()) {
                self.started = true;
                out.push(Piece::CallStart {
                    index,
                    id: self
                        .id
                        .clone()
                        .unwrap_or_else(|| new_call_id(ToolFormat::Generic)),
                    name: name.to_string(),
                });
                if !self.pending.is_empty() {
                    out.push(Piece::CallArguments {
                        index,
                        fragment: std::mem::take(&mut self.pending),
                    });
                }
            }
        }
        let args = arguments_text(&f["arguments"]);
        if args.is_empty() {
            return;
        }
        if self.started {
            out.push(Piece::CallArguments {
                index,
                fragment: args,
            });
        } else {
            self.pending.push_str(&args);
        }
    }
}

/// A message's content as Anthropic takes it: its text, or blocks when it
/// has images (a data URL as a base64 source, another URL as a url source).
fn anthropic_content(m: &ChatMessage) -> Value {
    use crate::chat::{ContentPart, MessageContent};
    let Some(MessageContent::Parts(parts)) = &m.content else {
        return Value::String(m.text());
    };
    if m.image_urls().is_empty() {
        return Value::String(m.text());
    }
    let blocks = parts
        .iter()
        .map(|p| match p {
            ContentPart::Text { text } => json!({"type": "text", "text": text}),
            ContentPart::ImageUrl { image_url } => {
                let url = image_url.url.trim();
                match url
                    .strip_prefix("data:")
                    .and_then(|r| r.split_once(','))
                    .and_then(|(head, data)| head.strip_suffix(";base64").map(|mime| (mime, data)))
                {
                    Some((mime, data)) => json!({"type": "image", "source": {
                        "type": "base64", "media_type": mime, "data": data}}),
                    None => json!({"type": "image", "source": {"type": "url", "url": url}}),
                }
            }
        })
        .collect();
    Value::Array(blocks)
}

#[cfg(test)]
mod image_tests {
    use super::*;
    use crate::chat::{ContentPart, MessageContent, Role};

    #[test]
    fn images_become_anthropic_image_blocks() {
        let m = ChatMessage::new(
            Role::User,
            MessageContent::Parts(vec![
                ContentPart::image("data:image/png;base64,iVBOR"),
                ContentPart::Text {
                    text: "what is it?".into(),
                },
                ContentPart::image("https://example.com/a.jpg"),
            ]),
        );
        assert_eq!(
            anthropic_content(&m),
            json!([
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
                {"type": "text", "text": "what is it?"},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
            ])
        );
        assert_eq!(
            anthropic_content(&ChatMessage::new(Role::User, "plain")),
            json!("plain")
        );
    }
}
