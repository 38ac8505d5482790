//! Every error the routes answer: status, OpenAI's body and the field named.

use serde_json::json;
use sipp::runtime::fake::{EXHAUSTING_GRAMMAR, INVALID_GRAMMAR};
use sipp_server::ServerSection;

use crate::harness::{assert_error, endless, target, App, Fake};

const BAD: &str = "invalid_request_error";

/// Bodies that are not JSON, not an object of the right types, or missing a
/// required field: 400, naming the field where there is one.
#[tokio::test]
async fn malformed_bodies_are_400_naming_the_field() {
    let app = App::new();
    let r = app.post_raw("/v1/completions", "{not json", &[]).await;
    let m = assert_error(&r, 400, BAD, None, None);
    assert!(m.contains("invalid JSON"), "{m}");
    let r = app.post_raw("/v1/completions", "", &[]).await;
    assert_error(&r, 400, BAD, None, None);
    let r = app.post_raw("/v1/completions", "{} trailing", &[]).await;
    assert_error(&r, 400, BAD, None, None);
    // Wrong types, in the request's own fields and in the flattened sampling
    // fields.
    for (path, body, field) in [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": "ten"}),
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": "hot"}),
            "temperature",
        ),
        (
            "/v1/completions",
            json!({"prompt": {"text": "x"}}),
            "prompt",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "n": "two"}),
            "n",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hello"}),
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "stop": 5}),
            "stop",
        ),
        ("/v1/query", json!({"prompt": 5}), "prompt"),
        ("/v1/query", json!({"prompt": "x", "seed": -1}), "seed"),
        ("/v1/embeddings", json!({"input": true}), "input"),
    ] {
        let r = app.post(path, body.clone()).await;
        let m = assert_error(&r, 400, BAD, None, Some(field));
        assert!(m.contains(field), "{path} {body}: {m}");
    }
    // A missing required field.
    let r = app.post("/tokenize", json!({"text": "x"})).await;
    assert_error(&r, 400, BAD, None, Some("content"));
    let r = app.post("/v1/embed", json!({"model": "embed"})).await;
    assert_error(&r, 400, BAD, None, Some("input"));
    // A JSON value that is not an object.
    let r = app.post("/v1/completions", json!([1, 2])).await;
    assert_error(&r, 400, BAD, None, None);
}

/// Values of the right type out of range: 400 naming the field.
#[tokio::test]
async fn out_of_range_values_are_400_naming_the_field() {
    let app = App::new();
    let chat = |extra: serde_json::Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "x"}]});
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b
    };
    for (path, body, field) in [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": -3}),
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 21}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": -1}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": -0.5}),
            "temperature",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 7}),
            "top_p",
        ),
        ("/v1/completions", json!({"prompt": "x", "n": 0}), "n"),
        ("/v1/completions", json!({"prompt": "x", "n": 17}), "n"),
        (
            "/v1/completions",
            json!({"prompt": "x", "seed": 1u64 << 40}),
            "seed",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logit_bias": {"abc": 1}}),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logit_bias": {"999": 1}}),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "samplers": ["nope"]}),
            "samplers",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "grammar": INVALID_GRAMMAR}),
            "grammar",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]}),
            "stop",
        ),
        ("/v1/completions", json!({}), "prompt"),
        ("/v1/completions", json!({"prompt": ""}), "prompt"),
        ("/v1/completions", json!({"prompt": []}), "prompt"),
        (
            "/v1/completions",
            json!({"prompt": [1, 5_000_000_000i64]}),
            "prompt",
        ),
        ("/v1/completions", json!({"prompt": [1, 999]}), "prompt"),
        (
            "/v1/completions",
            json!({"prompt": "x", "model": " "}),
            "model",
        ),
        ("/v1/chat/completions", json!({"messages": []}), "messages"),
        (
            "/v1/chat/completions",
            chat(json!({"max_completion_tokens": 0})),
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": 0})),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 2})),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
        ),
        ("/v1/chat/completions", chat(json!({"n": 99})), "n"),
        (
            "/v1/chat/completions",
            chat(json!({"temperature": -1})),
            "temperature",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function"}]})),
            "tools[0]",
        ),
        (
            "/v1/chat/completions",
            chat(
                json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            ),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            chat(
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}),
            ),
            "tools[0].function.parameters",
        ),
        (
            "/v1/chat/completions",
            chat(
                json!({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "nope", "content": "r"}]}),
            ),
            "messages[1].tool_call_id",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
            "response_format",
        ),
        (
            "/v1/query",
            json!({"prompt": "x", "temperature": -2}),
            "temperature",
        ),
        ("/v1/query", json!({"prompt": ""}), "prompt"),
        ("/v1/chat", json!({"messages": []}), "messages"),
        (
            "/v1/embeddings",
            json!({"model": "embed", "input": []}),
            "input",
        ),
        (
            "/v1/embeddings",
            json!({"model": "embed", "input": ""}),
            "input",
        ),
        (
            "/v1/embeddings",
            json!({"model": "embed", "input": "x", "dimensions": 4}),
            "dimensions",
        ),
        (
            "/v1/embeddings",
            json!({"model": "embed", "input": "x", "encoding_format": "hex"}),
            "encoding_format",
        ),
        (
            "/v1/embeddings",
            json!({"model": "embed", "input": [5_000_000_000i64]}),
            "input",
        ),
        ("/v1/embed", json!({"model": "embed", "input": []}), "input"),
        ("/detokenize", json!({"tokens": [1, 259]}), "tokens"),
    ] {
        let r = app.post(path, body.clone()).await;
        let v = r.json();
        assert_eq!(r.status, 400, "{path} {body}: {}", v["error"]);

        assert_eq!(v["error"]["type"], BAD, "{path} {body}: {v}");
        assert_eq!(
            v["error"]["param"].as_str(),
            Some(field),
            "{path} {body}: {v}"
        );
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(field)),
            "{path} {body}: {v}"
        );
    }
}

