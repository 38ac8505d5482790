//! `POST /v1/rerank` (and `/rerank`) on a tiny cross-encoder: MiniLM with a
//! seeded random classification head (scripts/tiny_reranker.py), served with
//! rank pooling. Scores are compared with an independent numpy reference
//! (scripts/rerank_reference.py) and, when `SIPP_LLAMA_SERVER` names
//! llama.cpp's llama-server from the reference build
//! (scripts/reference-llama.sh), with llama-server's own /rerank on the
//! same file.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::post_json as post;
use common::Server;
use reqwest::blocking::Client;
use serde_json::{json, Value};

/// Scores must agree within this. llama.cpp computes in f32 with f16 steps
/// (its GELU table; K and V under flash attention) and its results move a
/// little with batching; the numpy reference computes in f64.
const TOLERANCE: f64 = 1e-3;

const QUERIES: [&str; 2] = [
    "What instrument is the monkey playing?",
    "Which city is the capital of France?",
];

const DOCUMENTS: [&str; 10] = [
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "Paris is the capital and largest city of France.",
    "The quick brown fox jumps over the lazy dog!",
    "A man is playing a flute.",
    "The stock market fell sharply on Tuesday.",
    "Berlin is the capital of Germany.",
    "She plays the violin in an orchestra.",
    "Bananas are a good source of potassium.",
    "",
];

fn script(name: &str) -> PathBuf {
    common::manifest_dir().join("../../scripts").join(name)
}

/// The tiny reranker, made once and cached next to the models; with
/// `template`, its GGUF also has a `tokenizer.chat_template.rerank`.
fn tiny_reranker(template: bool) -> PathBuf {
    let minilm = sipp::models::fetch(&sipp::models::MINILM).expect("minilm fetched");
    let name = if template {
        "minilm-tiny-reranker-seed7-template.gguf"
    } else {
        "minilm-tiny-reranker-seed7.gguf"
    };
    let mut args = vec!["--seed", "7"];
    args.extend(template.then_some("--rerank-template"));
    common::tiny_model(name, "tiny_reranker.py", &minilm, &args)
}

/// The numpy reference: one score per (query, document), queries in order.
fn numpy_scores(model: &Path) -> (Vec<f64>, Vec<usize>) {
    let ckpt = sipp::models::checkpoint_dir(&sipp::models::MINILM);
    let mut child = Command::new(common::python())
        .arg(script("rerank_reference.py"))
        .arg(&ckpt)
        .arg(model)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python runs");
    {
        use std::io::Write;
        let reqs: Vec<Value> = QUERIES
            .iter()
            .map(|q| json!({"query": q, "documents": DOCUMENTS}))
            .collect();
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(Value::Array(reqs).to_string().as_bytes())
            .expect("write");
    }
    let out = child.wait_with_output().expect("reference finishes");
    assert!(
        out.status.success(),
        "reference failed (scripts/test.sh installs numpy, safetensors and gguf): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    let scores = v["scores"]
        .as_array()
        .expect("scores")
        .iter()
        .map(|s| s.as_f64().expect("number"))
        .collect();
    let lengths = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_array().expect("ids").len())
        .collect();
    (scores, lengths)
}

/// Targets: `reranker` (4 slots: a request's pairs share steps),
/// `reranker-tpl` (the file with a rerank template, flash attention off: K and
/// V stay f32, so the numpy reference agrees to ~5e-5) and `minilm` (mean
/// pooling) and, with `one_slot`, `reranker-1` (each pair alone).
fn config(dir: &std::path::Path, plain: &Path, templated: &Path, one_slot: bool) -> PathBuf {
    let target = |id: &str, model: &Path, slots: u32, extra: &str| {
        format!(
            "[[models]]\nid = \"{id}\"\nmodel = \"{}\"\n[models.runtime.context]\n\
             pooling = \"rank\"\nn_parallel = {slots}\n{extra}\n",
            model.display()
        )
    };
    let mut toml = target("reranker", plain, 4, "");
    toml += &target("reranker-tpl", templated, 1, "flash_attention = \"off\"\n");
    if one_slot {
        toml += &target("reranker-1", plain, 1, "");
    }
    toml += "[[models]]\nid = \"minilm\"\nmodel = \"minilm\"\n[models.runtime.context]\nn_parallel = 1\n";
    let path = dir.join("sipp.toml");
    std::fs::write(&path, toml).expect("write config");
    path
}

