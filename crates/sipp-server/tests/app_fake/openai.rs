//! OpenAI's routes on the fake: choices, echo, log-probabilities, usage.

use std::collections::BTreeSet;

use serde_json::{json, Value};

use crate::harness::App;

fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| {
            c["text"]
                .as_str()
                .or_else(|| c["message"]["content"].as_str())
                .expect("text")
                .to_string()
        })
        .collect()
}

fn indexes(v: &Value) -> Vec<u64> {
    v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| c["index"].as_u64().expect("index"))
        .collect()
}

/// `n` choices, indexed 0..n, each a full generation with its own seed (so
/// sampled choices differ, and the same seed repeats them); usage counts the
/// prompt once and every choice's tokens.
#[tokio::test]
async fn completions_with_n_give_n_indexed_choices_and_summed_usage() {
    let app = App::new();
    let body = json!({"prompt": "Hello", "max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 5});
    let r = app.post("/v1/completions", body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "fake");
    assert_eq!(indexes(&v), vec![0, 1, 2]);
    for c in v["choices"].as_array().expect("choices") {
        assert_eq!(c["finish_reason"], "length", "{v}");
        assert_eq!(c["logprobs"], Value::Null, "{v}");
    }
    let t = texts(&v);
    assert!(
        t.iter().collect::<BTreeSet<_>>().len() > 1,
        "three seeds gave one text: {t:?}"
    );
    // "Hello" is BOS and five bytes on the fake.
    assert_eq!(v["usage"]["prompt_tokens"], 6, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 36, "{v}");
    assert_eq!(v["usage"]["total_tokens"], 42, "{v}");
    let again = app.post("/v1/completions", body).await.json();
    assert_eq!(texts(&again), t, "the same seed must repeat the choices");

    // Several prompts: n choices each, prompt i owning indexes i*n..(i+1)*n.
    let r = app
        .post(
            "/v1/completions",
            json!({"prompt": ["Hello", "Goodbye"], "max_tokens": 4, "n": 2, "temperature": 0, "echo": true}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(indexes(&v), vec![0, 1, 2, 3]);
    let t = texts(&v);
    assert!(
        t[0].starts_with("Hello") && t[1].starts_with("Hello"),
        "{t:?}"
    );
    assert!(
        t[2].starts_with("Goodbye") && t[3].starts_with("Goodbye"),
        "{t:?}"
    );
    // Greedy choices of one prompt are the same text.
    assert_eq!(t[0], t[1]);
    assert_eq!(t[2], t[3]);
    assert_eq!(v["usage"]["prompt_tokens"], 6 + 8, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 16, "{v}");
}

#[tokio::test]
async fn chat_with_n_gives_n_indexed_assistant_messages() {
    let app = App::new();
    let body = json!({"messages": [{"role": "user", "content": "Say hi"}], "max_completion_tokens": 10, "n": 4, "temperature": 0.8, "seed": 11});
    let r = app.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(indexes(&v), vec![0, 1, 2, 3]);
    for c in v["choices"].as_array().expect("choices") {
        assert_eq!(c["message"]["role"], "assistant", "{v}");
        assert_eq!(c["finish_reason"], "length", "{v}");
        assert!(c.get("delta").is_none(), "{v}");
    }
    let t = texts(&v);
    assert!(t.iter().all(|s| !s.is_empty()), "{t:?}");
    assert!(t.iter().collect::<BTreeSet<_>>().len() > 1, "{t:?}");
    assert_eq!(v["usage"]["completion_tokens"], 40, "{v}");
    // The prompt is the rendered template, counted once.
    let one = app
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 10}),
        )
        .await
        .json();
    assert_eq!(v["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
    assert_eq!(
        one["usage"]["prompt_tokens"],
        // BOS, then "<|user|>Say hi\n<|assistant|>".
        1 + "<|user|>Say hi\n<|assistant|>".len()
    );
}

/// `echo` puts the prompt before the completion, and log-probability offsets
/// start after it.
#[tokio::test]
async fn completions_echo_prefixes_the_prompt() {
    let app = App::new();
    let plain = app
        .post(
            "/v1/completions",
            json!({"prompt": "The sky is", "max_tokens": 8, "temperature": 0}),
        )
        .await
        .json();
    let echoed = app
        .post(
            "/v1/completions",
            json!({"prompt": "The sky is", "max_tokens": 8, "temperature": 0, "echo": true, "logprobs": 1}),
        )
        .await
        .json();
    let text = texts(&plain).remove(0);
    assert_eq!(texts(&echoed)[0], format!("The sky is{text}"));
    let offsets = &echoed["choices"][0]["logprobs"]["text_offset"];
    assert_eq!(offsets[0], "The sky is".len(), "{echoed}");
    // Usage is the generation's, not the echo's.
    assert_eq!(echoed["usage"]["completion_tokens"], 8);
    // A token-id prompt echoes as its text.
    let v = app
        .post(
            "/v1/completions",
            json!({"prompt": [84, 104, 101], "max_tokens": 3, "temperature": 0, "echo": true}),
        )
        .await
        .json();
    assert!(texts(&v)[0].starts_with("The"), "{v}");
    // Without echo nothing of the prompt shows.
    assert!(!text.starts_with("The sky is"));
}

/// Legacy logprobs: one entry per generated token in each of the four
/// arrays, log-probabilities at most 0, at most k alternatives with the
/// chosen (greedy) token the most likely, and offsets that walk the text.
#[tokio::test]
async fn completions_logprobs_have_one_entry_per_token() {
    let app = App::new();
    for k in [0usize, 1, 3, 5] {
        let r = app
            .post(
                "/v1/completions",
                json!({"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "logprobs": k}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let text = texts(&v).remove(0);
        let lp = &v["choices"][0]["logprobs"];
        let n = v["usage"]["completion_tokens"].as_u64().expect("n") as usize;
        assert_eq!(n, 40);
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            assert_eq!(lp[key].as_array().expect(key).len(), n, "{key}: {lp}");
        }
        let mut last_offset = 0;
        for i in 0..n {
            let chosen = lp["token_logprobs"][i].as_f64().expect("logprob");
            assert!(chosen <= 0.0 && chosen.is_finite(), "{lp}");
            let top = lp["top_logprobs"][i].as_object().expect("map");
            // Alternatives are keyed by text, so two partial characters (both
            // U+FFFD) can share a key: at most k entries, at least one.
            assert!(top.len() <= k && (k == 0 || !top.is_empty()), "{top:?}");
            let mut values: Vec<f64> = top.values().map(|x| x.as_f64().expect("f")).collect();
            values.sort_by(|a, b| b.total_cmp(a));
            assert!(values.iter().all(|&x| x <= 0.0), "{top:?}");
            if let Some(&best) = values.first() {
                assert!((best - chosen).abs() < 1e-6, "greedy picks the best: {lp}");
            }
            let offset = lp["text_offset"][i].as_u64().expect("offset") as usize;
            assert!(offset >= last_offset && offset <= text.len(), "{lp}");
            last_offset = offset;
            let token = lp["tokens"][i].as_str().expect("token");
            if token.is_ascii() {
                assert!(
                    text.get(offset..).is_some_and(|t| t.starts_with(token)),
                    "{token:?} at {offset} in {text:?}"
                );
            }
        }
    }
    // Over 20 (OpenAI's chat limit, the engine's for both) is refused.
    let r = app
        .post("/v1/completions", json!({"prompt": "x", "logprobs": 21}))
        .await;
    crate::harness::assert_error(&r, 400, "invalid_request_error", None, Some("logprobs"));
}

/// Chat logprobs: one entry per token, exactly k alternatives sorted from the
/// most likely, all at most 0; the bytes of the entries spell the content.
#[tokio::test]
async fn chat_logprobs_have_k_sorted_alternatives_and_spell_the_content() {
    let app = App::new();
    for k in [0usize, 2, 5, 20] {
        let r = app
            .post(
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "Tell me something"}], "max_tokens": 30, "temperature": 0, "logprobs": true, "top_logprobs": k}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let content = texts(&v).remove(0);
        let entries = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .expect("content");
        assert_eq!(entries.len(), 30);
        let mut bytes = Vec::new();
        for e in entries {
            let chosen = e["logprob"].as_f64().expect("logprob");
            assert!(chosen <= 0.0 && chosen.is_finite(), "{e}");
            let top = e["top_logprobs"].as_array().expect("top");
            assert_eq!(top.len(), k, "{e}");
            let values: Vec<f64> = top
                .iter()
                .map(|t| t["logprob"].as_f64().expect("f"))
                .collect();
            assert!(values.windows(2).all(|w| w[0] >= w[1]), "unsorted: {e}");
            assert!(values.iter().all(|&x| x <= 0.0), "{e}");
            if k > 0 {
                assert!((values[0] - chosen).abs() < 1e-6, "greedy: {e}");
                assert_eq!(top[0]["bytes"], e["bytes"], "{e}");
            }
            bytes.extend(
                e["bytes"]
                    .as_array()
                    .expect("bytes")
                    .iter()
                    .map(|b| b.as_u64().expect("byte") as u8),
            );
        }
        // A character cut by max_tokens may be dropped or shown as U+FFFD.
        let spelled = String::from_utf8_lossy(&bytes);
        assert!(
            spelled == content || spelled.strip_prefix(content.as_str()) == Some("\u{FFFD}"),
            "{spelled:?} vs {content:?}"
        );
    }
    // `logprobs: true` alone: the chosen tokens, no alternatives. Absent: null.
    let v = app
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "logprobs": true}),
        )
        .await
        .json();
    let entries = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content");
    assert_eq!(entries.len(), 3);
    assert!(entries
        .iter()
        .all(|e| e["top_logprobs"].as_array().is_some_and(Vec::is_empty)));
    let v = app
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}),
        )
        .await
        .json();
    assert_eq!(v["choices"][0]["logprobs"], Value::Null, "{v}");
}

