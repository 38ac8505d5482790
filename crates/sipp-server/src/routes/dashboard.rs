//! `GET /v1/dashboard`: the operator dashboard's data (admin keys only when
//! keys are configured). JSON by default; with `Accept: text/event-stream`,
//! a server-sent event stream sending the same document once a second (each
//! event `event: state`, `data: <DashboardState JSON>`).

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream;

use crate::dashboard::SAMPLE_SECS;
use crate::state::AppState;

/// GET /v1/dashboard.
pub async fn state(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let wants_stream = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/event-stream"));
    if !wants_stream {
        return Json(state.dashboard_state()).into_response();
    }
    let events = stream::unfold((state, true), |(state, first)| async move {
        if !first {
            tokio::time::sleep(Duration::from_secs(SAMPLE_SECS)).await;
        }
        let event = Event::default()
            .event("state")
            .data(serde_json::to_string(&state.dashboard_state()).unwrap_or_else(|_| "{}".into()));
        Some((Ok::<_, Infallible>(event), (state, false)))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
