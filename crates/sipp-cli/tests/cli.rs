//! The `sipp` binary as a user runs it.

use std::path::PathBuf;
use std::process::{Command, Output};

fn sipp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sipp"))
        .args(args)
        .output()
        .expect("sipp runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A new temporary folder for one test's files, removed when it drops.
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("sipp-cli-test-")
        .tempdir()
        .expect("tmp")
}

fn default_model() -> PathBuf {
    let o = sipp(&["models", "fetch", "default"]);
    assert!(o.status.success(), "fetch failed: {}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    PathBuf::from(out.trim().trim_start_matches("default: "))
}

#[test]
fn run_says_paris() {
    default_model();
    let o = sipp(&[
        "run",
        "--model",
        "default",
        "--max-tokens",
        "16",
        "--temperature",
        "0",
        "The capital of France is",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("Paris"), "{out}");
    assert!(
        stderr(&o).contains("loaded"),
        "load time is reported: {}",
        stderr(&o)
    );
}

#[test]
fn run_stats_reports_speeds() {
    default_model();
    let o = sipp(&["run", "-n", "8", "--temperature", "0", "--stats", "Hello"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    for key in [
        "prompt tokens:",
        "prompt tok/s:",
        "generated tokens:",
        "decode tok/s:",
        "ttft ms:",
    ] {
        assert!(err.contains(key), "missing {key} in {err}");
    }
}

/// Bad input: exit status 2 and one line on stderr that names the problem.
fn assert_bad_input(args: &[&str], expect: &str) {
    let o = sipp(args);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    let err = stderr(&o);
    let error_lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(error_lines.len(), 1, "one error line expected: {err}");
    assert!(error_lines[0].contains(expect), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_model_paths_are_clear_errors() {
    let tmp = scratch();
    let dir = tmp.path().join("a-directory");
    std::fs::create_dir_all(&dir).expect("dir");
    let text = tmp.path().join("text.gguf");
    std::fs::write(&text, "this is not a model").expect("write");
    let model = default_model();
    let bytes = std::fs::read(&model).expect("read model");
    let truncated = tmp.path().join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("write");
    let header_only = tmp.path().join("header.gguf");
    std::fs::write(&header_only, &bytes[..1000]).expect("write");

    assert_bad_input(
        &["run", "--model", "/no/such/model.gguf", "hi"],
        "not found",
    );
    assert_bad_input(
        &["run", "--model", dir.to_str().expect("utf8"), "hi"],
        "directory",
    );
    assert_bad_input(
        &["run", "--model", text.to_str().expect("utf8"), "hi"],
        "not a GGUF file",
    );
    assert_bad_input(
        &["run", "--model", truncated.to_str().expect("utf8"), "hi"],
        "truncated",
    );
    assert_bad_input(
        &["run", "--model", header_only.to_str().expect("utf8"), "hi"],
        "truncated",
    );
    assert_bad_input(
        &["inspect", text.to_str().expect("utf8")],
        "not a GGUF file",
    );
}

/// A `--lora` file that is not a LoRA adapter is refused by name, by `run`
/// and by `serve` before it binds its port.
#[test]
fn bad_lora_adapters_are_clear_errors() {
    let tmp = scratch();
    let model = default_model();
    let text = tmp.path().join("not-an-adapter.gguf");
    std::fs::write(&text, "this is not an adapter").expect("write");
    let text = text.to_str().expect("utf8");
    assert_bad_input(&["run", "--lora", text, "hi"], "not a GGUF file");
    assert_bad_input(
        &["run", "--lora", model.to_str().expect("utf8"), "hi"],
        "not a LoRA adapter",
    );
    assert_bad_input(&["serve", "--lora", text, "--port", "0"], "adapter 0");
    let o = sipp(&["run", "--lora-scaled", "a.gguf", "hi"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("FNAME:SCALE"), "{}", stderr(&o));
}

#[test]
fn bad_prompts_are_clear_errors() {
    default_model();
    assert_bad_input(&["run", ""], "empty");
    let long = "word ".repeat(300);
    assert_bad_input(&["run", "--ctx-size", "128", &long], "context holds 128");
    assert_bad_input(&["run", "--temperature", "-1", "hi"], "temperature");
}

/// `--rpc` endpoints are checked before anything loads, and an RPC server
/// that is down is an error (ggml would abort the process on it).
#[test]
fn bad_rpc_endpoints_are_clear_errors() {
    default_model();
    assert_bad_input(&["run", "--rpc", "nohost", "hi"], "placement.rpc");
    assert_bad_input(
        &["serve", "--rpc", "10.0.0.5:0", "--port", "0"],
        "`10.0.0.5:0` is not host:port",
    );
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port");
    let o = sipp(&["run", "--rpc", &format!("127.0.0.1:{port}"), "hi"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("RPC server unreachable"),
        "{}",
        stderr(&o)
    );
}

/// Bad placement is refused before llama.cpp could abort on it: exit 2 and
/// one line naming the setting, from `run` and from `serve` (before it
/// binds its port), by flag and by config file.
#[test]
fn bad_placement_is_a_clear_error() {
    let tmp = scratch();
    default_model();
    assert_bad_input(
        &["run", "--gpu-layers", "-1", "hi"],
        "layer count is 0 or more",
    );
    assert_bad_input(&["run", "--gpu-layers", "many", "hi"], "--gpu-layers");
    assert_bad_input(&["run", "--tensor-split", "3,-1", "hi"], "0 or more");
    assert_bad_input(&["run", "--tensor-split", "0,0", "hi"], "at least one part");
    assert_bad_input(&["run", "--main-gpu", "-2", "hi"], "GPU index is 0 or more");
    assert_bad_input(
        &["run", "--split-mode", "diagonal", "hi"],
        "none, layer or row",
    );
    // A GPU beyond the devices there are (a CPU build has none; a GPU build
    // has fewer than 64).
    assert_bad_input(
        &["run", "--main-gpu", "64", "hi"],
        "main_gpu 64 does not exist",
    );
    assert_bad_input(
        &["run", "--tensor-split", &vec!["1"; 16].join(","), "hi"],
        "tensor_split names 16 GPUs",
    );
    // KV cache for 50M tokens (terabytes): llama.cpp's fitting says no.
    assert_bad_input(&["run", "--ctx-size", "50000000", "hi"], "does not fit");
    assert_bad_input(
        &["serve", "--ctx-size", "50000000", "--port", "0"],
        "model `default`: bad placement",
    );
    let cfg = tmp.path().join("negative-layers.toml");
    std::fs::write(
        &cfg,
        "[[models]]\nid = \"m\"\nmodel = \"default\"\n[models.runtime.placement]\ngpu_layers = -2\n",
    )
    .expect("write");
    let o = sipp(&[
        "serve",
        "--config",
        cfg.to_str().expect("utf8"),
        "--port",
        "0",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("line 5") && err.contains("gpu_layers: a layer count is 0 or more, got -2"),
        "{err}"
    );
    let runtime = tmp.path().join("zero-split.toml");
    std::fs::write(&runtime, "[placement]\ntensor_split = [0, 0]\n").expect("write");
    assert_bad_input(
        &["run", "--config", runtime.to_str().expect("utf8"), "hi"],
        "placement.tensor_split",
    );
}

#[test]
fn inspect_describes_the_model() {
    default_model();
    let o = sipp(&["inspect", "default", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    assert_eq!(v["architecture"], "llama");
    assert_eq!(v["quantization"], "Q4_1");
    assert_eq!(v["vocab_size"], 49152);
    assert_eq!(v["context_length"], 8192);
    assert_eq!(v["chat_template"], true);
    // Where the layers are: all on the CPU in the default build.
    let layers = v["placement"]["total_layers"]
        .as_u64()
        .expect("total_layers");
    assert_eq!(layers, v["layers"].as_u64().unwrap_or(30) + 1, "{v}");
    if cfg!(not(any(
        feature = "cuda",
        feature = "vulkan",
        feature = "metal"
    ))) {
        assert_eq!(v["placement"]["backend"], "CPU", "{v}");
        assert_eq!(v["placement"]["offloaded_layers"], 0, "{v}");
    }
    assert!(v["parameters"].as_u64().expect("number") > 100_000_000);
    assert!(v["special_tokens"]
        .as_array()
        .expect("array")
        .iter()
        .any(|t| t["name"] == "eos"));
}

/// Bad traffic policy in the server config stops `sipp serve` before it
/// binds or loads anything: exit code 2, with the line and the field.
#[test]
fn bad_policy_config_fails_at_start_with_the_line() {
    let tmp = scratch();
    let cases = [
        (
            "[server.ip]\ndeny = [\"10.0.0.0/8\", \"10.2.0.0/16\"]\n",
            "line 2",
            "overlaps",
        ),
        (
            "[server.ip]\nallow = [\"127.0.0.1/40\"]\n",
            "line 2",
            "not a CIDR",
        ),
        (
            "[server]\napi_keys = [\n  \"sk-a\",\n  { key = \"sk-b\", models = [\"gpt\"] },\n]\n",
            "line 4",
            "api_keys[1].models",
        ),
        (
            "[server.limits.per_key]\n\nconcurrent_requests = 0\n",
            "line 3",
            "concurrent_requests",
        ),
    ];
    for (i, (text, line, what)) in cases.iter().enumerate() {
        let path = tmp.path().join(format!("bad-policy-{i}.toml"));
        std::fs::write(&path, text).expect("write");
        let o = sipp(&[
            "serve",
            "--port",
            "0",
            "--config",
            path.to_str().expect("utf8"),
        ]);
        assert_eq!(o.status.code(), Some(2), "{text}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains(line) && e.contains(what), "{text}: {e}");
    }
}

/// The fields of each `sipp::step` debug event in `log`, in order (a log
/// written under `NO_COLOR`, without colour codes).
fn step_events(log: &str) -> Vec<std::collections::HashMap<String, u64>> {
    log.lines()
        .filter(|l| l.contains("sipp::step"))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|w| w.split_once('='))
                .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
                .collect()
        })
        .collect()
}

/// What `scripts/step_gain.py` prints for `log`'s steps of `slots`
/// decoding slots.
fn step_gain(log: &str, slots: usize) -> String {
    let dir = scratch();
    let path = dir.path().join("steps.log");
    std::fs::write(&path, log).unwrap();
    let python = std::env::var("SIPP_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/step_gain.py");
    let o = Command::new(python)
        .arg(script)
        .arg(&path)
        .args(["--slots", &slots.to_string()])
        .output()
        .expect("python runs");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{out}{}", stderr(&o));
    out
}

#[test]
fn step_events_add_up_to_the_stats_and_price_the_drafts() {
    default_model();
    let o = Command::new(env!("CARGO_BIN_EXE_sipp"))
        .args([
            "run",
            "-n",
            "48",
            "--temperature",
            "0",
            "--stats",
            "--speculative",
            "ngram",
            "Repeat this line twice: the quick brown fox jumps over the lazy dog.",
        ])
        .env("SIPP_LOG", "sipp::step=debug")
        .env("NO_COLOR", "1")
        .output()
        .expect("sipp runs");
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    let steps = step_events(&err);
    assert!(steps.len() >= 2, "a prefill and decode steps: {err}");
    let (mut drafted, mut accepted) = (0, 0);
    for s in &steps {
        // A decode row per slot plus its drafted tokens; only drafts accept.
        assert_eq!(s["decode_rows"], s["slots"] + s["drafted"], "{s:?}");
        assert!(s["accepted"] <= s["drafted"] && s["ns"] > 0, "{s:?}");
        drafted += s["drafted"];
        accepted += s["accepted"];
    }
    // The events add up to what the request's stats report.
    if drafted == 0 {
        assert!(!err.contains("draft acceptance"), "{err}");
    } else {
        let stats = format!("({accepted} of {drafted} drafted tokens)");
        assert!(err.contains(&stats), "{stats} in {err}");
    }
    // And the script that prices drafted steps reads them.
    let out = step_gain(&err, 1);
    let decode_steps = steps
        .iter()
        .filter(|s| s["slots"] == 1 && s["prompt_rows"] == 0)
        .count();
    let want = format!("1 slots: {decode_steps} steps, gain ");
    assert!(out.starts_with(&want), "{want} first in {out}");
    assert!(out.contains(&format!(", {drafted} drafted,")), "{out}");
}

#[test]
fn step_gain_prices_drafted_steps_at_their_neighbours_cost_per_token() {
    // Per scenario: 8-slot steps of 16 ms (2 ms a token) around one that
    // verified 8 drafted tokens, accepted 6 and took 24 ms; its 14 tokens
    // priced at 2 ms are 28 ms, so the scenario's steps gain (48 + 28) /
    // (48 + 24). Before any scenario: one undrafted step, reported since
    // `--slots` names its slot count.
    let step = |drafted: u32, accepted: u32, ms: u32| {
        format!(
            "2026-01-01T00:00:00Z DEBUG sipp::step: step slots=8 prompt_rows=0 decode_rows={} \
             drafted={drafted} accepted={accepted} ns={}\n",
            8 + drafted,
            ms * 1_000_000
        )
    };
    let mut log = step(0, 0, 16);
    for name in ["grounded x8 ngram", "generate x8 ngram"] {
        log += &format!("2026-01-01T00:00:00Z DEBUG sipp::step: scenario {name}\n");
        log += &step(0, 0, 16);
        log += &step(0, 0, 16);
        log += &step(8, 6, 24);
        log += &step(0, 0, 16);
        // A prompt step is no decode step.
        log += "2026-01-01T00:00:00Z DEBUG sipp::step: step slots=7 prompt_rows=1 \
                decode_rows=7 drafted=0 accepted=0 ns=5000000\n";
    }
    let out = step_gain(&log, 8);
    let gain = format!("{:.3}", (48.0 + 28.0) / (48.0 + 24.0));
    for name in ["grounded x8 ngram", "generate x8 ngram"] {
        let want = format!("{name}:\n8 slots: 4 steps, gain {gain}, 8 drafted, 0.75 accepted\n");
        assert!(out.contains(&want), "{want} in {out}");
    }
    assert!(
        out.starts_with("before the first scenario:\n8 slots: 1 steps, gain 1.000"),
        "{out}"
    );
}