/// Embeddings on an embedding model: one unit vector per input, in order; the
/// base64 form holds the same little-endian floats.
#[tokio::test]
async fn embeddings_float_and_base64_agree() {
    use base64::Engine as _;
    let app = App::new();
    let r = app
        .post(
            "/v1/embeddings",
            json!({"model": "embed", "input": ["a cat", "a dog"]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "embed");
    let data = v["data"].as_array().expect("data");
    assert_eq!(data.len(), 2);
    let vectors: Vec<Vec<f32>> = data
        .iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["index"], i);
            assert_eq!(d["object"], "embedding");
            d["embedding"]
                .as_array()
                .expect("floats")
                .iter()
                .map(|x| x.as_f64().expect("f") as f32)
                .collect()
        })
        .collect();
    for vec in &vectors {
        assert_eq!(vec.len(), sipp::runtime::fake::N_EMBD);
        let norm: f32 = vec.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    }
    assert_ne!(vectors[0], vectors[1]);
    // BOS and five bytes each.
    assert_eq!(v["usage"]["prompt_tokens"], 12, "{v}");
    let b = app
        .post(
            "/v1/embeddings",
            json!({"model": "embed", "input": "a cat", "encoding_format": "base64"}),
        )
        .await
        .json();
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b["data"][0]["embedding"].as_str().expect("base64"))
        .expect("decodes");
    let floats: Vec<f32> = raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(floats, vectors[0]);
}

