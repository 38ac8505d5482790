//! A chat with a remote provider.
//!
//!     OPENAI_API_KEY=... cargo run --release --example provider_chat -- openai gpt-4o-mini
//!     ANTHROPIC_API_KEY=... cargo run --release --example provider_chat -- anthropic claude-3-5-haiku-latest
//!     OPENAI_BASE_URL=http://127.0.0.1:8080/v1 cargo run --release --example provider_chat -- compatible default

use sipp::chat::ChatMessage;
use sipp::client::{ChatRequest, EndpointDescriptor, ProviderKind, SippClient, Timeouts};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (kind, key_var) = match args.next().as_deref() {
        Some("anthropic") => (ProviderKind::Anthropic, "ANTHROPIC_API_KEY"),
        Some("compatible") => (ProviderKind::OpenAiCompatible, "OPENAI_API_KEY"),
        _ => (ProviderKind::OpenAi, "OPENAI_API_KEY"),
    };
    let model = args.next().unwrap_or_else(|| "gpt-4o-mini".into());
    let client = SippClient::new();
    let ep = client
        .add(
            "provider",
            EndpointDescriptor::Provider {
                kind,
                base_url: std::env::var("OPENAI_BASE_URL")
                    .ok()
                    .filter(|_| kind != ProviderKind::Anthropic),
                api_key: std::env::var(key_var).ok(),
                model,
                headers: Vec::new(),
                timeouts: Timeouts::default(),
                max_retries: 2,
            },
        )
        .await?;
    let messages = vec![
        ChatMessage::system("Answer in one sentence."),
        ChatMessage::user("What is Rust?"),
    ];
    let answer = ep
        .chat(ChatRequest::new(messages).max_tokens(80))
        .await?
        .response()
        .await?;
    println!("{}", answer.text);
    Ok(())
}
