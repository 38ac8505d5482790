//! Reranking: `POST /v1/rerank` and `/rerank`, in the shape llama-server,
//! Jina and Cohere clients use. The target must be a cross-encoder loaded with
//! rank pooling; each document is one (query, document) pair, and the pairs
//! of a request are submitted together so the scheduler batches them.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ApiJson;
use crate::error::ApiError;
use crate::state::{AppState, Target};

/// The request: Jina's and Cohere's fields (`texts`, TEI's name, is not read).
#[derive(Debug, Deserialize)]
pub struct RerankBody {
    /// Target id.
    #[serde(default)]
    pub model: Option<String>,
    /// The query (a non-empty string).
    #[serde(default)]
    pub query: Option<Value>,
    /// The documents (a non-empty array of strings).
    #[serde(default)]
    pub documents: Option<Value>,
    /// Keep the best N results (default: all).
    #[serde(default)]
    pub top_n: Option<Value>,
    /// Return each document's text with its result (default false).
    #[serde(default)]
    pub return_documents: Option<bool>,
}

/// A returned document.
#[derive(Debug, Serialize)]
pub struct RerankDocument {
    /// Its text.
    pub text: String,
}

/// One scored document.
#[derive(Debug, Serialize)]
pub struct RerankResult {
    /// Its index in `documents`.
    pub index: usize,
    /// The model's raw score (higher is more relevant).
    pub relevance_score: f32,
    /// The document, with `return_documents: true`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document: Option<RerankDocument>,
}

/// Token counts.
#[derive(Debug, Serialize)]
pub struct RerankUsage {
    /// Tokens of all the pairs.
    pub prompt_tokens: usize,
    /// The same (nothing is generated).
    pub total_tokens: usize,
}

/// The answer.
#[derive(Debug, Serialize)]
pub struct RerankResponse {
    /// Target id.
    pub model: String,
    /// Always "list".
    pub object: &'static str,
    /// Best first, at most `top_n`.
    pub results: Vec<RerankResult>,
    /// Token counts.
    pub usage: RerankUsage,
}

/// The validated fields of a request.
#[derive(Debug, PartialEq)]
struct Checked {
    query: String,
    documents: Vec<String>,
    top_n: usize,
}

