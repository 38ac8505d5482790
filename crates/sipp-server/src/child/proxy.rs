//! Forwarding: a request whose body names a supervised target (or names none
//! while that target is the default) goes to the target's child process whole
//! (path, query, headers, body), and the child's answer comes back unchanged,
//! streamed. The traffic policy has already run (this middleware sits inside
//! the gate), so keys, model lists, rates and concurrency apply as for any
//! target; token-rate limits do not (the tokens are counted in the child).
//!
//! A child that cannot be reached, or dies before it answers, is a 503 in the
//! route's shape (Anthropic's on `/v1/messages`). A stream cut off by the
//! child's death ends with an error event in the route's shape, so clients
//! see why it stopped.

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderName, Method};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;

use super::ChildLink;
use crate::error::ApiError;
use crate::policy::{is_anthropic_route, refuse};
use crate::state::AppState;

/// Headers that belong to one connection, or to the caller's credentials,
/// and are never forwarded.
fn is_forwarded_header(name: &HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "host"
            | "authorization"
            | "x-api-key"
            | "content-length"
            | "connection"
            | "keep-alive"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "proxy-authorization"
    )
}

/// The body's `model`, when it is a JSON object with a string there.
#[derive(serde::Deserialize)]
struct ModelField {
    model: Option<serde_json::Value>,
}

/// The middleware: forwards requests for supervised targets, passes the rest.
pub async fn forward(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if req.method() != Method::POST || !state.has_supervised_targets() {
        return next.run(req).await;
    }
    let path = req.uri().path().to_string();
    let (parts, body) = req.into_parts();
    let limit = state.max_body_bytes;
    let bytes = match crate::routes::read_body(body, limit).await {
        Ok(b) => b,
        Err(e) => return refuse(&path, e),
    };
    let model = serde_json::from_slice::<ModelField>(&bytes)
        .ok()
        .and_then(|m| m.model);
    let forwarded = match &model {
        Some(serde_json::Value::String(s)) if !s.trim().is_empty() => {
            state.forward_link(Some(s.as_str()))
        }
        // The route answers a bad `model` itself.
        Some(_) => Ok(None),
        None => state.forward_link(None),
    };
    match forwarded {
        Ok(Some((id, link))) => send(&path, &id, &link, parts, bytes).await,
        Ok(None) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Err(e) => refuse(&path, e),
    }
}

fn unreachable_error(id: &str, e: &dyn std::fmt::Display) -> ApiError {
    ApiError::unavailable(format!(
        "the model `{id}` is unavailable: its engine process did not answer ({e}); it is restarted when it stops"
    ))
}

async fn send(
    path: &str,
    id: &str,
    link: &ChildLink,
    parts: axum::http::request::Parts,
    bytes: Bytes,
) -> Response {
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or(path, |p| p.as_str())
        .to_string();
    let mut out = link
        .client
        .post(format!("{}{path_and_query}", link.base))
        .bearer_auth(&*link.key)
        .body(bytes);
    for (name, value) in &parts.headers {
        if is_forwarded_header(name) {
            out = out.header(name, value);
        }
    }
    let upstream = match out.send().await {
        Ok(r) => r,
        Err(e) => return refuse(path, unreachable_error(id, &e)),
    };
    let mut resp = Response::builder().status(upstream.status().as_u16());
    for (name, value) in upstream.headers() {
        if is_forwarded_header(name) {
            resp = resp.header(name, value);
        }
    }
    let is_sse = upstream
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    // After an error the stream ends: a stream with an error event in the
    // route's shape (the child died mid-answer); any other body cut (its
    // length no longer adds up).
    let mut tail = Some(is_sse.then(|| stream_error(path, id)));
    let model = id.to_string();
    let body = upstream.bytes_stream().scan((), move |(), chunk| {
        std::future::ready(match chunk {
            Ok(b) => Some(Ok::<_, std::io::Error>(b)),
            Err(e) => tail.take().map(|t| {
                tracing::warn!(%model, "child answer cut: {e}");
                t.ok_or_else(|| std::io::Error::other(e))
            }),
        })
    });
    resp.body(Body::from_stream(body))
        .unwrap_or_else(|_| refuse(path, unreachable_error(id, &"bad response headers")))
}

/// The event that ends a stream the child's death cut: an error in the
/// route's shape (OpenAI's `data: {"error": ...}` then `[DONE]`, or
/// Anthropic's `event: error`).
fn stream_error(path: &str, id: &str) -> Bytes {
    let e = ApiError::unavailable(format!(
        "the model `{id}` is unavailable: its engine process stopped during the answer; it is restarted"
    ));
    let text = if is_anthropic_route(path) {
        let body = crate::routes::anthropic::error_body(&e);
        format!(
            "event: error\ndata: {}\n\n",
            serde_json::to_string(&body).unwrap_or_else(|_| "{}".into())
        )
    } else {
        format!(
            "data: {}\n\ndata: [DONE]\n\n",
            serde_json::to_string(&e.body()).unwrap_or_else(|_| "{}".into())
        )
    };
    Bytes::from(text)
}
