//! `sipp serve` over raw HTTP on loopback: every route, streaming, errors,
//! limits, auth, disconnects and shutdown.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::{eventually, two_model_config, Server};
use reqwest::blocking::Client;
use serde_json::{json, Value};
use sipp::sampling::JsonBounds;
use sipp::text::is_json_prefix;

fn post(client: &Client, s: &Server, path: &str, body: Value) -> (u16, Value) {
    let r = client
        .post(s.url(path))
        .json(&body)
        .send()
        .expect("request");
    let status = r.status().as_u16();
    let v = r.json().unwrap_or(Value::Null);
    (status, v)
}

fn assert_openai_error(v: &Value, kind: &str) {
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert_eq!(v["error"]["type"], kind, "{v}");
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

#[test]
fn completions_chat_embeddings_models_and_native_profile() {
    let tmp = common::temp_dir("serve-routes");
    let dir = tmp.path();
    let cfg = two_model_config(&dir, "");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let c = Client::new();

    // Completions, non-streamed, with logprobs and n = 2. ignore_eos makes
    // both choices run the full 8 tokens.
    let (st, v) = post(
        &c,
        &s,
        "/v1/completions",
        json!({"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": true, "logprobs": 2, "n": 2}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"].as_array().expect("choices").len(), 2);
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .expect("text")
            .contains("Paris"),
        "{v}"
    );
    assert_eq!(
        v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .expect("tokens")
            .len(),
        8
    );
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(
        v["usage"]["total_tokens"],
        v["usage"]["prompt_tokens"].as_u64().expect("n") + 16
    );

    // Completions, streamed, with usage.
    let r = c
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .expect("stream");
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .expect("ct")
        .starts_with("text/event-stream"));
    let data = sse_data(&r.text().expect("body"));
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("json"))
        .collect();
    let usage = chunks.last().expect("usage chunk");
    assert_eq!(usage["usage"]["completion_tokens"], 6, "{usage}");
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "length"));

    // Chat, non-streamed and streamed, routed by an alias.
    let (st, v) = post(
        &c,
        &s,
        "/v1/chat/completions",
        json!({"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Say hello"}], "max_completion_tokens": 10, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(!v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .is_empty());
    let r = c
        .post(s.url("/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "Count to three"}], "max_tokens": 8, "temperature": 0, "stream": true}))
        .send()
        .expect("stream");
    let data = sse_data(&r.text().expect("body"));
    let first: Value = serde_json::from_str(&data[0]).expect("json");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));

    // JSON mode through response_format, within json_bounds: max_tokens at
    // least the longest object the bounds allow, so the object always closes.
    let bounds = JsonBounds {
        max_string_chars: 12,
        max_object_members: 3,
        max_array_items: 3,
        max_depth: 1,
        compact_whitespace: true,
    };
    let longest = bounds.json_object_max_bytes().expect("bounded");
    // Patient: the worst case is hundreds of constrained tokens.
    let (st, v) = post(
        &patient(),
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Describe a cat in JSON"}], "max_tokens": longest, "temperature": 0, "response_format": {"type": "json_object"}, "json_bounds": bounds}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    assert!(serde_json::from_str::<Value>(content)
        .expect("valid JSON")
        .is_object());
    // With the target's bounds and a short max_tokens the object may be cut,
    // but what was written is always the start of valid JSON.
    let (st, v) = post(
        &c,
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Describe a cat in JSON"}], "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}}),
    );
    assert_eq!(st, 200, "{v}");
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    assert!(is_json_prefix(content), "{v}");
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(content)
            .expect("valid JSON")
            .is_object());
    }

    // Embeddings, float and base64.
    let (st, v) = post(
        &c,
        &s,
        "/v1/embeddings",
        json!({"model": "minilm", "input": ["a cat", "a dog"]}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["data"].as_array().expect("data").len(), 2);
    assert_eq!(
        v["data"][0]["embedding"].as_array().expect("vec").len(),
        384
    );
    let (_, b) = post(
        &c,
        &s,
        "/v1/embeddings",
        json!({"model": "minilm", "input": "a cat", "encoding_format": "base64"}),
    );
    assert!(b["data"][0]["embedding"].is_string());
    // Embeddings on the generation model: a clear 400.
    let (st, v) = post(
        &c,
        &s,
        "/v1/embeddings",
        json!({"model": "smol", "input": "x"}),
    );
    assert_eq!(st, 400, "{v}");

    // Models.
    let v: Value = c
        .get(s.url("/v1/models"))
        .send()
        .expect("models")
        .json()
        .expect("json");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, vec!["minilm", "smol"]);
    // Where each model runs: every layer on the CPU in the default build.
    for m in v["data"].as_array().expect("data") {
        let meta = &m["meta"];
        assert!(meta["n_params"].as_u64().expect("n_params") > 0, "{m}");
        assert_eq!(
            meta["total_layers"].as_u64(),
            Some(if m["id"] == "smol" { 31 } else { 7 }),
            "{m}"
        );
        if cfg!(not(any(
            feature = "cuda",
            feature = "vulkan",
            feature = "metal"
        ))) {
            assert_eq!(
                (&meta["placement"], &meta["backend"]),
                (&json!("CPU"), &json!("CPU")),
                "{m}"
            );
            assert_eq!(meta["offloaded_layers"], 0, "{m}");
        }
    }

    // First-party profile.
    let (st, v) = post(
        &c,
        &s,
        "/v1/query",
        json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(v["text"].as_str().expect("text").contains("Paris"));
    assert!(v["stats"]["ttft_ms"].as_f64().expect("ttft") > 0.0);
    let r = c
        .post(s.url("/v1/chat"))
        .json(&json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": true, "temperature": 0}))
        .send()
        .expect("stream");
    let events: Vec<Value> = sse_data(&r.text().expect("body"))
        .iter()
        .map(|d| serde_json::from_str(d).expect("json"))
        .collect();
    assert_eq!(events.last().expect("done")["type"], "done");
    assert!(events.iter().any(|e| e["type"] == "delta"));
    let (st, v) = post(
        &c,
        &s,
        "/v1/embed",
        json!({"model": "minilm", "input": ["x", "y"], "normalize": false}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["data"][1]["normalized"], false);
    assert_eq!(v["data"][1]["pooling"], "mean");

    // Tokenize and detokenize.
    let (_, t) = post(&c, &s, "/tokenize", json!({"content": "Hello world"}));
    let toks = t["tokens"].clone();
    let (_, d) = post(&c, &s, "/detokenize", json!({"tokens": toks}));
    assert_eq!(d["content"], "Hello world");

    // Metrics.
    let m = c
        .get(s.url("/metrics"))
        .send()
        .expect("metrics")
        .text()
        .expect("text");
    for name in [
        "sipp_http_requests_total",
        "sipp_time_to_first_token_seconds_bucket",
        "sipp_queue_depth",
        "sipp_busy_slots",
        "sipp_kv_cells_used",
        "sipp_prefix_cache_hit_tokens_total",
        "sipp_generated_tokens_total",
        "sipp_http_request_duration_seconds",
    ] {
        assert!(m.contains(name), "missing {name}");
    }
    assert!(m.contains("route=\"/v1/completions\""), "{m}");
    // Placement and device memory.
    let series = |prefix: &str| {
        m.lines()
            .find(|l| l.starts_with(prefix))
            .map(str::to_string)
    };
    let layers = series("sipp_offloaded_layers{model=\"smol\"").expect("sipp_offloaded_layers");
    let total = series("sipp_device_memory_total_bytes{").expect("device memory");
    assert!(total.contains("backend=\"CPU\""), "{total}");
    let bytes: f64 = total
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .expect("value");
    assert!(bytes > 0.0, "{total}");
    if cfg!(not(any(
        feature = "cuda",
        feature = "vulkan",
        feature = "metal"
    ))) {
        assert!(
            layers.ends_with(" 0") && layers.contains("backend=\"CPU\""),
            "{layers}"
        );
    }
}

/// A client for requests that are slow by design (the test keeps them running
/// while it fills the queue): reqwest's 30 s default is not about behaviour.
fn patient() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(600))
        .build()
        .expect("client")
}