/// A prompt over the context: 400 `context_length_exceeded` with the numbers,
/// naming the field the request calls its prompt.
#[tokio::test]
async fn prompts_over_the_context_are_context_length_exceeded() {
    let app = App::with(
        ServerSection::default(),
        vec![
            (
                target("fake", &[]),
                Fake {
                    n_ctx: 128,
                    ..Fake::default()
                },
            ),
            (target("embed", &[]), Fake::embedder()),
        ],
    );
    // 200 bytes: 201 tokens with BOS; as a chat, BOS, "<|user|>", the
    // bytes, "\n" and "<|assistant|>": 223.
    let long = "word ".repeat(40);
    let chat = json!({"messages": [{"role": "user", "content": long}]});
    for (path, body, field, tokens) in [
        ("/v1/completions", json!({"prompt": long}), "prompt", 201),
        ("/v1/query", json!({"prompt": long}), "prompt", 201),
        ("/v1/chat/completions", chat.clone(), "messages", 223),
        ("/v1/chat", chat, "messages", 223),
        // An embedding input is limited by the micro-batch (64 on the fake).
        (
            "/v1/embeddings",
            json!({"model": "embed", "input": long}),
            "input",
            201,
        ),
        (
            "/v1/embed",
            json!({"model": "embed", "input": long}),
            "input",
            201,
        ),
    ] {
        let r = app.post(path, body).await;
        let m = assert_error(&r, 400, BAD, Some("context_length_exceeded"), Some(field));
        assert!(m.contains(&format!("{tokens} tokens")), "{path}: {m}");
    }
}

