//! The official `openai` Python package against the real `sipp serve`.

mod common;

use common::{run_python_client, two_model_server};

#[test]
fn the_openai_python_client_works_against_sipp() {
    let s = two_model_server("openai");
    run_python_client(
        &s,
        "SIPP_PYTHON",
        "openai_client.py",
        &["sk-local"],
        "openai client failed (scripts/test.sh installs the openai package)",
    );
}

/// Tool calls through the official `openai` package: forced calls over 30
/// seeds at temperature 1, a two-turn loop streamed and not, `auto`, `none`,
/// and bad tool input (tests/tools_client.py).
#[test]
fn the_openai_python_client_calls_tools_through_sipp() {
    let s = two_model_server("openai-tools");
    run_python_client(
        &s,
        "SIPP_PYTHON",
        "tools_client.py",
        &["sk-local", "smol"],
        "tool calls through the openai client failed (scripts/test.sh installs openai and jsonschema)",
    );
}

/// An agent framework from PyPI (openai-agents, in its own venv since it
/// needs a newer openai package) runs tool loops against sipp unmodified
/// (tests/agents_client.py).
#[test]
fn an_agent_framework_runs_a_tool_loop_against_sipp() {
    let s = two_model_server("agents");
    run_python_client(
        &s,
        "SIPP_AGENTS_PYTHON",
        "agents_client.py",
        &["sk-local", "smol"],
        "the agent framework's tool loop failed (scripts/test.sh installs openai-agents into $SIPP_AGENTS_VENV)",
    );
}
