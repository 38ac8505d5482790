//! Code infill: `POST /infill`, in llama-server's shape. The prompt is built
//! as llama-server's `format_prompt_infill` builds it (repo-level FIM
//! pattern): the extra files, then `[FIM_PRE]prefix prompt [FIM_SUF]suffix
//! [FIM_MID]`, with its truncation; it is submitted as tokens. Models whose
//! vocabulary lacks the prefix, suffix or middle FIM token are refused.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sipp::engine::{Completion, PromptInput};
use sipp::protocol::native::TextOptions;
use sipp::protocol::request_from_text_options;
use sipp::runtime::{FimTokens, Token, Vocab};
use sipp::text::FinishReason;

use super::{json_event, sse, ApiJson, StreamItem};
use crate::error::ApiError;
use crate::state::{AppState, Target};

/// llama-server's default batch size, which its infill truncation is sized
/// against (prefix: 3/4 of it; suffix and prompt: the rest).
const N_BATCH: usize = 2048;

/// The request: llama-server's fields plus the usual generation options.
#[derive(Debug, Deserialize)]
pub struct InfillBody {
    /// Target id.
    #[serde(default)]
    pub model: Option<String>,
    /// Text before the cursor (a string, required).
    #[serde(default)]
    pub input_prefix: Option<Value>,
    /// Text after the cursor (a string, required).
    #[serde(default)]
    pub input_suffix: Option<Value>,
    /// Other files: an array of `{"filename": string, "text": string}`.
    #[serde(default)]
    pub input_extra: Option<Value>,
    /// Text put after the middle token's prefix (a string, optional).
    #[serde(default)]
    pub prompt: Option<Value>,
    /// llama-server's name for `max_tokens`.
    #[serde(default)]
    pub n_predict: Option<i64>,
    /// Return the generated token ids as `tokens`.
    #[serde(default)]
    pub return_tokens: Option<bool>,
    /// Stream the answer as server-sent events (llama-server's pieces).
    #[serde(default)]
    pub stream: Option<bool>,
    /// Sampling and limits.
    #[serde(flatten)]
    pub options: TextOptions,
}

/// The answer, in the shape of llama-server's `/infill` answer.
#[derive(Debug, Serialize)]
pub struct InfillResponse {
    /// Target id.
    pub model: String,
    /// The generated text.
    pub content: String,
    /// The generated token ids, with `return_tokens: true`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<Token>>,
    /// Always true (the answer is complete).
    pub stop: bool,
    /// "eos", "word" (a stop string) or "limit".
    pub stop_type: &'static str,
    /// Generated token count.
    pub tokens_predicted: usize,
    /// Prompt token count.
    pub tokens_evaluated: usize,
    /// The prompt as text, special tokens written out (as llama-server).
    pub prompt: String,
    /// The prompt's token ids (sipp's addition).
    pub prompt_tokens: Vec<Token>,
    /// Whether the prompt was truncated to fit.
    pub truncated: bool,
}

/// An extra file.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Extra {
    filename: String,
    text: String,
}

/// The validated fields of a request.
#[derive(Debug, PartialEq)]
pub(crate) struct Checked {
    prefix: String,
    suffix: String,
    extra: Vec<Extra>,
    prompt: String,
}

fn string_field(v: &Option<Value>, field: &str, required: bool) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) if required => Err(ApiError::bad_field(
            field,
            "is required (a string, possibly empty)",
        )),
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(ApiError::bad_field(field, "must be a string")),
    }
}

