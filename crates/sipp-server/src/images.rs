//! http(s) image URLs in requests, fetched when the server allows it
//! (`--fetch-image-urls`, `server.fetch_image_urls`): each becomes a data URL
//! before the engine reads it, under a time and size limit. Off by default:
//! the engine then refuses such a URL with a 400 that says how to allow it.

use base64::Engine as _;
use sipp::chat::{ChatMessage, ContentPart, MessageContent};

use crate::error::ApiError;
use crate::state::AppState;

fn is_remote(url: &str) -> bool {
    let u = url.trim_start();
    u.starts_with("http://") || u.starts_with("https://")
}

/// The image URLs of chat messages.
pub fn chat_urls(messages: &mut [ChatMessage]) -> Vec<&mut String> {
    messages
        .iter_mut()
        .filter_map(|m| match &mut m.content {
            Some(MessageContent::Parts(parts)) => Some(parts),
            _ => None,
        })
        .flatten()
        .filter_map(|p| match p {
            ContentPart::ImageUrl { image_url } => Some(&mut image_url.url),
            ContentPart::Text { .. } => None,
        })
        .collect()
}

/// The `url` image sources of Anthropic messages.
pub fn anthropic_urls(
    messages: &mut [sipp::protocol::anthropic::InputMessage],
) -> Vec<&mut String> {
    use sipp::protocol::anthropic::{Content, ContentBlock};
    messages
        .iter_mut()
        .filter_map(|m| match &mut m.content {
            Content::Blocks(b) => Some(b),
            Content::Text(_) => None,
        })
        .flatten()
        .filter_map(|b| match b {
            ContentBlock::Image { source } => match source.get_mut("url") {
                Some(serde_json::Value::String(s)) => Some(s),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// The `input_image` URLs of a Responses request's input.
pub fn responses_urls(
    input: &mut Option<sipp::protocol::responses::ResponseInput>,
) -> Vec<&mut String> {
    use sipp::protocol::responses::{ContentPart, InputContent, InputItem, ResponseInput};
    let Some(ResponseInput::Items(items)) = input else {
        return Vec::new();
    };
    items
        .iter_mut()
        .filter_map(|i| match i {
            InputItem::Message(m) => match &mut m.content {
                InputContent::Parts(p) => Some(p),
                InputContent::Text(_) => None,
            },
            _ => None,
        })
        .flatten()
        .filter_map(|p| match p {
            ContentPart::InputImage {
                image_url: Some(u), ..
            } => Some(u),
            _ => None,
        })
        .collect()
}

/// Replaces each http(s) URL with a data URL of what it serves, when the
/// server fetches image URLs; leaves them otherwise (the engine refuses them).
/// `field` names the request's messages in errors.
pub async fn fetch_remote(
    state: &AppState,
    urls: Vec<&mut String>,
    field: &str,
) -> Result<(), ApiError> {
    let cfg = &state.child_server;
    if !cfg.fetch_image_urls || !urls.iter().any(|u| is_remote(u)) {
        return Ok(());
    }
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(
            cfg.image_fetch_timeout_secs.max(1),
        ))
        .build()
        .map_err(|e| ApiError::unavailable(format!("cannot build an HTTP client: {e}")))?;
    for (i, url) in urls.into_iter().enumerate() {
        if !is_remote(url) {
            continue;
        }
        let bytes = fetch(&client, url, cfg.image_fetch_max_bytes)
            .await
            .map_err(|why| {
                ApiError::bad_field(field, format!("image {i}: cannot fetch {url}: {why}"))
            })?;
        *url = format!(
            "data:application/octet-stream;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        );
    }
    Ok(())
}

async fn fetch(client: &reqwest::Client, url: &str, max: usize) -> Result<Vec<u8>, String> {
    let mut resp = client.get(url.trim()).send().await.map_err(|e| {
        if e.is_timeout() {
            "it took too long".to_string()
        } else {
            e.to_string()
        }
    })?;
    if !resp.status().is_success() {
        return Err(format!("it answered {}", resp.status()));
    }
    if resp.content_length().is_some_and(|n| n > max as u64) {
        return Err(format!("it is larger than the {max} bytes allowed"));
    }
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| {
        if e.is_timeout() {
            "it took too long".to_string()
        } else {
            e.to_string()
        }
    })? {
        out.extend_from_slice(&chunk);
        if out.len() > max {
            return Err(format!("it is larger than the {max} bytes allowed"));
        }
    }
    Ok(out)
}

/// Runs `f` (a chat preparation) so that, when it decodes and preprocesses
/// images (`heavy`), the async worker's other tasks (streams being written)
/// move to other workers meanwhile. Plain call otherwise, and on a
/// single-threaded runtime.
pub fn prepare<T>(heavy: bool, f: impl FnOnce() -> T) -> T {
    let multi = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if heavy && multi {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

/// Whether a chat preparation decodes images: the engine takes them and a
/// message has some.
pub fn heavy(engine: &sipp::Engine, messages: &[ChatMessage]) -> bool {
    engine.info().model.takes_images && messages.iter().any(|m| !m.image_urls().is_empty())
}
