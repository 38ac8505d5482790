//! The official `anthropic` Python package against the real `sipp serve`
//! (tests/anthropic_client.py): messages, streaming, a tool loop,
//! count_tokens and errors on the Messages API.

mod common;

use common::{run_python_client, Server};

#[test]
fn the_anthropic_python_client_works_against_sipp() {
    let key = "sk-anthropic";
    let s = Server::start(&["--api-key", key, "--ctx-size", "2048", "--parallel", "2"]);
    // The default model's id, as the server lists it.
    let models: serde_json::Value = reqwest::blocking::Client::new()
        .get(s.url("/v1/models"))
        .header("x-api-key", key)
        .send()
        .and_then(|r| r.json())
        .expect("models");
    let model = models["data"][0]["id"]
        .as_str()
        .expect("a model id")
        .to_string();
    run_python_client(
        &s,
        "SIPP_PYTHON",
        "anthropic_client.py",
        &[key, &model],
        "anthropic client failed (scripts/test.sh installs the anthropic package)",
    );
}
