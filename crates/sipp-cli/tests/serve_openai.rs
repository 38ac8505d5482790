//! The official `openai` Python package against the real `sipp serve`.

mod common;

use common::{two_model_config, Server};

#[test]
fn the_openai_python_client_works_against_sipp() {
    let dir = std::env::temp_dir().join(format!("sipp-openai-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let cfg = two_model_config(&dir, "api_keys = [\"sk-local\"]");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let python = std::env::var("SIPP_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = common::manifest_dir().join("tests/openai_client.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(&s.base)
        .arg("sk-local")
        .output()
        .expect("python runs");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
        "openai client failed (scripts/test.sh installs the openai package):\nstdout: {}\nstderr: {}\nserver: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        s.log()
    );
}
