//! Slot persistence on the real `sipp serve` and default model:
//! llama-server's `POST /slots/{id}?action=save|restore|erase` and the
//! native profile's `POST /v1/sessions/{key}?action=...`. A conversation
//! saved, erased and restored continues as on a server where nothing
//! happened to it (greedy, up to a near-tie: see DESIGN.md), reusing the
//! restored KV; erased KV is reused by nothing; bad names, other models'
//! files and busy slots are refused.

mod common;

use common::{eventually, Server};
use reqwest::blocking::Client;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The largest top-2 logit gap at which two batchings may pick differently.
const NEAR_TIE: f32 = 1.0;

const SYSTEM: &str = "The following is a conversation between a patient librarian and a \
    visitor who wants to learn about the history of printing in Europe, from movable type \
    to the newspapers of the eighteenth century.";

fn post(c: &Client, s: &Server, path: &str, body: Option<Value>) -> (u16, Value) {
    let mut r = c.post(s.url(path));
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().expect("request");
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

/// A greedy /v1/query with the top-2 log-probabilities of every token.
fn query(c: &Client, s: &Server, prompt: &str, n: u32) -> Value {
    let (st, v) = post(
        c,
        s,
        "/v1/query",
        Some(json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 2})),
    );
    assert_eq!(st, 200, "{v}");
    v
}

/// A greedy /v1/chat turn pinned to `key`.
fn chat(c: &Client, s: &Server, key: &str, messages: &Value, n: u32) -> Value {
    let (st, v) = post(
        c,
        s,
        "/v1/chat",
        Some(
            json!({"messages": messages, "max_tokens": n, "temperature": 0,
                    "logprobs": 2, "context_key": key}),
        ),
    );
    assert_eq!(st, 200, "{v}");
    v
}

fn cached(v: &Value) -> u64 {
    v["usage"]["cached_tokens"].as_u64().expect("cached_tokens")
}

fn tokens(v: &Value) -> Vec<i64> {
    v["logprobs"]
        .as_array()
        .expect("logprobs")
        .iter()
        .map(|l| l["token"].as_i64().expect("token"))
        .collect()
}

/// The top-2 gap at generated token `i`.
fn gap(v: &Value, i: usize) -> f32 {
    let top = v["logprobs"][i]["top"].as_array().expect("top");
    let lp = |k: usize| top[k][1].as_f64().expect("logprob") as f32;
    lp(0) - lp(1)
}

/// The two greedy outputs agree up to their first difference, and there
/// the model was at a near-tie.
fn assert_same_up_to_near_tie(reference: &Value, other: &Value, what: &str) {
    let (a, b) = (tokens(reference), tokens(other));
    let n = a.len().min(b.len());
    let at = (0..n)
        .find(|&i| a[i] != b[i])
        .or((a.len() != b.len()).then_some(n));
    if let Some(i) = at {
        let g = [reference, other]
            .iter()
            .filter(|v| i < tokens(v).len())
            .map(|v| gap(v, i))
            .fold(f32::INFINITY, f32::min);
        assert!(
            g <= NEAR_TIE,
            "{what}: outputs diverge at token {i} where the top-2 gap is {g}:\n{}\nvs\n{}",
            reference["text"],
            other["text"]
        );
    }
}

/// A folder that does not exist yet, inside a new temporary one (removed
/// when the handle drops).
fn fresh_dir(tag: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = common::temp_dir(&format!("slots-{tag}"));
    let dir = tmp.path().join("slots");
    (tmp, dir)
}

fn serve_saving(dir: &Path, extra: &[&str]) -> Server {
    let mut args = vec![
        "--parallel",
        "2",
        "--slot-save-path",
        dir.to_str().expect("utf8"),
    ];
    args.extend_from_slice(extra);
    Server::start(&args)
}

fn assert_error(st: u16, v: &Value, status: u16, mentions: &str, what: &str) {
    assert_eq!(st, status, "{what}: {v}");
    assert!(v["error"]["type"].is_string(), "{what}: {v}");
    let m = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        v["error"]["param"].as_str() == Some(mentions) || m.contains(mentions),
        "{what}: expected a mention of {mentions:?}: {v}"
    );
}

