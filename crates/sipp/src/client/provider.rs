//! Provider endpoints: OpenAI, any OpenAI-compatible server, and Anthropic.

use std::time::Duration;

use serde_json::{json, Value};

use super::gateway::{header_map, protocol, remote_error, transport};
use super::sse::stream_run;
use super::sse::Piece;
use super::{
    ChatRequest, ClientError, EmbedRequest, Embedding, Embeddings, ProviderKind, QueryRequest,
    RequestOptions, Response, Run, RunEvent, Timeouts,
};
use crate::chat::Role;
use crate::engine::Usage;

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

    fn common_fields(&self, body: &mut Value, o: &RequestOptions) {
        if let Some(t) = o.text.temperature {
            body["temperature"] = json!(t);
        }
        if let Some(p) = o.text.top_p {
            body["top_p"] = json!(p);
        }
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
        self.openai_run("/completions", body, req.options.stream, false)
            .await
    }

    pub(super) async fn chat(&self, req: ChatRequest) -> Result<Run, ClientError> {
        if self.kind == ProviderKind::Anthropic {
            return self.anthropic_chat(req).await;
        }
        let mut body = self.openai_body(&req.options, true);
        body["messages"] =
            serde_json::to_value(&req.messages).map_err(|e| protocol(&self.id, e))?;
        self.openai_run("/chat/completions", body, req.options.stream, true)
            .await
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
            let text = if chat {
                &choice["message"]["content"]
            } else {
                &choice["text"]
            };
            let text = text
                .as_str()
                .ok_or_else(|| protocol(&self.id, format!("no text in {v}")))?;
            let (tx, _, run) = Run::channel();
            let _ = tx.send(RunEvent::Done(Response {
                text: text.to_string(),
                finish_reason: choice["finish_reason"]
                    .as_str()
                    .unwrap_or("stop")
                    .to_string(),
                usage: openai_usage(&v["usage"]),
                stats: None,
                logprobs: Vec::new(),
            }));
            return Ok(run);
        }
        let id = self.id.clone();
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
                    let t = if chat {
                        &c["delta"]["content"]
                    } else {
                        &c["text"]
                    };
                    if let Some(t) = t.as_str().filter(|t| !t.is_empty()) {
                        out.push(Piece::Text(t.to_string()));
                    }
                    if let Some(r) = c["finish_reason"].as_str() {
                        out.push(Piece::Finish(r.to_string()));
                    }
                }
                if v["usage"].is_object() {
                    out.push(Piece::Usage(openai_usage(&v["usage"])));
                }
                Ok(out)
            },
        ))
    }

    async fn anthropic_chat(&self, req: ChatRequest) -> Result<Run, ClientError> {
        let o = &req.options;
        let mut system = Vec::new();
        let mut messages = Vec::new();
        for m in &req.messages {
            match m.role {
                Role::System => system.push(m.content.text()),
                Role::User | Role::Assistant => {
                    messages.push(json!({"role": m.role.as_str(), "content": m.content.text()}))
                }
                Role::Tool => {
                    return Err(self.unsupported(
                        "chat",
                        "tool messages are not supported on Anthropic endpoints",
                    ))
                }
            }
        }
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
        let resp = self.send("/v1/messages", &body, o.stream).await?;
        if !o.stream {
            let v: Value = resp.json().await.map_err(|e| protocol(&self.id, e))?;
            let text: String = v["content"]
                .as_array()
                .ok_or_else(|| protocol(&self.id, format!("no content in {v}")))?
                .iter()
                .filter(|b| b["type"] == "text")
                .filter_map(|b| b["text"].as_str())
                .collect();
            let (tx, _, run) = Run::channel();
            let _ = tx.send(RunEvent::Done(Response {
                text,
                finish_reason: anthropic_reason(v["stop_reason"].as_str()),
                usage: anthropic_usage(&v["usage"], None),
                stats: None,
                logprobs: Vec::new(),
            }));
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
                    "content_block_delta" if v["delta"]["type"] == "text_delta" => {
                        vec![Piece::Text(
                            v["delta"]["text"].as_str().unwrap_or_default().to_string(),
                        )]
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
        Some(other) => other,
    }
    .to_string()
}
