//! LoRA adapters on the default model: two tiny rank-4 adapters
//! (scripts/tiny_lora.py, seeds 1 and 2) loaded with `--lora`. Greedy
//! tokens with adapter A, adapter B and none differ from each other; each
//! equals llama.cpp's llama-server with the same `--lora` files and request
//! `lora` (when `SIPP_LLAMA_SERVER` names the reference build,
//! scripts/reference-llama.sh) and sipp's own output when the three sets run
//! interleaved in one batch, up to near-ties. Also: `model: "ID:ADAPTER"`,
//! `GET`/`POST /lora-adapters`, the per-adapter request counter, and bad
//! input.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::post_json as post;
use common::Server;
use reqwest::blocking::Client;
use serde_json::{json, Value};

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
];
const N: u32 = 16;
/// Near-tie rule: two computations may part only where the top-2 logprob
/// gap is at most this.
const NEAR_TIE: f32 = 1.0;

fn adapter(seed: &str) -> PathBuf {
    let src = sipp::models::fetch(&sipp::models::DEFAULT_MODEL).expect("default model fetched");
    common::tiny_model(
        &format!("smollm2-tiny-lora-seed{seed}.gguf"),
        "tiny_lora.py",
        &src,
        &[seed],
    )
}

/// The sets compared: none (both at 0), A, B.
fn sets() -> [(&'static str, Value); 3] {
    [
        (
            "none",
            json!([{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]),
        ),
        ("A", json!([{"id": 0, "scale": 1.0}])),
        ("B", json!([{"id": 1, "scale": 1.0}])),
    ]
}

/// A greedy generation: its token ids and, per token, the top-2 gap.
#[derive(Debug, Clone)]
struct Gen {
    tokens: Vec<i64>,
    gaps: Vec<f32>,
    text: String,
}

fn query(c: &Client, s: &Server, model: Option<&str>, prompt: &str, lora: Option<&Value>) -> Gen {
    let mut body = json!({"prompt": prompt, "max_tokens": N, "temperature": 0.0, "logprobs": 2});
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    if let Some(l) = lora {
        body["lora"] = l.clone();
    }
    let (status, v) = post(c, &s.url("/v1/query"), &body);
    assert_eq!(status, 200, "{v}");
    let lp = v["logprobs"].as_array().expect("logprobs").clone();
    Gen {
        tokens: lp
            .iter()
            .map(|e| e["token"].as_i64().expect("id"))
            .collect(),
        gaps: lp
            .iter()
            .map(|e| {
                let top = e["top"].as_array().expect("top");
                let p = |i: usize| top[i][1].as_f64().expect("logprob") as f32;
                p(0) - p(1)
            })
            .collect(),
        text: v["text"].as_str().expect("text").to_string(),
    }
}

/// `other` equals `reference` up to a near-tie of `reference`'s: at the
/// first token where they part (or where one ends), its top-2 gap is at
/// most [`NEAR_TIE`]. Returns whether they parted.
fn same_up_to_near_tie(reference: &Gen, other: &[i64], what: &str) -> bool {
    let n = reference.tokens.len().min(other.len());
    let part = (0..n).find(|&i| reference.tokens[i] != other[i]);
    let at = match part {
        Some(i) => i,
        None if reference.tokens.len() == other.len() => return false,
        None => n,
    };
    let gap = reference.gaps.get(at).copied().unwrap_or(0.0);
    assert!(
        gap <= NEAR_TIE,
        "{what}: parts at token {at} where the top-2 gap is {gap}:\n{:?}\nvs\n{other:?}",
        reference.tokens
    );
    eprintln!("{what}: parted at a near-tie (token {at}, gap {gap:.3})");
    true
}

fn differ(a: &Gen, b: &Gen) -> bool {
    a.tokens != b.tokens
}

/// llama-server's greedy tokens for each prompt and set, each request alone
/// on one slot, its prompt cache off (it would reuse KV across sets).
fn llama_server_tokens(bin: &str, a: &PathBuf, b: &PathBuf) -> Vec<Vec<Vec<i64>>> {
    let model = sipp::models::fetch(&sipp::models::DEFAULT_MODEL).expect("default model");
    let adapters = format!("{},{}", a.display(), b.display());
    let server = common::LlamaServer::start(
        bin,
        &model,
        &["-t", "2", "-np", "1", "-c", "2048", "--lora", &adapters],
    );
    let c = Client::new();
    PROMPTS
        .iter()
        .map(|p| {
            sets()
                .iter()
                .map(|(_, lora)| {
                    let body = json!({"prompt": p, "n_predict": N, "temperature": 0.0,
                        "cache_prompt": false, "return_tokens": true, "lora": lora});
                    let (status, v) = post(&c, &format!("{}/completion", server.base), &body);
                    assert_eq!(status, 200, "llama-server: {v}");
                    v["tokens"]
                        .as_array()
                        .expect("tokens")
                        .iter()
                        .map(|t| t.as_i64().expect("id"))
                        .collect()
                })
                .collect()
        })
        .collect()
}

#[test]
fn adapters_change_greedy_output_as_llama_cpp_does_alone_and_batched_together() {
    let (a, b) = (adapter("1"), adapter("2"));
    let adapters = format!("{},{}", a.display(), b.display());
    let s = Server::start(&["--lora", &adapters, "--parallel", "9", "--ctx-size", "4096"]);
    let c = Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .expect("client");
    let (_, models) = {
        let r = c.get(s.url("/v1/models")).send().expect("models");
        (r.status(), r.json::<Value>().expect("json"))
    };
    let id = models["data"][0]["id"].as_str().expect("id").to_string();
    let listed: Vec<&str> = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert!(
        listed.contains(&format!("{id}:smollm2-tiny-lora-seed1").as_str()),
        "{listed:?}"
    );

    // Alone, one request at a time.
    let alone: Vec<Vec<Gen>> = PROMPTS
        .iter()
        .map(|p| {
            sets()
                .iter()
                .map(|(_, l)| query(&c, &s, None, p, Some(l)))
                .collect()
        })
        .collect();
    for (p, gens) in PROMPTS.iter().zip(&alone) {
        eprintln!("{p:?}");
        for ((name, _), g) in sets().iter().zip(gens) {
            eprintln!("  {name}: {:?}", g.text);
            assert!(!g.tokens.is_empty(), "{p} {name}: no tokens");
        }
        assert!(differ(&gens[0], &gens[1]), "{p}: A changes nothing");
        assert!(differ(&gens[0], &gens[2]), "{p}: B changes nothing");
        assert!(differ(&gens[1], &gens[2]), "{p}: A and B agree");
    }

    // llama.cpp's own server on the same files and request `lora` lists.
    if let Ok(bin) = std::env::var("SIPP_LLAMA_SERVER") {
        let reference = llama_server_tokens(&bin, &a, &b);
        let mut parted = 0;
        for (i, p) in PROMPTS.iter().enumerate() {
            for (j, (name, _)) in sets().iter().enumerate() {
                let what = format!("{p:?} {name} vs llama-server");
                parted += usize::from(same_up_to_near_tie(&alone[i][j], &reference[i][j], &what));
            }
        }
        eprintln!("{parted} of 9 parted from llama-server at near-ties");
    } else {
        eprintln!("SIPP_LLAMA_SERVER unset: no comparison with llama-server");
    }

    // All nine at once: the three sets interleave in the slots, each step
    // runs one batch per set, and no set reuses another's KV (the prompts
    // repeat across sets).
    let together: Vec<(usize, usize, Gen)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3)
            .flat_map(|j| (0..3).map(move |i| (i, j)))
            .map(|(i, j)| {
                let (c, s) = (&c, &s);
                scope.spawn(move || (i, j, query(c, s, None, PROMPTS[i], Some(&sets()[j].1))))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    for (i, j, g) in &together {
        let what = format!("{:?} {} together", PROMPTS[*i], sets()[*j].0);
        same_up_to_near_tie(&alone[*i][*j], &g.tokens, &what);
    }

    // An adapter named as a model: alone, at its configured scale.
    let named = query(
        &c,
        &s,
        Some(&format!("{id}:smollm2-tiny-lora-seed2")),
        PROMPTS[0],
        None,
    );
    same_up_to_near_tie(&alone[0][2], &named.tokens, "ID:ADAPTER");
    let (status, v) = post(
        &c,
        &s.url("/v1/completions"),
        &json!({"model": format!("{id}:nope"), "prompt": "x", "max_tokens": 1}),
    );
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("no LoRA adapter `nope`") && msg.contains("smollm2-tiny-lora-seed1"),
        "{msg}"
    );

    // Global scales: both at 1 from `--lora`; POST sets B alone, and a
    // request that chooses nothing then runs with B.
    let listed: Value = c
        .get(s.url("/lora-adapters"))
        .send()
        .expect("list")
        .json()
        .expect("json");
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");
    assert_eq!(listed[0]["id"], 0);
    assert_eq!(listed[1]["scale"], 1.0);
    assert_eq!(listed[0]["path"], a.display().to_string());
    let (status, v) = post(
        &c,
        &s.url("/lora-adapters"),
        &json!([{"id": 1, "scale": 1.0}]),
    );
    assert_eq!((status, v.clone()), (200, json!({"success": true})));
    let listed: Value = c
        .get(s.url("/lora-adapters"))
        .send()
        .expect("list")
        .json()
        .expect("json");
    assert_eq!(
        (listed[0]["scale"].as_f64(), listed[1]["scale"].as_f64()),
        (Some(0.0), Some(1.0))
    );
    let global = query(&c, &s, None, PROMPTS[0], None);
    same_up_to_near_tie(&alone[0][2], &global.tokens, "global scales");

    // Counted per adapter: A ran 3 + 3 times, B 3 + 3 + 2.
    let count = |name: &str| {
        s.metric(&format!(
            "sipp_lora_requests_total{{model=\"{id}\",adapter=\"{name}\"}}"
        ))
        .unwrap_or(0.0)
    };
    assert_eq!(count("smollm2-tiny-lora-seed1"), 6.0);
    assert_eq!(count("smollm2-tiny-lora-seed2"), 8.0);

    // Bad input, each a clear 400 naming `lora`, and nothing else lost.
    for (route, body) in [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1, "lora": [{"id": 2, "scale": 1.0}]}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "lora": [{"id": 0}]}),
        ),
        (
            "/v1/query",
            json!({"prompt": "x", "max_tokens": 1, "lora": {"id": 0, "scale": 1.0}}),
        ),
        ("/lora-adapters", json!([{"id": 9, "scale": 1.0}])),
        ("/lora-adapters", json!({"id": 0, "scale": 1.0})),
    ] {
        let (status, v) = post(&c, &s.url(route), &body);
        assert_eq!(status, 400, "{route} {body}: {v}");
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(!msg.is_empty(), "{route} {body}: {v}");
    }
    let after = query(&c, &s, None, PROMPTS[0], Some(&sets()[1].1));
    same_up_to_near_tie(&alone[0][1], &after.tokens, "after bad input");
}