/// Scores by document index, from a rerank answer.
fn by_index(v: &Value) -> Vec<f64> {
    let results = v["results"].as_array().expect("results");
    let mut out = vec![f64::NAN; results.len()];
    for r in results {
        let i = r["index"].as_u64().expect("index") as usize;
        out[i] = r["relevance_score"].as_f64().expect("score");
    }
    out
}

/// The answer's order is best first, and agrees with the reference's order
/// except between documents whose reference scores are within the tolerance.
fn assert_order(v: &Value, reference: &[f64], what: &str) {
    let order: Vec<usize> = v["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| r["index"].as_u64().expect("index") as usize)
        .collect();
    for w in order.windows(2) {
        let (a, b) = (reference[w[0]], reference[w[1]]);
        assert!(
            a >= b - 2.0 * TOLERANCE,
            "{what}: document {} ({a}) ranked above {} ({b})",
            w[0],
            w[1]
        );
    }
}

/// llama-server's /rerank on the same file, when the reference build is here.
fn llama_server_scores(bin: &str, model: &Path, flash_attention: &str) -> Vec<Vec<f64>> {
    // One slot: each pair computed alone, as on sipp's `reranker-1`.
    let server = common::LlamaServer::start(
        bin,
        model,
        &[
            "--reranking",
            "-t",
            "2",
            "-np",
            "1",
            "-c",
            "2048",
            "-fa",
            flash_attention,
        ],
    );
    let c = Client::new();
    let base = &server.base;
    let out = QUERIES
        .iter()
        .map(|q| {
            let (status, v) = post(
                &c,
                &format!("{base}/rerank"),
                &json!({"query": q, "documents": DOCUMENTS}),
            );
            assert_eq!(status, 200, "llama-server: {v}");
            by_index(&v)
        })
        .collect();
    out
}

/// Scores of the 20 pairs from `target`, by query then document, checked
/// against the numpy reference (scores, order, token counts).
fn checked_scores(c: &Client, s: &Server, target: &str, model: &Path) -> Vec<Vec<f64>> {
    let (reference, lengths) = numpy_scores(model);
    let n = DOCUMENTS.len();
    let mut out = Vec::new();
    let mut max_diff = 0.0f64;
    // Each query with all ten documents in one request.
    for (qi, q) in QUERIES.iter().enumerate() {
        let (status, v) = post(
            c,
            &s.url("/v1/rerank"),
            &json!({"model": target, "query": q, "documents": DOCUMENTS}),
        );
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["object"], "list");
        assert_eq!(v["model"], target);
        let reference = &reference[qi * n..(qi + 1) * n];
        let got = by_index(&v);
        assert_eq!(got.len(), n);
        for (i, (g, r)) in got.iter().zip(reference).enumerate() {
            max_diff = max_diff.max((g - r).abs());
            assert!(
                (g - r).abs() <= TOLERANCE,
                "{target}, query {qi}, document {i}: sipp {g}, numpy {r}"
            );
        }
        assert_order(&v, reference, target);
        // The pairs were tokenized as the reference (and llama-server) does.
        let tokens: usize = lengths[qi * n..(qi + 1) * n].iter().sum();
        assert_eq!(v["usage"]["prompt_tokens"], tokens, "{target}: {v}");
        assert_eq!(v["usage"]["total_tokens"], tokens);
        assert!(v["results"][0].get("document").is_none());
        out.push(got);
    }
    println!("rerank: 20 pairs on {target}, max |sipp - numpy| = {max_diff:.2e}");
    out
}

/// Asserts two score tables agree within the tolerance; prints the largest gap.
fn assert_close(ours: &[Vec<f64>], theirs: &[Vec<f64>], what: &str) {
    let mut max_diff = 0.0f64;
    for (ours, theirs) in ours.iter().zip(theirs) {
        assert_eq!(ours.len(), theirs.len());
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            max_diff = max_diff.max((a - b).abs());
            assert!(
                (a - b).abs() <= TOLERANCE,
                "{what}, document {i}: {a} vs {b}"
            );
        }
    }
    println!("rerank: 20 pairs, max |{what}| = {max_diff:.2e}");
}

