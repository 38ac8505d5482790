//! `SippClient`: one API over local engines, sipp gateways and remote providers.
//!
//! ```no_run
//! # async fn demo() -> Result<(), sipp::client::ClientError> {
//! use sipp::client::{EndpointDescriptor, QueryRequest, SippClient};
//! let client = SippClient::new();
//! let local = client.add("local", EndpointDescriptor::local("default")).await?;
//! let answer = local.query(QueryRequest::new("The capital of France is").max_tokens(8)).await?.response().await?;
//! println!("{}", answer.text);
//! # Ok(()) }
//! ```
//!
//! Every endpoint answers with a [`Run`]: the final [`Response`], a stream of
//! text deltas (and reasoning and tool-call pieces) when asked, and
//! cancellation. Options are split by where they
//! apply ([`TextOptions`] everywhere, [`LocalOptions`] on local engines only,
//! [`ProviderOptions`] on providers only) and checked before anything is sent.

mod gateway;
mod local;
mod provider;
pub mod sse;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::Stream;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::chat::ChatMessage;
use crate::engine::{EngineError, RequestStats, Usage};
use crate::runtime::Pooling;
use crate::sampling::SamplingParams;
use crate::tools::{Tool, ToolCall, ToolChoice, ToolSpec};
use crate::NativeRuntimeConfig;

pub use crate::engine::TokenLogprobs;

/// Client errors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClientError {
    /// No endpoint with this id.
    #[error("no endpoint named `{0}`")]
    UnknownEndpoint(String),
    /// The request is invalid for this endpoint.
    #[error("invalid request for endpoint `{endpoint}`: {message}")]
    Invalid {
        /// The endpoint.
        endpoint: String,
        /// What is wrong.
        message: String,
    },
    /// The endpoint cannot do this operation.
    #[error("endpoint `{endpoint}` does not support {operation}: {why}")]
    Unsupported {
        /// The endpoint.
        endpoint: String,
        /// The operation.
        operation: &'static str,
        /// Why.
        why: String,
    },
    /// The local engine refused or failed the request.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Loading a local model failed.
    #[error("cannot start local endpoint: {0}")]
    Load(String),
    /// The remote answered with an error.
    #[error("{endpoint} answered {status}: {message}")]
    Remote {
        /// The endpoint.
        endpoint: String,
        /// HTTP status.
        status: u16,
        /// Its message.
        message: String,
    },
    /// The connection failed or timed out.
    #[error("{endpoint}: transport error: {message}")]
    Transport {
        /// The endpoint.
        endpoint: String,
        /// What happened.
        message: String,
    },
    /// The remote sent something that is not what its API documents.
    #[error("{endpoint}: unexpected response: {message}")]
    Protocol {
        /// The endpoint.
        endpoint: String,
        /// What was wrong.
        message: String,
    },
    /// The endpoint was closed.
    #[error("endpoint `{0}` is closed")]
    Closed(String),
}

/// Options every endpoint understands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TextOptions {
    /// Most tokens to generate.
    pub max_tokens: Option<u32>,
    /// Temperature.
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Stop strings.
    pub stop: Vec<String>,
}

/// Options only a local engine honours.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LocalOptions {
    /// Session affinity key.
    pub context_key: Option<String>,
    /// A GBNF grammar.
    pub grammar: Option<String>,
    /// A JSON schema the output must satisfy.
    pub json_schema: Option<serde_json::Value>,
    /// Any JSON object.
    pub json_mode: bool,
    /// Full sampling settings (fields in [`TextOptions`] still win).
    pub sampling: Option<SamplingParams>,
    /// Random seed.
    pub seed: Option<u32>,
    /// Keep generating past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Top-n log-probabilities per token.
    pub logprobs: Option<u32>,
    /// Reuse KV across requests (`None`: the endpoint's default, on).
    pub cache_prompt: Option<bool>,
    /// Compute as on a fresh engine, alone, so seeded text repeats.
    pub repeatable: bool,
    /// Speculative decoding (`None`: the endpoint's setting).
    pub speculative: Option<crate::engine::SpeculativeRequest>,
    /// LoRA adapters by id and scale, the others off (`None`: the
    /// endpoint's choice; a model named `TARGET:ADAPTER` also chooses one).
    pub lora: Option<Vec<crate::engine::LoraScale>>,
}

