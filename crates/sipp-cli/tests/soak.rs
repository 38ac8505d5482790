//! Soak and chaos on loopback: 64 concurrent clients mixing streamed and plain
//! generations, chats, embeddings, random stops and max_tokens, disconnects,
//! cancellations and bad requests, for SIPP_SOAK_SECS seconds (30 in CI; run
//! the long form with SIPP_SOAK_SECS=300). Afterwards every request has had
//! exactly one well-formed answer or error, every slot is idle, no lease or
//! queue entry is left, the engines found no leak when they went idle, and the
//! server's resident memory is within 5% of its level after warm-up.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{eventually, Server};
use futures::StreamExt;
use serde_json::{json, Value};

const CLIENTS: usize = 64;

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Default)]
struct Tally {
    outcomes: BTreeMap<String, u64>,
    malformed: Vec<String>,
}

impl Tally {
    fn add(&mut self, k: impl Into<String>) {
        *self.outcomes.entry(k.into()).or_default() += 1;
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .map(str::to_string)
        })
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn is_openai_error(v: &Value) -> bool {
    v["error"]["message"].is_string() && v["error"]["type"].is_string()
}

/// Reads an SSE body; well-formed means valid JSON chunks and exactly one
/// ending: `[DONE]` (after at most one error event) for OpenAI routes.
async fn read_sse(
    resp: reqwest::Response,
    stop_after: Option<usize>,
) -> Result<&'static str, String> {
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let mut events = 0;
    let mut done = 0;
    let mut errors = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("stream broke: {e}"))?;
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(i) = buf.find("\n\n") {
            let ev: String = buf.drain(..i + 2).collect();
            for line in ev.lines() {
                let Some(d) = line.strip_prefix("data: ") else {
                    continue;
                };
                if d == "[DONE]" {
                    done += 1;
                    continue;
                }
                if done > 0 {
                    return Err("data after [DONE]".into());
                }
                let v: Value =
                    serde_json::from_str(d).map_err(|e| format!("bad chunk {d}: {e}"))?;
                if v.get("error").is_some() {
                    errors += 1;
                } else if v["object"].as_str().is_none() {
                    return Err(format!("chunk without object: {d}"));
                }
                events += 1;
            }
        }
        if stop_after.is_some_and(|n| events >= n) {
            // Hang up mid-stream.
            return Ok("disconnected");
        }
    }
    match (done, errors) {
        (1, 0) => Ok("stream_ok"),
        (1, 1) => Ok("stream_error"),
        _ => Err(format!(
            "stream ended with {done} [DONE] and {errors} errors"
        )),
    }
}

