//! A target spread over two llama.cpp RPC servers runs in a supervised child
//! process of `sipp serve`: requests naming it are forwarded there (chat,
//! streams, Anthropic's Messages, aliases, the parent's keys), and when an RPC
//! server is killed mid-request only that target's in-flight requests fail
//! (503, or an error event ending a stream), `/health` names it, the other
//! target keeps serving, and the child is restarted with backoff until the
//! server is back.
//!
//! `SIPP_RPC_SERVER` names llama.cpp's `rpc-server` (`scripts/rpc-server.sh`).

mod common;
#[path = "../../sipp/tests/common/rpc.rs"]
mod rpc;

use std::io::Read;
use std::sync::mpsc;
use std::time::Duration;

use common::{eventually, Server};
use reqwest::blocking::Client;
use rpc::RpcServer;
use serde_json::{json, Value};

const KEY: &str = "sk-rpc";

fn config(dir: &std::path::Path, endpoints: &[&str]) -> std::path::PathBuf {
    let path = dir.join("sipp.toml");
    let rpc: Vec<String> = endpoints.iter().map(|e| format!("\"{e}\"")).collect();
    std::fs::write(
        &path,
        format!(
            r#"
[server]
api_keys = ["{KEY}"]

[[models]]
id = "local"
model = "default"
default = true
[models.runtime.context]
n_ctx = 2048
n_parallel = 2

[[models]]
id = "spread"
model = "default"
aliases = ["spread-alias"]
[models.runtime.context]
n_ctx = 2048
n_parallel = 2
[models.runtime.placement]
rpc = [{}]
"#,
            rpc.join(", ")
        ),
    )
    .expect("write config");
    path
}

fn client() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client")
}