impl LocalOptions {
    /// Names of the options that are set.
    fn set_names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.context_key.is_some() {
            v.push("context_key");
        }
        if self.grammar.is_some() {
            v.push("grammar");
        }
        if self.json_schema.is_some() {
            v.push("json_schema");
        }
        if self.json_mode {
            v.push("json_mode");
        }
        if self.sampling.is_some() {
            v.push("sampling");
        }
        if self.seed.is_some() {
            v.push("seed");
        }
        if self.ignore_eos {
            v.push("ignore_eos");
        }
        if self.logprobs.is_some() {
            v.push("logprobs");
        }
        if self.cache_prompt.is_some() {
            v.push("cache_prompt");
        }
        if self.repeatable {
            v.push("repeatable");
        }
        if self.speculative.is_some() {
            v.push("speculative");
        }
        if self.lora.is_some() {
            v.push("lora");
        }
        v
    }
}

/// Options only a remote provider honours.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProviderOptions {
    /// End-user id sent to the provider (`user` / `metadata.user_id`).
    pub user: Option<String>,
    /// Extra JSON fields merged into the provider's request body.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ProviderOptions {
    fn is_set(&self) -> bool {
        self.user.is_some() || !self.extra.is_empty()
    }
}

/// Everything a generation request can carry besides its input.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOptions {
    /// Shared options.
    pub text: TextOptions,
    /// Local-only options.
    pub local: LocalOptions,
    /// Provider-only options.
    pub provider: ProviderOptions,
    /// Stream text deltas through [`Run::next`].
    pub stream: bool,
}

impl RequestOptions {
    /// The options as sipp's first-party profile carries them: what a local
    /// engine and a sipp gateway both honour.
    pub fn native_options(&self) -> crate::protocol::native::TextOptions {
        let (t, l) = (&self.text, &self.local);
        crate::protocol::native::TextOptions {
            max_tokens: t.max_tokens,
            temperature: t.temperature,
            top_p: t.top_p,
            stop: t.stop.clone(),
            seed: l.seed,
            ignore_eos: l.ignore_eos.then_some(true),
            grammar: l.grammar.clone(),
            json_schema: l.json_schema.clone(),
            json_mode: l.json_mode.then_some(true),
            logprobs: l.logprobs,
            context_key: l.context_key.clone(),
            cache_prompt: l.cache_prompt,
            repeatable: l.repeatable.then_some(true),
            speculative: l.speculative,
            lora: l.lora.clone(),
            sampling: l.sampling.clone(),
        }
    }
}

/// A completion of a prompt.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueryRequest {
    /// The prompt.
    pub prompt: String,
    /// Options.
    pub options: RequestOptions,
}

/// A chat turn.
///
/// Tools work on every endpoint kind: a local engine (and a sipp gateway)
/// renders them with the model's template and constrains the calls to their
/// schemas; providers receive them in their own API's shape. Calls come back
/// in [`Response::tool_calls`] (and, streamed, as [`RunEvent::ToolCallStart`]
/// and [`RunEvent::ToolCallArguments`]); answer them with
/// [`ChatMessage::tool_calls`] and [`ChatMessage::tool_result`] in the next
/// turn's messages.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Options.
    pub options: RequestOptions,
    /// Tools the model may call (empty: a plain chat).
    pub tools: Vec<Tool>,
    /// Whether and which tool must be called (`None`: `auto` when there are
    /// tools; providers get the field only when it is set).
    pub tool_choice: Option<ToolChoice>,
    /// Several calls in one answer (`None`: allowed, the providers' default;
    /// providers get the field only when it is set).
    pub parallel_tool_calls: Option<bool>,
}

macro_rules! builder_methods {
    ($t:ty) => {
        impl $t {
            /// Sets max_tokens.
            pub fn max_tokens(mut self, n: u32) -> Self {
                self.options.text.max_tokens = Some(n);
                self
            }
            /// Sets the temperature.
            pub fn temperature(mut self, t: f32) -> Self {
                self.options.text.temperature = Some(t);
                self
            }
            /// Adds a stop string.
            pub fn stop(mut self, s: impl Into<String>) -> Self {
                self.options.text.stop.push(s.into());
                self
            }
            /// Streams text deltas.
            pub fn stream(mut self) -> Self {
                self.options.stream = true;
                self
            }
        }
    };
}