#[test]
fn a_saved_slot_is_erased_restored_and_the_conversation_continues() {
    let c = Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .expect("client");
    let ask =
        format!("{SYSTEM}\nVisitor: Who printed the first book with movable type?\nLibrarian:");

    // The reference: both turns on a server where nothing is saved or erased
    // (the second reusing the first's KV, as it does after a restore).
    let (first_ref, second_ref, continued) = {
        let r = Server::start(&["--parallel", "2"]);
        let first = query(&c, &r, &ask, 16);
        let continued = format!(
            "{ask}{}\nVisitor: And what did he print next?\nLibrarian:",
            first["text"].as_str().expect("text")
        );
        let second = query(&c, &r, &continued, 16);
        assert!(
            cached(&second) > 0,
            "the reference reused turn one: {second}"
        );
        // Without --slot-save-path there is nothing to save to.
        let (st, v) = post(
            &c,
            &r,
            "/slots/0?action=save",
            Some(json!({"filename": "a.bin"})),
        );
        assert_error(st, &v, 501, "slot-save-path", "save without a directory");
        (first, second, continued)
    };

    let (_tmp, dir) = fresh_dir("continue");
    let s = serve_saving(&dir, &[]);
    let first = query(&c, &s, &ask, 16);
    assert_same_up_to_near_tie(&first_ref, &first, "turn one");

    // Save: the slot's prompt and answer (all but the last token, which was
    // never fed back) go to the file.
    let (st, saved) = post(
        &c,
        &s,
        "/slots/0?action=save",
        Some(json!({"filename": "turn1.bin"})),
    );
    assert_eq!(st, 200, "{saved}");
    let n_saved = saved["n_saved"].as_u64().expect("n_saved");
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().expect("prompt");
    assert!(n_saved >= prompt_tokens, "{saved} after {first}");
    assert_eq!(saved["id_slot"], 0);
    assert_eq!(saved["filename"], "turn1.bin");
    let file = dir.join("turn1.bin");
    assert_eq!(
        saved["n_written"].as_u64(),
        Some(std::fs::metadata(&file).expect("saved file").len())
    );
    assert!(saved["timings"]["save_ms"].is_number(), "{saved}");

    // Erase: the next request reuses nothing.
    let (st, erased) = post(&c, &s, "/slots/0?action=erase", None);
    assert_eq!(
        (st, erased["n_erased"].as_u64()),
        (200, Some(n_saved)),
        "{erased}"
    );
    let cold = query(&c, &s, &continued, 16);
    assert_eq!(cached(&cold), 0, "erased KV was reused: {cold}");
    assert_same_up_to_near_tie(&second_ref, &cold, "turn two, computed cold");
    for slot in 0..2 {
        let (st, v) = post(&c, &s, &format!("/slots/{slot}?action=erase"), None);
        assert_eq!(st, 200, "{v}");
    }

    // Restore, then continue: the restored KV is reused, and the answer is
    // the reference's.
    let (st, restored) = post(
        &c,
        &s,
        "/slots/0?action=restore",
        Some(json!({"filename": "turn1.bin"})),
    );
    assert_eq!(st, 200, "{restored}");
    assert_eq!(restored["n_restored"].as_u64(), Some(n_saved), "{restored}");
    assert_eq!(restored["n_read"], saved["n_written"]);
    assert_eq!(restored["id_slot"], 0);
    assert!(restored["timings"]["restore_ms"].is_number(), "{restored}");
    let second = query(&c, &s, &continued, 16);
    // (All of turn one's prompt but, where the answer's first token merges
    // with the prompt's last when the text is tokenized again, that one.)
    assert!(
        cached(&second) + 1 >= prompt_tokens,
        "the restored KV was not reused: {second}"
    );
    assert_same_up_to_near_tie(&second_ref, &second, "turn two after a restore");

    // A file whose fingerprint is another model's is refused.
    let mut bytes = std::fs::read(&file).expect("read");
    let fp_len = u32::from_le_bytes(bytes[8..12].try_into().expect("len")) as usize;
    assert!(fp_len > 0);
    bytes[12] = if bytes[12] == b'x' { b'y' } else { b'x' };
    std::fs::write(dir.join("other.bin"), &bytes).expect("write");
    let (st, v) = post(
        &c,
        &s,
        "/slots/1?action=restore",
        Some(json!({"filename": "other.bin"})),
    );
    assert_error(st, &v, 400, "filename", "another model's file");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("another model"),
        "{v}"
    );

    // Names outside the directory, missing files, unknown slots and actions.
    for name in ["../turn1.bin", "sub/turn1.bin", "..", "a\\b", ""] {
        for action in ["save", "restore"] {
            let (st, v) = post(
                &c,
                &s,
                &format!("/slots/0?action={action}"),
                Some(json!({"filename": name})),
            );
            assert_error(st, &v, 400, "filename", &format!("{action} {name:?}"));
        }
    }
    assert!(!dir.parent().expect("parent").join("turn1.bin").exists());
    let (st, v) = post(
        &c,
        &s,
        "/slots/0?action=restore",
        Some(json!({"filename": "missing.bin"})),
    );
    assert_error(st, &v, 404, "filename", "a missing file");
    let (st, v) = post(&c, &s, "/slots/2?action=erase", None);
    assert_error(st, &v, 400, "id_slot", "slot out of range");
    let (st, v) = post(&c, &s, "/slots/0?action=compact", None);
    assert_error(st, &v, 400, "action", "unknown action");

    // A slot serving a request is left alone.
    let base = s.base.clone();
    let long = std::thread::spawn(move || {
        Client::builder()
            .timeout(Duration::from_secs(300))
            .build()
            .expect("client")
            .post(format!("{base}/v1/query"))
            .json(
                &json!({"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": true}),
            )
            .send()
            .map(|r| r.status().as_u16())
    });
    assert!(
        eventually(Duration::from_secs(30), || {
            c.get(s.url("/slots"))
                .send()
                .and_then(|r| r.json::<Value>())
                .is_ok_and(|v| v[0]["is_processing"] == true)
        }),
        "the long request never took slot 0"
    );
    let (st, v) = post(
        &c,
        &s,
        "/slots/0?action=save",
        Some(json!({"filename": "busy.bin"})),
    );
    assert_error(st, &v, 409, "processing", "save of a busy slot");
    let (st, v) = post(&c, &s, "/slots/0?action=erase", None);
    assert_error(st, &v, 409, "processing", "erase of a busy slot");
    assert_eq!(long.join().expect("thread").expect("answered"), 200);
    assert!(!dir.join("busy.bin").exists());
    assert_eq!(s.metric("sipp_idle_invariant_violations_total{"), Some(0.0));
}

