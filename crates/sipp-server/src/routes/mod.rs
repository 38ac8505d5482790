//! The HTTP routes, the JSON extractor, and the streaming driver they share.

pub mod anthropic;
pub mod dashboard;
pub mod infill;
pub mod lora;
pub mod native;
pub mod openai;
pub mod ops;
pub mod remote;
pub mod rerank;
pub mod responses;
pub mod slots;
pub mod web;
pub mod worker;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Instant;

use axum::extract::{FromRequest, MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::Response;
use futures::stream::{self, BoxStream, Stream, StreamExt};
use serde::de::DeserializeOwned;
use sipp::engine::{Completion, RequestEvent, RequestHandle, TextDelta};

use crate::error::ApiError;
use crate::state::AppState;

/// How much of a body over the limit is read and discarded before the 413 is
/// sent. A server that answers while the client is still sending, then closes,
/// makes the client's kernel reset the connection, and the client sees "error
/// sending request" instead of the 413 (a CI run caught it with a 10 MB
/// prompt); reading the rest first lets the answer arrive. Larger bodies are
/// cut off at this point.
const DRAIN_MAX_BYTES: usize = 64 * 1024 * 1024;

/// Reads a request body of at most `limit` bytes; a longer one is a 413,
/// answered after reading the body (up to [`DRAIN_MAX_BYTES`]).
pub(crate) async fn read_body(
    body: axum::body::Body,
    limit: usize,
) -> Result<axum::body::Bytes, ApiError> {
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        // A body that breaks off is answered as too large only when it was.
        let Ok(data) = chunk else {
            break;
        };
        seen += data.len();
        if seen <= limit {
            buf.extend_from_slice(&data);
        } else if seen > DRAIN_MAX_BYTES {
            break;
        }
    }
    if seen > limit {
        return Err(ApiError::too_large(limit));
    }
    Ok(buf.into())
}

/// A JSON body, read with the server's size limit; every failure is an
/// OpenAI-shaped error (413 for size, 400 otherwise).
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let bytes = read_body(req.into_body(), state.max_body_bytes).await?;
        if bytes.is_empty() {
            return Err(ApiError::bad_request(
                "the request body is empty; send a JSON object",
            ));
        }
        parse_body(&bytes).map(ApiJson)
    }
}

/// Parses a JSON body. Syntax errors are 400 "invalid JSON body"; a value of
/// the wrong type is a 400 naming its field in `param` (as OpenAI does), found
/// by its path, or, for fields flattened into the request (where serde loses
/// the path), as the one top-level key whose removal changes the error.
fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let (path, inner) = match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Ok(v) => match de.end() {
            Ok(()) => return Ok(v),
            Err(e) => (String::new(), e),
        },
        Err(e) => (e.path().to_string(), e.into_inner()),
    };
    if !inner.is_data() {
        return Err(ApiError::bad_request(format!("invalid JSON body: {inner}")));
    }
    let message = inner.to_string();
    let missing = message
        .strip_prefix("missing field `")
        .and_then(|m| m.split('`').next());
    let field = match missing {
        // A required field: name it (under its parent's path when nested).
        Some(name) if path.is_empty() || path == "." => Some(name.to_string()),
        _ if path.is_empty() || path == "." || path.contains('?') => culprit::<T>(bytes),
        _ => Some(path),
    };
    Err(match field {
        Some(f) => ApiError::bad_field(&f, inner.to_string()),
        None => ApiError::bad_request(format!("invalid JSON body: {inner}")),
    })
}