builder_methods!(QueryRequest);
builder_methods!(ChatRequest);

impl QueryRequest {
    /// A query for a prompt.
    pub fn new(prompt: impl Into<String>) -> Self {
        Self {
            prompt: prompt.into(),
            options: RequestOptions::default(),
        }
    }
}

impl ChatRequest {
    /// A chat over messages.
    pub fn new(messages: Vec<ChatMessage>) -> Self {
        Self {
            messages,
            ..Self::default()
        }
    }

    /// Sets the tools the model may call.
    pub fn tools(mut self, tools: Vec<Tool>) -> Self {
        self.tools = tools;
        self
    }

    /// Sets whether and which tool must be called.
    pub fn tool_choice(mut self, choice: ToolChoice) -> Self {
        self.tool_choice = Some(choice);
        self
    }

    /// Allows or forbids several calls in one answer.
    pub fn parallel_tool_calls(mut self, parallel: bool) -> Self {
        self.parallel_tool_calls = Some(parallel);
        self
    }

    /// The tools with the defaults filled in: `auto` when there are tools
    /// and no choice (calls off without tools), parallel calls allowed
    /// unless turned off.
    pub fn tool_spec(&self) -> ToolSpec {
        let choice = match (&self.tool_choice, self.tools.is_empty()) {
            (Some(c), _) => c.clone(),
            (None, false) => ToolChoice::Auto,
            (None, true) => ToolChoice::None,
        };
        ToolSpec {
            tools: self.tools.clone(),
            choice,
            parallel: self.parallel_tool_calls.unwrap_or(true),
        }
    }
}

/// An embedding request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EmbedRequest {
    /// Inputs.
    pub inputs: Vec<String>,
    /// L2-normalize (local only; providers normalize as they do).
    pub normalize: Option<bool>,
    /// Provider-only options.
    pub provider: ProviderOptions,
}

impl EmbedRequest {
    /// Embeds these inputs.
    pub fn new<S: Into<String>>(inputs: impl IntoIterator<Item = S>) -> Self {
        Self {
            inputs: inputs.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }
}

/// The final answer of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Response {
    /// Generated text (of a chat: the answer, without reasoning and calls).
    pub text: String,
    /// stop, eos, length, cancelled, error or tool_calls (the answer called
    /// tools and ended there); providers' reasons mapped onto these.
    pub finish_reason: String,
    /// The tools the answer called, in order (arguments as JSON text).
    pub tool_calls: Vec<ToolCall>,
    /// The reasoning before the answer, when the model reasoned (a local
    /// model's `<think>` block, a provider's reasoning or thinking).
    pub reasoning: Option<String>,
    /// Token counts.
    pub usage: Usage,
    /// Timing, for local endpoints (and gateways, which report the server's).
    pub stats: Option<RequestStats>,
    /// Log-probabilities (local endpoints, when asked for).
    pub logprobs: Vec<TokenLogprobs>,
}

/// One embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct Embedding {
    /// The vector.
    pub values: Vec<f32>,
    /// Pooling, when the endpoint reports it.
    pub pooling: Option<Pooling>,
    /// Whether the vector is L2-normalized, when known.
    pub normalized: Option<bool>,
}

/// The answer to an embedding request.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    /// One per input.
    pub data: Vec<Embedding>,
    /// Input tokens.
    pub prompt_tokens: usize,
}

/// What a run emits.
#[derive(Debug, Clone, PartialEq)]
pub enum RunEvent {
    /// New answer text (only when streaming).
    Delta(String),
    /// New reasoning text (only when streaming).
    Reasoning(String),
    /// Tool call `index` (0, 1, ...) started (only when streaming).
    ToolCallStart {
        /// Which call of the answer.
        index: usize,
        /// Its id (a tool result answers it by this id).
        id: String,
        /// The function's name.
        name: String,
    },
    /// The next piece of call `index`'s arguments, JSON text (only when
    /// streaming); the pieces joined are the call's arguments.
    ToolCallArguments {
        /// Which call.
        index: usize,
        /// The piece.
        fragment: String,
    },
    /// The final answer.
    Done(Response),
    /// The run failed.
    Error(ClientError),
}

/// A request in flight.
#[derive(Debug)]
pub struct Run {
    events: mpsc::UnboundedReceiver<RunEvent>,
    cancel: CancellationToken,
    done: bool,
}

