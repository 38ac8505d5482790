//! The worker contract of the routers operators run in front of replicas
//! (SGLang's model gateway `sglang-router`, `vllm-router`, llm-d's endpoint
//! picker): `/model_info`, `/server_info`, `/get_load`, and the render
//! endpoints that turn a request into the token ids it would compute.
//! `/tokenize` (in `ops`) takes their `{model, prompt | messages}` too.

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use sipp::engine::PromptInput;
use sipp::protocol::openai::{ChatCompletionRequest, CompletionRequest};
use sipp::Engine;

use super::{new_id, ApiJson};
use crate::config::LoadFormat;
use crate::error::ApiError;
use crate::state::{AppState, Target, TargetState};

/// `?model=` on the info routes: which target (the default when absent).
#[derive(Debug, Default, Deserialize)]
pub struct ModelQuery {
    model: Option<String>,
}

/// The local engine of a model, or a 400 for a provider target.
fn local(state: &AppState, model: Option<&str>) -> Result<(String, Engine), ApiError> {
    let (id, target) = state.target(model)?;
    match target {
        Target::Local(e) => Ok((id, e)),
        Target::Remote(_) => Err(ApiError::bad_field(
            "model",
            format!("`{id}` is a remote provider; it has no local tokenizer or load"),
        )),
    }
}

/// GET /model_info (and SGLang's older `/get_model_info`).
pub async fn model_info(
    State(state): State<AppState>,
    Query(q): Query<ModelQuery>,
) -> Result<Response, ApiError> {
    let (id, engine) = local(&state, q.model.as_deref())?;
    let info = engine.info();
    Ok(Json(serde_json::json!({
        // Routers key their per-model state by this name; it is the id
        // clients send as `model`.
        "model_path": id,
        "tokenizer_path": id,
        "served_model_name": id,
        "is_generation": info.model.can_generate() && info.can_generate,
        "model_file": info.model.path,
        "architecture": info.model.architecture,
        "max_context_length": info.n_ctx,
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "weight_version": "default",
    }))
    .into_response())
}

/// GET /server_info (and `/get_server_info`): one data-parallel rank, one
/// tensor-parallel rank, the context and slots of the default target.
pub async fn server_info(
    State(state): State<AppState>,
    Query(q): Query<ModelQuery>,
) -> Result<Response, ApiError> {
    let (id, engine) = local(&state, q.model.as_deref())?;
    let info = engine.info();
    Ok(Json(serde_json::json!({
        "server": "sipp",
        "version": env!("CARGO_PKG_VERSION"),
        "model_path": id,
        "served_model_name": id,
        "context_length": info.n_ctx,
        "max_total_num_tokens": info.n_ctx,
        "max_running_requests": info.slots,
        "max_queued_requests": info.max_queued,
        "dp_size": 1,
        "tp_size": 1,
        "pp_size": 1,
        "disaggregation_mode": "null",
    }))
    .into_response())
}

/// `?format=sglang|vllm` on /get_load.
#[derive(Debug, Default, Deserialize)]
pub struct LoadQuery {
    format: Option<String>,
}

/// One data-parallel rank's load, as sglang-router reads it.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct RankLoad {
    /// Always 0: a sipp process is one rank.
    pub dp_rank: u32,
    /// Requests in slots and waiting.
    pub num_reqs: u64,
    /// Requests waiting for a slot.
    pub num_waiting_reqs: u64,
    /// KV cells in use.
    pub num_tokens: u64,
}

/// GET /get_load: the load over every local target. Its shape follows
/// `?format=`, else `[server] load_format`: SGLang's list per rank or
/// vLLM's `{"load": N}` (N: requests running plus waiting). Both routers
/// call the same path without saying who they are, so the replica is told
/// which one it is behind.
pub async fn get_load(
    State(state): State<AppState>,
    Query(q): Query<LoadQuery>,
) -> Result<Response, ApiError> {
    let format = match q.format.as_deref() {
        None => state.load_format,
        Some(f) => f
            .parse::<LoadFormat>()
            .map_err(|e| ApiError::bad_field("format", e))?,
    };
    let mut load = RankLoad {
        dp_rank: 0,
        num_reqs: 0,
        num_waiting_reqs: 0,
        num_tokens: 0,
    };
    for (_, s) in state.target_list() {
        if let TargetState::Ready(Target::Local(e)) = s {
            let m = e.metrics();
            load.num_reqs += m.busy_slots + m.queue_depth;
            load.num_waiting_reqs += m.queue_depth;
            load.num_tokens += m.kv_cells_used;
        }
    }
    Ok(match format {
        LoadFormat::Sglang => Json(vec![load]).into_response(),
        LoadFormat::Vllm => Json(serde_json::json!({ "load": load.num_reqs })).into_response(),
    })
}

/// `?model=ID` on GET /slots (default: the default target).
#[derive(Debug, Default, Deserialize)]
pub struct SlotsQuery {
    model: Option<String>,
}