async fn one_request(c: &reqwest::Client, base: &str, rng: &mut Lcg) -> Result<String, String> {
    let max_tokens = 1 + rng.below(48);
    let stops = [None, Some("."), Some("\n"), Some(" the")];
    let stop = stops[rng.below(4) as usize];
    let prompts = [
        "Tell me about the sea.",
        "List three colours:",
        "Write a haiku about rain.",
        "The history of bread is",
        "Explain gravity simply.",
    ];
    let prompt = prompts[rng.below(prompts.len() as u64) as usize];
    let op = rng.below(10);
    let body = match op {
        0..=2 => {
            json!({"model": "smol", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stop": stop, "stream": op == 2})
        }
        3..=5 => {
            json!({"model": "smol", "prompt": prompt, "max_tokens": max_tokens, "stop": stop, "stream": op >= 4, "temperature": 0.7})
        }
        6 => json!({"model": "minilm", "input": [prompt, "another input"]}),
        7 => {
            json!({"model": "smol", "prompt": prompt, "max_tokens": 200, "ignore_eos": true, "stream": true})
        }
        8 => json!({"model": "smol", "prompt": prompt, "max_tokens": 150, "ignore_eos": true}),
        _ => Value::Null,
    };
    let path = match op {
        0..=2 => "/v1/chat/completions",
        6 => "/v1/embeddings",
        _ => "/v1/completions",
    };
    let req = c.post(format!("{base}{path}"));
    let req = if op == 9 {
        req.header("content-type", "application/json")
            .body("{\"prompt\": oops")
    } else {
        req.json(&body)
    };
    if op == 8 {
        // Cancel by giving up: drop the request after a random delay.
        let delay = Duration::from_millis(50 + rng.below(400));
        return match tokio::time::timeout(delay, req.send()).await {
            Err(_) => Ok("abandoned".into()),
            Ok(r) => {
                let r = r.map_err(|e| e.to_string())?;
                let status = r.status().as_u16();
                let v: Value = r
                    .json()
                    .await
                    .map_err(|e| format!("bad JSON ({status}): {e}"))?;
                if status == 200 && v["choices"][0]["text"].is_string() {
                    Ok("ok".into())
                } else if is_openai_error(&v) {
                    Ok(format!("error_{status}"))
                } else {
                    Err(format!("malformed {status}: {v}"))
                }
            }
        };
    }
    let r = req.send().await.map_err(|e| format!("send: {e}"))?;
    let status = r.status().as_u16();
    let streaming = r
        .headers()
        .get("content-type")
        .is_some_and(|h| h.to_str().unwrap_or("").starts_with("text/event-stream"));
    if streaming {
        let stop_after = (op == 7).then(|| 1 + rng.below(20) as usize);
        return read_sse(r, stop_after).await.map(str::to_string);
    }
    let v: Value = r
        .json()
        .await
        .map_err(|e| format!("bad JSON ({status}): {e}"))?;
    let well_formed = match (status, op) {
        (200, 0..=2) => {
            v["choices"][0]["message"]["content"].is_string() && v["usage"]["total_tokens"].is_u64()
        }
        (200, 3..=5) => {
            v["choices"][0]["text"].is_string() && v["choices"][0]["finish_reason"].is_string()
        }
        (200, 6) => v["data"].as_array().is_some_and(|d| d.len() == 2),
        (200, _) => false,
        _ => is_openai_error(&v),
    };
    if !well_formed {
        return Err(format!("malformed {status} for op {op}: {v}"));
    }
    Ok(if status == 200 {
        "ok".into()
    } else {
        format!("error_{status}")
    })
}

#[test]
fn soak_and_chaos_leave_nothing_behind() {
    let secs: u64 = std::env::var("SIPP_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let tmp = common::temp_dir("soak");
    let dir = tmp.path().to_path_buf();
    let minilm = std::process::Command::new(env!("CARGO_BIN_EXE_sipp"))
        .args(["models", "fetch", "minilm"])
        .output()
        .expect("fetch");
    assert!(minilm.status.success());
    let cfg = dir.join("soak.toml");
    std::fs::write(
        &cfg,
        r#"
[[models]]
id = "smol"
model = "default"
default = true
[models.runtime.context]
n_ctx = 4096
n_parallel = 8
[models.runtime.scheduler]
max_queued_requests = 128
[models.runtime.cache]
max_snapshot_bytes = 8388608

[[models]]
id = "minilm"
model = "minilm"
[models.runtime.context]
embeddings = true
n_parallel = 4
"#,
    )
    .expect("write");
    let server = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let pid = server.child.id();
    let base = server.base.clone();
    let tally = Arc::new(Mutex::new(Tally::default()));
    // Warm-up fills the caches (prefix snapshots, allocator pools) so that what
    // grows afterwards is a leak, not a cache reaching its budget.
    let warmup = Duration::from_secs(if secs >= 120 {
        secs / 4
    } else {
        (secs / 2).max(10)
    });
    let total = Duration::from_secs(secs).max(warmup + Duration::from_secs(8));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let start = Instant::now();
    let run_phase = |until: Instant, seed: u64| {
        let tasks: Vec<_> = (0..CLIENTS)
            .map(|i| {
                let base = base.clone();
                let tally = tally.clone();
                rt.spawn(async move {
                    let c = reqwest::Client::builder()
                        .pool_max_idle_per_host(0)
                        .build()
                        .expect("client");
                    let mut rng = Lcg(seed * 1000 + i as u64 + 1);
                    while Instant::now() < until {
                        let outcome = one_request(&c, &base, &mut rng).await;
                        let mut t = tally.lock().expect("tally");
                        match outcome {
                            Ok(k) => t.add(k),
                            Err(e) => {
                                t.add("malformed");
                                t.malformed.push(e);
                            }
                        }
                    }
                })
            })
            .collect();
        rt.block_on(async {
            for t in tasks {
                t.await.expect("client task");
            }
        });
    };
    let idle = |server: &Server| {
        eventually(Duration::from_secs(60), || {
            ["smol", "minilm"].iter().all(|m| {
                let q = |name: &str| server.metric(&format!("{name}{{model=\"{m}\"}}"));
                q("sipp_busy_slots") == Some(0.0)
                    && q("sipp_queue_depth") == Some(0.0)
                    && q("sipp_leased_sequences") == Some(0.0)
            })
        })
    };
    run_phase(start + warmup, 1);
    assert!(idle(&server), "not idle after warm-up: {}", server.log());
    let rss_warm = rss_kib(pid);
    let kv_warm = server
        .metric("sipp_kv_cells_used{model=\"smol\"}")
        .unwrap_or(0.0);
    run_phase(start + total, 2);
    assert!(
        idle(&server),
        "slots, queue or leases left busy: {}",
        server.log()
    );
    let rss_end = rss_kib(pid);
    let kv_end = server
        .metric("sipp_kv_cells_used{model=\"smol\"}")
        .unwrap_or(0.0);
    let t = tally.lock().expect("tally");
    let served: u64 = t.outcomes.values().sum();
    println!(
        "soak: {secs}s, {CLIENTS} clients, {served} requests: {:?}",
        t.outcomes
    );
    println!(
        "soak: RSS {rss_warm} KiB after warm-up, {rss_end} KiB at the end ({:+.2}%)",
        (rss_end as f64 / rss_warm as f64 - 1.0) * 100.0
    );
    println!(
        "soak: KV cells in use (idle prefix cache) {kv_warm} after warm-up, {kv_end} at the end"
    );
    for m in ["smol", "minilm"] {
        let finished: Vec<String> = ["completed", "failed", "cancelled"]
            .iter()
            .map(|o| {
                format!(
                    "{o}={}",
                    server
                        .metric(&format!(
                            "sipp_requests_finished_total{{model=\"{m}\",outcome=\"{o}\"}}"
                        ))
                        .unwrap_or(0.0)
                )
            })
            .collect();
        println!("soak: engine {m}: {}", finished.join(" "));
        assert_eq!(
            server.metric(&format!(
                "sipp_idle_invariant_violations_total{{model=\"{m}\"}}"
            )),
            Some(0.0),
            "{m} leaked"
        );
        assert!(server.metric(&format!("sipp_engine_up{{model=\"{m}\"}}")) == Some(1.0));
    }
    assert!(
        t.malformed.is_empty(),
        "malformed answers: {:?}",
        &t.malformed[..t.malformed.len().min(5)]
    );
    assert!(
        t.outcomes.get("ok").copied().unwrap_or(0) > 50,
        "too little was served: {:?}",
        t.outcomes
    );
    assert!(
        t.outcomes.contains_key("disconnected") && t.outcomes.contains_key("error_400"),
        "{:?}",
        t.outcomes
    );
    assert!(
        rss_end as f64 <= rss_warm as f64 * 1.05,
        "RSS grew from {rss_warm} to {rss_end} KiB"
    );
    // KV the engine holds at rest is only the idle prefix cache, bounded by the context.
    assert!(kv_end <= 4096.0);
}
