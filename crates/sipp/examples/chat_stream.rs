//! A chat on the default model, streaming the answer as it is generated.
//!
//!     cargo run --release --example chat_stream

use std::io::Write;

use sipp::chat::ChatMessage;
use sipp::client::{ChatRequest, EndpointDescriptor, RunEvent, SippClient};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = SippClient::new();
    let local = client
        .add("local", EndpointDescriptor::local("default"))
        .await?;
    let messages = vec![
        ChatMessage::system("You are a concise assistant."),
        ChatMessage::user("Give me three tips for learning Rust."),
    ];
    let mut run = local
        .chat(ChatRequest::new(messages).max_tokens(120).stream())
        .await?;
    while let Some(event) = run.next().await {
        match event {
            RunEvent::Delta(text) => {
                print!("{text}");
                std::io::stdout().flush()?;
            }
            RunEvent::Done(r) => println!(
                "\n[{} tokens, {}]",
                r.usage.completion_tokens, r.finish_reason
            ),
            RunEvent::Error(e) => return Err(e.into()),
            // Reasoning and tool-call pieces (this chat has no tools).
            _ => {}
        }
    }
    Ok(())
}