impl Run {
    fn channel() -> (mpsc::UnboundedSender<RunEvent>, CancellationToken, Run) {
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        (
            tx,
            cancel.clone(),
            Run {
                events: rx,
                cancel,
                done: false,
            },
        )
    }

    /// The next event: deltas, reasoning and call pieces (when streaming),
    /// then `Done` or `Error`; `None` after.
    pub async fn next(&mut self) -> Option<RunEvent> {
        if self.done {
            return None;
        }
        let ev = self.events.recv().await;
        match ev {
            Some(final_event @ (RunEvent::Done(_) | RunEvent::Error(_))) => {
                self.done = true;
                Some(final_event)
            }
            Some(piece) => Some(piece),
            None => {
                self.done = true;
                Some(RunEvent::Error(ClientError::Closed("run".into())))
            }
        }
    }

    /// Waits for the final response.
    pub async fn response(mut self) -> Result<Response, ClientError> {
        while let Some(ev) = self.next().await {
            match ev {
                RunEvent::Done(r) => return Ok(r),
                RunEvent::Error(e) => return Err(e),
                _ => {}
            }
        }
        Err(ClientError::Closed("run".into()))
    }

    /// Cancels the run; its final response reports `cancelled`.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// The events as a stream.
    pub fn into_stream(self) -> impl Stream<Item = RunEvent> {
        futures::stream::unfold(
            self,
            |mut run| async move { run.next().await.map(|e| (e, run)) },
        )
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        // A dropped run is abandoned: stop the work behind it.
        if !self.done {
            self.cancel.cancel();
        }
    }
}

/// Connection, request and stream-read timeouts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timeouts {
    /// Establishing a connection.
    pub connect: Duration,
    /// A whole non-streamed request.
    pub request: Duration,
    /// The longest wait for the next piece of a stream.
    pub stream_read: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(10),
            request: Duration::from_secs(600),
            stream_read: Duration::from_secs(120),
        }
    }
}

/// How a gateway request authenticates.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum GatewayAuth {
    /// No credentials.
    #[default]
    None,
    /// `Authorization: Bearer <token>`.
    Bearer(String),
    /// A custom header.
    Header {
        /// Header name.
        name: String,
        /// Header value.
        value: String,
    },
}

/// A remote provider's API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderKind {
    /// api.openai.com.
    OpenAi,
    /// Any server with OpenAI's API (base_url required).
    OpenAiCompatible,
    /// api.anthropic.com (/v1/messages).
    Anthropic,
}

/// How to reach an endpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum EndpointDescriptor {
    /// An engine in this process.
    Local {
        /// A GGUF path or a known model name.
        model: String,
        /// Runtime configuration.
        config: Box<NativeRuntimeConfig>,
    },
    /// A sipp server's first-party profile.
    Gateway {
        /// e.g. `http://127.0.0.1:8080`.
        base_url: String,
        /// Model id on the server (its default when `None`).
        target: Option<String>,
        /// Credentials.
        auth: GatewayAuth,
        /// Headers sent with every request.
        headers: Vec<(String, String)>,
        /// Timeouts.
        timeouts: Timeouts,
    },
    /// A remote provider.
    Provider {
        /// Which API.
        kind: ProviderKind,
        /// Base URL (defaults: OpenAI `https://api.openai.com/v1`, Anthropic
        /// `https://api.anthropic.com`).
        base_url: Option<String>,
        /// API key.
        api_key: Option<String>,
        /// Model name at the provider.
        model: String,
        /// Headers sent with every request.
        headers: Vec<(String, String)>,
        /// Timeouts.
        timeouts: Timeouts,
        /// Retries on connection failures, 429 and 503 (nothing was generated).
        max_retries: u32,
    },
}

impl EndpointDescriptor {
    /// A local model with the default runtime configuration.
    pub fn local(model: impl Into<String>) -> Self {
        EndpointDescriptor::Local {
            model: model.into(),
            config: Box::default(),
        }
    }

    /// A sipp server.
    pub fn gateway(base_url: impl Into<String>) -> Self {
        EndpointDescriptor::Gateway {
            base_url: base_url.into(),
            target: None,
            auth: GatewayAuth::None,
            headers: Vec::new(),
            timeouts: Timeouts::default(),
        }
    }

