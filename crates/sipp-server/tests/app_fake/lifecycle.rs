//! Loading, readiness, failure and authentication.

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::Duration;

use serde_json::json;
use sipp_server::{AppState, ServeConfig, ServerSection};

use crate::harness::{assert_error, target, App, Fake};

/// The state the server starts with (every target loading), with targets
/// loaded by `spawn_loading_with` as `sipp serve` loads them: each waits for
/// a word on its gate, then starts a fake engine or fails with the word.
fn loading_app(server: ServerSection, ids: &[&str]) -> (App, Vec<mpsc::Sender<String>>) {
    let config = ServeConfig {
        server: server.clone(),
        models: ids.iter().map(|id| target(id, &[])).collect(),
        ..Default::default()
    };
    let state = AppState::new(&config);
    let (senders, receivers): (Vec<_>, Vec<_>) =
        ids.iter().map(|_| mpsc::channel::<String>()).unzip();
    let gates: BTreeMap<String, std::sync::Mutex<mpsc::Receiver<String>>> = ids
        .iter()
        .map(|id| id.to_string())
        .zip(receivers.into_iter().map(std::sync::Mutex::new))
        .collect();
    state.spawn_loading_with(config.models.clone(), move |m| {
        let word = gates[&m.id]
            .lock()
            .expect("gate")
            .recv()
            .map_err(|e| e.to_string())?;
        if word == "ok" {
            Ok(Fake::default().start())
        } else {
            Err(word)
        }
    });
    (App::over(state, &server, BTreeMap::new()), senders)
}

/// A two-token completion from `model`.
async fn complete(app: &App, model: &str) -> crate::harness::Reply {
    app.post(
        "/v1/completions",
        json!({"model": model, "prompt": "Hi", "max_tokens": 2}),
    )
    .await
}

