//! OpenAI's Responses API through the official `openai` Python package
//! against the real `sipp serve`.

mod common;

use common::{run_python_client, two_model_server};

/// `client.responses`: text, instructions, retrieve, a forced call and its
/// output by `previous_response_id`, the same streamed, errors and delete
/// (tests/responses_client.py).
#[test]
fn the_openai_python_client_uses_the_responses_api() {
    let s = two_model_server("responses");
    run_python_client(
        &s,
        "SIPP_PYTHON",
        "responses_client.py",
        &["sk-local", "smol"],
        "the Responses API through the openai client failed (scripts/test.sh installs openai and jsonschema)",
    );
}
