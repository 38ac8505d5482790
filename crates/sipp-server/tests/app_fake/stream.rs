//! Server-sent events: framing, `[DONE]`, and deltas that add up to the
//! non-streamed answer.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::harness::{openai_chunks, sse_data, App, Fake};

/// The streamed text of each choice, checking every chunk's shape and that
/// each choice finishes exactly once, last.
fn completion_texts(chunks: &[Value], object: &str) -> BTreeMap<u64, (String, String)> {
    let mut out: BTreeMap<u64, (String, String)> = BTreeMap::new();
    for c in chunks {
        assert_eq!(c["object"], object, "{c}");
        let choices = c["choices"].as_array().expect("choices");
        if choices.is_empty() {
            // The usage chunk.
            assert!(c["usage"].is_object(), "{c}");
            continue;
        }
        assert_eq!(choices.len(), 1, "one choice per chunk: {c}");
        let ch = &choices[0];
        let i = ch["index"].as_u64().expect("index");
        let entry = out.entry(i).or_default();
        assert!(entry.1.is_empty(), "a chunk after the finish: {c}");
        let text = ch["text"]
            .as_str()
            .or_else(|| ch["delta"]["content"].as_str())
            .unwrap_or("");
        entry.0.push_str(text);
        if let Some(reason) = ch["finish_reason"].as_str() {
            entry.1 = reason.to_string();
        }
    }
    for (i, (_, reason)) in &out {
        assert!(!reason.is_empty(), "choice {i} never finished");
    }
    out
}

/// Streamed completions: `text/event-stream`, `data: ` events of JSON chunks
/// ending with `data: [DONE]`; the deltas of each choice add up to the
/// non-streamed greedy text; the usage chunk comes last when asked for.
#[tokio::test]
async fn streamed_completions_add_up_to_the_plain_answer() {
    let app = App::new();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "n": 2});
    let plain = app.post("/v1/completions", body.clone()).await.json();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = app.post("/v1/completions", streamed).await;
    let chunks = openai_chunks(&r);
    let texts = completion_texts(&chunks, "text_completion");
    assert_eq!(texts.len(), 2);
    for (i, (text, reason)) in &texts {
        assert_eq!(
            text,
            plain["choices"][*i as usize]["text"]
                .as_str()
                .expect("text")
        );
        assert_eq!(reason, "length");
    }
    let id = chunks[0]["id"].as_str().expect("id");
    assert!(chunks.iter().all(|c| c["id"] == id), "one id per stream");
    let usage = chunks.last().expect("usage");
    assert_eq!(usage["choices"], json!([]), "{usage}");
    // The same counts (the streamed request may find the prompt cached).
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(usage["usage"][k], plain["usage"][k], "{usage}");
    }
    // Without include_usage there is no usage chunk.
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let chunks = openai_chunks(&app.post("/v1/completions", streamed).await);
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "{chunks:?}"
    );
}

/// Streamed chat: each choice opens with an assistant role delta, then
/// content deltas that add up to the non-streamed message.
#[tokio::test]
async fn streamed_chat_opens_with_the_role_and_adds_up() {
    let app = App::new();
    let body = json!({"messages": [{"role": "user", "content": "Count to three"}], "max_tokens": 20, "temperature": 0, "n": 2});
    let plain = app.post("/v1/chat/completions", body.clone()).await.json();
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let chunks = openai_chunks(&app.post("/v1/chat/completions", streamed).await);
    for i in 0..2u64 {
        let first = chunks
            .iter()
            .find(|c| c["choices"][0]["index"] == i)
            .expect("a chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant", "{first}");
        assert_eq!(
            chunks
                .iter()
                .filter(|c| c["choices"][0]["index"] == i
                    && !c["choices"][0]["delta"]["role"].is_null())
                .count(),
            1,
            "one role delta per choice"
        );
    }
    let texts = completion_texts(&chunks, "chat.completion.chunk");
    for (i, (text, reason)) in &texts {
        assert_eq!(
            text,
            plain["choices"][*i as usize]["message"]["content"]
                .as_str()
                .expect("content")
        );
        assert_eq!(reason, "length");
    }
}

