//! Golden tests: sipp renders chat templates exactly as Hugging Face
//! transformers does. `fixtures/chat/expected.json` comes from
//! `scripts/chat_golden.py`, which renders each fixture with transformers' own
//! `render_jinja_template` (the code behind `apply_chat_template`); the last
//! test re-runs that script to show the file is current.

mod common;

use std::path::PathBuf;

use sipp::chat::{ChatError, ChatMessage, ChatTemplate};

fn fixtures() -> PathBuf {
    common::manifest_dir().join("tests/fixtures/chat")
}

fn load(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join(name)).expect("fixture"))
        .expect("json")
}

#[test]
fn every_template_matches_transformers() {
    let spec = load("cases.json");
    let expected = load("expected.json");
    let mut checked = 0;
    for (name, t) in spec["templates"].as_object().expect("templates") {
        let source = std::fs::read_to_string(fixtures().join(t["file"].as_str().expect("file")))
            .expect("template");
        let template = ChatTemplate::new(
            &source,
            t["bos_token"].as_str().expect("bos"),
            t["eos_token"].as_str().expect("eos"),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (case, c) in spec["cases"].as_object().expect("cases") {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(c["messages"].clone()).expect("messages");
            let add = c["add_generation_prompt"].as_bool().expect("bool");
            let want = &expected[name][case];
            match (
                template.render(&messages, add),
                want.get("ok"),
                want.get("error"),
            ) {
                (Ok(text), Some(ok), _) => {
                    assert_eq!(text, ok.as_str().expect("text"), "{name}/{case}")
                }
                (Err(ChatError::Raised(msg)), _, Some(err)) => {
                    assert_eq!(msg, err.as_str().expect("text"), "{name}/{case}")
                }
                (got, _, _) => panic!("{name}/{case}: got {got:?}, expected {want}"),
            }
            checked += 1;
        }
    }
    assert!(checked >= 20, "{checked} renderings checked");
}

#[test]
fn golden_file_is_what_transformers_renders_now() {
    let python = std::env::var("SIPP_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = common::manifest_dir().join("../../scripts/chat_golden.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(fixtures())
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{python} {}: {} (scripts/test.sh installs transformers into the test venv)",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let now: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(now, load("expected.json"));
}
