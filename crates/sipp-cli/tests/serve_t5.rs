//! An encoder-decoder model (T5): a tiny random-weight T5 with a real
//! SentencePiece unigram tokenizer (scripts/tiny_t5.py), served by
//! `sipp serve`. Each input is encoded once with llama_encode, then decoded
//! from the decoder start token with cross-attention. Greedy text equals
//! llama.cpp's llama-simple (which has the same encoder path) on the same
//! file, for ten inputs sent at once to four slots: llama.cpp keeps one
//! encoder output per context (for all the sequences of one encode), so sipp
//! encodes the requests of a wave together and admits the next wave when it
//! is done; no request may see another's encoder output.

mod common;

use std::process::Command;

use common::post_json as post;
use common::Server;
use reqwest::blocking::Client;
use serde_json::json;

const INPUTS: [&str; 10] = [
    "Hello, my name is Anna.",
    "The weather today is cloudy.",
    "What is the capital of France?",
    "Translate English to German: the house is wonderful.",
    "A prime number has two divisors.",
    "The cat sleeps on the wall.",
    "Please write a short story about a dragon.",
    "Water boils at one hundred degrees.",
    "The train leaves from platform two.",
    "Thank you very much for your help.",
];
const N: u32 = 16;
/// Near-tie rule: sipp and llama-simple may part only where sipp's top-2
/// logprob gap is at most this.
const NEAR_TIE: f64 = 1.0;

fn tiny_t5() -> std::path::PathBuf {
    common::tiny_model_from_scratch("tiny-t5-seed1.gguf", "tiny_t5.py", &["1"])
}

/// llama-simple's greedy continuation: its stdout is the input (as the
/// tokenizer normalized it) up to `</s>`, then the generated pieces.
fn reference(model: &std::path::Path, input: &str) -> String {
    let out = Command::new(common::reference_tool("llama-simple"))
        .arg("-m")
        .arg(model)
        .args(["-n", &N.to_string(), input])
        .output()
        .expect("llama-simple runs");
    assert!(
        out.status.success(),
        "llama-simple failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let (_, generated) = stdout
        .split_once("</s>")
        .unwrap_or_else(|| panic!("no `</s>` after the echoed input: {stdout:?}"));
    generated.trim_end_matches('\n').to_string()
}

#[test]
fn t5_greedy_text_equals_llama_simple_with_concurrent_requests() {
    let model = tiny_t5();
    let refs: Vec<String> = INPUTS.iter().map(|i| reference(&model, i)).collect();
    let s = Server::start(&[
        "--model",
        model.to_str().expect("utf-8 path"),
        "--parallel",
        "4",
    ]);
    let c = Client::new();
    let answers: Vec<(String, String, Vec<(String, f64)>)> = std::thread::scope(|scope| {
        let handles: Vec<_> =
            INPUTS
                .iter()
                .map(|input| {
                    let (c, s) = (&c, &s);
                    scope.spawn(move || {
                    let (status, v) = post(
                        c,
                        &s.url("/v1/completions"),
                        &json!({"prompt": input, "max_tokens": N, "temperature": 0, "logprobs": 2}),
                    );
                    assert_eq!(status, 200, "{v}");
                    // The usage counts the encoded input (with its EOS).
                    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().expect("usage");
                    assert!(prompt_tokens >= 5, "{input}: {prompt_tokens} prompt tokens");
                    let lp = &v["choices"][0]["logprobs"];
                    let pieces: Vec<(String, f64)> = lp["tokens"]
                        .as_array()
                        .expect("tokens")
                        .iter()
                        .zip(lp["top_logprobs"].as_array().expect("top"))
                        .map(|(t, top)| {
                            let mut l: Vec<f64> = top
                                .as_object()
                                .expect("top map")
                                .values()
                                .filter_map(serde_json::Value::as_f64)
                                .collect();
                            l.sort_by(|a, b| b.total_cmp(a));
                            let gap = if l.len() >= 2 { l[0] - l[1] } else { f64::INFINITY };
                            (t.as_str().unwrap_or_default().to_string(), gap)
                        })
                        .collect();
                    (
                        v["choices"][0]["text"].as_str().expect("text").to_string(),
                        v["choices"][0]["finish_reason"]
                            .as_str()
                            .expect("finish")
                            .to_string(),
                        pieces,
                    )
                })
                })
                .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let mut distinct = std::collections::HashSet::new();
    let mut parted = 0;
    for ((input, r), (text, finish, pieces)) in INPUTS.iter().zip(&refs).zip(&answers) {
        eprintln!("{input:?}: sipp {text:?} ({finish}), llama-simple {r:?}");
        assert!(!text.trim().is_empty(), "{input}: no text");
        // llama-simple generates up to the input's length + N - 1 tokens:
        // sipp's N tokens are its beginning, or all of it when both stop at
        // end-of-sequence; or the two part where sipp's two best tokens were
        // within the near-tie gap.
        let r = r.trim_start();
        let same = match finish.as_str() {
            "length" => r.starts_with(text.trim_start()),
            "stop" => text.trim_start() == r,
            other => panic!("{input}: finish reason {other}"),
        };
        if !same {
            let mut so_far = String::new();
            let at = pieces.iter().find(|(piece, _)| {
                so_far.push_str(piece);
                !r.starts_with(so_far.trim_start())
            });
            let (piece, gap) = at.unwrap_or_else(|| panic!("{input}: {text:?} vs {r:?}"));
            assert!(
                *gap <= NEAR_TIE,
                "{input}: sipp parts from llama-simple at {piece:?}, top-2 gap {gap}"
            );
            parted += 1;
        }
        distinct.insert(text.clone());
    }
    eprintln!("{parted} of 10 parted from llama-simple at near-ties");
    assert!(
        distinct.len() >= 8,
        "different inputs should mostly give different text: {distinct:?}"
    );
    // Four slots: waves of up to four requests, one encode each.
    let (status, slots) = {
        let r = c.get(s.url("/slots")).send().expect("slots");
        (
            r.status().as_u16(),
            r.json::<serde_json::Value>().expect("json"),
        )
    };
    assert_eq!(status, 200);
    assert_eq!(slots.as_array().map(Vec::len), Some(4), "{slots}");
    // Chat needs a template, which a T5 has not: a clear 400.
    let (status, v) = post(
        &c,
        &s.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    );
    assert_eq!(status, 400, "{v}");
}
