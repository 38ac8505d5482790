//! Gateway endpoints: a sipp server's first-party profile over HTTP.

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

use super::sse::{stream_run, Piece};
use super::{
    ChatRequest, ClientError, EmbedRequest, Embedding, Embeddings, GatewayAuth, QueryRequest,
    RequestOptions, Response, Run, Timeouts,
};
use crate::protocol::native::{
    ChatBody, EmbedBody, EmbedResponseBody, GenerationBody, OneOrMany, QueryBody, StreamEvent,
    TextOptions,
};
use crate::protocol::openai::ErrorBody;
use crate::tools::turn::ReasoningFormat;

pub(super) struct GatewayEndpoint {
    id: String,
    base: String,
    target: Option<String>,
    client: reqwest::Client,
    timeouts: Timeouts,
}

/// Builds the default headers of a remote endpoint.
pub(super) fn header_map(id: &str, pairs: &[(String, String)]) -> Result<HeaderMap, ClientError> {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        let name = HeaderName::from_bytes(k.as_bytes()).map_err(|e| ClientError::Invalid {
            endpoint: id.to_string(),
            message: format!("header name {k:?}: {e}"),
        })?;
        let value = HeaderValue::from_str(v).map_err(|e| ClientError::Invalid {
            endpoint: id.to_string(),
            message: format!("header {k}: {e}"),
        })?;
        h.insert(name, value);
    }
    Ok(h)
}

/// An error answer as a client error, with the server's message when it sent one.
pub(super) async fn remote_error(id: &str, resp: reqwest::Response) -> ClientError {
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    let message = serde_json::from_str::<ErrorBody>(&text)
        .map(|b| b.error.message)
        .or_else(|_| {
            serde_json::from_str::<serde_json::Value>(&text).map(|v| {
                v["error"]["message"]
                    .as_str()
                    .map_or_else(|| text.clone(), str::to_string)
            })
        })
        .unwrap_or(text);
    ClientError::Remote {
        endpoint: id.to_string(),
        status,
        message,
    }
}

pub(super) fn transport(id: &str, e: impl std::fmt::Display) -> ClientError {
    ClientError::Transport {
        endpoint: id.to_string(),
        message: e.to_string(),
    }
}

pub(super) fn protocol(id: &str, e: impl std::fmt::Display) -> ClientError {
    ClientError::Protocol {
        endpoint: id.to_string(),
        message: e.to_string(),
    }
}

impl GatewayEndpoint {
    pub(super) fn new(
        id: &str,
        base_url: String,
        target: Option<String>,
        auth: GatewayAuth,
        headers: Vec<(String, String)>,
        timeouts: Timeouts,
    ) -> Result<Self, ClientError> {
        let mut pairs = headers;
        match auth {
            GatewayAuth::None => {}
            GatewayAuth::Bearer(t) => pairs.push(("authorization".into(), format!("Bearer {t}"))),
            GatewayAuth::Header { name, value } => pairs.push((name, value)),
        }
        let client = reqwest::Client::builder()
            .default_headers(header_map(id, &pairs)?)
            .connect_timeout(timeouts.connect)
            .build()
            .map_err(|e| transport(id, e))?;
        Ok(Self {
            id: id.to_string(),
            base: base_url.trim_end_matches('/').to_string(),
            target,
            client,
            timeouts,
        })
    }

    fn options(o: &RequestOptions) -> TextOptions {
        o.native_options()
    }

    async fn post<T: serde::Serialize>(
        &self,
        path: &str,
        body: &T,
        stream: bool,
    ) -> Result<reqwest::Response, ClientError> {
        let mut req = self.client.post(format!("{}{path}", self.base)).json(body);
        if !stream {
            req = req.timeout(self.timeouts.request);
        }
        let resp = req.send().await.map_err(|e| transport(&self.id, e))?;
        if resp.status().is_success() {
            Ok(resp)
        } else {
            Err(remote_error(&self.id, resp).await)
        }
    }

    pub(super) async fn query(&self, req: QueryRequest) -> Result<Run, ClientError> {
        let stream = req.options.stream;
        let body = QueryBody {
            model: self.target.clone(),
            prompt: req.prompt,
            stream,
            options: Self::options(&req.options),
        };
        self.generate("/v1/query", &body, stream).await
    }

    pub(super) async fn chat(&self, req: ChatRequest) -> Result<Run, ClientError> {
        let stream = req.options.stream;
        let body = ChatBody {
            model: self.target.clone(),
            stream,
            options: Self::options(&req.options),
            tools: (!req.tools.is_empty()).then_some(req.tools),
            tool_choice: req.tool_choice,
            parallel_tool_calls: req.parallel_tool_calls,
            // Reasoning comes apart from the answer, as on a local endpoint.
            reasoning_format: Some(ReasoningFormat::Split),
            messages: req.messages,
        };
        self.generate("/v1/chat", &body, stream).await
    }

    async fn generate<T: serde::Serialize>(
        &self,
        path: &str,
        body: &T,
        stream: bool,
    ) -> Result<Run, ClientError> {
        // Always stream on the wire: cancelling then closes the connection,
        // which the server turns into a cancellation of the request.
        let mut wire = serde_json::to_value(body).map_err(|e| protocol(&self.id, e))?;
        wire["stream"] = serde_json::Value::Bool(true);
        let resp = self.post(path, &wire, true).await?;
        let id = self.id.clone();
        Ok(stream_run(
            &self.id,
            resp,
            self.timeouts.stream_read,
            stream,
            move |ev| {
                let parsed: StreamEvent = serde_json::from_str(&ev.data)
                    .map_err(|e| protocol(&id, format!("{e}: {}", ev.data)))?;
                Ok(match parsed {
                    StreamEvent::Delta { text } => vec![Piece::Text(text)],
                    StreamEvent::Reasoning { text } => vec![Piece::Reasoning(text)],
                    StreamEvent::ToolCallStart { index, id, name } => {
                        vec![Piece::CallStart { index, id, name }]
                    }
                    StreamEvent::ToolCallArguments { index, fragment } => {
                        vec![Piece::CallArguments { index, fragment }]
                    }
                    StreamEvent::Done(body) => vec![Piece::Done(response_of(body))],
                    StreamEvent::Error { error } => {
                        return Err(ClientError::Remote {
                            endpoint: id.clone(),
                            status: 200,
                            message: error.message,
                        })
                    }
                })
            },
        ))
    }

    pub(super) async fn embed(&self, req: EmbedRequest) -> Result<Embeddings, ClientError> {
        let body = EmbedBody {
            model: self.target.clone(),
            input: OneOrMany::Many(req.inputs),
            normalize: None,
        };
        let resp = self.post("/v1/embed", &body, false).await?;
        let r: EmbedResponseBody = resp.json().await.map_err(|e| protocol(&self.id, e))?;
        Ok(Embeddings {
            prompt_tokens: r.usage.prompt_tokens,
            data: r
                .data
                .into_iter()
                .map(|d| Embedding {
                    values: d.values,
                    pooling: Some(d.pooling),
                    normalized: Some(d.normalized),
                })
                .collect(),
        })
    }
}

fn response_of(b: GenerationBody) -> Response {
    Response {
        text: b.text,
        finish_reason: b.finish_reason,
        tool_calls: b.tool_calls,
        reasoning: b.reasoning,
        usage: b.usage,
        stats: Some(b.stats),
        logprobs: Vec::new(),
    }
}