/// The top-level key of a JSON object body without which deserializing `T`
/// no longer fails the same way: the field that holds the bad value.
/// Bodies over 64 KiB are not searched (each try copies the body).
fn culprit<T: DeserializeOwned>(bytes: &[u8]) -> Option<String> {
    if bytes.len() > 64 * 1024 {
        return None;
    }
    let serde_json::Value::Object(map) = serde_json::from_slice(bytes).ok()? else {
        return None;
    };
    let error_without = |key: Option<&str>| {
        let mut m = map.clone();
        if let Some(k) = key {
            m.remove(k);
        }
        serde_json::from_value::<T>(serde_json::Value::Object(m))
            .err()
            .map(|e| e.to_string())
    };
    let message = error_without(None)?;
    // Removing a required field fails differently, but does not make it the
    // culprit.
    let still_fails = |key: &str| {
        error_without(Some(key)).is_some_and(|e| e == message || e.starts_with("missing field"))
    };
    let mut found = map.keys().filter(|k| !still_fails(k));
    match (found.next(), found.next()) {
        (Some(k), None) => Some(k.clone()),
        _ => None,
    }
}

/// Counts every exchange by route and status.
pub async fn record_metrics(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let start = Instant::now();
    let resp = next.run(req).await;
    state.metrics.record_request(
        &route,
        resp.status().as_u16(),
        start.elapsed().as_secs_f64(),
    );
    resp
}

/// What a streaming route sees from its requests.
pub enum StreamItem {
    /// New text for choice `index`.
    Delta(usize, TextDelta),
    /// Choice `index` finished.
    Finished(usize, Completion),
    /// Choice `index` failed.
    Failed(usize, ApiError),
}

/// The events of several requests, interleaved as they arrive.
fn merged(handles: Vec<RequestHandle>) -> BoxStream<'static, StreamItem> {
    let streams = handles.into_iter().enumerate().map(|(i, h)| {
        stream::unfold(Some(h), move |h| async move {
            let mut h = h?;
            loop {
                match h.next_event().await? {
                    RequestEvent::Delta(d) => return Some((StreamItem::Delta(i, d), Some(h))),
                    RequestEvent::Finished(c) => return Some((StreamItem::Finished(i, c), None)),
                    RequestEvent::Failed(e) => {
                        return Some((StreamItem::Failed(i, e.into()), None))
                    }
                    RequestEvent::Embedding(_) => {
                        return Some((
                            StreamItem::Failed(i, ApiError::bad_request("unexpected embedding")),
                            None,
                        ))
                    }
                    RequestEvent::Started => {}
                }
            }
        })
        .boxed()
    });
    stream::select_all(streams).boxed()
}

/// Drives a server-sent event stream: `render` turns each item into events,
/// `tail` adds the closing events once every request has ended. Dropping the
/// stream (the client left) drops the handles, which cancels the requests.
pub fn sse<R, T>(
    handles: Vec<RequestHandle>,
    render: R,
    tail: T,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>>
where
    R: FnMut(StreamItem) -> Vec<Event> + Send + 'static,
    T: FnOnce() -> Vec<Event> + Send + 'static,
{
    struct Driver<R, T> {
        items: BoxStream<'static, StreamItem>,
        render: R,
        tail: Option<T>,
        pending: VecDeque<Event>,
    }
    let driver = Driver {
        items: merged(handles),
        render,
        tail: Some(tail),
        pending: VecDeque::new(),
    };
    let s = stream::unfold(driver, |mut d| async move {
        loop {
            if let Some(e) = d.pending.pop_front() {
                return Some((Ok(e), d));
            }
            match d.items.next().await {
                Some(item) => d.pending.extend((d.render)(item)),
                None => match d.tail.take() {
                    Some(t) => d.pending.extend(t()),
                    None => return None,
                },
            }
        }
    });
    Sse::new(s).keep_alive(KeepAlive::default())
}

/// An SSE `data:` event holding JSON.
pub fn json_event<T: serde::Serialize>(v: &T) -> Event {
    Event::default().data(serde_json::to_string(v).unwrap_or_else(|_| "{}".into()))
}

/// Unix seconds now.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A short random-looking id with a prefix.
pub fn new_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{prefix}-{:016x}", h.finish())
}
