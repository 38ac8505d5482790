//! One error type for every route, answered in OpenAI's shape
//! `{"error": {"message", "type", "code", "param"}}` with the right status.
//! Internal details never leak: engine failures become short messages.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sipp::chat::ChatError;
use sipp::engine::EngineError;
use sipp::protocol::openai::{ErrorBody, ErrorDetail};

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

    /// 503 for a target that failed.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some("unavailable"),
            message,
        )
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
            EngineError::Sampling(_) | EngineError::Tokenize(_) => Self::bad_request(message),
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
            EngineError::Unsupported(_) => Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("unsupported"),
                message,
            ),
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