pub(crate) fn check(body: &InfillBody) -> Result<Checked, ApiError> {
    let prefix = string_field(&body.input_prefix, "input_prefix", true)?;
    let suffix = string_field(&body.input_suffix, "input_suffix", true)?;
    let prompt = string_field(&body.prompt, "prompt", false)?;
    const SHAPE: &str = "must be an array of {\"filename\": string, \"text\": string}";
    let extra = match &body.input_extra {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let Value::Object(o) = c else {
                    return Err(ApiError::bad_field(
                        "input_extra",
                        format!("input_extra[{i}] must be an object; the field {SHAPE}"),
                    ));
                };
                let text = match o.get("text") {
                    Some(Value::String(s)) => s.clone(),
                    _ => {
                        return Err(ApiError::bad_field(
                            "input_extra",
                            format!("input_extra[{i}] must have a string \"text\""),
                        ))
                    }
                };
                // llama-server's default file name.
                let filename = match o.get("filename") {
                    None | Some(Value::Null) => "tmp".to_string(),
                    Some(Value::String(s)) => s.clone(),
                    Some(_) => {
                        return Err(ApiError::bad_field(
                            "input_extra",
                            format!("input_extra[{i}].filename must be a string"),
                        ))
                    }
                };
                Ok(Extra { filename, text })
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(ApiError::bad_field("input_extra", SHAPE)),
    };
    Ok(Checked {
        prefix,
        suffix,
        extra,
        prompt,
    })
}

/// The FIM tokens infill needs, or a 400 naming the missing ones.
fn fim_of(fim: &FimTokens) -> Result<(Token, Token, Token), ApiError> {
    match (fim.pre, fim.suf, fim.mid) {
        (Some(p), Some(s), Some(m)) => Ok((p, s, m)),
        _ => Err(ApiError::bad_field(
            "model",
            format!(
                "infill is not supported by this model: its vocabulary has no FIM {} token",
                fim.missing().join(", ")
            ),
        )),
    }
}

/// Tokenizes `(text, parse_special)`, never adding BOS or EOS.
pub(crate) type Tokenizer<'a> = dyn Fn(&str, bool) -> Result<Vec<Token>, ApiError> + 'a;

/// Builds the prompt as llama-server's `format_prompt_infill` does (with
/// `spm_infill` off and the server's `n_predict` at its default, -1), given a
/// tokenizer `tok(text, parse_special)` (never adding BOS/EOS). Returns the
/// tokens and whether anything was cut.
pub(crate) fn build_prompt(
    req: &Checked,
    fim: &FimTokens,
    (bos, add_bos): (Option<Token>, bool),
    n_ctx: usize,
    n_batch: usize,
    tok: &Tokenizer,
) -> Result<(Vec<Token>, bool), ApiError> {
    let (pre, suf, mid) = fim_of(fim)?;
    let prefix = tok(&req.prefix, false)?;
    let suffix = tok(&req.suffix, false)?;
    let prompt = tok(&req.prompt, true)?;
    let mut extra = Vec::new();
    if let Some(rep) = fim.rep {
        extra.push(rep);
        extra.extend(tok("myproject\n", false)?);
    }
    for c in &req.extra {
        match fim.sep {
            Some(sep) => {
                extra.push(sep);
                extra.extend(tok(&format!("{}\n", c.filename), false)?);
            }
            None => extra.extend(tok("\n\n--- snippet ---\n\n", false)?),
        }
        extra.extend(tok(&c.text, false)?);
    }
    if let Some(sep) = fim.sep {
        extra.push(sep);
        extra.extend(tok("filename\n", false)?);
    }
    let n_prefix_take = prefix.len().min(3 * (n_batch / 4));
    let n_suffix_take = suffix
        .len()
        .min((n_batch / 4).saturating_sub(2 + prompt.len()));
    // n_ctx - n_batch - 2 * n_predict, with n_predict = -1.
    let n_extra_take = ((n_ctx + 2).saturating_sub(n_batch)).min(extra.len());
    let truncated =
        n_prefix_take < prefix.len() || n_suffix_take < suffix.len() || n_extra_take < extra.len();

    let mut out =
        Vec::with_capacity(n_extra_take + n_prefix_take + n_suffix_take + prompt.len() + 4);
    out.extend_from_slice(&extra[extra.len() - n_extra_take..]);
    if add_bos {
        if let Some(b) = bos {
            out.push(b);
        }
    }
    out.push(pre);
    out.extend_from_slice(&prefix[prefix.len() - n_prefix_take..]);
    out.extend_from_slice(&prompt);
    out.push(suf);
    out.extend_from_slice(&suffix[..n_suffix_take]);
    out.push(mid);
    Ok((out, truncated))
}

