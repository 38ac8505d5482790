//! `GET`/`POST /lora-adapters` (llama-server's): a local model's LoRA
//! adapters and their global scales, the scales requests get when they
//! choose no adapters (no `lora` field, no `TARGET:ADAPTER` model name).

use axum::extract::{Query, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use sipp::engine::{Engine, LoraScale};

use super::ApiJson;
use crate::error::ApiError;
use crate::state::{AppState, Target};

/// `?model=ID` (default: the default target).
#[derive(Debug, Default, Deserialize)]
pub struct LoraQuery {
    model: Option<String>,
}

/// One adapter as llama-server lists it, with its name.
#[derive(Debug, Serialize)]
pub struct AdapterEntry {
    /// Its id (the `id` of a request's `lora` entries).
    pub id: usize,
    /// Its file.
    pub path: String,
    /// Its global scale.
    pub scale: f32,
    /// The name that selects it as `model: "TARGET:NAME"`.
    pub name: String,
    /// Its scale when a request selects it by name.
    pub default_scale: f32,
}

fn local(state: &AppState, model: Option<&str>) -> Result<Engine, ApiError> {
    match state.target(model)?.1 {
        Target::Local(e) => Ok(e),
        _ => Err(ApiError::bad_field(
            "model",
            "LoRA adapters belong to local models (this target is a remote provider)",
        )),
    }
}

fn entries(engine: &Engine) -> Vec<AdapterEntry> {
    engine
        .lora_adapters()
        .into_iter()
        .map(|a| AdapterEntry {
            id: a.info.id,
            path: a.info.path,
            scale: a.global_scale,
            name: a.info.name,
            default_scale: a.info.scale,
        })
        .collect()
}

/// GET /lora-adapters: the adapters, by id, with their global scales.
pub async fn list(
    State(state): State<AppState>,
    Query(q): Query<LoraQuery>,
) -> Result<Json<Vec<AdapterEntry>>, ApiError> {
    Ok(Json(entries(&local(&state, q.model.as_deref())?)))
}

/// POST /lora-adapters with `[{"id", "scale"}]`: sets the global scales
/// (those not listed go to 0, as in llama-server); answers
/// `{"success": true}`. Requests already submitted keep their scales.
pub async fn set(
    State(state): State<AppState>,
    Query(q): Query<LoraQuery>,
    ApiJson(body): ApiJson<Vec<LoraScale>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let engine = local(&state, q.model.as_deref())?;
    engine.set_lora_scales(&body)?;
    Ok(Json(serde_json::json!({ "success": true })))
}
