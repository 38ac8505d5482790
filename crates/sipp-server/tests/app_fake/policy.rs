//! The traffic policy over loopback: the router served on a real port, and
//! clients bound to different loopback addresses (the whole of 127/8 is
//! local) so the server sees different client addresses.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sipp_server::ServeConfig;

use super::harness::{target, App, Fake};

/// An app over two fake targets (`fake`, alias `fake-alias`, and `other`)
/// with the `[server]` table `server`, served on loopback.
async fn served(server: &str, fake: Fake) -> (App, SocketAddr) {
    let text = format!(
        "[server]\n{server}\n\n[[models]]\nid = \"fake\"\nmodel = \"fake:fake\"\naliases = [\"fake-alias\"]\ndefault = true\n\n[[models]]\nid = \"other\"\nmodel = \"fake:other\"\n"
    );
    let config = ServeConfig::from_toml(&text).expect("valid config");
    let app = App::with(
        config.server,
        vec![
            (target("fake", &["fake-alias"]), fake.clone()),
            (target("other", &[]), fake),
        ],
    );
    let addr = app.serve_tcp().await;
    (app, addr)
}

/// A client whose connections come from `from` (127.0.0.x).
fn client(from: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(from.parse::<IpAddr>().expect("ip"))
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: Value,
}

async fn post(
    c: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    body: Value,
) -> Answer {
    let mut r = c.post(format!("http://{addr}{path}")).json(&body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    answer(r.send().await.expect("sent")).await
}

async fn get(c: &reqwest::Client, addr: SocketAddr, path: &str, key: Option<&str>) -> Answer {
    let mut r = c.get(format!("http://{addr}{path}"));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    answer(r.send().await.expect("sent")).await
}

async fn answer(resp: reqwest::Response) -> Answer {
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let text = resp.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Answer {
        status,
        retry_after,
        body,
    }
}

fn completion(max_tokens: u32) -> Value {
    json!({"prompt": "hello there", "max_tokens": max_tokens})
}

/// A short completion with `key`, from the client's address.
async fn complete(
    c: &reqwest::Client,
    addr: SocketAddr,
    key: Option<&str>,
    max_tokens: u32,
) -> Answer {
    post(c, addr, "/v1/completions", key, &[], completion(max_tokens)).await
}

#[track_caller]
fn assert_refused(a: &Answer, status: u16, code: &str, mentions: &str) {
    assert_eq!(a.status, status, "{}", a.body);
    assert_eq!(a.body["error"]["code"], code, "{}", a.body);
    let m = a.body["error"]["message"].as_str().unwrap_or_default();
    assert!(m.contains(mentions), "`{mentions}` not in {m:?}");
    if status == 429 {
        let secs: u64 = a
            .retry_after
            .as_deref()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no Retry-After on a 429: {}", a.body));
        assert!((1..=60).contains(&secs), "Retry-After {secs}");
    }
}

/// A key over its request rate gets 429 with `Retry-After` and the limit
/// named; another key is still served, and so is the same address.
#[tokio::test]
async fn a_key_over_its_request_rate_is_refused_while_another_key_is_served() {
    let (_app, addr) = served(
        r#"api_keys = [
  { key = "sk-slow", name = "slow", role = "user", limits = { requests_per_minute = 2 } },
  "sk-admin",
]"#,
        Fake::default(),
    )
    .await;
    let c = client("127.0.0.2");
    for _ in 0..2 {
        let a = complete(&c, addr, Some("sk-slow"), 2).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let a = complete(&c, addr, Some("sk-slow"), 2).await;
    assert_refused(&a, 429, "rate_limit_exceeded", "requests per minute");
    assert!(a.body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("`slow`"));
    assert_eq!(a.body["error"]["type"], "rate_limit_error");
    // The key itself never appears in the message.
    assert!(!a.body.to_string().contains("sk-slow"));
    let b = complete(&c, addr, Some("sk-admin"), 2).await;
    assert_eq!(b.status, 200, "{}", b.body);
}

/// Token-rate limits: the prompt is charged at admission, generated tokens
/// as they stream; a key that has spent its minute is refused (429 naming
/// the tokens limit) while another key is served.
#[tokio::test]
async fn a_key_over_its_token_rate_is_refused_while_another_key_is_served() {
    let (_app, addr) = served(
        r#"api_keys = [
  { key = "sk-a", name = "a", limits = { tokens_per_minute = 40 } },
  { key = "sk-b", name = "b", limits = { tokens_per_minute = 40 } },
]"#,
        Fake::default(),
    )
    .await;
    let c = client("127.0.0.2");
    // Within the allowance: a short prompt and 30 generated tokens, streamed.
    let mut r = c
        .post(format!("http://{addr}/v1/completions"))
        .bearer_auth("sk-a")
        .json(&json!({"prompt": "hi", "max_tokens": 30, "stream": true}))
        .send()
        .await
        .expect("sent");
    assert_eq!(r.status(), 200);
    while r.chunk().await.expect("chunk").is_some() {}
    // What is left does not cover another 30-token answer's prompt plus the
    // 30 tokens already owed past the allowance.
    let a = complete(&c, addr, Some("sk-a"), 30).await;
    assert_refused(&a, 429, "rate_limit_exceeded", "tokens per minute");
    assert!(a.body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("`a`"));
    let b = complete(&c, addr, Some("sk-b"), 5).await;
    assert_eq!(b.status, 200, "{}", b.body);
    // A prompt over what the key has left is refused at admission, before
    // it takes a slot.
    let long = "word ".repeat(200);
    let b = post(
        &c,
        addr,
        "/v1/completions",
        Some("sk-b"),
        &[],
        json!({"prompt": long, "max_tokens": 1}),
    )
    .await;
    assert_refused(&b, 429, "rate_limit_exceeded", "tokens per minute");
}