/// Streamed logprobs: one entry per token across the chunks, with text
/// offsets that continue from chunk to chunk (after the echo) as in the
/// non-streamed answer.
#[tokio::test]
async fn streamed_logprobs_continue_across_chunks() {
    let app = App::new();
    let body = json!({"prompt": "Hello there", "max_tokens": 30, "temperature": 0, "logprobs": 2, "echo": true});
    let plain = app.post("/v1/completions", body.clone()).await.json();
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let chunks = openai_chunks(&app.post("/v1/completions", streamed).await);
    let mut tokens = Vec::new();
    let mut offsets = Vec::new();
    let mut text = String::new();
    for c in &chunks {
        let ch = &c["choices"][0];
        text.push_str(ch["text"].as_str().unwrap_or(""));
        if ch["logprobs"].is_object() {
            for t in ch["logprobs"]["tokens"].as_array().expect("tokens") {
                tokens.push(t.clone());
            }
            for o in ch["logprobs"]["text_offset"].as_array().expect("offsets") {
                offsets.push(o.as_u64().expect("offset"));
            }
        }
    }
    let lp = &plain["choices"][0]["logprobs"];
    assert_eq!(text, plain["choices"][0]["text"].as_str().expect("text"));
    assert_eq!(&Value::from(tokens), &lp["tokens"]);
    assert_eq!(&Value::from(offsets), &lp["text_offset"]);
}

/// A choice that stops before writing anything still streams its echo.
#[tokio::test]
async fn streamed_echo_survives_an_immediate_stop() {
    let app = App::new();
    let first = app
        .post(
            "/v1/completions",
            json!({"prompt": "Hello", "max_tokens": 1, "temperature": 0}),
        )
        .await
        .json();
    let first = first["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    assert!(!first.is_empty());
    let body = json!({"prompt": "Hello", "max_tokens": 5, "temperature": 0, "echo": true, "stop": [first]});
    let plain = app.post("/v1/completions", body.clone()).await.json();
    assert_eq!(plain["choices"][0]["text"], "Hello", "{plain}");
    assert_eq!(plain["choices"][0]["finish_reason"], "stop", "{plain}");
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let chunks = openai_chunks(&app.post("/v1/completions", streamed).await);
    let texts = completion_texts(&chunks, "text_completion");
    assert_eq!(texts[&0], ("Hello".to_string(), "stop".to_string()));

    // A model that ends at once (its first token is EOS): the fake writes EOS
    // one time in 40, so some prompt starts with it.
    let app = App::one(Fake {
        eos_one_in: 40,
        ..Fake::default()
    });
    let mut prompt = None;
    for i in 0..2000 {
        let p = format!("prompt {i}");
        let v = app
            .post(
                "/v1/completions",
                json!({"prompt": p, "max_tokens": 1, "temperature": 0}),
            )
            .await
            .json();
        if v["choices"][0]["finish_reason"] == "stop" {
            assert_eq!(v["choices"][0]["text"], "", "{v}");
            prompt = Some(p);
            break;
        }
    }
    let prompt = prompt.expect("a prompt the fake ends at once");
    let r = app
        .post(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": true, "stream": true}),
        )
        .await;
    let texts = completion_texts(&openai_chunks(&r), "text_completion");
    assert_eq!(texts[&0], (prompt, "stop".to_string()));
}

/// The native profile streams `delta` events and one closing `done` event
/// holding the whole answer (no `[DONE]`).
#[tokio::test]
async fn native_stream_ends_with_done() {
    let app = App::new();
    let plain = app
        .post(
            "/v1/query",
            json!({"prompt": "Hello", "max_tokens": 12, "temperature": 0}),
        )
        .await
        .json();
    let r = app
        .post(
            "/v1/query",
            json!({"prompt": "Hello", "max_tokens": 12, "temperature": 0, "stream": true}),
        )
        .await;
    let events: Vec<Value> = sse_data(&r)
        .iter()
        .map(|d| serde_json::from_str(d).expect("json"))
        .collect();
    let (done, deltas) = events.split_last().expect("events");
    assert_eq!(done["type"], "done", "{done}");
    assert_eq!(done["text"], plain["text"]);
    assert!(!deltas.is_empty());
    let text: String = deltas
        .iter()
        .map(|d| {
            assert_eq!(d["type"], "delta", "{d}");
            d["text"].as_str().expect("text")
        })
        .collect();
    assert_eq!(text, plain["text"].as_str().expect("text"));
}

/// A request that fails mid-stream reports an OpenAI error event in the
/// stream and still ends with `[DONE]`.
#[tokio::test]
async fn a_failure_mid_stream_is_an_error_event() {
    let app = App::new();
    let r = app
        .post(
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 10, "grammar": sipp::runtime::fake::EXHAUSTING_GRAMMAR, "stream": true}),
        )
        .await;
    let chunks = openai_chunks(&r);
    let err = chunks.last().expect("error event");
    assert_eq!(err["error"]["code"], "grammar_exhausted", "{chunks:?}");
    assert_eq!(err["error"]["type"], "invalid_request_error");
}