/// POST /infill.
pub async fn infill(
    State(state): State<AppState>,
    ApiJson(mut body): ApiJson<InfillBody>,
) -> Result<Response, ApiError> {
    let (model, target) = state.target(body.model.as_deref())?;
    let engine = match target {
        Target::Local(e) => e,
        Target::Remote(_) => {
            let why = "a provider target; infill needs a local model with FIM tokens";
            return Err(ApiError::bad_field("model", format!("{model} is {why}")));
        }
    };
    if let Some(e) = ApiError::cannot_generate(&engine) {
        return Err(e);
    }
    // The body is checked first, so bad input is named on any model.
    let req = check(&body)?;
    let info = engine.info();
    fim_of(&info.model.fim)?;
    if body.options.max_tokens.is_none() {
        match body.n_predict {
            Some(n) if n >= 0 => {
                body.options.max_tokens = Some(u32::try_from(n).unwrap_or(u32::MAX))
            }
            _ => {}
        }
    }
    let vocab = engine.vocab().clone();
    let tok = |text: &str, special: bool| {
        vocab
            .tokenize(text, false, special)
            .map_err(|e| ApiError::bad_request(format!("tokenizing the infill input: {e}")))
    };
    let (tokens, truncated) = build_prompt(
        &req,
        &info.model.fim,
        (info.model.bos, info.model.add_bos),
        info.n_ctx as usize,
        N_BATCH,
        &tok,
    )?;
    let prompt_text = prompt_text(vocab.as_ref(), &tokens);
    let gen = request_from_text_options(
        &body.options,
        &info.sampling,
        PromptInput::Tokens(tokens.clone()),
    )?;
    let handle = engine.generate(gen).map_err(ApiError::from)?;
    let return_tokens = body.return_tokens.unwrap_or(false);
    let answer = move |model: String, c: Completion| InfillResponse {
        model,
        tokens_predicted: c.usage.completion_tokens,
        tokens: return_tokens.then_some(c.tokens),
        content: c.text,
        stop: true,
        stop_type: stop_type(c.finish_reason),
        tokens_evaluated: tokens.len(),
        prompt: prompt_text.clone(),
        prompt_tokens: tokens.clone(),
        truncated,
    };
    if body.stream == Some(true) {
        // llama-server's stream: `{"content", "stop": false}` pieces, then the
        // whole answer with `stop: true` and empty `content`.
        let st = state.clone();
        let render = move |item: StreamItem| match item {
            StreamItem::Delta(_, d) if d.text.is_empty() && d.tokens.is_empty() => Vec::new(),
            StreamItem::Delta(_, d) => {
                let mut piece = json!({"content": d.text, "stop": false});
                if return_tokens {
                    piece["tokens"] = json!(d.tokens);
                }
                vec![json_event(&piece)]
            }
            StreamItem::Finished(_, c) => {
                st.finished(&model, &c);
                let mut last = answer(model.clone(), c);
                last.content = String::new();
                last.tokens = return_tokens.then(Vec::new);
                vec![json_event(&last)]
            }
            StreamItem::Failed(_, e) => vec![json_event(&json!({"error": e.body().error}))],
        };
        return Ok(sse(vec![handle], render, Vec::new).into_response());
    }
    let c = handle.completion().await.map_err(ApiError::from)?;
    state.finished(&model, &c);
    Ok(Json(answer(model, c)).into_response())
}

/// llama-server's `stop_type`.
fn stop_type(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "limit",
        FinishReason::Stop => "word",
        _ => "eos",
    }
}