/// A key may hold at most `concurrent_requests` requests at once: a stream
/// counts until it ends, and its place is free once the client leaves.
#[tokio::test]
async fn concurrent_requests_are_capped_per_key_until_the_stream_ends() {
    let (app, addr) = served(
        r#"api_keys = [{ key = "sk-one", limits = { concurrent_requests = 1 } }, "sk-free"]"#,
        Fake {
            slots: 2,
            n_ctx: 1 << 16,
            ..Fake::default()
        },
    )
    .await;
    let c = client("127.0.0.2");
    // A long stream the client does not read: it holds the key's one place.
    let held = c
        .post(format!("http://{addr}/v1/completions"))
        .bearer_auth("sk-one")
        .json(&json!({"prompt": "a long story", "max_tokens": 60000, "stream": true}))
        .send()
        .await
        .expect("sent");
    assert_eq!(held.status(), 200);
    let a = complete(&c, addr, Some("sk-one"), 2).await;
    assert_refused(&a, 429, "rate_limit_exceeded", "concurrent requests");
    let b = complete(&c, addr, Some("sk-free"), 2).await;
    assert_eq!(b.status, 200, "{}", b.body);
    // The client leaves: the stream is dropped, the request cancelled, the
    // place given back.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let a = complete(&c, addr, Some("sk-one"), 2).await;
        if a.status == 200 {
            break;
        }
        assert_eq!(a.status, 429, "{}", a.body);
        assert!(Instant::now() < deadline, "the place was never given back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let engine = app.engine("fake");
    let deadline = Instant::now() + Duration::from_secs(20);
    while engine.metrics().busy_slots > 0 {
        assert!(
            Instant::now() < deadline,
            "the abandoned stream kept its slot"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Addresses in a denied CIDR get 403 on every route (pages too); others
/// are served. With an allow list, only its ranges are served.
#[tokio::test]
async fn denied_and_unlisted_addresses_get_403() {
    let (_app, addr) = served(
        "[server.ip]\nallow = [\"127.0.0.0/29\"]\ndeny = [\"127.0.0.3/32\"]",
        Fake::default(),
    )
    .await;
    let ok = complete(&client("127.0.0.2"), addr, None, 2).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    for path in ["/v1/models", "/", "/health"] {
        let a = get(&client("127.0.0.3"), addr, path, None).await;
        assert_refused(&a, 403, "ip_denied", "127.0.0.3");
    }
    let a = complete(&client("127.0.0.9"), addr, None, 2).await;
    assert_refused(&a, 403, "ip_denied", "not allowed");
}

/// Per-address rate limits count each client address on its own.
#[tokio::test]
async fn per_address_rates_count_each_address() {
    let (_app, addr) = served(
        "[server.limits.per_ip]\nrequests_per_minute = 2",
        Fake::default(),
    )
    .await;
    let (c2, c3) = (client("127.0.0.2"), client("127.0.0.3"));
    for _ in 0..2 {
        assert_eq!(get(&c2, addr, "/v1/models", None).await.status, 200);
    }
    let a = get(&c2, addr, "/v1/models", None).await;
    assert_refused(&a, 429, "rate_limit_exceeded", "127.0.0.2");
    assert_eq!(get(&c3, addr, "/v1/models", None).await.status, 200);
}

/// A user key cannot read the dashboard's data or use a model outside its
/// list (nor see it in /v1/models); an admin key (and a plain string key)
/// can. The dashboard page itself holds no data and opens without a key.
#[tokio::test]
async fn user_keys_are_held_to_their_models_and_kept_off_the_dashboard() {
    let (_app, addr) = served(
        r#"api_keys = [
  { key = "sk-user", name = "app", role = "user", models = ["fake-alias"] },
  { key = "sk-ops", role = "admin" },
  "sk-plain",
]"#,
        Fake::default(),
    )
    .await;
    let c = client("127.0.0.2");
    let a = get(&c, addr, "/v1/dashboard", Some("sk-user")).await;
    assert_refused(&a, 403, "admin_only", "admin key");
    for admin in ["sk-ops", "sk-plain"] {
        let a = get(&c, addr, "/v1/dashboard", Some(admin)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert!(a.body["targets"].is_array(), "{}", a.body);
    }
    assert_eq!(get(&c, addr, "/v1/dashboard", None).await.status, 401);
    assert_eq!(get(&c, addr, "/dashboard", None).await.status, 200);

    // Its own model, by id or alias, and the default (which is it).
    for model in [Some("fake"), Some("fake-alias"), None] {
        let mut body = completion(2);
        if let Some(m) = model {
            body["model"] = json!(m);
        }
        let a = post(&c, addr, "/v1/completions", Some("sk-user"), &[], body).await;
        assert_eq!(a.status, 200, "{model:?}: {}", a.body);
    }
    let mut body = completion(2);
    body["model"] = json!("other");
    let a = post(
        &c,
        addr,
        "/v1/completions",
        Some("sk-user"),
        &[],
        body.clone(),
    )
    .await;
    assert_refused(&a, 403, "model_not_allowed", "`other`");
    assert_eq!(a.body["error"]["param"], "model");
    let chat =
        json!({"model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let a = post(
        &c,
        addr,
        "/v1/chat/completions",
        Some("sk-user"),
        &[],
        chat.clone(),
    )
    .await;
    assert_refused(&a, 403, "model_not_allowed", "`other`");
    let a = post(&c, addr, "/v1/chat/completions", Some("sk-ops"), &[], chat).await;
    assert_eq!(a.status, 200, "{}", a.body);

    let ids = |a: &Answer| -> Vec<String> {
        a.body["data"]
            .as_array()
            .map(|d| {
                d.iter()
                    .filter_map(|m| m["id"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(
        ids(&get(&c, addr, "/v1/models", Some("sk-user")).await),
        vec!["fake"]
    );
    assert_eq!(
        ids(&get(&c, addr, "/v1/models", Some("sk-plain")).await),
        vec!["fake", "other"]
    );
}

/// A forwarded-for header is believed only from a trusted proxy: a client
/// cannot dodge a deny list (or another address's limits) by writing one.
#[tokio::test]
async fn a_spoofed_forwarded_for_header_is_ignored_unless_the_proxy_is_trusted() {
    let (_app, addr) = served(
        "[server.ip]\ndeny = [\"203.0.113.0/24\"]\ntrusted_proxies = [\"127.0.0.4\"]\n\n[server.limits.per_ip]\nrequests_per_minute = 1",
        Fake::default(),
    )
    .await;
    let spoof = [("x-forwarded-for", "203.0.113.7")];
    // From an untrusted peer the header is ignored: served as 127.0.0.2.
    let direct = client("127.0.0.2");
    let a = post(
        &direct,
        addr,
        "/v1/completions",
        None,
        &spoof,
        completion(2),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    // ... and writing another address does not buy a fresh allowance.
    let other = [("x-forwarded-for", "198.51.100.1")];
    let a = post(
        &direct,
        addr,
        "/v1/completions",
        None,
        &other,
        completion(2),
    )
    .await;
    assert_refused(&a, 429, "rate_limit_exceeded", "127.0.0.2");
    // Through the trusted proxy the header names the client: denied.
    let proxy = client("127.0.0.4");
    let a = post(&proxy, addr, "/v1/completions", None, &spoof, completion(2)).await;
    assert_refused(&a, 403, "ip_denied", "203.0.113.7");
    // Two clients behind the proxy have their own allowances.
    for from in ["198.51.100.1", "198.51.100.2"] {
        let a = post(
            &proxy,
            addr,
            "/v1/completions",
            None,
            &[("x-forwarded-for", from)],
            completion(2),
        )
        .await;
        assert_eq!(a.status, 200, "{from}: {}", a.body);
    }
    let a = post(
        &proxy,
        addr,
        "/v1/completions",
        None,
        &[("x-forwarded-for", "198.51.100.1")],
        completion(2),
    )
    .await;
    assert_refused(&a, 429, "rate_limit_exceeded", "198.51.100.1");
}

/// Anthropic's routes answer policy refusals in Anthropic's error shape.
#[tokio::test]
async fn refusals_on_the_messages_api_are_anthropic_shaped() {
    let (_app, addr) = served(
        r#"api_keys = [{ key = "sk-user", role = "user", models = ["fake"] }]"#,
        Fake::default(),
    )
    .await;
    let c = client("127.0.0.2");
    let body =
        json!({"model": "other", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let a = post(
        &c,
        addr,
        "/v1/messages",
        None,
        &[("x-api-key", "sk-user")],
        body,
    )
    .await;
    assert_eq!(a.status, 403, "{}", a.body);
    assert_eq!(a.body["type"], "error", "{}", a.body);
    assert_eq!(a.body["error"]["type"], "permission_error", "{}", a.body);
}