    /// A provider.
    pub fn provider(kind: ProviderKind, model: impl Into<String>) -> Self {
        EndpointDescriptor::Provider {
            kind,
            base_url: None,
            api_key: None,
            model: model.into(),
            headers: Vec::new(),
            timeouts: Timeouts::default(),
            max_retries: 2,
        }
    }
}

/// A started endpoint.
enum Endpoint {
    Local(local::LocalEndpoint),
    Gateway(gateway::GatewayEndpoint),
    Provider(provider::ProviderEndpoint),
}

impl Endpoint {
    fn kind(&self) -> &'static str {
        match self {
            Endpoint::Local(_) => "local",
            Endpoint::Gateway(_) => "gateway",
            Endpoint::Provider(_) => "provider",
        }
    }
}

/// Checks options against the endpoint kind before anything is sent.
fn validate(id: &str, ep: &Endpoint, options: &RequestOptions) -> Result<(), ClientError> {
    let invalid = |message: String| ClientError::Invalid {
        endpoint: id.to_string(),
        message,
    };
    let local = options.local.set_names();
    match ep {
        Endpoint::Local(_) => {
            if options.provider.is_set() {
                return Err(invalid(
                    "provider options (user, extra) apply to provider endpoints only".into(),
                ));
            }
        }
        // A sipp gateway speaks the first-party profile, which carries every
        // engine option but log-probabilities (its answers do not return them).
        Endpoint::Gateway(_) if local.contains(&"logprobs") => {
            return Err(invalid(
                "`logprobs` is a local-only option; gateway endpoints do not accept it".into(),
            ));
        }
        Endpoint::Gateway(_) => {
            if options.provider.is_set() {
                return Err(invalid(
                    "provider options (user, extra) do not apply to gateway endpoints".into(),
                ));
            }
        }
        Endpoint::Provider(_) => {
            if let Some(name) = local.first() {
                return Err(invalid(format!(
                    "`{name}` is a local-only option; {} endpoints do not accept it",
                    ep.kind()
                )));
            }
            if matches!(ep, Endpoint::Gateway(_)) && options.provider.is_set() {
                return Err(invalid(
                    "provider options (user, extra) do not apply to gateway endpoints".into(),
                ));
            }
        }
    }
    Ok(())
}

/// The client: endpoints by id.
#[derive(Clone, Default)]
pub struct SippClient {
    endpoints: Arc<RwLock<HashMap<String, Arc<Endpoint>>>>,
}

impl std::fmt::Debug for SippClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<String> = self
            .endpoints
            .read()
            .map(|e| e.keys().cloned().collect())
            .unwrap_or_default();
        f.debug_struct("SippClient")
            .field("endpoints", &ids)
            .finish()
    }
}

/// A handle on one endpoint of a client.
#[derive(Debug, Clone)]
pub struct EndpointRef {
    id: String,
    client: SippClient,
}

impl EndpointRef {
    /// The endpoint's id.
    pub fn id(&self) -> &str {
        &self.id
    }
    /// [`SippClient::query`] on this endpoint.
    pub async fn query(&self, req: QueryRequest) -> Result<Run, ClientError> {
        self.client.query(&self.id, req).await
    }
    /// [`SippClient::chat`] on this endpoint.
    pub async fn chat(&self, req: ChatRequest) -> Result<Run, ClientError> {
        self.client.chat(&self.id, req).await
    }
    /// [`SippClient::embed`] on this endpoint.
    pub async fn embed(&self, req: EmbedRequest) -> Result<Embeddings, ClientError> {
        self.client.embed(&self.id, req).await
    }
}

impl SippClient {
    /// A client with no endpoints.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) an endpoint. A local model is loaded here; a replaced
    /// endpoint is closed.
    pub async fn add(
        &self,
        id: impl Into<String>,
        desc: EndpointDescriptor,
    ) -> Result<EndpointRef, ClientError> {
        let id = id.into();
        let ep = match desc {
            EndpointDescriptor::Local { model, config } => {
                Endpoint::Local(local::LocalEndpoint::start(model, *config).await?)
            }
            EndpointDescriptor::Gateway {
                base_url,
                target,
                auth,
                headers,
                timeouts,
            } => Endpoint::Gateway(gateway::GatewayEndpoint::new(
                &id, base_url, target, auth, headers, timeouts,
            )?),
            EndpointDescriptor::Provider {
                kind,
                base_url,
                api_key,
                model,
                headers,
                timeouts,
                max_retries,
            } => Endpoint::Provider(provider::ProviderEndpoint::new(
                &id,
                kind,
                base_url,
                api_key,
                model,
                headers,
                timeouts,
                max_retries,
            )?),
        };
        let old = self
            .endpoints
            .write()
            .map_err(|_| ClientError::Closed(id.clone()))?
            .insert(id.clone(), Arc::new(ep));
        drop(old);
        Ok(EndpointRef {
            id,
            client: self.clone(),
        })
    }

