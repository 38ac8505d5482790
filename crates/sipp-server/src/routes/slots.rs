//! Slot persistence: llama-server's `POST /slots/{id}?action=save|restore|erase`
//! (body `{"filename": "x.bin"}` for save and restore), and the same for a
//! native-profile conversation by its `context_key`:
//! `POST /v1/sessions/{key}?action=save|restore|erase`. `?model=ID` picks the
//! local target, as on `GET /slots`.
//!
//! Files live only in the directory given by `sipp serve --slot-save-path`
//! (`[server] slot_save_path`); a filename is a plain name in it. Erase needs
//! no directory.

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use sipp::engine::{KvHolder, SlotActionError};
use sipp::session::{RestoreError, SlotFileError};
use sipp::Engine;

use crate::error::ApiError;
use crate::state::{AppState, Target};

/// `?action=save|restore|erase&model=ID`.
#[derive(Debug, Default, Deserialize)]
pub struct ActionQuery {
    action: Option<String>,
    model: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Save,
    Restore,
    Erase,
}

fn action_of(q: &ActionQuery) -> Result<Action, ApiError> {
    match q.action.as_deref() {
        Some("save") => Ok(Action::Save),
        Some("restore") => Ok(Action::Restore),
        Some("erase") => Ok(Action::Erase),
        None => Err(ApiError::bad_field(
            "action",
            "is required: `?action=save`, `restore` or `erase`",
        )),
        Some(a) => Err(ApiError::bad_field(
            "action",
            format!("`{a}` is not an action; use save, restore or erase"),
        )),
    }
}

fn error(
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
    param: Option<&str>,
    message: impl Into<String>,
) -> ApiError {
    ApiError {
        status,
        message: message.into(),
        kind,
        code: Some(code),
        param: param.map(str::to_string),
        retry_after_secs: None,
    }
}

fn api_error(e: SlotActionError, holder: &KvHolder) -> ApiError {
    let message = e.to_string();
    let bad = |param: &str| ApiError {
        param: Some(param.to_string()),
        ..ApiError::bad_request(message.clone())
    };
    match &e {
        SlotActionError::NoSuchSlot { .. } => bad("id_slot"),
        SlotActionError::Adapters(_) => match holder {
            KvHolder::Slot(_) => bad("id_slot"),
            KvHolder::Session(_) => bad("context_key"),
        },
        SlotActionError::Busy(_) => error(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "slot_busy",
            None,
            message,
        ),
        SlotActionError::Empty(_) => match holder {
            KvHolder::Slot(_) => bad("id_slot"),
            KvHolder::Session(_) => error(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "session_not_found",
                Some("context_key"),
                message,
            ),
        },
        SlotActionError::File(SlotFileError::NotFound(_)) => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "file_not_found",
            Some("filename"),
            message,
        ),
        SlotActionError::File(SlotFileError::OtherModel { .. }) => ApiError {
            code: Some("other_model"),
            ..bad("filename")
        },
        SlotActionError::File(SlotFileError::Invalid { .. }) => bad("filename"),
        SlotActionError::Restore {
            error: RestoreError::NoRoom { .. },
            ..
        } => ApiError {
            code: Some("context_length_exceeded"),
            ..bad("filename")
        },
        SlotActionError::File(SlotFileError::Io { .. })
        | SlotActionError::Restore {
            error: RestoreError::Refused(_),
            ..
        } => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "slot_file_failed",
            None,
            message,
        ),
        SlotActionError::EngineStopped => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "unavailable",
            None,
            message,
        ),
    }
}

/// The `filename` of a save or restore body: a plain, non-empty name (no
/// `..`, `/` or `\`), at most 255 bytes.
fn filename_of(body: &[u8]) -> Result<String, ApiError> {
    let missing = || ApiError::bad_field("filename", "is required: `{\"filename\": \"NAME\"}`");
    if body.is_empty() {
        return Err(missing());
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    let Value::Object(map) = v else {
        return Err(ApiError::bad_request(
            "invalid JSON body: expected an object with `filename`",
        ));
    };
    let name = match map.get("filename") {
        None | Some(Value::Null) => return Err(missing()),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad_field("filename", "must be a string")),
    };
    let problem = if name.is_empty() {
        Some("must not be empty")
    } else if name.contains("..") || name.contains('/') || name.contains('\\') {
        Some("must be a plain file name, without `..`, `/` or `\\`")
    } else if name.contains('\0') || name.chars().any(char::is_control) {
        Some("must not contain control characters")
    } else if name.len() > 255 {
        Some("must be at most 255 bytes")
    } else {
        None
    };
    match problem {
        Some(p) => Err(ApiError::bad_field("filename", p)),
        None => Ok(name),
    }
}