/// Models lists the ready targets; an alias answers as its target.
#[tokio::test]
async fn models_list_targets_and_aliases_route() {
    let app = App::new();
    let v = app.get("/v1/models").await.json();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, vec!["embed", "fake"]);
    assert!(v["data"]
        .as_array()
        .expect("data")
        .iter()
        .all(|m| m["object"] == "model"));
    let a = app
        .post(
            "/v1/completions",
            json!({"model": "fake-alias", "prompt": "Hi", "max_tokens": 3, "temperature": 0}),
        )
        .await
        .json();
    let b = app
        .post(
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 3, "temperature": 0}),
        )
        .await
        .json();
    assert_eq!(a["model"], "fake");
    assert_eq!(b["model"], "fake");
    assert_eq!(texts(&a), texts(&b));
}

/// /tokenize and /detokenize round-trip on the fake's byte vocabulary.
#[tokio::test]
async fn tokenize_and_detokenize_round_trip() {
    let app = App::new();
    let v = app.post("/tokenize", json!({"content": "hé"})).await.json();
    assert_eq!(v["tokens"], json!([104, 0xC3, 0xA9]));
    let v = app
        .post(
            "/tokenize",
            json!({"content": "hi", "add_special": true, "with_pieces": true}),
        )
        .await
        .json();
    assert_eq!(
        v["tokens"],
        json!([{"id": 256, "piece": ""}, {"id": 104, "piece": "h"}, {"id": 105, "piece": "i"}])
    );
    let v = app
        .post("/detokenize", json!({"tokens": [104, 0xC3, 0xA9]}))
        .await
        .json();
    assert_eq!(v["content"], "hé");
}