/// One slot in GET /slots: llama-server's fields where sipp has them, and
/// the slot's phase.
#[derive(Debug, Serialize)]
pub struct SlotState {
    /// Slot index.
    pub id: usize,
    /// The request it serves (-1 when idle, as llama-server's `id_task`).
    pub id_task: i64,
    /// The context (KV cells) every slot shares.
    pub n_ctx: u32,
    /// Whether it holds a request.
    pub is_processing: bool,
    /// `Idle`, `Admitted`, `Prefill`, `Decode`, ...
    pub phase: sipp::scheduler::SlotPhase,
    /// Prompt tokens of its request.
    pub n_prompt_tokens: usize,
    /// Of them, reused from the KV cache.
    pub n_prompt_tokens_cache: usize,
    /// Tokens generated so far.
    pub n_decoded: usize,
}

/// GET /slots (llama-server's): each slot of a local model, what it is doing
/// and its token counts (no request content).
pub async fn slots(
    State(state): State<AppState>,
    Query(q): Query<SlotsQuery>,
) -> Result<Json<Vec<SlotState>>, ApiError> {
    let (_, target) = state.target(q.model.as_deref())?;
    let Target::Local(engine) = target else {
        return Err(ApiError::bad_field(
            "model",
            "/slots describes local models only (this target is a provider)",
        ));
    };
    let n_ctx = engine.info().n_ctx;
    Ok(Json(
        engine
            .slot_views()
            .into_iter()
            .enumerate()
            .map(|(id, v)| SlotState {
                id,
                id_task: v.request_id.map_or(-1, |r| r as i64),
                n_ctx,
                is_processing: v.phase.is_busy(),
                phase: v.phase,
                n_prompt_tokens: v.prompt_tokens,
                n_prompt_tokens_cache: v.cached_tokens,
                n_decoded: v.generated_tokens,
            })
            .collect(),
    ))
}

/// What a render endpoint answers per prompt: vLLM's generate request shape,
/// whose `token_ids` routers hash for prefix-aware placement.
#[derive(Debug, Serialize)]
struct Rendered {
    request_id: String,
    model: String,
    token_ids: Vec<i32>,
    features: Option<()>,
    stream: bool,
}

impl Rendered {
    fn new(id_prefix: &str, model: String, token_ids: Vec<i32>, stream: Option<bool>) -> Self {
        Self {
            request_id: new_id(id_prefix),
            model,
            token_ids,
            features: None,
            stream: stream.unwrap_or(false),
        }
    }
}

/// POST /v1/chat/completions/render: the token ids the chat request would
/// compute (template, tools, `chat_template_kwargs`,
/// `continue_final_message` applied), without generating.
pub async fn render_chat(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let (model, engine) = local(&state, req.model.as_deref())?;
    // A prepared turn's prompt is already the tokenizer's ids.
    let token_ids = match super::openai::chat_turn(&engine, &req)?.prompt {
        PromptInput::Tokens(t) => t,
        PromptInput::Media(m) => m.tokens,
        PromptInput::Text(t) => engine.prompt_tokens(&PromptInput::Text(t), true, true)?,
    };
    Ok(Json(Rendered::new("chatcmpl", model, token_ids, req.stream)).into_response())
}

/// POST /v1/completions/render: the token ids of each prompt, one entry per
/// prompt, as vLLM answers.
pub async fn render_completions(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let (model, engine) = local(&state, req.model.as_deref())?;
    let prompts = super::openai::completion_prompts(&req)?;
    let out = prompts
        .iter()
        .map(|p| {
            let ids = engine.prompt_tokens(p, true, true)?;
            Ok(Rendered::new("cmpl", model.clone(), ids, req.stream))
        })
        .collect::<Result<Vec<_>, sipp::engine::EngineError>>()?;
    Ok(Json(out).into_response())
}

/// The tokens of a `/tokenize` body in vLLM's form: `prompt` text (special
/// tokens added unless `add_special_tokens: false`) or `messages` rendered
/// with the chat template, tokenized as the chat route does (the generation
/// prompt unless `add_generation_prompt: false`).
pub(super) fn tokenize_vllm(
    engine: &Engine,
    prompt: Option<&str>,
    messages: Option<&[sipp::chat::ChatMessage]>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
) -> Result<Vec<i32>, ApiError> {
    match (prompt, messages) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "give one of `content`, `prompt` or `messages`, not several",
        )),
        (Some(p), None) => Ok(engine.prompt_tokens(
            &PromptInput::Text(p.to_string()),
            add_special_tokens.unwrap_or(true),
            true,
        )?),
        (None, Some([])) => Err(ApiError::bad_field(
            "messages",
            "must contain at least one message",
        )),
        (None, Some(m)) => engine
            .chat_tokens(m, add_generation_prompt.unwrap_or(true))
            .map_err(|e| ApiError::from(e).renamed_param("prompt", "messages")),
        (None, None) => Err(ApiError::bad_field(
            "content",
            "is required (or `prompt`, or `messages`)",
        )),
    }
}
