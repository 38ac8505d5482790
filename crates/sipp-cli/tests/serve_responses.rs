//! OpenAI's Responses API through the official `openai` Python package
//! against the real `sipp serve`.

mod common;

use common::{two_model_config, Server};

/// `client.responses`: text, instructions, retrieve, a forced call and its
/// output by `previous_response_id`, the same streamed, errors and delete
/// (tests/responses_client.py).
#[test]
fn the_openai_python_client_uses_the_responses_api() {
    let dir = std::env::temp_dir().join(format!("sipp-responses-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let cfg = two_model_config(&dir, "api_keys = [\"sk-local\"]");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let python = std::env::var("SIPP_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = common::manifest_dir().join("tests/responses_client.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(&s.base)
        .arg("sk-local")
        .arg("smol")
        .output()
        .expect("python runs");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
        "the Responses API through the openai client failed (scripts/test.sh installs openai and jsonschema):\nstdout: {}\nstderr: {}\nserver: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        s.log()
    );
}