/// Adapters from TOML, with an alias, on a target loaded on demand: a
/// request naming the adapter (by `TARGET:NAME` or its alias) loads the
/// target and runs with the adapter.
#[test]
fn an_adapter_alias_loads_its_on_demand_target() {
    let a = adapter("1");
    let model = sipp::models::fetch(&sipp::models::DEFAULT_MODEL).expect("default model");
    let tmp = common::temp_dir("lora");
    let dir = tmp.path().to_path_buf();
    let cfg = dir.join("serve.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[models]]\nid = \"chat\"\nmodel = \"{}\"\nload = \"on_demand\"\n\
             [[models.runtime.lora]]\npath = \"{}\"\nname = \"pirate\"\naliases = [\"smol-pirate\"]\napply = false\n",
            model.display(),
            a.display()
        ),
    )
    .expect("config");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let c = Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("client");
    let by_alias = query(&c, &s, Some("smol-pirate"), PROMPTS[0], None);
    let by_name = query(&c, &s, Some("chat:pirate"), PROMPTS[0], None);
    let explicit = query(
        &c,
        &s,
        Some("chat"),
        PROMPTS[0],
        Some(&json!([{"id": 0, "scale": 1.0}])),
    );
    let base = query(&c, &s, Some("chat"), PROMPTS[0], None);
    same_up_to_near_tie(&explicit, &by_alias.tokens, "alias");
    same_up_to_near_tie(&explicit, &by_name.tokens, "TARGET:NAME");
    assert!(
        differ(&base, &explicit),
        "apply = false: the base model by default"
    );
    let count = s
        .metric("sipp_lora_requests_total{model=\"chat\",adapter=\"pirate\"}")
        .unwrap_or(0.0);
    assert_eq!(count, 3.0);
}