#[test]
fn a_session_is_saved_and_restored_by_its_context_key() {
    let c = Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .expect("client");
    let turn_one = json!([
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Who printed the first book with movable type?"}
    ]);
    let turn_two = |answer: &Value| {
        json!([
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Who printed the first book with movable type?"},
            {"role": "assistant", "content": answer["text"]},
            {"role": "user", "content": "And what did he print next?"}
        ])
    };

    let (first_ref, second_ref) = {
        let r = Server::start(&["--parallel", "2"]);
        let first = chat(&c, &r, "visitor", &turn_one, 16);
        let second = chat(&c, &r, "visitor", &turn_two(&first), 16);
        (first, second)
    };

    let (_tmp, dir) = fresh_dir("session");
    let s = serve_saving(&dir, &[]);
    let first = chat(&c, &s, "visitor", &turn_one, 16);
    assert_same_up_to_near_tie(&first_ref, &first, "session turn one");
    let path = "/v1/sessions/visitor";
    let (st, saved) = post(
        &c,
        &s,
        &format!("{path}?action=save"),
        Some(json!({"filename": "visitor.bin"})),
    );
    assert_eq!(st, 200, "{saved}");
    assert_eq!(saved["context_key"], "visitor");
    let n_saved = saved["n_saved"].as_u64().expect("n_saved");
    assert!(n_saved >= first["usage"]["prompt_tokens"].as_u64().expect("prompt"));
    let (st, erased) = post(&c, &s, &format!("{path}?action=erase"), None);
    assert_eq!(
        (st, erased["n_erased"].as_u64()),
        (200, Some(n_saved)),
        "{erased}"
    );
    // Erased: nothing is left to save under the key.
    let (st, v) = post(
        &c,
        &s,
        &format!("{path}?action=save"),
        Some(json!({"filename": "x.bin"})),
    );
    assert_error(st, &v, 404, "context_key", "save of an erased session");
    let (st, restored) = post(
        &c,
        &s,
        &format!("{path}?action=restore"),
        Some(json!({"filename": "visitor.bin"})),
    );
    assert_eq!(st, 200, "{restored}");
    assert_eq!(restored["n_restored"].as_u64(), Some(n_saved));
    let second = chat(&c, &s, "visitor", &turn_two(&first_ref), 16);
    assert!(
        cached(&second) >= first["usage"]["prompt_tokens"].as_u64().expect("prompt"),
        "the restored session was not reused: {second}"
    );
    assert_same_up_to_near_tie(&second_ref, &second, "session turn two after a restore");
    // Bad names are refused here too; a key with nothing resident is a 404.
    let (st, v) = post(
        &c,
        &s,
        &format!("{path}?action=restore"),
        Some(json!({"filename": "../visitor.bin"})),
    );
    assert_error(
        st,
        &v,
        400,
        "filename",
        "session restore outside the directory",
    );
    let (st, v) = post(
        &c,
        &s,
        "/v1/sessions/nobody?action=save",
        Some(json!({"filename": "n.bin"})),
    );
    assert_error(st, &v, 404, "context_key", "an unknown session");
    assert_eq!(s.metric("sipp_idle_invariant_violations_total{"), Some(0.0));
}

