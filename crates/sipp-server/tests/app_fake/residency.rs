//! Models in and out of memory: on-demand loading, the cap with
//! least-recently-used unloading, idle unloading, admin loads and unloads,
//! /v1/models status and the load and unload counters. The engines are
//! fakes, loaded by the server's own loading path (`spawn_loading_with`).

use std::collections::BTreeMap;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use serde_json::{json, Value};
use sipp_server::config::ProviderTarget;
use sipp_server::{AppState, LoadWhen, ModelTarget, ServeConfig, ServerSection};

use crate::harness::{assert_error, target, App, Fake, Reply};

/// An on-demand target.
fn on_demand(id: &str, aliases: &[&str]) -> ModelTarget {
    ModelTarget {
        load: LoadWhen::OnDemand,
        ..target(id, aliases)
    }
}

/// The app over `models`, loaded as `sipp serve` loads them; each load
/// waits for a word on `gate` when there is one ("ok" starts a fake engine,
/// any other word is the load's error).
fn residency_app(
    server: ServerSection,
    models: Vec<ModelTarget>,
    gate: Option<mpsc::Receiver<String>>,
) -> App {
    let config = ServeConfig {
        server: server.clone(),
        models,
        ..Default::default()
    };
    config.validate().expect("valid config");
    let state = AppState::new(&config);
    let gate = gate.map(Mutex::new);
    state.spawn_loading_with(config.models.clone(), move |_| {
        if let Some(g) = &gate {
            let word = g.lock().expect("gate").recv().map_err(|e| e.to_string())?;
            if word != "ok" {
                return Err(word);
            }
        }
        Ok(Fake::default().start())
    });
    App::over(state, &server, BTreeMap::new())
}

fn capped(models_max: usize) -> ServerSection {
    ServerSection {
        models_max: Some(models_max),
        ..Default::default()
    }
}

/// Each model's `status` in /v1/models.
async fn statuses(app: &App) -> BTreeMap<String, Value> {
    let r = app.get("/v1/models").await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| {
            (
                m["id"].as_str().expect("id").to_string(),
                m["status"].clone(),
            )
        })
        .collect()
}

/// Each model's `status.value` in /v1/models.
async fn values(app: &App) -> BTreeMap<String, String> {
    statuses(app)
        .await
        .into_iter()
        .map(|(id, s)| (id, s["value"].as_str().expect("value").to_string()))
        .collect()
}

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect()
}

