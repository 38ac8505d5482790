//! The HTTP routes, the JSON extractor, and the streaming driver they share.

pub mod native;
pub mod openai;
pub mod ops;
pub mod remote;

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

/// A JSON body, read with the server's size limit; every failure is an
/// OpenAI-shaped error (413 for size, 400 otherwise).
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let limit = state.max_body_bytes;
        let bytes = axum::body::to_bytes(req.into_body(), limit)
            .await
            .map_err(|_| ApiError::too_large(limit))?;
        if bytes.is_empty() {
            return Err(ApiError::bad_request(
                "the request body is empty; send a JSON object",
            ));
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
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
