//! `POST /infill` on a FIM model: a copy of the default model whose GGUF
//! names FIM tokens (scripts/tiny_fim.py). The prompt tokens sipp builds are
//! checked against a sequence built here from the server's own /tokenize
//! pieces in llama-server's layout (`format_prompt_infill`) and, when
//! `SIPP_LLAMA_SERVER` names llama.cpp's llama-server from the reference
//! build (scripts/reference-llama.sh), against llama-server's /infill on the
//! same file (its `prompt` text and `tokens_evaluated`). The default model,
//! whose GGUF has no FIM tokens (llama-server answers 501 there), and bad
//! bodies get 400.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::post_json as post;
use common::Server;
use reqwest::blocking::Client;
use serde_json::{json, Value};

/// The FIM ids tiny_fim.py writes (SmolLM2 control tokens standing in).
const FIM_PRE: i64 = 8;
const FIM_SUF: i64 = 9;
const FIM_MID: i64 = 10;
const FIM_REP: i64 = 3;
const FIM_SEP: i64 = 5;

/// Context of both servers' slots: with llama-server's batch of 2048, the
/// extra files may take n_ctx - 2048 + 2 tokens, so none is cut here.
const N_CTX: u32 = 4096;

fn bodies() -> Vec<Value> {
    vec![
        json!({"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n"}),
        json!({"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "prompt": "return"}),
        json!({
            "input_prefix": "import util\n\nx = util.",
            "input_suffix": "(3)\n",
            "input_extra": [
                {"filename": "util.py", "text": "def square(n):\n    return n * n\n"},
                {"text": "# no file name: llama-server calls it tmp\n"}
            ]
        }),
        json!({
            "input_prefix": "fn main() {\n    let v = ",
            "input_suffix": ";\n}\n",
            "input_extra": [{"filename": "lib.rs", "text": "pub fn make() -> Vec<u8> { vec![] }\n"}],
            "prompt": " make"
        }),
    ]
}

/// The FIM copy of the default model, made once and cached with the models.
fn tiny_fim() -> PathBuf {
    let src = sipp::models::fetch(&sipp::models::DEFAULT_MODEL).expect("default model fetched");
    common::tiny_model("smollm2-tiny-fim.gguf", "tiny_fim.py", &src, &[])
}

/// Token ids of `text` from the server's /tokenize (no BOS).
fn tokenize(c: &Client, s: &Server, text: &str, parse_special: bool) -> Vec<i64> {
    let (status, v) = post(
        c,
        &s.url("/tokenize"),
        &json!({"model": "fim", "content": text, "add_special": false, "parse_special": parse_special}),
    );
    assert_eq!(status, 200, "{v}");
    v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_i64().expect("id"))
        .collect()
}

/// llama-server's infill prompt for `body`, from pieces (nothing truncated).
fn expected(c: &Client, s: &Server, body: &Value) -> Vec<i64> {
    let text = |k: &str| body[k].as_str().unwrap_or("").to_string();
    let mut out = vec![FIM_REP];
    out.extend(tokenize(c, s, "myproject\n", false));
    for e in body["input_extra"].as_array().cloned().unwrap_or_default() {
        out.push(FIM_SEP);
        let name = e["filename"].as_str().unwrap_or("tmp");
        out.extend(tokenize(c, s, &format!("{name}\n"), false));
        out.extend(tokenize(c, s, e["text"].as_str().expect("text"), false));
    }
    out.push(FIM_SEP);
    out.extend(tokenize(c, s, "filename\n", false));
    // BOS, where the tokenizer adds one (SmolLM2's does not).
    let (_, v) = post(
        c,
        &s.url("/tokenize"),
        &json!({"model": "fim", "content": "", "add_special": true}),
    );
    out.extend(
        v["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_i64().expect("id")),
    );
    out.push(FIM_PRE);
    out.extend(tokenize(c, s, &text("input_prefix"), false));
    out.extend(tokenize(c, s, &text("prompt"), true));
    out.push(FIM_SUF);
    out.extend(tokenize(c, s, &text("input_suffix"), false));
    out.push(FIM_MID);
    out
}

/// What llama-server's /infill did with each body: its `prompt` text, its
/// `tokens_evaluated`, and how many leading tokens of `ours` (sipp's prompt
/// tokens for that body) its prompt cache then reused when `ours` was sent to
/// its /completion on the same (single) slot: all but the last when the two
/// token sequences agree (llama-server always evaluates at least one token).
fn llama_server_prompts(
    bin: &str,
    model: &std::path::Path,
    ours: &[Vec<i64>],
) -> Vec<(String, u64, u64)> {
    let n_ctx = N_CTX.to_string();
    let server = common::LlamaServer::start(
        bin,
        model,
        &["-t", "2", "-np", "1", "-b", "2048", "-c", &n_ctx],
    );
    let c = Client::new();
    let base = &server.base;
    let out = bodies()
        .into_iter()
        .zip(ours)
        .map(|(mut b, ours)| {
            b["n_predict"] = json!(1);
            b["cache_prompt"] = json!(true);
            let (status, v) = post(&c, &format!("{base}/infill"), &b);
            assert_eq!(status, 200, "llama-server: {v}");
            let (status, w) = post(
                &c,
                &format!("{base}/completion"),
                &json!({"prompt": ours, "n_predict": 1, "cache_prompt": true}),
            );
            assert_eq!(status, 200, "llama-server: {w}");
            (
                v["prompt"].as_str().expect("prompt").to_string(),
                v["tokens_evaluated"].as_u64().expect("tokens_evaluated"),
                w["timings"]["cache_n"].as_u64().expect("cache_n"),
            )
        })
        .collect();
    out
}

#[test]
fn infill_builds_llama_servers_prompt_and_refuses_bad_input() {
    let fim = tiny_fim();
    let default = sipp::models::fetch(&sipp::models::DEFAULT_MODEL).expect("default model");
    let tmp = common::temp_dir("infill");
    let dir = tmp.path().to_path_buf();
    let target = |id: &str, model: &std::path::Path| {
        format!(
            "[[models]]\nid = \"{id}\"\nmodel = \"{}\"\n[models.runtime.context]\n\
             n_ctx = {N_CTX}\nn_parallel = 1\n",
            model.display()
        )
    };
    let cfg = dir.join("sipp.toml");
    std::fs::write(&cfg, target("fim", &fim) + &target("plain", &default)).expect("config");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let c = Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client");

    let mut ours = Vec::new();
    let mut our_tokens = Vec::new();
    for b in bodies() {
        let mut req = b.clone();
        req["model"] = json!("fim");
        req["n_predict"] = json!(4);
        req["return_tokens"] = json!(true);
        let (status, v) = post(&c, &s.url("/infill"), &req);
        assert_eq!(status, 200, "{b}: {v}");
        let got: Vec<i64> = v["prompt_tokens"]
            .as_array()
            .expect("prompt_tokens")
            .iter()
            .map(|t| t.as_i64().expect("id"))
            .collect();
        assert_eq!(got, expected(&c, &s, &b), "{b}");
        assert_eq!(v["tokens_evaluated"], got.len(), "{v}");
        assert!(v["content"].is_string(), "{v}");
        assert!(
            v["tokens_predicted"].as_u64().is_some_and(|n| n <= 4),
            "{v}"
        );
        assert_eq!(
            v["tokens"].as_array().map(Vec::len),
            v["tokens_predicted"].as_u64().map(|n| n as usize)
        );
        assert_eq!(v["truncated"], false);
        ours.push((
            v["prompt"].as_str().expect("prompt").to_string(),
            got.len() as u64,
        ));
        our_tokens.push(got);
    }
    println!(
        "infill: {} prompts match the /tokenize-built layout",
        ours.len()
    );

    if let Ok(bin) = std::env::var("SIPP_LLAMA_SERVER") {
        let theirs = llama_server_prompts(&bin, &fim, &our_tokens);
        for (i, ((text, n), (t_text, t_n, reused))) in ours.iter().zip(&theirs).enumerate() {
            assert_eq!(text, t_text, "body {i}: prompt text, sipp vs llama-server");
            assert_eq!(n, t_n, "body {i}: prompt tokens, sipp vs llama-server");
            // Token for token: llama-server reused its /infill prompt's KV for
            // sipp's tokens up to the last (FIM middle, equal in both).
            assert_eq!(
                *reused,
                n - 1,
                "body {i}: tokens llama-server's cache reused"
            );
            println!("infill: body {i}: {n} tokens, llama-server reused {reused} + FIM middle");
        }
        println!(
            "infill: {} prompts equal llama-server's /infill",
            theirs.len()
        );
    }

    // Streaming: llama-server's pieces, then the answer with `stop: true`;
    // greedy, so the text equals the unstreamed answer's.
    let mut req = bodies()[1].clone();
    req["model"] = json!("fim");
    req["n_predict"] = json!(6);
    req["temperature"] = json!(0.0);
    let (status, whole) = post(&c, &s.url("/infill"), &req);
    assert_eq!(status, 200, "{whole}");
    req["stream"] = json!(true);
    let text = c
        .post(s.url("/infill"))
        .json(&req)
        .send()
        .expect("answered")
        .text()
        .expect("body");
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).expect("json event"))
        .collect();
    let (last, pieces) = events.split_last().expect("events");
    assert_eq!(last["stop"], true, "{text}");
    assert_eq!(
        last["tokens_evaluated"], whole["tokens_evaluated"],
        "{text}"
    );
    assert_eq!(
        last["tokens_predicted"], whole["tokens_predicted"],
        "{text}"
    );
    let streamed: String = pieces
        .iter()
        .inspect(|p| assert_eq!(p["stop"], false, "{text}"))
        .map(|p| p["content"].as_str().expect("content"))
        .collect();
    assert_eq!(
        streamed,
        whole["content"].as_str().expect("content"),
        "{text}"
    );

    // The default model has no FIM tokens: a 400 naming them.
    let (status, v) = post(
        &c,
        &s.url("/infill"),
        &json!({"model": "plain", "input_prefix": "a", "input_suffix": "b"}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "model", "{v}");
    let m = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        m.contains("FIM") && m.contains("prefix, suffix, middle"),
        "{v}"
    );

    // Bad bodies: a 400 naming the field.
    for (body, param) in [
        (json!({"input_suffix": "b"}), "input_prefix"),
        (
            json!({"input_prefix": 1, "input_suffix": "b"}),
            "input_prefix",
        ),
        (
            json!({"input_prefix": "a", "input_suffix": ["b"]}),
            "input_suffix",
        ),
        (
            json!({"input_prefix": "a", "input_suffix": "b", "prompt": 3}),
            "prompt",
        ),
        (
            json!({"input_prefix": "a", "input_suffix": "b", "input_extra": {"text": "x"}}),
            "input_extra",
        ),
        (
            json!({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "f"}]}),
            "input_extra",
        ),
        (
            json!({"input_prefix": "a", "input_suffix": "b", "input_extra": ["x"]}),
            "input_extra",
        ),
    ] {
        let mut body = body;
        body["model"] = json!("fim");
        let (status, v) = post(&c, &s.url("/infill"), &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
}
