//! `GET /v1/dashboard` on its own: the document's figures against what the
//! engines are doing, its event-stream form, and the pages it feeds.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sipp_server::ServerSection;

use super::harness::{assert_error, endless, target, App, Fake};

fn fake_target(v: &Value) -> &Value {
    v["targets"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["id"] == "fake"))
        .unwrap_or_else(|| panic!("no `fake` target in {v}"))
}

/// Slots with their phases, queue depth and KV cells follow a running
/// request; finished requests appear newest first with their TTFT and
/// finish reason; prefix-cache figures count a repeated prompt.
#[tokio::test]
async fn the_document_follows_the_engine() {
    let app = App::one(Fake {
        slots: 2,
        n_ctx: 1 << 16,
        ..Fake::default()
    });
    let idle = app.get("/v1/dashboard").await;
    assert_eq!(idle.status, 200, "{}", idle.text());
    let v = idle.json();
    let t = fake_target(&v);
    assert_eq!(t["kind"], "local");
    assert_eq!(t["state"], "ready");
    let e = &t["engine"];
    assert_eq!(e["slots"].as_array().map(Vec::len), Some(2), "{e}");
    assert!(
        e["slots"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|s| s["phase"] == "Idle"),
        "{e}"
    );
    assert_eq!(e["busy_slots"], 0);
    assert_eq!(e["kv_cells_total"], 1 << 16);

    // One request holds a slot; another waits for the second... and a third queues.
    let engine = app.engine("fake").clone();
    let a = engine.generate(endless()).expect("admitted");
    let b = engine.generate(endless()).expect("admitted");
    let c = engine.generate(endless()).expect("queued");
    let deadline = Instant::now() + Duration::from_secs(10);
    let busy = loop {
        let v = app.get("/v1/dashboard").await.json();
        let e = fake_target(&v)["engine"].clone();
        if e["busy_slots"] == 2 && e["queue_depth"] == 1 {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "never saw 2 busy slots and 1 queued: {e}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    for s in busy["slots"].as_array().expect("slots") {
        assert!(s["request_id"].is_u64(), "{s}");
        assert!(
            ["Admitted", "Prefill", "Decode", "EmitBuffered"]
                .contains(&s["phase"].as_str().unwrap_or_default()),
            "{s}"
        );
    }
    assert!(busy["kv_cells_used"].as_u64().unwrap_or(0) > 0, "{busy}");
    drop((a, b, c));

    // Two finished requests, the same prompt twice: the second reuses it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.metrics().busy_slots > 0 {
        assert!(
            Instant::now() < deadline,
            "the cancelled requests kept their slots"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let prompt = "The same long prompt, long enough to be worth caching as a prefix.";
    for max_tokens in [3, 4] {
        let r = app
            .post(
                "/v1/completions",
                json!({"prompt": prompt, "max_tokens": max_tokens}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let v = app.get("/v1/dashboard").await.json();
    let recent = v["recent_requests"].as_array().expect("recent");
    assert!(recent.len() >= 2, "{v}");
    assert_eq!(recent[0]["generated_tokens"], 4, "newest first: {v}");
    assert_eq!(recent[1]["generated_tokens"], 3, "{v}");
    for r in &recent[..2] {
        assert_eq!(r["model"], "fake");
        assert_eq!(r["finish_reason"], "length");
        assert!(r["ttft_ms"].as_f64().is_some_and(|t| t > 0.0), "{r}");
    }
    assert!(recent[0]["cached_tokens"].as_u64().unwrap_or(0) > 0, "{v}");
    let pc = &fake_target(&v)["engine"]["prefix_cache"];
    assert!(pc["hit_tokens"].as_u64().unwrap_or(0) > 0, "{pc}");
    let rate = pc["hit_rate"].as_f64().unwrap_or(-1.0);
    assert!(rate > 0.0 && rate <= 1.0, "{pc}");
}

/// The throughput samples count generated tokens per second of each target.
#[tokio::test]
async fn throughput_samples_count_generated_tokens() {
    let app = App::new();
    let state_sampler = app.spawn_sampler();
    // Tokens generated while the sampler runs show in some sample.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = app
            .post(
                "/v1/completions",
                json!({"prompt": "count", "max_tokens": 50}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = app.get("/v1/dashboard").await.json();
        let samples = v["throughput"].as_array().cloned().unwrap_or_default();
        let best = samples
            .iter()
            .filter_map(|s| s["tokens_per_sec"]["fake"].as_f64())
            .fold(0.0, f64::max);
        if best > 0.0 {
            assert!(samples.iter().all(|s| s["t"].is_u64()), "{v}");
            assert!(
                samples.iter().all(|s| s["tokens_per_sec"]["embed"] == 0.0),
                "{v}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "no sample counted tokens: {v}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    state_sampler.abort();
}

/// With `Accept: text/event-stream` the same document comes as `state`
/// events.
#[tokio::test]
async fn the_event_stream_sends_the_document() {
    use http_body_util::BodyExt;
    let app = App::new();
    let resp = app
        .stream_get("/v1/dashboard", &[("accept", "text/event-stream")])
        .await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap_or_default()
        .starts_with("text/event-stream"));
    let mut body = resp.into_body();
    let mut text = String::new();
    // Two events: the first at once, the next a second later.
    let deadline = Instant::now() + Duration::from_secs(10);
    while text.matches("event: state").count() < 2 {
        assert!(Instant::now() < deadline, "fewer than 2 events: {text}");
        if let Some(Ok(frame)) = body.frame().await {
            if let Ok(d) = frame.into_data() {
                text.push_str(&String::from_utf8_lossy(&d));
            }
        }
    }
    let first = text
        .split("\n\n")
        .find(|e| e.starts_with("event: state"))
        .expect("an event");
    let data = first
        .lines()
        .find_map(|l| l.strip_prefix("data: "))
        .expect("data");
    let v: Value = serde_json::from_str(data).expect("JSON");
    assert_eq!(v["targets"].as_array().map(Vec::len), Some(2), "{v}");
}

/// With keys configured the document needs one (the role rules are in
/// tests/app_fake/policy.rs); the pages open without, with a strict CSP.
#[tokio::test]
async fn the_data_needs_a_key_and_the_pages_do_not() {
    let app = App::with(
        ServerSection {
            api_keys: vec!["sk-admin".into()],
            ..ServerSection::default()
        },
        vec![(target("fake", &[]), Fake::default())],
    );
    let r = app.get("/v1/dashboard").await;
    assert_error(
        &r,
        401,
        "authentication_error",
        Some("invalid_api_key"),
        None,
    );
    let r = app
        .get_with("/v1/dashboard", &[("authorization", "Bearer sk-admin")])
        .await;
    assert_eq!(r.status, 200);
    for (path, ty) in [
        ("/", "text/html"),
        ("/dashboard", "text/html"),
        ("/ui/chat.js", "text/javascript"),
        ("/ui/dashboard.js", "text/javascript"),
        ("/ui/common.js", "text/javascript"),
        ("/ui/style.css", "text/css"),
        ("/ui/vendor/marked.umd.js", "text/javascript"),
        ("/ui/vendor/purify.min.js", "text/javascript"),
    ] {
        let r = app.get(path).await;
        assert_eq!(r.status, 200, "{path}");
        assert!(
            r.header("content-type").is_some_and(|c| c.starts_with(ty)),
            "{path}: {:?}",
            r.headers
        );
        let csp = r.header("content-security-policy").unwrap_or_default();
        assert!(
            csp.contains("script-src 'self'") && !csp.contains("unsafe"),
            "{path}: {csp}"
        );
        assert!(csp.contains("connect-src 'self'"), "{csp}");
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    }
    // Everything a page loads is served (no reference to another origin or
    // a missing asset).
    for page in ["/", "/dashboard"] {
        let html = app.get(page).await.text();
        for src in html.split(['"', '\'']).filter(|s| s.starts_with("/ui/")) {
            assert_eq!(app.get(src).await.status, 200, "{page} loads {src}");
        }
        assert!(
            !html.contains("http://") && !html.contains("https://"),
            "{page}"
        );
    }
    let r = app.get("/ui/nope.js").await;
    assert_error(&r, 404, "invalid_request_error", Some("not_found"), None);
    let r = app.get("/ui/../Cargo.toml").await;
    assert_eq!(r.status, 404);
}
