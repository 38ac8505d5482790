//! Operations: /health, /metrics, /v1/models, /tokenize, /detokenize, and the
//! answers for unknown routes and methods.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use sipp::protocol::openai::{ModelCard, ModelList};

use super::ApiJson;
use crate::error::ApiError;
use crate::state::{AppState, Health, Target, TargetState};

/// GET /health: 200 once every model is loaded, 503 while loading or after a
/// failure (including an engine thread that stopped).
pub async fn health(State(state): State<AppState>) -> Response {
    match state.health() {
        Health::Ok => (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))).into_response(),
        Health::Loading => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "loading"})),
        )
            .into_response(),
        Health::Failed(m) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "error", "message": m})),
        )
            .into_response(),
    }
}

/// GET /metrics in Prometheus text format.
pub async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

/// GET /v1/models: the ready targets the caller's key may use.
pub async fn models(State(state): State<AppState>) -> Json<ModelList> {
    let data = state
        .target_list()
        .into_iter()
        .filter(|(id, s)| {
            matches!(s, TargetState::Ready(_) | TargetState::Forwarded(_))
                && state.caller_may_use(id)
        })
        .map(|(id, _)| ModelCard {
            id,
            object: "model".into(),
            created: state.created,
            owned_by: "sipp".into(),
        })
        .collect();
    Json(ModelList {
        object: "list".into(),
        data,
    })
}

/// POST /tokenize body: llama-server's `{content}` or vLLM's
/// `{prompt}` / `{messages}` (what routers send).
#[derive(Debug, Deserialize)]
pub struct TokenizeBody {
    model: Option<String>,
    /// Text, tokenized as given (llama-server).
    content: Option<String>,
    /// Text, tokenized as a completion prompt (vLLM).
    prompt: Option<String>,
    /// A conversation, rendered with the chat template (vLLM).
    messages: Option<Vec<sipp::chat::ChatMessage>>,
    /// llama-server's name: add BOS (default false for `content`).
    #[serde(default)]
    add_special: bool,
    /// vLLM's name: add BOS (default true for `prompt`, false for
    /// `messages`, whose template writes it).
    add_special_tokens: Option<bool>,
    /// For `messages`: end with the assistant's opening (default true).
    add_generation_prompt: Option<bool>,
    #[serde(default = "yes")]
    parse_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Serialize)]
struct Piece {
    id: i32,
    piece: String,
}

/// POST /tokenize: `{tokens, count, max_model_len}` (pieces instead of ids
/// with `with_pieces`).
pub async fn tokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<TokenizeBody>,
) -> Result<Response, ApiError> {
    let (id, target) = state.target(req.model.as_deref())?;
    let Target::Local(engine) = target else {
        return Err(ApiError::bad_request(format!(
            "`{id}` is a remote provider; it has no local tokenizer"
        )));
    };
    let v = engine.vocab();
    let tokens = match (&req.content, &req.prompt, &req.messages) {
        (Some(c), None, None) => v
            .tokenize(
                c,
                req.add_special_tokens.unwrap_or(req.add_special),
                req.parse_special,
            )
            .map_err(|e| ApiError::bad_request(e.to_string()))?,
        (None, p, m) => super::worker::tokenize_vllm(
            &engine,
            p.as_deref(),
            m.as_deref(),
            req.add_special_tokens,
            req.add_generation_prompt,
        )?,
        _ => {
            return Err(ApiError::bad_request(
                "give one of `content`, `prompt` or `messages`, not several",
            ))
        }
    };
    let count = tokens.len();
    let max_model_len = engine.info().n_ctx;
    if req.with_pieces {
        let pieces: Vec<Piece> = tokens
            .iter()
            .map(|&id| Piece {
                id,
                piece: String::from_utf8_lossy(&v.token_bytes(id)).into_owned(),
            })
            .collect();
        return Ok(Json(serde_json::json!({
            "tokens": pieces, "count": count, "max_model_len": max_model_len
        }))
        .into_response());
    }
    Ok(Json(serde_json::json!({
        "tokens": tokens, "count": count, "max_model_len": max_model_len
    }))
    .into_response())
}

/// POST /detokenize body.
#[derive(Debug, Deserialize)]
pub struct DetokenizeBody {
    model: Option<String>,
    tokens: Vec<i64>,
}

/// POST /detokenize.
pub async fn detokenize(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<DetokenizeBody>,
) -> Result<Response, ApiError> {
    let (id, target) = state.target(req.model.as_deref())?;
    let Target::Local(engine) = target else {
        return Err(ApiError::bad_request(format!(
            "`{id}` is a remote provider; it has no local tokenizer"
        )));
    };
    let n_vocab = engine.info().model.n_vocab;
    let tokens = req
        .tokens
        .iter()
        .map(|&t| sipp::engine::validate::token_id("tokens", t, n_vocab))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Json(serde_json::json!({ "content": engine.vocab().detokenize(&tokens) })).into_response())
}

/// Unknown route.
pub async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such route".into(),
        kind: "invalid_request_error",
        code: Some("not_found"),
        param: None,
        retry_after_secs: None,
    }
}

/// Known route, wrong method.
pub async fn method_not_allowed() -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: "method not allowed on this route".into(),
        kind: "invalid_request_error",
        code: Some("method_not_allowed"),
        param: None,
        retry_after_secs: None,
    }
}