/// Polls /v1/models until `id`'s status is `value` (10 s at most).
async fn until_status(app: &App, id: &str, value: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = values(app).await;
        if now.get(id).map(String::as_str) == Some(value) {
            return;
        }
        assert!(Instant::now() < deadline, "{id} never {value}: {now:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn complete(app: &App, model: &str) -> Reply {
    app.post(
        "/v1/completions",
        json!({"model": model, "prompt": "Hi", "max_tokens": 2}),
    )
    .await
}

/// The value of one series in /metrics (0 when absent); the admin key goes
/// along for the app that has keys.
async fn metric(app: &App, series: &str) -> u64 {
    let r = app
        .get_with("/metrics", &[("authorization", "Bearer sk-admin")])
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.text();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}

fn loads(model: &str, result: &str) -> String {
    format!("sipp_model_loads_total{{model=\"{model}\",result=\"{result}\"}}")
}

fn unloads(model: &str, reason: &str) -> String {
    format!("sipp_model_unloads_total{{model=\"{model}\",reason=\"{reason}\"}}")
}

/// Cap 1, two on-demand models: nothing is loaded until asked, then
/// alternating requests load one and unload the other in turn; /health
/// stays 200 throughout, and the counters count every load and unload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alternating_requests_load_and_unload_in_turn() {
    let app = residency_app(
        capped(1),
        vec![on_demand("a", &["a-alias"]), on_demand("b", &[])],
        None,
    );
    assert_eq!(
        values(&app).await,
        map(&[("a", "unloaded"), ("b", "unloaded")])
    );
    let r = app.get("/health").await;
    assert_eq!(
        (r.status.as_u16(), r.json()),
        (200, json!({"status": "ok"}))
    );
    // A route that does not load models finds it unloaded.
    let r = app.get("/model_info?model=a").await;
    let m = assert_error(&r, 503, "server_error", Some("model_not_loaded"), None);
    assert!(m.contains("`a`"), "{m}");
    for round in 0..3 {
        for (id, other) in [("a", "b"), ("b", "a")] {
            let r = complete(&app, id).await;
            assert_eq!(r.status, 200, "round {round}, {id}: {}", r.text());
            assert_eq!(r.json()["model"], id);
            assert_eq!(
                values(&app).await,
                map(&[(id, "loaded"), (other, "unloaded")]),
                "round {round}"
            );
        }
    }
    // An alias loads its target; so does a chat request.
    let r = app
        .post(
            "/v1/chat/completions",
            json!({"model": "a-alias", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        values(&app).await,
        map(&[("a", "loaded"), ("b", "unloaded")])
    );
    assert_eq!(app.get("/health").await.status, 200);
    assert_eq!(metric(&app, &loads("a", "ok")).await, 4);
    assert_eq!(metric(&app, &loads("b", "ok")).await, 3);
    assert_eq!(metric(&app, &unloads("a", "lru")).await, 3);
    assert_eq!(metric(&app, &unloads("b", "lru")).await, 3);
    assert_eq!(metric(&app, &loads("a", "error")).await, 0);
}

/// The next data frame of a stream, as text.
async fn next_frame(body: &mut axum::body::Body) -> String {
    loop {
        let frame = body
            .frame()
            .await
            .expect("the stream ended")
            .expect("a frame");
        if let Ok(data) = frame.into_data() {
            return String::from_utf8_lossy(&data).into_owned();
        }
    }
}

/// A streaming answer holds its model: a request for the other model (cap
/// 1) waits while the stream runs, the stream's model stays loaded and its
/// stream keeps coming, and only once the stream's body is gone is the
/// model unloaded and the other loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_flight_stream_finishes_before_its_model_unloads() {
    let app = Arc::new(residency_app(
        capped(1),
        vec![on_demand("a", &[]), on_demand("b", &[])],
        None,
    ));
    let resp = app
        .stream_post(
            "/v1/completions",
            json!({"model": "a", "prompt": "Tell me a long story", "max_tokens": 60000, "stream": true, "temperature": 0}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = next_frame(&mut body).await;
    assert!(first.starts_with("data: "), "{first}");
    let other = {
        let app = app.clone();
        tokio::spawn(async move { complete(&app, "b").await })
    };
    // `b`'s load has begun: it waits to unload `a`.
    until_status(&app, "b", "loading").await;
    for _ in 0..20 {
        let text = next_frame(&mut body).await;
        assert!(
            !text.contains("[DONE]") && !text.contains("\"error\""),
            "the stream was cut: {text}"
        );
        assert_eq!(values(&app).await["a"], "loaded");
        assert!(!other.is_finished(), "`b` did not wait for the stream");
    }
    assert_eq!(metric(&app, &unloads("a", "lru")).await, 0);
    // The client leaves: the lease goes with the body.
    drop(body);
    let r = other.await.expect("joined");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        values(&app).await,
        map(&[("a", "unloaded"), ("b", "loaded")])
    );
    assert_eq!(metric(&app, &unloads("a", "lru")).await, 1);
}

/// Requests for a model that is loading wait for it (one load serves them
/// all), and /health stays 200 while an on-demand model loads. A failed
/// load is a 503 with the reason and shows as `failed`; the next request
/// tries again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_a_loading_model_waits() {
    let (tx, rx) = mpsc::channel();
    let app = Arc::new(residency_app(
        ServerSection::default(),
        vec![on_demand("a", &[])],
        Some(rx),
    ));
    let first = {
        let app = app.clone();
        tokio::spawn(async move { complete(&app, "a").await })
    };
    until_status(&app, "a", "loading").await;
    let second = {
        let app = app.clone();
        tokio::spawn(async move { complete(&app, "a").await })
    };
    let r = app.get("/health").await;
    assert_eq!(
        (r.status.as_u16(), r.json()),
        (200, json!({"status": "ok"}))
    );
    assert!(!first.is_finished() && !second.is_finished());
    tx.send("ok".into()).expect("gate");
    for r in [first.await.expect("joined"), second.await.expect("joined")] {
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(metric(&app, &loads("a", "ok")).await, 1);

    // Unloaded by an admin, then a load that fails.
    let r = app.post("/models/unload", json!({"model": "a"})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    tx.send("no such file: a.gguf".into()).expect("gate");
    let r = complete(&app, "a").await;
    let m = assert_error(&r, 503, "server_error", Some("unavailable"), None);
    assert!(m.contains("no such file: a.gguf"), "{m}");
    let s = &statuses(&app).await["a"];
    assert_eq!(s["value"], "failed", "{s}");
    assert!(
        s["message"]
            .as_str()
            .is_some_and(|m| m.contains("no such file")),
        "{s}"
    );
    assert_eq!(metric(&app, &loads("a", "error")).await, 1);
    tx.send("ok".into()).expect("gate");
    let r = complete(&app, "a").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(statuses(&app).await["a"], json!({"value": "loaded"}));
}

/// A model unused for `idle_unload_secs` is unloaded (counted as `idle`),
/// and its next request loads it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_models_unload_after_the_configured_time() {
    let server = ServerSection {
        idle_unload_secs: Some(1),
        ..Default::default()
    };
    let app = residency_app(server, vec![target("a", &[]), on_demand("b", &[])], None);
    let unloader = app.spawn_idle_unloader();
    until_status(&app, "a", "loaded").await;
    let r = complete(&app, "b").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let deadline = Instant::now() + Duration::from_secs(15);
    while values(&app).await != map(&[("a", "unloaded"), ("b", "unloaded")]) {
        assert!(Instant::now() < deadline, "{:?}", values(&app).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&app, &unloads("a", "idle")).await, 1);
    assert_eq!(metric(&app, &unloads("b", "idle")).await, 1);
    assert_eq!(app.get("/health").await.status, 200);
    let r = complete(&app, "a").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(metric(&app, &loads("a", "ok")).await, 2);
    drop(unloader);
}

/// POST /models/load and /models/unload: admin keys only; they answer the
/// model's new status; a bad body is a 400, an unknown model a 404, a
/// provider target a 400; loading under the cap unloads the least recently
/// used model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_load_and_unload() {
    let server = ServeConfig::from_toml(
        "[server]\nmodels_max = 1\napi_keys = [\"sk-admin\", { key = \"sk-user\", role = \"user\" }]\n",
    )
    .expect("parses")
    .server;
    let provider = ModelTarget {
        model: String::new(),
        provider: Some(ProviderTarget {
            kind: "openai_compatible".into(),
            base_url: Some("http://127.0.0.1:9/v1".into()),
            api_key: None,
            api_key_env: None,
            model: "gpt".into(),
            max_retries: 0,
        }),
        ..target("p", &[])
    };
    let app = residency_app(
        server,
        vec![on_demand("a", &["a-alias"]), on_demand("b", &[]), provider],
        None,
    );
    let admin = [("authorization", "Bearer sk-admin")];
    let post = |path: &'static str, body: &'static str, key: &'static str| {
        let app = &app;
        async move { app.post_raw(path, body, &[("authorization", key)]).await }
    };
    for path in ["/models/load", "/models/unload"] {
        let r = post(path, r#"{"model": "a"}"#, "Bearer sk-user").await;
        let m = assert_error(&r, 403, "permission_error", Some("admin_only"), None);
        assert!(m.contains("admin"), "{m}");
        let r = post(path, r#"{"model": "a"}"#, "Bearer nope").await;
        assert_eq!(r.status, 401, "{}", r.text());
        let r = post(path, "", "Bearer sk-admin").await;
        assert_error(&r, 400, "invalid_request_error", None, None);
        let r = post(path, "{", "Bearer sk-admin").await;
        assert_error(&r, 400, "invalid_request_error", None, None);
        for bad in [r#"{}"#, r#"{"model": 5}"#, r#"{"model": " "}"#] {
            let r = post(path, bad, "Bearer sk-admin").await;
            assert_error(&r, 400, "invalid_request_error", None, Some("model"));
        }
        let r = post(path, r#"{"model": "nope"}"#, "Bearer sk-admin").await;
        let m = assert_error(
            &r,
            404,
            "invalid_request_error",
            Some("model_not_found"),
            Some("model"),
        );
        assert!(m.contains("`nope`"), "{m}");
        let r = post(path, r#"{"model": "p"}"#, "Bearer sk-admin").await;
        let m = assert_error(&r, 400, "invalid_request_error", None, Some("model"));
        assert!(m.contains("`p`"), "{m}");
        let r = app.get_with(path, &admin).await;
        assert_error(
            &r,
            405,
            "invalid_request_error",
            Some("method_not_allowed"),
            None,
        );
    }
    // Nothing was loaded by the refusals.
    assert_eq!(metric(&app, &loads("a", "ok")).await, 0);

    let r = post("/models/load", r#"{"model": "a-alias"}"#, "Bearer sk-admin").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json(),
        json!({"success": true, "model": "a", "status": {"value": "loaded"}})
    );
    // Loading again is a no-op.
    let r = post("/models/load", r#"{"model": "a"}"#, "Bearer sk-admin").await;
    assert_eq!(r.json()["status"]["value"], "loaded");
    assert_eq!(metric(&app, &loads("a", "ok")).await, 1);
    let r = post("/models/load", r#"{"model": "b"}"#, "Bearer sk-admin").await;
    assert_eq!(
        r.json(),
        json!({"success": true, "model": "b", "status": {"value": "loaded"}})
    );
    let r = app.get_with("/v1/models", &admin).await;
    let got: BTreeMap<String, Value> = r.json()["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter(|m| m["id"] != "p")
        .map(|m| {
            (
                m["id"].as_str().expect("id").to_string(),
                m["status"]["value"].clone(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [("a", "unloaded"), ("b", "loaded")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect()
    );
    let r = post("/models/unload", r#"{"model": "b"}"#, "Bearer sk-admin").await;
    assert_eq!(
        r.json(),
        json!({"success": true, "model": "b", "status": {"value": "unloaded"}})
    );
    // Unloading what is not loaded answers the same.
    let r = post("/models/unload", r#"{"model": "b"}"#, "Bearer sk-admin").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"]["value"], "unloaded");
    assert_eq!(metric(&app, &unloads("b", "admin")).await, 1);
    assert_eq!(metric(&app, &unloads("a", "lru")).await, 1);
    // A user key's request still loads it on demand.
    let r = app
        .post_raw(
            "/v1/completions",
            json!({"model": "b", "prompt": "Hi", "max_tokens": 2}).to_string(),
            &[("authorization", "Bearer sk-user")],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Without any residency settings, an admin can still unload a startup
/// model; its next request loads it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_unload_without_residency_settings_reloads_on_demand() {
    let app = residency_app(ServerSection::default(), vec![target("a", &[])], None);
    until_status(&app, "a", "loaded").await;
    let r = app.post("/models/unload", json!({"model": "a"})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"]["value"], "unloaded");
    assert_eq!(app.get("/health").await.status, 200);
    let r = complete(&app, "a").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(statuses(&app).await["a"], json!({"value": "loaded"}));
    assert_eq!(metric(&app, &loads("a", "ok")).await, 2);
    assert_eq!(metric(&app, &unloads("a", "admin")).await, 1);
}
