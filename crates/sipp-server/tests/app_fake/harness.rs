//! The server's router over engines on the fake backend, driven in-process
//! with `tower::ServiceExt::oneshot`: no port, no model.

use std::collections::BTreeMap;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use sipp::config::{CacheMode, NativeRuntimeConfig};
use sipp::engine::{Engine, GenerateRequest};
use sipp::runtime::fake::{FakeBackend, FakeConfig};
use sipp_server::{app, AppState, ModelTarget, ServeConfig, ServerSection, Target, TargetState};

/// A chat template for the fake: `<|role|>content` lines, then `<|assistant|>`.
pub const TEMPLATE: &str = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
{% if add_generation_prompt %}<|assistant|>{% endif %}";

/// One fake engine.
#[derive(Debug, Clone)]
pub struct Fake {
    /// Slots.
    pub slots: u32,
    /// KV cells (the context).
    pub n_ctx: u32,
    /// One EOS in this many tokens; 0 (the default here) never, so lengths
    /// are exact.
    pub eos_one_in: u64,
    /// A chat template (the default here has [`TEMPLATE`]).
    pub chat_template: Option<String>,
    /// An encoder-only embedding model.
    pub encoder_only: bool,
    /// `scheduler.max_queued_requests`.
    pub max_queued: u32,
}

impl Default for Fake {
    fn default() -> Self {
        Self {
            slots: 4,
            n_ctx: 4096,
            eos_one_in: 0,
            chat_template: Some(TEMPLATE.into()),
            encoder_only: false,
            max_queued: 256,
        }
    }
}

impl Fake {
    /// An encoder-only embedding model.
    pub fn embedder() -> Self {
        Self {
            encoder_only: true,
            chat_template: None,
            ..Self::default()
        }
    }

    /// Starts it.
    pub fn start(&self) -> Engine {
        let mut cfg = NativeRuntimeConfig::default();
        cfg.context.n_parallel = self.slots;
        cfg.context.n_batch = 64;
        cfg.context.n_ubatch = 64;
        cfg.cache.mode = CacheMode::SharedPrefix;
        cfg.cache.idle_sequences = if self.encoder_only { 0 } else { 2 };
        cfg.cache.min_prefix_tokens = 8;
        cfg.scheduler.max_queued_requests = self.max_queued;
        let backend = FakeBackend::new(FakeConfig {
            n_ctx: self.n_ctx,
            n_seq_max: self.slots + cfg.cache.idle_sequences,
            n_batch: 64,
            n_ubatch: 64,
            encoder_only: self.encoder_only,
            eos_one_in: self.eos_one_in,
            chat_template: self.chat_template.clone(),
            ..FakeConfig::default()
        });
        Engine::start(backend, cfg)
    }
}

/// A served target: its id, aliases and engine.
pub fn target(id: &str, aliases: &[&str]) -> ModelTarget {
    ModelTarget {
        id: id.into(),
        model: format!("fake:{id}"),
        provider: None,
        default: false,
        aliases: aliases.iter().map(|a| (*a).to_string()).collect(),
        runtime: NativeRuntimeConfig::default(),
        load: Default::default(),
    }
}

/// The router and its state.
pub struct App {
    router: Router,
    state: AppState,
    /// The engines, by target id.
    pub engines: BTreeMap<String, Engine>,
}

/// An answer, read whole.
#[derive(Debug)]
pub struct Reply {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

impl App {
    /// The default app: `fake` (the default model, alias `fake-alias`) and
    /// `embed` (an encoder-only embedding model).
    pub fn new() -> Self {
        Self::with(
            ServerSection::default(),
            vec![
                (target("fake", &["fake-alias"]), Fake::default()),
                (target("embed", &[]), Fake::embedder()),
            ],
        )
    }

    /// An app with one generation target `fake` started from `fake`.
    pub fn one(fake: Fake) -> Self {
        Self::with(ServerSection::default(), vec![(target("fake", &[]), fake)])
    }

    /// An app with these server settings and targets, every engine ready.
    pub fn with(server: ServerSection, targets: Vec<(ModelTarget, Fake)>) -> Self {
        let config = ServeConfig {
            server: server.clone(),
            models: targets.iter().map(|(t, _)| t.clone()).collect(),
            ..Default::default()
        };
        config.validate().expect("valid config");
        let state = AppState::new(&config);
        let mut engines = BTreeMap::new();
        for (t, fake) in &targets {
            let engine = fake.start();
            state.set_target(&t.id, TargetState::Ready(Target::Local(engine.clone())));
            engines.insert(t.id.clone(), engine);
        }
        Self::over(state, &server, engines)
    }

    /// The router over a state built elsewhere.
    pub fn over(
        state: AppState,
        server: &ServerSection,
        engines: BTreeMap<String, Engine>,
    ) -> Self {
        Self {
            router: app(state.clone(), &server.cors_origins),
            state,
            engines,
        }
    }

