//! Embeds sentences with MiniLM (fetched and converted on first use) and
//! prints their cosine similarities.
//!
//!     cargo run --release --example embed

use sipp::client::{EmbedRequest, EndpointDescriptor, SippClient};
use sipp::NativeRuntimeConfig;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = NativeRuntimeConfig::default();
    config.context.embeddings = true;
    let client = SippClient::new();
    let minilm = client
        .add(
            "minilm",
            EndpointDescriptor::Local {
                model: "minilm".into(),
                config: Box::new(config),
            },
        )
        .await?;
    let sentences = [
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "A man is riding a horse.",
    ];
    let out = minilm.embed(EmbedRequest::new(sentences)).await?;
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    for i in 1..sentences.len() {
        println!(
            "{:?} ~ {:?}: {:.3}",
            sentences[0],
            sentences[i],
            dot(&out.data[0].values, &out.data[i].values)
        );
    }
    Ok(())
}