async fn eventually_status(app: &App, path: &str, status: u16) -> crate::harness::Reply {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = app.get(path).await;
        if r.status.as_u16() == status || std::time::Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// While a model loads, /health is 503 `loading` and requests for it are 503
/// `model_loading`; once it is ready, /health is 200 and it serves. The
/// listener (here, the router) answers from the start, before any model.
#[tokio::test]
async fn health_is_503_while_loading_then_200_when_ready() {
    let (app, gates) = loading_app(ServerSection::default(), &["first", "second"]);
    for _ in 0..3 {
        let r = app.get("/health").await;
        assert_eq!(r.status, 503, "{}", r.text());
        assert_eq!(r.json(), json!({"status": "loading"}));
    }
    let r = app
        .post("/v1/completions", json!({"prompt": "Hi", "max_tokens": 2}))
        .await;
    let m = assert_error(&r, 503, "server_error", Some("model_loading"), None);
    assert!(m.contains("first"), "{m}");
    let listed: Vec<(String, String)> = app.get("/v1/models").await.json()["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| (m["id"].to_string(), m["status"]["value"].to_string()))
        .collect();
    assert_eq!(
        listed,
        [("first", "loading"), ("second", "loading")]
            .map(|(i, s)| (format!("{i:?}"), format!("{s:?}")))
            .to_vec()
    );
    // One of two ready: still loading overall, and the ready one serves.
    gates[0].send("ok".into()).expect("gate");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = complete(&app, "first").await;
        if r.status == 200 {
            break;
        }
        assert_error(&r, 503, "server_error", Some("model_loading"), None);
        assert!(std::time::Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = app.get("/health").await;
    assert_eq!(
        (r.status.as_u16(), r.json()),
        (503, json!({"status": "loading"}))
    );
    let r = complete(&app, "second").await;
    assert_error(&r, 503, "server_error", Some("model_loading"), None);
    // Both ready.
    gates[1].send("ok".into()).expect("gate");
    let r = eventually_status(&app, "/health", 200).await;
    assert_eq!(
        (r.status.as_u16(), r.json()),
        (200, json!({"status": "ok"}))
    );
    let r = complete(&app, "second").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let ids: Vec<String> = app.get("/v1/models").await.json()["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(ids, vec!["first", "second"]);
}

/// A model that fails to load makes /health 503 `error` with the reason, and
/// requests for it 503 `unavailable`.
#[tokio::test]
async fn a_model_that_fails_to_load_is_503_unavailable() {
    let (app, gates) = loading_app(ServerSection::default(), &["broken"]);
    gates[0]
        .send("no such file: model.gguf".into())
        .expect("gate");
    let r = eventually_status(&app, "/health", 503).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut r = r;
    while r.json()["status"] == "loading" {
        assert!(std::time::Instant::now() < deadline, "still loading");
        tokio::time::sleep(Duration::from_millis(5)).await;
        r = app.get("/health").await;
    }
    assert_eq!(r.status, 503);
    let v = r.json();
    assert_eq!(v["status"], "error", "{v}");
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains("broken") && m.contains("no such file")),
        "{v}"
    );
    let r = app
        .post("/v1/completions", json!({"prompt": "Hi", "max_tokens": 2}))
        .await;
    let m = assert_error(&r, 503, "server_error", Some("unavailable"), None);
    assert!(m.contains("failed to load"), "{m}");
}

fn keyed(protect_health: bool) -> App {
    App::with(
        ServerSection {
            api_keys: vec!["sk-one".into(), "sk-two".into()],
            protect_health,
            cors_origins: vec!["https://app.example".into()],
            ..ServerSection::default()
        },
        vec![(target("fake", &[]), Fake::default())],
    )
}

/// With API keys, every route but /health needs `Authorization: Bearer
/// <key>` (or Anthropic's `x-api-key: <key>`) with one of them: 401
/// `invalid_api_key` with `WWW-Authenticate`.
#[tokio::test]
async fn api_keys_guard_every_route_but_health() {
    let app = keyed(false);
    assert_eq!(app.get("/health").await.status, 200);
    let body = json!({"prompt": "x", "max_tokens": 1}).to_string();
    for headers in [
        vec![],
        vec![("authorization", "Bearer sk-three")],
        vec![("authorization", "Bearer sk-on")],
        vec![("authorization", "Bearer ")],
        vec![("authorization", "sk-one")],
        vec![("authorization", "Basic c2stb25lOg==")],
        vec![("x-api-key", "sk-on")],
        vec![("x-api-key", "Bearer sk-one")],
    ] {
        let r = app
            .post_raw("/v1/completions", body.clone(), &headers)
            .await;
        assert_error(
            &r,
            401,
            "authentication_error",
            Some("invalid_api_key"),
            None,
        );
        assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{headers:?}");
    }
    for key in ["Bearer sk-one", "Bearer sk-two", "bearer sk-two"] {
        let r = app
            .post_raw("/v1/completions", body.clone(), &[("authorization", key)])
            .await;
        assert_eq!(r.status, 200, "{key}: {}", r.text());
    }
    let r = app
        .post_raw("/v1/completions", body.clone(), &[("x-api-key", "sk-two")])
        .await;
    assert_eq!(r.status, 200, "x-api-key: {}", r.text());
    // Every other route, including unknown ones: no key, no answer.
    for path in ["/v1/models", "/metrics", "/v1/nothing"] {
        let r = app.get(path).await;
        assert_error(
            &r,
            401,
            "authentication_error",
            Some("invalid_api_key"),
            None,
        );
        let r = app
            .get_with(path, &[("authorization", "Bearer sk-one")])
            .await;
        assert_ne!(r.status, 401, "{path}");
    }
    // Bad requests from unauthenticated clients are 401, not 400.
    let r = app.post_raw("/v1/completions", "{not json", &[]).await;
    assert_eq!(r.status, 401);
}

/// `protect_health` puts /health behind the key too.
#[tokio::test]
async fn protected_health_needs_the_key() {
    let app = keyed(true);
    let r = app.get("/health").await;
    assert_error(
        &r,
        401,
        "authentication_error",
        Some("invalid_api_key"),
        None,
    );
    let r = app
        .get_with("/health", &[("authorization", "Bearer sk-two")])
        .await;
    assert_eq!(r.status, 200);
}

/// CORS preflights pass without a key and name the allowed origin; other
/// origins get no CORS grant.
#[tokio::test]
async fn cors_preflights_pass_without_a_key() {
    use axum::body::Body;
    use axum::http::{Method, Request};
    let app = keyed(false);
    let preflight = |origin: &str| {
        Request::builder()
            .method(Method::OPTIONS)
            .uri("/v1/chat/completions")
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type",
            )
            .body(Body::empty())
            .expect("request")
    };
    let r = app.send(preflight("https://app.example")).await;
    assert!(r.status.is_success(), "{:?}", r.status);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://app.example")
    );
    let r = app.send(preflight("https://evil.example")).await;
    assert_eq!(r.header("access-control-allow-origin"), None);
}
