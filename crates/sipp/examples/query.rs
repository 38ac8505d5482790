//! Completes a prompt on the default model in this process.
//!
//!     cargo run --release --example query -- "The capital of France is"

use sipp::client::{EndpointDescriptor, QueryRequest, SippClient};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let prompt = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "The capital of France is".into());
    let client = SippClient::new();
    let local = client
        .add("local", EndpointDescriptor::local("default"))
        .await?;
    let answer = local
        .query(QueryRequest::new(prompt).max_tokens(16).temperature(0.0))
        .await?
        .response()
        .await?;
    println!("{}", answer.text);
    eprintln!(
        "{} prompt tokens, {} generated, finish: {}",
        answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.finish_reason
    );
    Ok(())
}