/// The native profile: /v1/query and /v1/chat answer the same text as the
/// OpenAI routes for the same greedy request; /v1/embed keeps the pooling.
#[tokio::test]
async fn native_profile_matches_openai_routes() {
    let app = App::new();
    let q = app
        .post(
            "/v1/query",
            json!({"prompt": "Hello", "max_tokens": 7, "temperature": 0, "logprobs": 2}),
        )
        .await;
    assert_eq!(q.status, 200, "{}", q.text());
    let q = q.json();
    let o = app
        .post(
            "/v1/completions",
            json!({"prompt": "Hello", "max_tokens": 7, "temperature": 0}),
        )
        .await
        .json();
    assert_eq!(q["text"], o["choices"][0]["text"]);
    assert_eq!(q["finish_reason"], "length");
    assert_eq!(q["usage"]["completion_tokens"], 7);
    let c = app
        .post(
            "/v1/chat",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}),
        )
        .await
        .json();
    let oc = app
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}),
        )
        .await
        .json();
    assert_eq!(c["text"], oc["choices"][0]["message"]["content"]);
    let e = app
        .post(
            "/v1/embed",
            json!({"model": "embed", "input": ["x", "y"], "normalize": false}),
        )
        .await;
    assert_eq!(e.status, 200, "{}", e.text());
    let e = e.json();
    assert_eq!(e["data"][1]["normalized"], false);
    assert_eq!(e["data"][1]["pooling"], "mean");
    assert_eq!(e["data"][1]["index"], 1);
}

/// /metrics shows the engines (attached when the state is built) and counts
/// HTTP exchanges by route and status.
#[tokio::test]
async fn metrics_count_requests_and_read_the_engines() {
    let app = App::new();
    let r = app
        .post("/v1/completions", json!({"prompt": "Hi", "max_tokens": 4}))
        .await;
    assert_eq!(r.status, 200);
    let r = app
        .post("/v1/completions", json!({"prompt": "Hi", "max_tokens": 0}))
        .await;
    assert_eq!(r.status, 400);
    let m = app.get("/metrics").await;
    assert!(m
        .header("content-type")
        .is_some_and(|c| c.starts_with("text/plain")));
    let m = m.text();
    for line in [
        "sipp_http_requests_total{route=\"/v1/completions\",status=\"200\"} 1",
        "sipp_http_requests_total{route=\"/v1/completions\",status=\"400\"} 1",
        "sipp_busy_slots{model=\"fake\"} 0",
        "sipp_engine_up{model=\"embed\"} 1",
        "sipp_generated_tokens_total{model=\"fake\"} 4",
        "sipp_requests_finished_total{model=\"fake\",outcome=\"completed\"} 1",
    ] {
        assert!(m.lines().any(|l| l == line), "missing {line:?} in\n{m}");
    }
}

/// The value of `name{labels}` in a Prometheus text scrape.
fn scraped(m: &str, series: &str) -> f64 {
    m.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {series:?} in\n{m}"))
}

/// The inference extension's three gauges, under vLLM's names, follow a
/// known load: two requests in the two slots and one queued, then none; the
/// KV fraction is the cells in use over the context, from the same scrape.
#[tokio::test]
async fn inference_extension_gauges_follow_the_load() {
    use crate::harness::{endless, Fake};
    use std::time::{Duration, Instant};
    let n_ctx = 1u32 << 16;
    let app = App::one(Fake {
        slots: 2,
        n_ctx,
        ..Fake::default()
    });
    let waiting = "vllm:num_requests_waiting{model_name=\"fake\"}";
    let running = "vllm:num_requests_running{model_name=\"fake\"}";
    let usage = "vllm:kv_cache_usage_perc{model_name=\"fake\"}";
    let m = app.get("/metrics").await.text();
    assert_eq!(scraped(&m, waiting), 0.0);
    assert_eq!(scraped(&m, running), 0.0);
    assert_eq!(scraped(&m, usage), 0.0);
    for line in [
        "# TYPE vllm:num_requests_waiting gauge",
        "# TYPE vllm:num_requests_running gauge",
        "# TYPE vllm:kv_cache_usage_perc gauge",
    ] {
        assert!(m.lines().any(|l| l == line), "missing {line:?} in\n{m}");
    }

    let engine = app.engine("fake").clone();
    let held: Vec<_> = (0..3)
        .map(|_| engine.generate(endless()).expect("admitted or queued"))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let m = loop {
        let m = app.get("/metrics").await.text();
        if scraped(&m, running) == 2.0 && scraped(&m, waiting) == 1.0 {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "never saw 2 running, 1 waiting:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let used = scraped(&m, "sipp_kv_cells_used{model=\"fake\"}");
    let fraction = scraped(&m, usage);
    assert!(used > 0.0, "{m}");
    assert!(fraction > 0.0 && fraction <= 1.0, "{fraction}");
    assert!(
        (fraction - used / f64::from(n_ctx)).abs() < 1e-12,
        "{fraction} vs {used} cells of {n_ctx}"
    );
    assert_eq!(
        scraped(&m, "sipp_queue_depth{model=\"fake\"}"),
        scraped(&m, waiting)
    );

    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = app.get("/metrics").await.text();
        if scraped(&m, running) == 0.0 && scraped(&m, waiting) == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the load never went away:\n{m}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