fn post(s: &Server, path: &str, body: Value) -> (u16, Value) {
    let r = client()
        .post(s.url(path))
        .bearer_auth(KEY)
        .json(&body)
        .send()
        .expect("request");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

fn chat(model: &str, max_tokens: u32) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

fn health(s: &Server) -> (u16, Value) {
    let r = client().get(s.url("/health")).send().expect("health");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

#[test]
fn an_rpc_backed_target_is_forwarded_and_survives_a_dropped_server() {
    let a = RpcServer::start();
    let mut b = RpcServer::start();
    let tmp = common::temp_dir("rpc");
    let dir = tmp.path().to_path_buf();
    let cfg = config(&dir, &[&a.endpoint, &b.endpoint]);
    // Healthy only once the child has loaded the model over both servers.
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);

    // Both targets are listed; the spread one answers through its child,
    // by id and by alias, streamed and not, and in Anthropic's API.
    let models = client()
        .get(s.url("/v1/models"))
        .bearer_auth(KEY)
        .send()
        .and_then(|r| r.json::<Value>())
        .expect("models");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert!(
        ids.contains(&"local") && ids.contains(&"spread"),
        "{models}"
    );
    for model in ["spread", "spread-alias"] {
        let (status, v) = post(&s, "/v1/chat/completions", chat(model, 8));
        assert_eq!(status, 200, "{model}: {v}");
        assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
        assert!(v["usage"]["completion_tokens"].as_u64() > Some(0), "{v}");
    }
    let mut streamed = String::new();
    let mut body = chat("spread", 8);
    body["stream"] = json!(true);
    client()
        .post(s.url("/v1/chat/completions"))
        .bearer_auth(KEY)
        .json(&body)
        .send()
        .expect("stream")
        .read_to_string(&mut streamed)
        .expect("stream body");
    assert!(streamed.contains("\"delta\""), "{streamed}");
    assert!(streamed.trim_end().ends_with("data: [DONE]"), "{streamed}");
    let r = client()
        .post(s.url("/v1/messages"))
        .header("x-api-key", KEY)
        .json(&json!({"model": "spread", "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hello"}]}))
        .send()
        .expect("messages");
    assert_eq!(r.status(), 200);
    let m: Value = r.json().expect("json");
    assert_eq!(m["type"], "message", "{m}");
    // The parent's policy applies before forwarding.
    let r = client()
        .post(s.url("/v1/chat/completions"))
        .bearer_auth("sk-wrong")
        .json(&chat("spread", 8))
        .send()
        .expect("bad key");
    assert_eq!(r.status(), 401);

    // Two long requests on the spread target, one streamed; an RPC server is
    // killed once the stream has produced tokens.
    let (tx, rx) = mpsc::channel();
    let base = s.base.clone();
    let stream = std::thread::spawn(move || {
        let mut body = chat("spread", 1500);
        body["stream"] = json!(true);
        body["ignore_eos"] = json!(true);
        let mut r = client()
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .expect("stream starts");
        let status = r.status().as_u16();
        let mut text = String::new();
        let mut buf = [0u8; 4096];
        let mut told = false;
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            text.push_str(&String::from_utf8_lossy(&buf[..n]));
            if !told && text.matches("\"delta\"").count() >= 4 {
                told = true;
                let _ = tx.send(());
            }
        }
        (status, text)
    });
    let base = s.base.clone();
    let plain = std::thread::spawn(move || {
        let mut body = chat("spread", 1500);
        body["ignore_eos"] = json!(true);
        let r = client()
            .post(format!("{base}/v1/chat/completions"))
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .expect("request");
        (
            r.status().as_u16(),
            r.json::<Value>().unwrap_or(Value::Null),
        )
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the stream produced tokens");
    std::thread::sleep(Duration::from_millis(300));
    let port = b.port;
    let _ = b.child.kill();
    let _ = b.child.wait();

    let (status, text) = stream.join().expect("stream thread");
    assert_eq!(status, 200);
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    let error = data
        .iter()
        .rev()
        .find_map(|d| {
            serde_json::from_str::<Value>(d)
                .ok()
                .filter(|v| v["error"].is_object())
        })
        .unwrap_or_else(|| panic!("the cut stream ends with an error event: {text}"));
    assert_eq!(error["error"]["code"], "unavailable", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("spread")),
        "{error}"
    );
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let (status, v) = plain.join().expect("plain thread");
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "unavailable", "{v}");

    // /health names the target; the local target keeps serving; the spread
    // one is refused with 503 while its child is down.
    assert!(
        eventually(Duration::from_secs(20), || {
            let (status, v) = health(&s);
            status == 503 && v["message"].as_str().is_some_and(|m| m.contains("spread"))
        }),
        "/health says the spread target is down: {:?}",
        health(&s)
    );
    eprintln!("while down: /health = {:?}", health(&s));
    let (status, v) = post(&s, "/v1/chat/completions", chat("local", 8));
    assert_eq!(status, 200, "{v}");
    let (status, v) = post(&s, "/v1/chat/completions", chat("spread", 8));
    assert_eq!(status, 503, "{v}");

    // A restart while the server is down fails at load, clearly (the
    // endpoint is probed first, so ggml never aborts on it), and the next
    // waits longer.
    assert!(
        eventually(Duration::from_secs(30), || {
            let (_, v) = health(&s);
            v["message"].as_str().is_some_and(|m| {
                m.contains("RPC server unreachable") && m.contains("restarting in")
            })
        }),
        "a failed restart is reported: {:?}",
        health(&s)
    );
    eprintln!("failed restart: /health = {:?}", health(&s));

    // The server comes back on its port: a restart with backoff finds it.
    let _b = RpcServer::start_on(port);
    assert!(
        eventually(Duration::from_secs(120), || health(&s).0 == 200),
        "healthy again: {:?}\n{}",
        health(&s),
        s.log()
    );
    let (status, v) = post(&s, "/v1/chat/completions", chat("spread", 8));
    assert_eq!(status, 200, "{v}");
    let starts = s
        .metric_with_key("sipp_child_starts_total{model=\"spread\"}", Some(KEY))
        .expect("child starts counted");
    eprintln!("child starts: {starts}");
    // The first start, at least one failed restart, the one that served.
    assert!(starts >= 3.0, "{starts}");
    drop(a);
}