    /// Closes and removes an endpoint (a local engine stops once no run uses it).
    pub fn close(&self, id: &str) -> Result<(), ClientError> {
        self.endpoints
            .write()
            .map_err(|_| ClientError::Closed(id.to_string()))?
            .remove(id)
            .map(|_| ())
            .ok_or_else(|| ClientError::UnknownEndpoint(id.to_string()))
    }

    /// Ids of the endpoints.
    pub fn endpoint_ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .endpoints
            .read()
            .map(|e| e.keys().cloned().collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    fn get(&self, id: &str) -> Result<Arc<Endpoint>, ClientError> {
        self.endpoints
            .read()
            .map_err(|_| ClientError::Closed(id.to_string()))?
            .get(id)
            .cloned()
            .ok_or_else(|| ClientError::UnknownEndpoint(id.to_string()))
    }

    /// Completes a prompt.
    pub async fn query(&self, id: &str, req: QueryRequest) -> Result<Run, ClientError> {
        let ep = self.get(id)?;
        validate(id, &ep, &req.options)?;
        match ep.as_ref() {
            Endpoint::Local(l) => l.query(req),
            Endpoint::Gateway(g) => g.query(req).await,
            Endpoint::Provider(p) => p.query(req).await,
        }
    }

    /// Answers a conversation.
    pub async fn chat(&self, id: &str, req: ChatRequest) -> Result<Run, ClientError> {
        let ep = self.get(id)?;
        validate(id, &ep, &req.options)?;
        if req.messages.is_empty() {
            return Err(ClientError::Invalid {
                endpoint: id.to_string(),
                message: "`messages` must contain at least one message".into(),
            });
        }
        // A local engine constrains calls with a grammar of its own, which
        // cannot be combined with another constraint.
        let l = &req.options.local;
        let constrained = l.grammar.is_some() || l.json_schema.is_some() || l.json_mode;
        if constrained
            && req.tool_spec().may_call()
            && !matches!(ep.as_ref(), Endpoint::Provider(_))
        {
            return Err(ClientError::Invalid {
                endpoint: id.to_string(),
                message: "`tools` cannot be combined with `grammar`, `json_schema` or `json_mode` unless `tool_choice` is none".into(),
            });
        }
        match ep.as_ref() {
            Endpoint::Local(l) => l.chat(req),
            Endpoint::Gateway(g) => g.chat(req).await,
            Endpoint::Provider(p) => p.chat(req).await,
        }
    }

    /// Embeds inputs.
    pub async fn embed(&self, id: &str, req: EmbedRequest) -> Result<Embeddings, ClientError> {
        let ep = self.get(id)?;
        let invalid = |message: &str| ClientError::Invalid {
            endpoint: id.to_string(),
            message: message.to_string(),
        };
        if req.inputs.is_empty() {
            return Err(invalid("`inputs` must not be empty"));
        }
        match ep.as_ref() {
            Endpoint::Local(l) => {
                if req.provider.is_set() {
                    return Err(invalid("provider options apply to provider endpoints only"));
                }
                l.embed(req).await
            }
            Endpoint::Gateway(g) => {
                if req.provider.is_set() {
                    return Err(invalid(
                        "provider options do not apply to gateway endpoints",
                    ));
                }
                if req.normalize.is_some() {
                    return Err(invalid(
                        "`normalize` is a local-only option; gateway endpoints do not accept it",
                    ));
                }
                g.embed(req).await
            }
            Endpoint::Provider(p) => {
                if req.normalize.is_some() {
                    return Err(invalid(
                        "`normalize` is a local-only option; provider endpoints do not accept it",
                    ));
                }
                p.embed(req).await
            }
        }
    }
}
