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

/// Tool calls through the official `openai` package: forced calls over 30
/// seeds at temperature 1, a two-turn loop streamed and not, `auto`, `none`,
/// and bad tool input (tests/tools_client.py).
#[test]
fn the_openai_python_client_calls_tools_through_sipp() {
    let dir = std::env::temp_dir().join(format!("sipp-openai-tools-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let cfg = two_model_config(&dir, "api_keys = [\"sk-local\"]");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let python = std::env::var("SIPP_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = common::manifest_dir().join("tests/tools_client.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(&s.base)
        .arg("sk-local")
        .arg("smol")
        .output()
        .expect("python runs");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
        "tool calls through the openai client failed (scripts/test.sh installs openai and jsonschema):\nstdout: {}\nstderr: {}\nserver: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        s.log()
    );
}

/// An agent framework from PyPI (openai-agents, in its own venv since it
/// needs a newer openai package) runs tool loops against sipp unmodified
/// (tests/agents_client.py).
#[test]
fn an_agent_framework_runs_a_tool_loop_against_sipp() {
    let dir = std::env::temp_dir().join(format!("sipp-agents-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let cfg = two_model_config(&dir, "api_keys = [\"sk-local\"]");
    let s = Server::start(&["--config", cfg.to_str().expect("utf8")]);
    let python = std::env::var("SIPP_AGENTS_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = common::manifest_dir().join("tests/agents_client.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(&s.base)
        .arg("sk-local")
        .arg("smol")
        .output()
        .expect("python runs");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
        "the agent framework's tool loop failed (scripts/test.sh installs openai-agents into $SIPP_AGENTS_VENV):\nstdout: {}\nstderr: {}\nserver: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        s.log()
    );
}