fn local_engine(state: &AppState, model: Option<&str>) -> Result<Engine, ApiError> {
    match state.target(model)? {
        (_, Target::Local(e)) => Ok(e),
        (id, Target::Remote(_)) => Err(ApiError::bad_field(
            "model",
            format!("`{id}` is a remote provider; it has no slots to save or restore"),
        )),
    }
}

/// Runs a blocking slot action off the async threads.
async fn blocking<T: Send + 'static>(
    holder: &KvHolder,
    f: impl FnOnce() -> Result<T, SlotActionError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "slot_file_failed",
                None,
                "the slot action failed",
            )
        })?
        .map_err(|e| api_error(e, holder))
}

/// What names the holder in an answer: llama-server's `id_slot`, or the
/// session's `context_key`.
fn holder_field(holder: &KvHolder) -> (&'static str, Value) {
    match holder {
        KvHolder::Slot(i) => ("id_slot", json!(i)),
        KvHolder::Session(k) => ("context_key", json!(k)),
    }
}

async fn run(
    state: AppState,
    holder: KvHolder,
    q: ActionQuery,
    body: Body,
) -> Result<Response, ApiError> {
    let action = action_of(&q)?;
    let engine = local_engine(&state, q.model.as_deref())?;
    if let KvHolder::Slot(id) = holder {
        let slots = engine.info().slots;
        if id >= slots {
            return Err(api_error(
                SlotActionError::NoSuchSlot { id, slots },
                &holder,
            ));
        }
    }
    let (key, id) = holder_field(&holder);
    if action == Action::Erase {
        let h = holder.clone();
        let erased = blocking(&holder, move || engine.erase_kv(&h)).await?;
        let mut out = json!({ "n_erased": erased.n_erased });
        out[key] = id;
        return Ok(Json(out).into_response());
    }
    let bytes = super::read_body(body, state.max_body_bytes).await?;
    let filename = filename_of(&bytes)?;
    let Some(dir) = state.child_server.slot_save_path.clone() else {
        return Err(error(
            StatusCode::NOT_IMPLEMENTED,
            "not_supported_error",
            "not_supported",
            None,
            "this server does not save or restore slots: start it with --slot-save-path DIR \
             (or `[server] slot_save_path`)",
        ));
    };
    let path = dir.join(&filename);
    let h = holder.clone();
    let mut out = if action == Action::Save {
        let saved = blocking(&holder, move || {
            std::fs::create_dir_all(&dir).map_err(|e| {
                SlotActionError::File(SlotFileError::Io {
                    file: dir.display().to_string(),
                    reason: e.to_string(),
                })
            })?;
            engine.save_kv(&h, &path)
        })
        .await?;
        json!({
            "filename": filename,
            "n_saved": saved.n_saved,
            "n_written": saved.n_written,
            "timings": {"save_ms": saved.save_ms},
        })
    } else {
        let restored = blocking(&holder, move || engine.restore_kv(&h, &path)).await?;
        json!({
            "filename": filename,
            "n_restored": restored.n_restored,
            "n_read": restored.n_read,
            "timings": {"restore_ms": restored.restore_ms},
        })
    };
    out[key] = id;
    Ok(Json(out).into_response())
}

/// POST /slots/{id}?action=save|restore|erase (llama-server's).
pub async fn slot_action(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<ActionQuery>,
    body: Body,
) -> Result<Response, ApiError> {
    let id = id.parse::<usize>().map_err(|_| {
        ApiError::bad_field(
            "id_slot",
            format!("`{id}` is not a slot id (GET /slots lists them: 0, 1, ...)"),
        )
    })?;
    run(state, KvHolder::Slot(id), q, body).await
}

/// POST /v1/sessions/{key}?action=save|restore|erase: the conversation the
/// native profile pins to `context_key` = key.
pub async fn session_action(
    State(state): State<AppState>,
    Path(key): Path<String>,
    Query(q): Query<ActionQuery>,
    body: Body,
) -> Result<Response, ApiError> {
    if key.is_empty() {
        return Err(ApiError::bad_field("context_key", "must not be empty"));
    }
    run(state, KvHolder::Session(key), q, body).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filenames_are_plain_names() {
        assert_eq!(
            filename_of(br#"{"filename": "a.bin"}"#).ok(),
            Some("a.bin".into())
        );
        for bad in [
            r#"{"filename": ""}"#,
            r#"{"filename": "../a.bin"}"#,
            r#"{"filename": "a/b.bin"}"#,
            r#"{"filename": "a\\b.bin"}"#,
            r#"{"filename": ".."}"#,
            r#"{"filename": 3}"#,
            r#"{}"#,
            "",
        ] {
            let e = filename_of(bad.as_bytes()).expect_err(bad);
            assert_eq!(e.param.as_deref(), Some("filename"), "{bad}: {e:?}");
        }
        assert!(filename_of(b"{bad").is_err());
    }
}
