//! Operations: /health, /metrics, /v1/models, /models/load, /models/unload,
//! /tokenize, /detokenize, and the answers for unknown routes and methods.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use sipp::protocol::openai::ModelCard;

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

/// A target's state in /v1/models and the admin routes (as llama-server's
/// router mode shows it).
#[derive(Debug, Serialize)]
pub struct ModelStatus {
    /// `loaded`, `loading`, `unloaded` or `failed`.
    pub value: &'static str,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl ModelStatus {
    fn of(s: &TargetState) -> Self {
        let (value, message) = crate::residency::status_of(s);
        Self { value, message }
    }
}

/// One model in GET /v1/models: OpenAI's card and its status.
#[derive(Debug, Serialize)]
pub struct ModelEntry {
    /// OpenAI's fields.
    #[serde(flatten)]
    pub card: ModelCard,
    /// Loaded, loading, unloaded or failed.
    pub status: ModelStatus,
    /// What a loaded local model is and where it runs (llama-server's
    /// `meta`, plus the placement); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub meta: Option<ModelMeta>,
}

/// `meta` of a loaded local model in GET /v1/models.
#[derive(Debug, Serialize)]
pub struct ModelMeta {
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Training context.
    pub n_ctx_train: u32,
    /// Embedding width.
    pub n_embd: usize,
    /// Parameters.
    pub n_params: u64,
    /// Weight bytes.
    pub size: u64,
    /// The context this engine runs with.
    pub n_ctx: u32,
    /// "31/31 layers on Vulkan0 (...)" or "CPU".
    pub placement: String,
    /// The backend holding the offloaded layers ("CPU" when none).
    pub backend: String,
    /// Devices holding offloaded layers.
    pub devices: Vec<String>,
    /// Layers offloaded, of `total_layers`.
    pub offloaded_layers: u32,
    /// The model's layers plus its output layer.
    pub total_layers: u32,
    /// What requests may send it: `text`, and `image` with a projector.
    pub input_modalities: Vec<&'static str>,
}

impl ModelMeta {
    fn of(s: &TargetState) -> Option<Self> {
        let TargetState::Ready(crate::state::Target::Local(engine)) = s else {
            return None;
        };
        let info = engine.info();
        let m = &info.model;
        let p = &m.placement;
        Some(Self {
            n_vocab: m.n_vocab,
            n_ctx_train: m.n_ctx_train,
            n_embd: m.n_embd,
            n_params: m.n_params,
            size: m.size_bytes,
            n_ctx: info.n_ctx,
            placement: p.summary(),
            backend: p.backend.clone(),
            devices: p.devices.clone(),
            offloaded_layers: p.offloaded_layers,
            total_layers: p.total_layers,
            input_modalities: if m.takes_images {
                vec!["text", "image"]
            } else {
                vec!["text"]
            },
        })
    }
}

/// GET /v1/models.
#[derive(Debug, Serialize)]
pub struct ModelEntries {
    /// "list".
    pub object: &'static str,
    /// Models.
    pub data: Vec<ModelEntry>,
}

/// GET /v1/models: every target the caller's key may use, with its status
/// (a declared on-demand model is listed `unloaded`; requesting it loads
/// it).
pub async fn models(State(state): State<AppState>) -> Json<ModelEntries> {
    let data = state
        .target_list()
        .into_iter()
        .filter(|(id, _)| state.caller_may_use(id))
        .flat_map(|(id, s)| {
            // Each LoRA adapter of a ready local model is a model of its
            // own to OpenAI clients: `ID:ADAPTER`.
            let adapters: Vec<String> = match &s {
                TargetState::Ready(crate::state::Target::Local(e)) => e
                    .lora_adapters()
                    .into_iter()
                    .map(|a| format!("{id}:{}", a.info.name))
                    .collect(),
                _ => Vec::new(),
            };
            std::iter::once(id)
                .chain(adapters)
                .map(|id| ModelEntry {
                    card: ModelCard {
                        id,
                        object: "model".into(),
                        created: state.created,
                        owned_by: "sipp".into(),
                    },
                    status: ModelStatus::of(&s),
                    meta: ModelMeta::of(&s),
                })
                .collect::<Vec<_>>()
        })
        .collect();
    Json(ModelEntries {
        object: "list",
        data,
    })
}

/// POST /models/load and /models/unload body.
#[derive(Debug, Deserialize)]
pub struct ModelBody {
    /// A target id or alias.
    model: String,
}

/// The target a load or unload names (404 when none has the id or alias;
/// 403 when the caller's key may not use it).
fn admin_target(state: &AppState, model: &str) -> Result<String, ApiError> {
    if model.trim().is_empty() {
        return Err(ApiError::bad_field("model", "must not be empty"));
    }
    let (_, id) = state.named(Some(model));
    if state.target_state(id).is_none() {
        return Err(ApiError::unknown_model(model));
    }
    // The same refusal as a request for it.
    if let Some(caller) = crate::policy::current() {
        if !caller.may_use(id) {
            return Err(crate::state::not_allowed(&caller, model));
        }
    }
    Ok(id.to_string())
}

fn admin_answer(state: &AppState, id: String) -> Json<serde_json::Value> {
    let status = ModelStatus::of(&state.target_state(&id).unwrap_or(TargetState::Unloaded));
    Json(serde_json::json!({"success": true, "model": id, "status": status}))
}

/// POST /models/load (admin): brings a model into memory (unloading the
/// least recently used one when at `server.models_max`) and answers once it
/// is loaded: `{"success": true, "model", "status": {"value": "loaded"}}`.
pub async fn load_model(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ModelBody>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id = admin_target(&state, &req.model)?;
    let residency = state.residency.clone();
    residency.bring_in(&state, &id).await?;
    Ok(admin_answer(&state, id))
}

/// POST /models/unload (admin): takes a model out of memory once its
/// requests in flight finish; its next request loads it again. Answers
/// `{"success": true, "model", "status": {"value": "unloaded"}}` (also when
/// it was not loaded).
pub async fn unload_model(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ModelBody>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id = admin_target(&state, &req.model)?;
    let residency = state.residency.clone();
    residency
        .unload(&state, &id, crate::residency::UnloadReason::Admin)
        .await?;
    Ok(admin_answer(&state, id))
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
