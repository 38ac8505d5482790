//! One error type for every route, answered in OpenAI's shape
//! `{"error": {"message", "type", "code", "param"}}` with the right status.
//! Internal details never leak: engine failures become short messages.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sipp::chat::ChatError;
use sipp::engine::EngineError;
use sipp::protocol::openai::{ErrorBody, ErrorDetail};
use sipp::sampling::SamplingError;

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Message for the client.
    pub message: String,
    /// OpenAI's `type`.
    pub kind: &'static str,
    /// OpenAI's `code`.
    pub code: Option<&'static str>,
    /// The offending field.
    pub param: Option<String>,
    /// `Retry-After` seconds on a 429 (default 1).
    pub retry_after_secs: Option<u64>,
}

impl ApiError {
    fn new(
        status: StatusCode,
        kind: &'static str,
        code: Option<&'static str>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code,
            param: None,
            retry_after_secs: None,
        }
    }

    /// 400 invalid_request_error.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            None,
            message,
        )
    }

    /// 400 naming a field.
    pub fn bad_field(field: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(field.to_string()),
            ..Self::bad_request(format!("invalid `{field}`: {}", message.into()))
        }
    }

    /// 404 for an unknown model.
    pub fn unknown_model(model: &str) -> Self {
        Self {
            param: Some("model".into()),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
                format!("the model `{model}` does not exist"),
            )
        }
    }

    /// 401.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            Some("invalid_api_key"),
            message,
        )
    }

    /// 413.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("request_too_large"),
            format!("the request body is larger than the limit of {limit} bytes"),
        )
    }

    /// 503 while a model loads.
    pub fn loading(model: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("model_loading"),
            format!("the model `{model}` is still loading"),
        )
    }

    /// 503 for a declared model that is not in memory, reached by a route
    /// that does not load models (one whose body names none).
    pub fn not_loaded(model: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("model_not_loaded"),
            format!(
                "the model `{model}` is not loaded; a request naming it in `model` (or POST /models/load) loads it"
            ),
        )
    }

    /// 503 for a target that failed.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("unavailable"),
            message,
        )
    }

    /// The same error naming the request's field `to` where the engine named
    /// its `from` (the engine calls every input `prompt`; an embeddings request
    /// calls it `input`, a chat request `messages`).
    pub fn renamed_param(mut self, from: &str, to: &str) -> Self {
        if self.param.as_deref() == Some(from) {
            self.param = Some(to.to_string());
            let (from, to) = (format!("`{from}`"), format!("`{to}`"));
            self.message = if self.message.contains(&from) {
                self.message.replace(&from, &to)
            } else {
                format!("invalid {to}: {}", self.message)
            };
        }
        self
    }

    /// 400 `unsupported` naming `model`, for a model that cannot generate
    /// (checked before a chat template is looked for, which such a model
    /// usually lacks too).
    pub fn cannot_generate(engine: &sipp::Engine) -> Option<Self> {
        (!engine.info().can_generate).then(|| {
            EngineError::Unsupported(format!(
                "{} computes embeddings; it cannot generate text",
                engine.info().model.name.as_deref().unwrap_or("this model")
            ))
            .into()
        })
    }

    /// The body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind.to_string(),
                code: self.code.map(str::to_string),
                param: self.param.clone(),
            },
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match &e {
            EngineError::PromptTooLong { .. } | EngineError::InputTooLong { .. } => Self {
                param: Some("prompt".into()),
                ..Self::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    Some("context_length_exceeded"),
                    message,
                )
            },
            EngineError::EmptyPrompt => Self {
                param: Some("prompt".into()),
                ..Self::bad_request(message)
            },
            EngineError::InvalidRequest { field, .. } => Self {
                param: Some((*field).to_string()),
                ..Self::bad_request(message)
            },
            EngineError::Sampling(s) => Self {
                param: Some(
                    match s {
                        SamplingError::Invalid { field, .. } => field,
                        SamplingError::Grammar(_) => "grammar",
                        SamplingError::Schema(_) => "json_schema",
                    }
                    .to_string(),
                ),
                ..Self::bad_request(message)
            },
            EngineError::Tokenize(_) => Self::bad_request(message),
            EngineError::Tool(t) => Self {
                param: Some(t.field.clone()),
                ..Self::bad_request(message)
            },
            EngineError::Chat(ChatError::Field { field, .. }) => Self {
                param: Some(field.clone()),
                ..Self::bad_request(message)
            },
            EngineError::Chat(ChatError::NoMessages) => Self {
                param: Some("messages".into()),
                ..Self::bad_request(message)
            },
            EngineError::Chat(_) => Self {
                param: Some("messages".into()),
                ..Self::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    Some("chat_template_error"),
                    message,
                )
            },
            // The model (or how its context is configured) cannot do this:
            // another `model` can.
            EngineError::Unsupported(_) => Self {
                param: Some("model".into()),
                ..Self::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    Some("unsupported"),
                    message,
                )
            },
            EngineError::RateLimited {
                retry_after_secs, ..
            } => Self::rate_limited(message, *retry_after_secs),
            EngineError::QueueFull { .. } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("queue_full"),
                message,
            ),
            EngineError::GrammarExhausted { .. } => Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("grammar_exhausted"),
                message,
            ),
            EngineError::KvCacheFull(_) | EngineError::EngineStopped => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("unavailable"),
                message,
            ),
            EngineError::Decode(_) => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                Some("decode_failed"),
                message,
            ),
        }
    }
}

