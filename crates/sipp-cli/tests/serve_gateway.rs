//! `sipp serve` fronting a remote provider with server-side credentials: a
//! second sipp server stands in for the provider.

mod common;

use common::Server;
use reqwest::blocking::Client;
use serde_json::{json, Value};

#[test]
fn a_target_can_be_a_remote_provider() {
    let upstream = Server::start_with_env(&[], &[("SIPP_API_KEY", "inner-key")]);
    let dir = std::env::temp_dir().join(format!("sipp-gateway-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let cfg = dir.join("gateway.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
[[models]]
id = "upstream"
[models.provider]
kind = "openai_compatible"
base_url = "{}/v1"
api_key_env = "UPSTREAM_KEY"
model = "default"
"#,
            upstream.base
        ),
    )
    .expect("write");
    let gw = Server::start_with_env(
        &["--config", cfg.to_str().expect("utf8")],
        &[("UPSTREAM_KEY", "inner-key")],
    );
    let c = Client::new();
    // The client needs no upstream key: the gateway holds it.
    let v: Value = c
        .post(gw.url("/v1/chat/completions"))
        .json(&json!({"model": "upstream", "messages": [{"role": "user", "content": "The capital of France is"}], "max_tokens": 8, "temperature": 0}))
        .send()
        .expect("send")
        .json()
        .expect("json");
    assert_eq!(v["object"], "chat.completion", "{v}");
    assert!(!v["choices"][0]["message"]["content"]
        .as_str()
        .expect("text")
        .is_empty());
    // The gateway refuses ignore_eos for a remote target, so the model may end
    // early; "length" means all 8 tokens were made.
    let n = v["usage"]["completion_tokens"].as_u64().expect("usage");
    assert!(n <= 8, "{v}");
    if v["choices"][0]["finish_reason"] == "length" {
        assert_eq!(n, 8, "{v}");
    }
    // Streaming passes through. The greedy first token of this raw prompt is
    // " Paris" on every kernel set.
    let body = c
        .post(gw.url("/v1/completions"))
        .json(&json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": true}))
        .send()
        .expect("send")
        .text()
        .expect("text");
    let text: String = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert!(text.contains("Paris"), "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"));
    // First-party profile through the gateway.
    let v: Value = c
        .post(gw.url("/v1/query"))
        .json(&json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}))
        .send()
        .expect("send")
        .json()
        .expect("json");
    assert!(v["text"].as_str().expect("text").contains("Paris"), "{v}");
    // Local-only options are refused with the field named.
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "x"}], "grammar": "root ::= \"a\""}))
        .send()
        .expect("send");
    assert_eq!(r.status(), 400);
    let v: Value = r.json().expect("json");
    assert_eq!(v["error"]["param"], "grammar", "{v}");
    // Upstream errors keep their status and message.
    let r = c
        .post(gw.url("/v1/completions"))
        .json(&json!({"prompt": "word ".repeat(10000), "max_tokens": 1}))
        .send()
        .expect("send");
    assert_eq!(r.status(), 400);
    assert!(r.text().expect("text").contains("context"));
}