#[test]
fn a_slot_saved_by_one_model_is_refused_by_another() {
    let c = Client::new();
    let (_tmp, dir) = fresh_dir("models");
    {
        let s = serve_saving(&dir, &[]);
        query(&c, &s, &format!("{SYSTEM}\nVisitor: Hello.\nLibrarian:"), 4);
        let (st, v) = post(
            &c,
            &s,
            "/slots/0?action=save",
            Some(json!({"filename": "smol.bin"})),
        );
        assert_eq!(st, 200, "{v}");
    }
    let fetch = std::process::Command::new(env!("CARGO_BIN_EXE_sipp"))
        .args(["models", "fetch", "gemma3"])
        .output()
        .expect("fetch");
    assert!(
        fetch.status.success(),
        "{}",
        String::from_utf8_lossy(&fetch.stderr)
    );
    let g = serve_saving(&dir, &["--model", "gemma3"]);
    let (st, v) = post(
        &c,
        &g,
        "/slots/0?action=restore",
        Some(json!({"filename": "smol.bin"})),
    );
    assert_error(st, &v, 400, "filename", "another model's slot");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("another model"),
        "{v}"
    );
    // Nothing was restored.
    let (st, v) = post(
        &c,
        &g,
        "/slots/0?action=save",
        Some(json!({"filename": "g.bin"})),
    );
    assert_error(st, &v, 400, "id_slot", "save of an empty slot");
}

#[test]
fn slot_files_come_from_the_config_and_take_an_admin_key() {
    let c = Client::new();
    let (_tmp, dir) = fresh_dir("keys");
    std::fs::create_dir_all(&dir).expect("dir");
    let files = dir.join("files");
    let cfg = dir.join("sipp.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nslot_save_path = {:?}\napi_keys = [\"sk-admin\", {{ key = \"sk-user\", role = \"user\" }}]\n",
            files.to_str().expect("utf8")
        ),
    )
    .expect("config");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let send = |key: &str, path: &str, body: Value| {
        let r = c
            .post(s.url(path))
            .bearer_auth(key)
            .json(&body)
            .send()
            .expect("request");
        (
            r.status().as_u16(),
            r.json::<Value>().unwrap_or(Value::Null),
        )
    };
    let (st, v) = send(
        "sk-user",
        "/v1/query",
        json!({"prompt": format!("{SYSTEM}\nVisitor: Hello.\nLibrarian:"), "max_tokens": 4}),
    );
    assert_eq!(st, 200, "{v}");
    for path in ["/slots/0?action=save", "/v1/sessions/k?action=save"] {
        let (st, v) = send("sk-user", path, json!({"filename": "u.bin"}));
        assert_eq!(st, 403, "a user key on {path}: {v}");
    }
    let (st, v) = send(
        "sk-admin",
        "/slots/0?action=save",
        json!({"filename": "a.bin"}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(files.join("a.bin").is_file(), "saved under slot_save_path");
    assert!(!files.join("u.bin").exists());
}
