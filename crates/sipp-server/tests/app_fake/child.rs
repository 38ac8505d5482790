//! Forwarding to a supervised target's child process, against a stand-in
//! child on loopback (the real child and RPC servers are in
//! `crates/sipp-cli/tests/serve_rpc.rs`): which requests go there, with which
//! credentials, what comes back, and the errors when the child is gone.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use serde_json::{json, Value};
use sipp_server::child::ChildLink;
use sipp_server::{AppState, ServeConfig, Target, TargetState};

use super::harness::{App, Fake};

/// What the stand-in child saw of one request.
#[derive(Debug, Clone)]
struct Seen {
    uri: String,
    authorization: Option<String>,
    api_key: Option<String>,
    body: Value,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// Answers JSON naming itself; a streamed request gets one event and then
/// the connection dies, as when the child aborts mid-answer.
async fn stand_in(State(log): State<Log>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let header = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    log.lock().expect("log").push(Seen {
        uri: uri.to_string(),
        authorization: header("authorization"),
        api_key: header("x-api-key"),
        body: body.clone(),
    });
    if body["stream"] == json!(true) {
        // The event goes out; a moment later the connection dies.
        let first = futures::stream::once(async {
            Ok::<_, std::io::Error>(Bytes::from_static(
                b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
            ))
        });
        let death = futures::stream::once(async {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            Err(std::io::Error::other("the child died"))
        });
        let chunks = futures::StreamExt::chain(first, death);
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(chunks))
            .expect("response");
    }
    axum::Json(json!({"from": "child", "model": body["model"]})).into_response()
}

/// The stand-in child on a loopback port, and what it saw.
async fn child() -> (String, Log) {
    let log = Log::default();
    let router = Router::new()
        .route("/v1/chat/completions", post(stand_in))
        .route("/v1/messages", post(stand_in))
        .with_state(log.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    (format!("http://{addr}"), log)
}

/// A port nothing listens on.
fn dead_base() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port");
    format!("http://127.0.0.1:{port}")
}

/// `fake` (local, the default) and `remote` (alias `remote-alias`, on RPC
/// servers, so supervised), with the parent's keys: `sk-admin` may use both,
/// `sk-user` only `fake`. `remote` is forwarded to `base`.
fn app(base: &str) -> App {
    let config = ServeConfig::from_toml(
        r#"
[server]
api_keys = ["sk-admin", { key = "sk-user", models = ["fake"] }]

[[models]]
id = "fake"
model = "fake:fake"
default = true

[[models]]
id = "remote"
model = "fake:remote"
aliases = ["remote-alias"]
[models.runtime.placement]
rpc = ["127.0.0.1:1"]
"#,
    )
    .expect("config");
    config.validate().expect("valid");
    let state = AppState::new(&config);
    let engine = Fake::default().start();
    state.set_target("fake", TargetState::Ready(Target::Local(engine.clone())));
    state.set_target(
        "remote",
        TargetState::Forwarded(ChildLink {
            base: base.to_string(),
            key: "sk-child".into(),
            client: reqwest::Client::new(),
        }),
    );
    App::over(
        state,
        &config.server,
        BTreeMap::from([("fake".to_string(), engine)]),
    )
}

async fn send(app: &App, path: &str, key: &str, body: Value) -> (u16, String) {
    let reply = app
        .send(
            axum::http::Request::post(path)
                .header("authorization", format!("Bearer {key}"))
                .header("x-api-key", key)
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .expect("request"),
        )
        .await;
    (reply.status.as_u16(), reply.text())
}

fn chat(model: Option<&str>) -> Value {
    let mut v = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    if let Some(m) = model {
        v["model"] = json!(m);
    }
    v
}

#[tokio::test]
async fn requests_naming_the_target_go_to_its_child_with_the_childs_key() {
    let (base, log) = child().await;
    let app = app(&base);
    for model in ["remote", "remote-alias"] {
        let (status, text) = send(
            &app,
            "/v1/chat/completions?trace=1",
            "sk-admin",
            chat(Some(model)),
        )
        .await;
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["from"], "child", "{v}");
    }
    let seen = log.lock().expect("log").clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for (s, model) in seen.iter().zip(["remote", "remote-alias"]) {
        assert_eq!(s.uri, "/v1/chat/completions?trace=1");
        // The caller's credentials stay with the parent; the child gets its own.
        assert_eq!(s.authorization.as_deref(), Some("Bearer sk-child"), "{s:?}");
        assert_eq!(s.api_key, None, "{s:?}");
        // The body is forwarded as sent.
        assert_eq!(s.body, chat(Some(model)));
    }
    // The local target, named or by default, never reaches the child.
    for body in [chat(Some("fake")), chat(None)] {
        let (status, text) = send(&app, "/v1/chat/completions", "sk-admin", body).await;
        assert_eq!(status, 200, "{text}");
        assert!(text.contains("chat.completion"), "{text}");
    }
    // Bodies the routes reject themselves are not forwarded.
    let (status, _) = send(
        &app,
        "/v1/chat/completions",
        "sk-admin",
        json!({"model": 7}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(log.lock().expect("log").len(), 2);
}

#[tokio::test]
async fn the_parents_policy_applies_before_forwarding() {
    let (base, log) = child().await;
    let app = app(&base);
    let (status, text) = send(
        &app,
        "/v1/chat/completions",
        "sk-user",
        chat(Some("remote")),
    )
    .await;
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("model_not_allowed"), "{text}");
    let (status, _) = send(
        &app,
        "/v1/chat/completions",
        "sk-wrong",
        chat(Some("remote")),
    )
    .await;
    assert_eq!(status, 401);
    assert!(log.lock().expect("log").is_empty());
}

#[tokio::test]
async fn a_stream_the_childs_death_cuts_ends_with_an_error_event() {
    let (base, _log) = child().await;
    let app = app(&base);
    let mut body = chat(Some("remote"));
    body["stream"] = json!(true);
    let (status, text) = send(&app, "/v1/chat/completions", "sk-admin", body).await;
    assert_eq!(status, 200, "{text}");
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert!(data[0].contains("Hi"), "{text}");
    let error: Value = serde_json::from_str(data[1]).expect("error event");
    assert_eq!(error["error"]["code"], "unavailable", "{text}");
    assert!(error["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("remote")));
    assert_eq!(data[2..], ["[DONE]"], "{text}");
}

#[tokio::test]
async fn an_unreachable_child_is_a_503_in_the_routes_shape() {
    let app = app(&dead_base());
    let (status, text) = send(
        &app,
        "/v1/chat/completions",
        "sk-admin",
        chat(Some("remote")),
    )
    .await;
    assert_eq!(status, 503, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["error"]["code"], "unavailable", "{v}");
    let (status, text) = send(
        &app,
        "/v1/messages",
        "sk-admin",
        json!({"model": "remote", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 503, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "overloaded_error", "{v}");
    // The local target is unaffected.
    let (status, text) = send(&app, "/v1/chat/completions", "sk-admin", chat(Some("fake"))).await;
    assert_eq!(status, 200, "{text}");
}