    /// Serves the router on a loopback port, as `sipp serve` does (with each
    /// connection's address, for the traffic policy), until the test ends.
    pub async fn serve_tcp(&self) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let service = self
            .router
            .clone()
            .into_make_service_with_connect_info::<std::net::SocketAddr>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, service).await;
        });
        addr
    }

    /// Starts the state's throughput sampler (as `sipp serve` does).
    pub fn spawn_sampler(&self) -> tokio::task::JoinHandle<()> {
        self.state.spawn_sampler()
    }

    /// Starts the state's idle unloader (as `sipp serve` does).
    pub fn spawn_idle_unloader(&self) -> Option<tokio::task::JoinHandle<()>> {
        self.state.spawn_idle_unloader()
    }

    /// GETs a path and returns the answer unread (for streams).
    pub async fn stream_get(
        &self,
        path: &str,
        headers: &[(&str, &str)],
    ) -> axum::http::Response<Body> {
        use tower::ServiceExt;
        let mut b = Request::builder().method(Method::GET).uri(path);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        self.router
            .clone()
            .oneshot(b.body(Body::empty()).expect("request"))
            .await
            .expect("the router is infallible")
    }

    /// POSTs JSON and returns the answer unread (for streams).
    pub async fn stream_post(&self, path: &str, body: Value) -> axum::http::Response<Body> {
        use tower::ServiceExt;
        let req = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .expect("request");
        self.router
            .clone()
            .oneshot(req)
            .await
            .expect("the router is infallible")
    }

    /// The engine of a target.
    pub fn engine(&self, id: &str) -> &Engine {
        &self.engines[id]
    }

    /// Sends a request and reads the whole answer.
    pub async fn send(&self, req: Request<Body>) -> Reply {
        use tower::ServiceExt;
        let resp = self
            .router
            .clone()
            .oneshot(req)
            .await
            .expect("the router is infallible");
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// POSTs raw bytes as JSON, with extra headers.
    pub async fn post_raw(
        &self,
        path: &str,
        body: impl Into<Body>,
        headers: &[(&str, &str)],
    ) -> Reply {
        let mut b = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header(header::CONTENT_TYPE, "application/json");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        self.send(b.body(body.into()).expect("request")).await
    }

    /// POSTs JSON.
    pub async fn post(&self, path: &str, body: Value) -> Reply {
        self.post_raw(path, body.to_string(), &[]).await
    }

    /// GETs a path, with extra headers.
    pub async fn get_with(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        let mut b = Request::builder().method(Method::GET).uri(path);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        self.send(b.body(Body::empty()).expect("request")).await
    }

    /// GETs a path.
    pub async fn get(&self, path: &str) -> Reply {
        self.get_with(path, &[]).await
    }
}

/// Checks an OpenAI-shaped error: the status, `{"error": {message, type,
/// code, param}}` with nothing else at the top, a non-empty message, and the
/// given type, code and param.
#[track_caller]
pub fn assert_error(
    r: &Reply,
    status: u16,
    kind: &str,
    code: Option<&str>,
    param: Option<&str>,
) -> String {
    let v = r.json();
    assert_eq!(r.status.as_u16(), status, "{v}");
    let top: Vec<&String> = v.as_object().expect("object").keys().collect();
    assert_eq!(top, vec!["error"], "{v}");
    let e = &v["error"];
    let message = e["message"].as_str().expect("message").to_string();
    assert!(!message.is_empty(), "{v}");
    assert_eq!(e["type"], kind, "{v}");
    assert_eq!(e["code"].as_str(), code, "{v}");
    assert_eq!(e["param"].as_str(), param, "{v}");
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{:?}",
        r.headers
    );
    message
}

/// The `data:` payloads of a server-sent event stream, checking its framing:
/// events end with a blank line and every line of one is `data: ...` (or a
/// `:` comment, which keep-alives use).
#[track_caller]
pub fn sse_data(r: &Reply) -> Vec<String> {
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream")),
        "{:?}",
        r.headers
    );
    let body = r.text();
    assert!(body.ends_with("\n\n"), "unterminated event: {body:?}");
    let mut out = Vec::new();
    for event in body.split("\n\n").filter(|e| !e.is_empty()) {
        let mut data = Vec::new();
        for line in event.lines() {
            if line.starts_with(':') {
                continue;
            }
            let d = line
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("a line that is not `data: `: {line:?} in {body:?}"));
            data.push(d);
        }
        if !data.is_empty() {
            out.push(data.join("\n"));
        }
    }
    out
}

/// The JSON chunks of an OpenAI stream, checking it ends with `data: [DONE]`
/// and that every other event is a JSON object.
#[track_caller]
pub fn openai_chunks(r: &Reply) -> Vec<Value> {
    let data = sse_data(r);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    assert_eq!(
        data.iter().filter(|d| *d == "[DONE]").count(),
        1,
        "{data:?}"
    );
    data[..data.len() - 1]
        .iter()
        .map(|d| {
            let v: Value = serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}"));
            assert!(v.is_object(), "{d}");
            v
        })
        .collect()
}

/// A greedy request that holds its slot until dropped (the fake never
/// reaches 60,000 tokens within a test).
pub fn endless() -> GenerateRequest {
    GenerateRequest {
        max_tokens: Some(60_000),
        ..GenerateRequest::new("Tell me a long story").greedy()
    }
}
