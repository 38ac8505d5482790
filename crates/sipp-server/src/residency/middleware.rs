//! The middleware that brings a request's model into memory before its
//! route runs, and holds a lease on it until the response body ends (a
//! stream too), so the model is not unloaded under it.
//!
//! It reads a POST body's `model` (the default model when absent, aliases
//! resolved) only while [`super::Residency::engaged`]; otherwise requests
//! pass untouched. A body that is not a JSON object, or a `model` that is
//! not a string, unknown, or not the caller's to use, passes to its route,
//! which answers the error.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;

use crate::policy::refuse;
use crate::state::AppState;

/// The body's `model`, when it is a JSON object.
#[derive(serde::Deserialize)]
struct ModelField {
    model: Option<serde_json::Value>,
}

/// The admin routes that load and unload models themselves.
pub(crate) fn is_model_admin_route(path: &str) -> bool {
    path == "/models/load" || path == "/models/unload"
}

/// The middleware.
pub async fn ensure_loaded(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if req.method() != Method::POST || !state.residency.engaged() {
        return next.run(req).await;
    }
    let path = req.uri().path().to_string();
    if is_model_admin_route(&path) {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let limit = state.max_body_bytes;
    let bytes = match crate::routes::read_body(body, limit).await {
        Ok(b) => b,
        Err(e) => return refuse(&path, e),
    };
    let named = match serde_json::from_slice::<ModelField>(&bytes) {
        Ok(ModelField { model: None }) => None,
        Ok(ModelField {
            model: Some(serde_json::Value::String(s)),
        }) if !s.trim().is_empty() => Some(s),
        // The route answers a bad body or `model` itself.
        _ => {
            return next
                .run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
    };
    let id = state.target_id_of(named.as_deref()).to_string();
    if !state.caller_may_use(&id) {
        return next
            .run(Request::from_parts(parts, Body::from(bytes)))
            .await;
    }
    let residency = state.residency.clone();
    let lease = match residency.acquire(&state, &id).await {
        Ok(Some(lease)) => lease,
        // Not an in-process target (or unknown): the route answers.
        Ok(None) => {
            return next
                .run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Err(e) => return refuse(&path, e.into()),
    };
    let resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    // The lease goes with the body: released when its last byte is sent (or
    // the client leaves).
    let (parts, body) = resp.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _held = &lease;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}