impl ApiError {
    /// The headers its status calls for, in either API's shape: `Retry-After`
    /// on a 429, `WWW-Authenticate` on a 401.
    pub fn add_headers(&self, resp: &mut Response) {
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(self.retry_after_secs.unwrap_or(1).max(1)),
            );
        }
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        self.add_headers(&mut resp);
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every engine error maps to a status, OpenAI type and code, and names
    /// the field when there is one (the ones the fake backend cannot produce
    /// through the routes are here; the rest are in tests/app_fake).
    #[test]
    fn engine_errors_map_to_status_type_code_and_param() {
        // (error, status, type, code, param)
        type Case = (
            EngineError,
            u16,
            &'static str,
            Option<&'static str>,
            Option<&'static str>,
        );
        let cases: Vec<Case> = vec![
            (
                EngineError::PromptTooLong {
                    prompt_tokens: 10,
                    n_ctx: 8,
                },
                400,
                "invalid_request_error",
                Some("context_length_exceeded"),
                Some("prompt"),
            ),
            (
                EngineError::InputTooLong { tokens: 10, max: 8 },
                400,
                "invalid_request_error",
                Some("context_length_exceeded"),
                Some("prompt"),
            ),
            (
                EngineError::EmptyPrompt,
                400,
                "invalid_request_error",
                None,
                Some("prompt"),
            ),
            (
                EngineError::InvalidRequest {
                    field: "stop",
                    message: "too many".into(),
                },
                400,
                "invalid_request_error",
                None,
                Some("stop"),
            ),
            (
                SamplingError::Invalid {
                    field: "top_p",
                    message: "must be in (0, 1]".into(),
                }
                .into(),
                400,
                "invalid_request_error",
                None,
                Some("top_p"),
            ),
            (
                SamplingError::Grammar("bad".into()).into(),
                400,
                "invalid_request_error",
                None,
                Some("grammar"),
            ),
            (
                SamplingError::Schema("bad".into()).into(),
                400,
                "invalid_request_error",
                None,
                Some("json_schema"),
            ),
            (
                EngineError::Tokenize("bad".into()),
                400,
                "invalid_request_error",
                None,
                None,
            ),
            (
                ChatError::NoMessages.into(),
                400,
                "invalid_request_error",
                None,
                Some("messages"),
            ),
            (
                ChatError::NoTemplate.into(),
                400,
                "invalid_request_error",
                Some("chat_template_error"),
                Some("messages"),
            ),
            (
                EngineError::Unsupported("embeddings only".into()),
                400,
                "invalid_request_error",
                Some("unsupported"),
                Some("model"),
            ),
            (
                EngineError::QueueFull { max_queued: 1 },
                429,
                "rate_limit_error",
                Some("queue_full"),
                None,
            ),
            (
                EngineError::GrammarExhausted { generated: 3 },
                400,
                "invalid_request_error",
                Some("grammar_exhausted"),
                None,
            ),
            (
                EngineError::KvCacheFull("no room".into()),
                503,
                "server_error",
                Some("unavailable"),
                None,
            ),
            (
                EngineError::EngineStopped,
                503,
                "server_error",
                Some("unavailable"),
                None,
            ),
            (
                EngineError::Decode("-3".into()),
                500,
                "server_error",
                Some("decode_failed"),
                None,
            ),
        ];
        for (e, status, kind, code, param) in cases {
            let text = e.to_string();
            let a = ApiError::from(e);
            assert_eq!(a.status.as_u16(), status, "{text}");
            assert_eq!(a.kind, kind, "{text}");
            assert_eq!(a.code, code, "{text}");
            assert_eq!(a.param.as_deref(), param, "{text}");
            assert_eq!(a.message, text);
        }
    }

    #[test]
    fn renamed_param_names_the_request_field() {
        let a = ApiError::from(EngineError::EmptyPrompt).renamed_param("prompt", "input");
        assert_eq!(a.param.as_deref(), Some("input"));
        assert!(a.message.contains("`input`"), "{}", a.message);
        let a = ApiError::from(EngineError::InvalidRequest {
            field: "prompt",
            message: "token id 999 is outside the vocabulary".into(),
        })
        .renamed_param("prompt", "input");
        assert_eq!(
            a.message,
            "invalid `input`: token id 999 is outside the vocabulary"
        );
        // Other fields are left alone.
        let a = ApiError::bad_field("stop", "too many").renamed_param("prompt", "input");
        assert_eq!(a.param.as_deref(), Some("stop"));
    }

    #[test]
    fn statuses_carry_their_headers() {
        let r = ApiError::from(EngineError::QueueFull { max_queued: 1 }).into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let r = ApiError::unauthorized("no").into_response();
        assert_eq!(r.headers()[header::WWW_AUTHENTICATE], "Bearer");
    }
}