#[test]
fn errors_are_openai_shaped_with_the_right_status() {
    // Room for long requests below, which must outlast the queue-full steps.
    let s = Server::start(&["--ctx-size", "1024", "--parallel", "1", "--max-queue", "1"]);
    let c = Client::new();
    // Bad JSON.
    let r = c
        .post(s.url("/v1/completions"))
        .body("{not json")
        .send()
        .expect("r");
    assert_eq!(r.status(), 400);
    assert_openai_error(&r.json().expect("json"), "invalid_request_error");
    // Wrong type.
    let (st, v) = post(
        &c,
        &s,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": "ten"}),
    );
    assert_eq!(st, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .expect("m")
            .contains("max_tokens")
            || v["error"]["message"]
                .as_str()
                .expect("m")
                .contains("invalid type"),
        "{v}"
    );
    // Unknown model.
    let (st, v) = post(
        &c,
        &s,
        "/v1/chat/completions",
        json!({"model": "gpt-7", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(st, 404);
    assert_eq!(v["error"]["code"], "model_not_found");
    // Prompt too long, with the numbers.
    let (st, v) = post(
        &c,
        &s,
        "/v1/completions",
        json!({"prompt": "word ".repeat(2000)}),
    );
    assert_eq!(st, 400);
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert!(
        v["error"]["message"].as_str().expect("m").contains("1024"),
        "{v}"
    );
    // Negative max_tokens, bad top_p, empty messages, unknown route.
    let (st, v) = post(
        &c,
        &s,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": -3}),
    );
    assert_eq!(
        (st, v["error"]["param"].as_str()),
        (400, Some("max_tokens")),
        "{v}"
    );
    let (st, v) = post(
        &c,
        &s,
        "/v1/completions",
        json!({"prompt": "x", "top_p": 7}),
    );
    assert_eq!(st, 400, "{v}");
    assert!(v["error"]["message"].as_str().expect("m").contains("top_p"));
    let (st, _) = post(&c, &s, "/v1/chat/completions", json!({"messages": []}));
    assert_eq!(st, 400);
    let r = c.get(s.url("/v1/nothing")).send().expect("r");
    assert_eq!(r.status(), 404);
    // Oversized body.
    let huge = "a".repeat(9 * 1024 * 1024);
    let r = c
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": huge}))
        .send()
        .expect("r");
    assert_eq!(r.status(), 413);
    assert_openai_error(&r.json().expect("json"), "invalid_request_error");
    // Queue full: one slot busy, one waiting, the third is refused at once.
    // 1000 tokens without EOS take seconds even on a fast machine.
    let long = json!({"prompt": "Tell me a story", "max_tokens": 1000, "ignore_eos": true, "temperature": 0});
    let a = std::thread::spawn({
        let url = s.url("/v1/completions");
        let body = long.clone();
        move || {
            patient()
                .post(url)
                .json(&body)
                .send()
                .map(|r| r.status().as_u16())
        }
    });
    assert!(eventually(Duration::from_secs(10), || s
        .metric("sipp_busy_slots{")
        .unwrap_or(0.0)
        >= 1.0));
    let b = std::thread::spawn({
        let url = s.url("/v1/completions");
        let body = long.clone();
        move || {
            patient()
                .post(url)
                .json(&body)
                .send()
                .map(|r| r.status().as_u16())
        }
    });
    assert!(eventually(Duration::from_secs(10), || s
        .metric("sipp_queue_depth{")
        .unwrap_or(0.0)
        >= 1.0));
    let started = std::time::Instant::now();
    let r = c
        .post(s.url("/v1/completions"))
        .json(&long)
        .send()
        .expect("r");
    assert_eq!(r.status(), 429);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "429 must be immediate"
    );
    assert_eq!(r.headers()["retry-after"], "1");
    assert_openai_error(&r.json().expect("json"), "rate_limit_error");
    // The in-flight requests still finish.
    assert_eq!(a.join().expect("thread").expect("response"), 200);
    assert_eq!(b.join().expect("thread").expect("response"), 200);
}

#[test]
fn api_keys_guard_everything_but_health() {
    let s = Server::start_with_env(&[], &[("SIPP_API_KEY", "sk-test-123")]);
    let c = Client::new();
    assert_eq!(c.get(s.url("/health")).send().expect("r").status(), 200);
    let body = json!({"prompt": "x", "max_tokens": 1});
    let none = c
        .post(s.url("/v1/completions"))
        .json(&body)
        .send()
        .expect("r");
    assert_eq!(none.status(), 401);
    assert_openai_error(&none.json().expect("json"), "authentication_error");
    let wrong = c
        .post(s.url("/v1/completions"))
        .bearer_auth("sk-test-124")
        .json(&body)
        .send()
        .expect("r");
    assert_eq!(wrong.status(), 401);
    // Anthropic's header carries the key too; a wrong one is refused.
    let wrong_header = c
        .post(s.url("/v1/completions"))
        .header("x-api-key", "sk-test-124")
        .json(&body)
        .send()
        .expect("r");
    assert_eq!(wrong_header.status(), 401);
    let x_api_key = c
        .post(s.url("/v1/completions"))
        .header("x-api-key", "sk-test-123")
        .json(&body)
        .send()
        .expect("r");
    assert_eq!(x_api_key.status(), 200);
    let ok = c
        .post(s.url("/v1/completions"))
        .bearer_auth("sk-test-123")
        .json(&body)
        .send()
        .expect("r");
    assert_eq!(ok.status(), 200);
    assert_eq!(c.get(s.url("/v1/models")).send().expect("r").status(), 401);
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_slot() {
    let s = Server::start(&["--parallel", "1"]);
    let addr = s.base.trim_start_matches("http://").to_string();
    let mut sock = std::net::TcpStream::connect(&addr).expect("connect");
    let body = json!({"prompt": "Write an endless story", "max_tokens": 100000, "ignore_eos": true, "stream": true}).to_string();
    write!(sock, "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).expect("write");
    let mut buf = [0u8; 4096];
    let mut got = 0;
    while got < 2000 {
        got += sock.read(&mut buf).expect("read");
    }
    assert_eq!(s.metric("sipp_busy_slots{"), Some(1.0));
    drop(sock);
    assert!(
        eventually(Duration::from_secs(5), || s.metric("sipp_busy_slots{")
            == Some(0.0)),
        "the slot was not freed: {}",
        s.log()
    );
    assert_eq!(
        s.metric("sipp_requests_finished_total{model=\"default\",outcome=\"cancelled\"}"),
        Some(1.0)
    );
    // And the next request is served.
    let (st, _) = post(
        &Client::new(),
        &s,
        "/v1/completions",
        json!({"prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(st, 200);
}

/// The process answers /health as soon as it listens, turns ready, and
/// drains on SIGTERM. Whether the first probe still sees the model loading
/// depends on timing (a small model loads in well under a second), so the
/// loading phase itself (503 `loading`, then 200) is checked deterministically
/// in-process in `crates/sipp-server/tests/app_fake/lifecycle.rs`; here the
/// first answer must be one of the two, with the body that matches its status.
#[test]
fn health_answers_while_loading_turns_ready_and_sigterm_drains() {
    let fetch = std::process::Command::new(env!("CARGO_BIN_EXE_sipp"))
        .args(["models", "fetch"])
        .output()
        .expect("fetch");
    assert!(fetch.status.success());
    let _turn = common::ServerTurn::take();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sipp"))
        .args(["serve", "--port", "0", "--shutdown-grace", "120"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut err = std::io::BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    std::io::BufRead::read_line(&mut err, &mut line).expect("line");
    let base = line
        .trim()
        .strip_prefix("listening on ")
        .expect("address")
        .split_whitespace()
        .next()
        .expect("url")
        .to_string();
    std::thread::spawn(move || {
        let mut sink = String::new();
        let _ = err.read_to_string(&mut sink);
    });
    let first = Client::new()
        .get(format!("{base}/health"))
        .send()
        .expect("health answers before the model is known to be loaded");
    let status = first.status().as_u16();
    let body: Value = first.json().expect("health body is JSON");
    match status {
        503 => assert_eq!(body, json!({"status": "loading"})),
        200 => assert_eq!(body, json!({"status": "ok"})),
        other => panic!("/health answered {other} {body} while starting"),
    }
    assert!(eventually(Duration::from_secs(60), || {
        Client::new()
            .get(format!("{base}/health"))
            .send()
            .map(|r| r.status() == 200)
            .unwrap_or(false)
    }));
    // A request in flight when SIGTERM arrives still completes. 1000 tokens
    // outlast the polling below on a fast machine and fit the grace on a slow one.
    let url = format!("{base}/v1/completions");
    let inflight = std::thread::spawn(move || {
        patient()
            .post(url)
            .json(&json!({"prompt": "Tell me a story", "max_tokens": 1000, "ignore_eos": true}))
            .send()
            .and_then(|r| r.json::<Value>())
    });
    // SIGTERM once the request holds a slot.
    assert!(eventually(Duration::from_secs(30), || {
        common::metric_at(&base, "sipp_busy_slots{", None).unwrap_or(0.0) >= 1.0
    }));
    let pid = child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill")
        .success());
    let v = inflight
        .join()
        .expect("thread")
        .expect("in-flight request answered");
    assert_eq!(v["usage"]["completion_tokens"], 1000, "{v}");
    let status = child.wait().expect("exits");
    assert!(status.success(), "{status}");
}

/// Each model's `status.value` in /v1/models.
fn model_status(c: &Client, s: &Server) -> std::collections::BTreeMap<String, String> {
    let v: Value = c
        .get(s.url("/v1/models"))
        .send()
        .and_then(|r| r.json())
        .expect("models");
    v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| {
            let id = m["id"].as_str().expect("id").to_string();
            let status = m["status"]["value"].as_str().expect("status").to_string();
            (id, status)
        })
        .collect()
}

/// Two on-demand targets (the default model under two ids) and
/// `--models-max 1`: nothing loads at start; alternating requests load one
/// model and unload the other in turn; a stream in flight on one model
/// finishes whole while a request for the other waits for it; /metrics
/// counts the loads and unloads.
#[test]
fn on_demand_models_load_and_unload_in_turn_under_a_cap() {
    let tmp = common::temp_dir("serve-on-demand");
    let dir = tmp.path();
    let cfg = dir.join("sipp.toml");
    let target = |id: &str| {
        format!(
            "[[models]]\nid = \"{id}\"\nmodel = \"default\"\nload = \"on_demand\"\n[models.runtime.context]\nn_ctx = 1024\nn_parallel = 2\n\n"
        )
    };
    std::fs::write(&cfg, format!("{}{}", target("first"), target("second"))).expect("config");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8"), "--models-max", "1"]);
    let c = patient();
    let status = |pairs: [(&str, &str); 2]| -> std::collections::BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    };
    // Healthy with nothing loaded.
    assert_eq!(
        model_status(&c, &s),
        status([("first", "unloaded"), ("second", "unloaded")])
    );
    let chat = |model: &str, max_tokens: u32, stream: bool| {
        let mut body = json!({"model": model, "messages": [{"role": "user", "content": "Tell me about the sea"}], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    };
    for round in 0..2 {
        for (id, other) in [("first", "second"), ("second", "first")] {
            let (st, v) = post(&c, &s, "/v1/chat/completions", chat(id, 4, false));
            assert_eq!(st, 200, "round {round}, {id}: {v}");
            assert_eq!(v["model"], id, "{v}");
            assert_eq!(
                model_status(&c, &s),
                status([(id, "loaded"), (other, "unloaded")]),
                "round {round}"
            );
        }
    }
    // A stream on `second` (loaded now) and, once it has begun, a request
    // for `first`: the stream runs to its end, then `first` loads.
    let mut stream = c
        .post(s.url("/v1/chat/completions"))
        .json(&chat("second", 128, true))
        .send()
        .expect("stream");
    assert_eq!(stream.status(), 200);
    let mut first_bytes = [0u8; 6];
    stream
        .read_exact(&mut first_bytes)
        .expect("the stream begins");
    assert_eq!(&first_bytes, b"data: ");
    let other = {
        let c = c.clone();
        let url = s.url("/v1/chat/completions");
        let body = chat("first", 4, false);
        std::thread::spawn(move || {
            let r = c.post(url).json(&body).send().expect("request");
            (
                r.status().as_u16(),
                r.json::<Value>().unwrap_or(Value::Null),
            )
        })
    };
    let mut rest = String::new();
    stream.read_to_string(&mut rest).expect("the stream ends");
    let data = sse_data(&format!("data: {rest}"));
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{rest}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("json"))
        .collect();
    assert!(
        chunks.iter().all(|c| c.get("error").is_none()),
        "the stream was cut: {rest}"
    );
    let usage = chunks.last().expect("usage chunk");
    assert_eq!(usage["usage"]["completion_tokens"], 128, "{usage}");
    assert!(
        chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "length"),
        "{rest}"
    );
    let (st, v) = other.join().expect("thread");
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        model_status(&c, &s),
        status([("first", "loaded"), ("second", "unloaded")])
    );
    // Every load and unload counted.
    for (series, want) in [
        ("sipp_model_loads_total{model=\"first\",result=\"ok\"}", 3.0),
        (
            "sipp_model_loads_total{model=\"second\",result=\"ok\"}",
            2.0,
        ),
        (
            "sipp_model_unloads_total{model=\"first\",reason=\"lru\"}",
            2.0,
        ),
        (
            "sipp_model_unloads_total{model=\"second\",reason=\"lru\"}",
            2.0,
        ),
    ] {
        assert_eq!(s.metric(series), Some(want), "{series}");
    }
    assert_eq!(
        c.get(s.url("/health")).send().expect("health").status(),
        200
    );
}
