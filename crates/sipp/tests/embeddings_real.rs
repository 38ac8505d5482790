//! Embeddings on real models: MiniLM (BERT, converted here from safetensors)
//! against an independent numpy reference, semantic sanity, batching, and
//! mean-pooled embeddings from the default decoder model.

mod common;

use sipp::engine::{EmbedRequest, Engine, EngineError, GenerateRequest};
use sipp::runtime::Pooling;
use sipp::NativeRuntimeConfig;

fn minilm(slots: u32) -> Engine {
    let path = sipp::models::resolve_or_fetch("minilm").expect("minilm fetches and converts");
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_parallel = slots;
    cfg.context.embeddings = true;
    cfg.cache.idle_sequences = 0;
    Engine::load(&path, cfg).expect("minilm loads")
}

fn embed(e: &Engine, text: &str) -> Vec<f32> {
    let out = e
        .embed(EmbedRequest::new(text))
        .expect("submit")
        .blocking_embedding()
        .expect("embedding");
    assert_eq!(out.pooling, Pooling::Mean);
    assert!(out.normalized);
    out.values
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

const SENTENCES: [&str; 10] = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The quick brown fox jumps over the lazy dog!",
];

#[test]
fn minilm_matches_an_independent_numpy_reference() {
    let e = minilm(4);
    let ckpt = sipp::models::checkpoint_dir(&sipp::models::MINILM);
    let python = std::env::var("SIPP_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = common::manifest_dir().join("../../scripts/minilm_reference.py");
    let mut child = std::process::Command::new(&python)
        .arg(&script)
        .arg(&ckpt)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python runs");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(serde_json::to_string(&SENTENCES).expect("json").as_bytes())
            .expect("write");
    }
    let out = child.wait_with_output().expect("reference finishes");
    assert!(
        out.status.success(),
        "reference failed (scripts/test.sh installs numpy and safetensors): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    for (i, s) in SENTENCES.iter().enumerate() {
        let ref_tokens: Vec<i32> =
            serde_json::from_value(reference["tokens"][i].clone()).expect("tokens");
        assert_eq!(
            e.vocab().tokenize(s, true, false).expect("tokenize"),
            ref_tokens,
            "WordPiece of {s:?}"
        );
        let ref_vec: Vec<f32> =
            serde_json::from_value(reference["embeddings"][i].clone()).expect("vector");
        let c = cosine(&embed(&e, s), &ref_vec);
        assert!(c >= 0.999, "{s:?}: cosine {c} with the reference");
    }
}

#[test]
fn similar_sentences_are_closer() {
    let e = minilm(4);
    let triples = [
        (
            "A man is eating food.",
            "A man is eating a piece of bread.",
            "A man is riding a horse.",
        ),
        (
            "A monkey is playing drums.",
            "Someone in a gorilla costume is playing a set of drums.",
            "A woman is slicing an onion.",
        ),
        (
            "The cat sleeps on the sofa.",
            "A kitten is napping on the couch.",
            "The stock market fell sharply today.",
        ),
        (
            "How do I reset my password?",
            "I forgot my password and cannot log in.",
            "What time does the train leave?",
        ),
        (
            "It is raining heavily outside.",
            "There is a storm with lots of rain.",
            "She bought a new pair of shoes.",
        ),
        (
            "The children are playing football in the park.",
            "Kids kick a ball on the grass.",
            "The engineer fixed the server.",
        ),
    ];
    for (anchor, close, far) in triples {
        let (a, c, f) = (embed(&e, anchor), embed(&e, close), embed(&e, far));
        let (sc, sf) = (cosine(&a, &c), cosine(&a, &f));
        assert!(
            sc > sf,
            "{anchor:?}: {close:?} ({sc:.3}) should beat {far:?} ({sf:.3})"
        );
    }
}

#[test]
fn thirty_two_concurrent_equal_one_by_one() {
    let e = minilm(8);
    let inputs: Vec<String> = (0..32)
        .map(|i| format!("{} (variant {i})", SENTENCES[i % SENTENCES.len()]))
        .collect();
    let alone: Vec<Vec<f32>> = inputs.iter().map(|s| embed(&e, s)).collect();
    let steps_before = e.metrics().steps;
    let handles: Vec<_> = inputs
        .iter()
        .map(|s| e.embed(EmbedRequest::new(s.as_str())).expect("submit"))
        .collect();
    let together: Vec<Vec<f32>> = handles
        .into_iter()
        .map(|h| h.blocking_embedding().expect("ok").values)
        .collect();
    let steps = e.metrics().steps - steps_before;
    assert!(
        steps <= 8,
        "32 inputs on 8 slots took {steps} steps: not batched"
    );
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        let c = cosine(a, b);
        assert!(c >= 0.9999, "input {i}: cosine {c}");
    }
}

#[test]
fn raw_vectors_are_not_normalized_and_generation_is_refused() {
    let e = minilm(1);
    let raw = e
        .embed(EmbedRequest {
            normalize: false,
            ..EmbedRequest::new("hello there")
        })
        .expect("submit")
        .blocking_embedding()
        .expect("ok");
    assert!(!raw.normalized);
    let norm: f32 = raw.values.iter().map(|v| v * v).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() > 0.01, "raw norm {norm}");
    let err = e.generate(GenerateRequest::new("hello")).unwrap_err();
    assert!(matches!(err, EngineError::Unsupported(_)), "{err}");
    assert!(err.to_string().contains("encoder-only"), "{err}");
    let long = "word ".repeat(600);
    assert!(matches!(
        e.embed(EmbedRequest::new(long.as_str())),
        Err(EngineError::InputTooLong { .. })
    ));
}

#[test]
fn mean_pooled_embeddings_from_the_default_decoder() {
    let e = common::engine_with(4, |c| {
        c.context.embeddings = true;
        c.context.pooling = Some(Pooling::Mean);
    });
    let a = embed(&e, "The weather is lovely today.");
    assert_eq!(a.len(), 576);
    assert!(a.iter().all(|v| v.is_finite()));
    let norm: f32 = a.iter().map(|v| v * v).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-4);
    // Batched equals alone, and the same text gives the same vector.
    let handles: Vec<_> = SENTENCES
        .iter()
        .map(|s| e.embed(EmbedRequest::new(*s)).expect("submit"))
        .collect();
    for (s, h) in SENTENCES.iter().zip(handles) {
        let together = h.blocking_embedding().expect("ok").values;
        assert!(cosine(&embed(&e, s), &together) >= 0.9999, "{s}");
    }
    // This context pools; generation needs a context that does not.
    let err = e.generate(GenerateRequest::new("hi")).unwrap_err();
    assert!(err.to_string().contains("embeddings only"), "{err}");
    // And a generation context refuses embeddings with a clear message.
    let gen = common::engine_with(1, |_| {});
    let err = gen.embed(EmbedRequest::new("hi")).unwrap_err();
    assert!(
        err.to_string().contains("context.embeddings = true"),
        "{err}"
    );
}