/// Unknown models are 404 `model_not_found`; a model that cannot do what is
/// asked is 400 `unsupported` naming `model`.
#[tokio::test]
async fn unknown_and_unsuitable_models() {
    let app = App::new();
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": "gpt-7", "messages": [{"role": "user", "content": "x"}]}),
        ),
        ("/v1/completions", json!({"model": "gpt-7", "prompt": "x"})),
        ("/v1/embeddings", json!({"model": "gpt-7", "input": "x"})),
        ("/v1/query", json!({"model": "gpt-7", "prompt": "x"})),
        ("/tokenize", json!({"model": "gpt-7", "content": "x"})),
    ] {
        let r = app.post(path, body).await;
        let m = assert_error(&r, 404, BAD, Some("model_not_found"), Some("model"));
        assert!(m.contains("gpt-7"), "{m}");
    }
    // Embeddings on the generation model, generation on the embedding model.
    for (path, body) in [
        ("/v1/embeddings", json!({"model": "fake", "input": "x"})),
        ("/v1/embed", json!({"model": "fake", "input": "x"})),
        ("/v1/completions", json!({"model": "embed", "prompt": "x"})),
        (
            "/v1/chat/completions",
            json!({"model": "embed", "messages": [{"role": "user", "content": "x"}]}),
        ),
    ] {
        let r = app.post(path, body).await;
        assert_error(&r, 400, BAD, Some("unsupported"), Some("model"));
    }
    // A model without a chat template cannot chat, but still completes.
    let app = App::one(Fake {
        chat_template: None,
        ..Fake::default()
    });
    let r = app
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    let m = assert_error(&r, 400, BAD, Some("chat_template_error"), Some("messages"));
    assert!(m.contains("chat_template"), "{m}");
    let r = app
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 2}))
        .await;
    assert_eq!(r.status, 200);
}

/// Failures while generating: a grammar that allows nothing more is 400
/// `grammar_exhausted`; a batch that fails is 500 `decode_failed`.
#[tokio::test]
async fn failures_while_generating() {
    let app = App::new();
    let r = app
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 10, "grammar": EXHAUSTING_GRAMMAR}),
        )
        .await;
    assert_error(&r, 400, BAD, Some("grammar_exhausted"), None);
    // The fake fails any batch holding its poison token.
    let r = app
        .post(
            "/v1/completions",
            json!({"prompt": [sipp::runtime::fake::POISON], "max_tokens": 3}),
        )
        .await;
    assert_error(&r, 500, "server_error", Some("decode_failed"), None);
    // The engine goes on serving.
    let r = app
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 3}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Bodies over `max_body_bytes` are 413; unknown routes 404; wrong methods 405.
#[tokio::test]
async fn limits_routes_and_methods() {
    let app = App::with(
        ServerSection {
            max_body_bytes: 1024,
            ..ServerSection::default()
        },
        vec![(target("fake", &[]), Fake::default())],
    );
    let r = app
        .post("/v1/completions", json!({"prompt": "a".repeat(2000)}))
        .await;
    let m = assert_error(&r, 413, BAD, Some("request_too_large"), None);
    assert!(m.contains("1024"), "{m}");
    let r = app
        .post(
            "/v1/completions",
            json!({"prompt": "a".repeat(900), "max_tokens": 1}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = app.get("/v1/nothing").await;
    assert_error(&r, 404, BAD, Some("not_found"), None);
    let r = app.get("/v1/completions").await;
    assert_error(&r, 405, BAD, Some("method_not_allowed"), None);
    let r = app.post("/health", json!({})).await;
    assert_error(&r, 405, BAD, Some("method_not_allowed"), None);
}

/// A full queue is 429 `queue_full` with `Retry-After`, at once; a request
/// whose `n` choices overflow the queue holds nothing afterwards.
#[tokio::test]
async fn a_full_queue_is_429_and_leaks_nothing() {
    let app = App::one(Fake {
        slots: 1,
        n_ctx: 1 << 16,
        max_queued: 1,
        ..Fake::default()
    });
    let engine = app.engine("fake").clone();
    // One request holds the only slot.
    let running = engine.generate(endless()).expect("admitted");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.metrics().busy_slots < 1 {
        assert!(std::time::Instant::now() < deadline, "never admitted");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // n = 3: the first choice waits, the second finds the queue full.
    let r = app
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 2, "n": 3}),
        )
        .await;
    let m = assert_error(&r, 429, "rate_limit_error", Some("queue_full"), None);
    assert!(m.contains("queue full"), "{m}");
    assert_eq!(r.header("retry-after"), Some("1"));
    // The choice that was queued was withdrawn with the request: the queue
    // takes one again, and is full after it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let waiting = loop {
        match engine.generate(endless()) {
            Ok(h) => break h,
            Err(e) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the queue stayed full: {e}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
    };
    let r = app
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_error(&r, 429, "rate_limit_error", Some("queue_full"), None);
    drop((running, waiting));
}