#[test]
fn rerank_matches_the_references_and_honours_its_fields() {
    let plain = tiny_reranker(false);
    let templated = tiny_reranker(true);
    let tmp = common::temp_dir("rerank");
    let dir = tmp.path().to_path_buf();
    let llama_server = std::env::var("SIPP_LLAMA_SERVER").ok();
    let cfg = config(&dir, &plain, &templated, llama_server.is_some());
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let c = Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client");
    let n = DOCUMENTS.len();

    let steps = || s.metric("sipp_engine_steps_total{model=\"reranker\"}");
    let before = steps().expect("steps metric");
    let sipp_scores = checked_scores(&c, &s, "reranker", &plain);
    // The ten pairs of a request share steps (4 slots: 3 steps when all are
    // queued before the first; a step may start between two submissions).
    let took = steps().expect("steps metric") - before;
    assert!(
        took <= 2.0 * 5.0,
        "2 requests of 10 pairs took {took} steps"
    );
    let sipp_templated = checked_scores(&c, &s, "reranker-tpl", &templated);

    // llama.cpp's own server on the same files. Batching moves llama.cpp's
    // scores a little (here up to ~4e-4: flash attention's f16 K and V, and
    // the f16 GELU table, round differently), so pairs computed one at a time
    // (`reranker-1`, `reranker-tpl`) are compared too: they agree to ~1e-8.
    if let Some(bin) = llama_server {
        let theirs = llama_server_scores(&bin, &plain, "auto");
        assert_close(&sipp_scores, &theirs, "sipp (4 slots) - llama-server");
        let one_slot = checked_scores(&c, &s, "reranker-1", &plain);
        assert_close(&one_slot, &theirs, "sipp (1 slot) - llama-server");
        let theirs = llama_server_scores(&bin, &templated, "off");
        assert_close(
            &sipp_templated,
            &theirs,
            "sipp (rerank template) - llama-server",
        );
    }

    // top_n and return_documents, on the alias route.
    let (status, v) = post(
        &c,
        &s.url("/rerank"),
        &json!({"query": QUERIES[0], "documents": DOCUMENTS, "top_n": 3, "return_documents": true}),
    );
    assert_eq!(status, 200, "{v}");
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 3);
    let mut best: Vec<usize> = (0..n).collect();
    best.sort_by(|&a, &b| sipp_scores[0][b].total_cmp(&sipp_scores[0][a]));
    for (r, want) in results.iter().zip(&best) {
        let i = r["index"].as_u64().expect("index") as usize;
        assert!(
            (sipp_scores[0][i] - sipp_scores[0][*want]).abs() <= TOLERANCE,
            "top 3: got {i}, expected {want}: {v}"
        );
        assert_eq!(r["document"]["text"], DOCUMENTS[i]);
    }
    // A top_n beyond the documents keeps them all.
    let (status, v) = post(
        &c,
        &s.url("/v1/rerank"),
        &json!({"query": "q", "documents": ["a", "b"], "top_n": 10}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["results"].as_array().map(Vec::len), Some(2));

    // Bad input is a 400 naming the field.
    for (body, param) in [
        (json!({"query": "", "documents": ["a"]}), "query"),
        (json!({"documents": ["a"]}), "query"),
        (json!({"query": "q", "documents": []}), "documents"),
        (json!({"query": "q", "documents": ["a", 3]}), "documents"),
        (
            json!({"query": "q", "documents": ["a"], "top_n": -2}),
            "top_n",
        ),
        (
            json!({"model": "minilm", "query": "q", "documents": ["a"]}),
            "model",
        ),
    ] {
        let (status, v) = post(&c, &s.url("/v1/rerank"), &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    let (_, v) = post(
        &c,
        &s.url("/v1/rerank"),
        &json!({"model": "minilm", "query": "q", "documents": ["a"]}),
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("rank pooling") && m.contains("mean")),
        "{v}"
    );
    drop(s);

    // llama-server's flag: `--reranking` serves the same file with rank
    // pooling, and the scores are the config's.
    let flagged = Server::start(&["--model", plain.to_str().expect("utf8"), "--reranking"]);
    let (status, v) = post(
        &c,
        &flagged.url("/v1/rerank"),
        &json!({"query": QUERIES[0], "documents": DOCUMENTS}),
    );
    assert_eq!(status, 200, "{v}");
    let flag_scores: Vec<f64> = (0..n)
        .map(|i| {
            let r = v["results"]
                .as_array()
                .expect("results")
                .iter()
                .find(|r| r["index"] == i)
                .expect("each document scored");
            r["relevance_score"].as_f64().expect("score")
        })
        .collect();
    for (i, (a, b)) in flag_scores.iter().zip(&sipp_scores[0]).enumerate() {
        assert!(
            (a - b).abs() < TOLERANCE,
            "document {i}: {a} by flag, {b} by config"
        );
    }
}