fn check(body: &RerankBody) -> Result<Checked, ApiError> {
    let query = match &body.query {
        None | Some(Value::Null) => {
            return Err(ApiError::bad_field(
                "query",
                "is required (a non-empty string)",
            ))
        }
        Some(Value::String(s)) if s.trim().is_empty() => {
            return Err(ApiError::bad_field("query", "must not be empty"))
        }
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad_field("query", "must be a string")),
    };
    let documents = match &body.documents {
        None | Some(Value::Null) => {
            return Err(ApiError::bad_field(
                "documents",
                "is required (a non-empty array of strings)",
            ))
        }
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::bad_field(
                "documents",
                "must not be empty (give at least one document)",
            ))
        }
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, d)| match d {
                Value::String(s) => Ok(s.clone()),
                _ => Err(ApiError::bad_field(
                    "documents",
                    format!("documents[{i}] must be a string, got {}", kind(d)),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => {
            return Err(ApiError::bad_field(
                "documents",
                "must be an array of strings",
            ))
        }
    };
    let top_n = match &body.top_n {
        None | Some(Value::Null) => documents.len(),
        Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(n), _) => usize::try_from(n).unwrap_or(usize::MAX),
            (None, Some(_)) => return Err(ApiError::bad_field("top_n", "must not be negative")),
            _ => return Err(ApiError::bad_field("top_n", "must be an integer")),
        },
        Some(_) => return Err(ApiError::bad_field("top_n", "must be an integer")),
    };
    Ok(Checked {
        query,
        documents,
        top_n,
    })
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Sorts best first (stable: equal scores keep the documents' order) and
/// keeps `top_n`.
fn ranked(mut results: Vec<RerankResult>, top_n: usize) -> Vec<RerankResult> {
    results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
    results.truncate(top_n);
    results
}

/// POST /v1/rerank, /rerank.
pub async fn rerank(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<RerankBody>,
) -> Result<Response, ApiError> {
    let (model, target) = state.target(body.model.as_deref())?;
    let engine = match target {
        Target::Local(e) => e,
        Target::Remote(_) => {
            let why = "a provider target; reranking needs a local model with rank pooling";
            return Err(ApiError::bad_field("model", format!("{model} is {why}")));
        }
    };
    let req = check(&body)?;
    // All pairs are submitted before any is awaited, so they share steps.
    let handles = req
        .documents
        .iter()
        .map(|d| engine.rerank(&req.query, d))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ApiError::from(e).renamed_param("prompt", "documents"))?;
    let mut results = Vec::with_capacity(handles.len());
    let mut prompt_tokens = 0;
    for (index, h) in handles.into_iter().enumerate() {
        let e = h
            .embedding()
            .await
            .map_err(|e| ApiError::from(e).renamed_param("prompt", "documents"))?;
        prompt_tokens += e.prompt_tokens;
        let relevance_score = e
            .values
            .first()
            .copied()
            .ok_or_else(|| ApiError::bad_field("model", "the model returned no rank score"))?;
        results.push(RerankResult {
            index,
            relevance_score,
            document: None,
        });
    }
    let mut results = ranked(results, req.top_n);
    if body.return_documents.unwrap_or(false) {
        let mut documents = req.documents;
        for r in &mut results {
            r.document = Some(RerankDocument {
                text: std::mem::take(&mut documents[r.index]),
            });
        }
    }
    Ok(Json(RerankResponse {
        model,
        object: "list",
        results,
        usage: RerankUsage {
            prompt_tokens,
            total_tokens: prompt_tokens,
        },
    })
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> RerankBody {
        serde_json::from_value(v).expect("a body")
    }

    /// The field a refusal names and its message.
    fn refused(v: Value) -> (String, String) {
        let e = check(&body(v)).expect_err("refused");
        (e.param.clone().unwrap_or_default(), e.message.clone())
    }

    #[test]
    fn good_requests_pass_with_top_n_defaulting_to_all() {
        let c = check(&body(json!({"query": "q", "documents": ["a", "b"]}))).expect("ok");
        assert_eq!(c.top_n, 2);
        assert_eq!(c.documents, vec!["a", "b"]);
        let c = check(&body(json!({"query": "q", "documents": ["a"], "top_n": 0}))).expect("ok");
        assert_eq!(c.top_n, 0);
    }

    #[test]
    fn bad_fields_are_named() {
        for (v, field, says) in [
            (json!({"documents": ["a"]}), "query", "required"),
            (json!({"query": " ", "documents": ["a"]}), "query", "empty"),
            (json!({"query": 3, "documents": ["a"]}), "query", "string"),
            (json!({"query": "q"}), "documents", "required"),
            (json!({"query": "q", "documents": []}), "documents", "empty"),
            (
                json!({"query": "q", "documents": "a"}),
                "documents",
                "array",
            ),
            (
                json!({"query": "q", "documents": ["a", 7]}),
                "documents",
                "documents[1]",
            ),
            (
                json!({"query": "q", "documents": ["a"], "top_n": -1}),
                "top_n",
                "negative",
            ),
            (
                json!({"query": "q", "documents": ["a"], "top_n": 1.5}),
                "top_n",
                "integer",
            ),
            (
                json!({"query": "q", "documents": ["a"], "top_n": "2"}),
                "top_n",
                "integer",
            ),
        ] {
            let (param, message) = refused(v.clone());
            assert_eq!(param, field, "{v}");
            assert!(message.contains(says), "{v}: {message}");
        }
    }

    #[test]
    fn ranked_sorts_best_first_and_cuts() {
        let r = |index, relevance_score| RerankResult {
            index,
            relevance_score,
            document: None,
        };
        let out = ranked(vec![r(0, 0.1), r(1, 2.0), r(2, -1.0), r(3, 0.5)], 3);
        let order: Vec<usize> = out.iter().map(|r| r.index).collect();
        assert_eq!(order, vec![1, 3, 0]);
    }
}
