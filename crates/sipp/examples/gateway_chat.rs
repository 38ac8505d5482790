//! A chat through a sipp server (`sipp serve`), streamed.
//!
//!     sipp serve &
//!     cargo run --release --example gateway_chat -- http://127.0.0.1:8080
//!
//! SIPP_API_KEY is sent as a Bearer token when set.

use std::io::Write;

use sipp::chat::ChatMessage;
use sipp::client::{ChatRequest, EndpointDescriptor, GatewayAuth, RunEvent, SippClient, Timeouts};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let base_url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "http://127.0.0.1:8080".into());
    let auth = std::env::var("SIPP_API_KEY").map_or(GatewayAuth::None, GatewayAuth::Bearer);
    let client = SippClient::new();
    let gw = client
        .add(
            "gw",
            EndpointDescriptor::Gateway {
                base_url,
                target: None,
                auth,
                headers: Vec::new(),
                timeouts: Timeouts::default(),
            },
        )
        .await?;
    let mut run = gw
        .chat(
            ChatRequest::new(vec![ChatMessage::user("Hello! Who are you?")])
                .max_tokens(60)
                .stream(),
        )
        .await?;
    while let Some(event) = run.next().await {
        match event {
            RunEvent::Delta(t) => {
                print!("{t}");
                std::io::stdout().flush()?;
            }
            RunEvent::Done(r) => println!("\n[{}]", r.finish_reason),
            RunEvent::Error(e) => return Err(e.into()),
            // Reasoning and tool-call pieces (this chat has no tools).
            _ => {}
        }
    }
    Ok(())
}