fn prompt_text(vocab: &dyn Vocab, tokens: &[Token]) -> String {
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| vocab.token_bytes_special(t))
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> InfillBody {
        serde_json::from_value(v).expect("a body")
    }

    /// A tokenizer of one token per byte (ids 100+), for prompt layout tests.
    fn bytes(text: &str, _special: bool) -> Result<Vec<Token>, ApiError> {
        Ok(text.bytes().map(|b| 100 + Token::from(b)).collect())
    }

    const FIM: FimTokens = FimTokens {
        pre: Some(1),
        suf: Some(2),
        mid: Some(3),
        pad: None,
        rep: Some(4),
        sep: Some(5),
    };

    #[test]
    fn stop_types_are_llama_servers() {
        assert_eq!(stop_type(FinishReason::Length), "limit");
        assert_eq!(stop_type(FinishReason::Stop), "word");
        assert_eq!(stop_type(FinishReason::Eos), "eos");
    }

    #[test]
    fn bad_fields_are_named() {
        for (v, field, says) in [
            (json!({"input_suffix": ""}), "input_prefix", "required"),
            (json!({"input_prefix": ""}), "input_suffix", "required"),
            (
                json!({"input_prefix": 1, "input_suffix": ""}),
                "input_prefix",
                "string",
            ),
            (
                json!({"input_prefix": "", "input_suffix": "", "prompt": []}),
                "prompt",
                "string",
            ),
            (
                json!({"input_prefix": "", "input_suffix": "", "input_extra": "x"}),
                "input_extra",
                "array",
            ),
            (
                json!({"input_prefix": "", "input_suffix": "", "input_extra": ["x"]}),
                "input_extra",
                "input_extra[0]",
            ),
            (
                json!({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}),
                "input_extra",
                "text",
            ),
            (
                json!({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "", "filename": 2}]}),
                "input_extra",
                "filename",
            ),
        ] {
            let e = check(&body(v.clone())).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(field), "{v}");
            assert!(e.message.contains(says), "{v}: {}", e.message);
        }
    }

    #[test]
    fn prompt_follows_llama_server_layout() {
        let c = check(&body(json!({
            "input_prefix": "ab", "input_suffix": "c", "prompt": "p",
            "input_extra": [{"filename": "f", "text": "x"}, {"text": "y"}]
        })))
        .expect("ok");
        assert_eq!(c.extra[1].filename, "tmp");
        let (t, cut) = build_prompt(&c, &FIM, (Some(9), true), 8192, 2048, &bytes).expect("built");
        assert!(!cut);
        let b = |s: &str| bytes(s, false).expect("tokens");
        let mut want = vec![4];
        want.extend(b("myproject\n"));
        want.push(5);
        want.extend(b("f\n"));
        want.extend(b("x"));
        want.push(5);
        want.extend(b("tmp\n"));
        want.extend(b("y"));
        want.push(5);
        want.extend(b("filename\n"));
        want.extend([9, 1]);
        want.extend(b("abp"));
        want.push(2);
        want.extend(b("c"));
        want.push(3);
        assert_eq!(t, want);
    }

    #[test]
    fn truncation_keeps_the_prefix_end_and_the_suffix_start() {
        let c = check(&body(
            json!({"input_prefix": "abcdefgh", "input_suffix": "ijklmnop"}),
        ))
        .expect("ok");
        // n_batch 8: prefix keeps 6, suffix keeps 8/4 - 2 = 0; n_ctx 8 keeps 2 extra.
        let (t, cut) = build_prompt(&c, &FIM, (None, false), 8, 8, &bytes).expect("built");
        assert!(cut);
        let b = |s: &str| bytes(s, false).expect("tokens");
        let mut want = b("e\n");
        want.push(1);
        want.extend(b("cdefgh"));
        want.extend([2, 3]);
        assert_eq!(t, want);
    }

    #[test]
    fn models_without_fim_tokens_are_refused() {
        let e = fim_of(&FimTokens::default()).expect_err("refused");
        assert!(
            e.message.contains("prefix, suffix, middle"),
            "{}",
            e.message
        );
        let e = fim_of(&FimTokens { mid: None, ..FIM }).expect_err("refused");
        assert!(e.message.ends_with("FIM middle token"), "{}", e.message);
    }
}
