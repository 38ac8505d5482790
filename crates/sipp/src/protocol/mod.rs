//! Wire types shared by the server and the client: OpenAI's API (with
//! llama-server's extensions) and sipp's first-party profile, and how their
//! fields become a [`GenerateRequest`].
//!
//! Only wire shapes are checked here (a `logit_bias` key that is not a token
//! id, an integer that does not fit the engine's type, two ways of asking for
//! one thing); each field's rule and limit is the engine's
//! ([`crate::engine::validate`]); [`FieldNames`] tells how a request calls the
//! engine's fields, for errors to name the field the user sent.

pub mod anthropic;
pub mod native;
pub mod openai;
pub mod responses;

use crate::engine::{EngineError, GenerateRequest, PromptInput};
use crate::sampling::{BiasTarget, LogitBias, OutputConstraint, SamplingParams};

fn invalid(field: &'static str, message: impl Into<String>) -> EngineError {
    EngineError::InvalidRequest {
        field,
        message: message.into(),
    }
}

/// A wire integer as the engine's unsigned count. Refuses only what the
/// engine's type cannot hold; the count's own rule (at least 1, at most 20...)
/// is the engine's.
pub fn wire_count(field: &'static str, n: i64) -> Result<u32, EngineError> {
    u32::try_from(n).map_err(|_| {
        if n < 0 {
            invalid(field, format!("must not be negative, got {n}"))
        } else {
            invalid(field, format!("{n} is too large"))
        }
    })
}

/// How a request names the engine's fields where the two differ (OpenAI chat's
/// `top_logprobs` is the engine's `logprobs`), so that an error names the field
/// the user sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldNames(Vec<(&'static str, &'static str)>);

impl FieldNames {
    /// No renames: the request uses the engine's names.
    pub fn new() -> Self {
        Self::default()
    }

    /// The engine's `engine` field is `wire` in this request.
    pub fn rename(mut self, engine: &'static str, wire: &'static str) -> Self {
        self.0.push((engine, wire));
        self
    }

    /// The request's name for an engine field.
    pub fn wire_name(&self, engine: &'static str) -> &'static str {
        self.0
            .iter()
            .find(|(e, _)| *e == engine)
            .map_or(engine, |(_, w)| w)
    }

    /// The (engine name, request name) pairs.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &'static str)> + '_ {
        self.0.iter().copied()
    }

    /// The names of an OpenAI completions request (`n_predict` when it gave
    /// that instead of `max_tokens`).
    pub fn openai_completion(req: &openai::CompletionRequest) -> Self {
        let names = Self::openai_sampling();
        if req.max_tokens.is_none() && req.n_predict.is_some() {
            names.rename("max_tokens", "n_predict")
        } else {
            names
        }
    }

    /// The names of an OpenAI chat request: `top_logprobs`, and
    /// `max_completion_tokens` when it gave that.
    pub fn openai_chat(req: &openai::ChatCompletionRequest) -> Self {
        let names = Self::openai_sampling().rename("logprobs", "top_logprobs");
        if req.max_completion_tokens.is_some() {
            names.rename("max_tokens", "max_completion_tokens")
        } else {
            names
        }
    }

    /// llama-server's names for the sampling fields both OpenAI requests carry.
    fn openai_sampling() -> Self {
        Self::new().rename("penalty_last_n", "repeat_last_n")
    }
}

/// Picks at most one output constraint from the ways a request can ask.
fn one_constraint(
    grammar: Option<&String>,
    json_schema: Option<&serde_json::Value>,
    json_mode: bool,
) -> Result<Option<OutputConstraint>, EngineError> {
    let mut found = Vec::new();
    if let Some(g) = grammar {
        found.push(OutputConstraint::Grammar(g.clone()));
    }
    if let Some(s) = json_schema {
        found.push(OutputConstraint::JsonSchema(s.clone()));
    }
    if json_mode {
        found.push(OutputConstraint::JsonObject);
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(invalid(
            "grammar",
            "give at most one of `grammar`, `json_schema` and a JSON `response_format`",
        )),
    }
}

/// The first-party options over an endpoint's default sampling settings.
pub fn request_from_text_options(
    o: &native::TextOptions,
    defaults: &SamplingParams,
    prompt: PromptInput,
) -> Result<GenerateRequest, EngineError> {
    let mut sampling = o.sampling.clone().unwrap_or_else(|| defaults.clone());
    if let Some(t) = o.temperature {
        sampling.temperature = t;
    }
    if let Some(p) = o.top_p {
        sampling.top_p = p;
    }
    if let Some(s) = o.seed {
        sampling.seed = Some(s);
    }
    Ok(GenerateRequest {
        prompt,
        max_tokens: o.max_tokens,
        stop: o.stop.clone(),
        ignore_eos: o.ignore_eos.unwrap_or(false),
        sampling: Some(sampling),
        constraint: one_constraint(
            o.grammar.as_ref(),
            o.json_schema.as_ref(),
            o.json_mode.unwrap_or(false),
        )?,
        logprobs: o.logprobs,
        context_key: o.context_key.clone(),
        cache_prompt: o.cache_prompt.unwrap_or(true),
        repeatable: o.repeatable.unwrap_or(false),
        speculative: o.speculative,
        lora: o.lora.clone(),
        ..GenerateRequest::new(PromptInput::Text(String::new()))
    })
}

/// OpenAI fields over an endpoint's default sampling settings. `max_tokens`
/// and `logprobs` (top alternatives per token) come as the request gave them;
/// the engine checks them when the request is submitted.
pub fn request_from_openai(
    f: &openai::SamplingFields,
    max_tokens: Option<i64>,
    logprobs: Option<i64>,
    response_format: Option<&openai::ResponseFormat>,
    defaults: &SamplingParams,
    prompt: PromptInput,
) -> Result<GenerateRequest, EngineError> {
    let mut s = defaults.clone();
    macro_rules! set {
        ($($field:ident => $target:ident),*) => {$(
            if let Some(v) = f.$field { s.$target = v; }
        )*};
    }
    set!(temperature => temperature, top_p => top_p, top_k => top_k, min_p => min_p, typical_p => typical_p,
         presence_penalty => presence_penalty, frequency_penalty => frequency_penalty,
         repeat_penalty => repeat_penalty, repeat_last_n => penalty_last_n, mirostat => mirostat,
         mirostat_tau => mirostat_tau, mirostat_eta => mirostat_eta);
    if let Some(seed) = f.seed {
        s.seed =
            match seed {
                n if n < 0 => None,
                n => Some(u32::try_from(n).map_err(|_| {
                    invalid("seed", format!("must be at most {}, got {n}", u32::MAX))
                })?),
            };
    }
    if let Some(order) = &f.samplers {
        s.samplers = Some(SamplingParams::parse_order(order)?);
    }
    if let Some(b) = &f.json_bounds {
        s.json_bounds = b.over(s.json_bounds);
    }
    if let Some(bias) = &f.logit_bias {
        for (k, v) in bias {
            let token: i32 = k
                .trim()
                .parse()
                .map_err(|_| invalid("logit_bias", format!("keys must be token ids, got {k:?}")))?;
            s.logit_bias.push(LogitBias {
                target: BiasTarget::Token(token),
                bias: *v,
            });
        }
    }
    let max_tokens = max_tokens
        .map(|n| wire_count("max_tokens", n))
        .transpose()?;
    let logprobs = logprobs.map(|n| wire_count("logprobs", n)).transpose()?;
    let (schema, json_mode) = match response_format {
        None | Some(openai::ResponseFormat::Text) => (None, false),
        Some(openai::ResponseFormat::JsonObject) => (None, true),
        Some(openai::ResponseFormat::JsonSchema { json_schema }) => (
            Some(
                json_schema
                    .schema
                    .clone()
                    .ok_or_else(|| invalid("response_format", "json_schema.schema is required"))?,
            ),
            false,
        ),
    };
    let schema = match (schema, f.json_schema.as_ref()) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "json_schema",
                "give either `json_schema` or a json_schema `response_format`, not both",
            ))
        }
        (Some(a), None) => Some(a),
        (None, b) => b.cloned(),
    };
    Ok(GenerateRequest {
        prompt,
        max_tokens,
        stop: f
            .stop
            .clone()
            .map(openai::StopField::into_vec)
            .unwrap_or_default(),
        ignore_eos: f.ignore_eos.unwrap_or(false),
        sampling: Some(s),
        constraint: one_constraint(f.grammar.as_ref(), schema.as_ref(), json_mode)?,
        logprobs,
        context_key: None,
        cache_prompt: f.cache_prompt.unwrap_or(true),
        repeatable: f.repeatable.unwrap_or(false),
        speculative: f.speculative,
        lora: f.lora.clone(),
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
        include_stop: f
            .no_stop_trim
            .or(f.include_stop_str_in_output)
            .unwrap_or(false),
        ..GenerateRequest::new(PromptInput::Text(String::new()))
    })
}

#[cfg(test)]
mod tests {
    use super::openai::*;
    use super::*;

    #[test]
    fn openai_fields_map_onto_sampling() {
        let f: SamplingFields = serde_json::from_value(serde_json::json!({
            "temperature": 0.2, "top_k": 5, "seed": 7, "stop": "END",
            "logit_bias": {"42": -100}, "repeat_penalty": 1.1, "grammar": "root ::= \"a\""
        }))
        .expect("parses");
        let r = request_from_openai(
            &f,
            Some(10),
            None,
            None,
            &SamplingParams::default(),
            "x".into(),
        )
        .expect("maps");
        let s = r.sampling.expect("sampling");
        assert_eq!((s.temperature, s.top_k, s.seed), (0.2, 5, Some(7)));
        assert_eq!(s.logit_bias[0].effective_bias(), f32::NEG_INFINITY);
        assert_eq!(r.stop, vec!["END".to_string()]);
        assert_eq!(r.max_tokens, Some(10));
        assert!(matches!(r.constraint, Some(OutputConstraint::Grammar(_))));
    }

    #[test]
    fn bad_openai_fields_name_themselves() {
        let d = SamplingParams::default();
        let f = SamplingFields::default();
        let e = request_from_openai(&f, Some(-5), None, None, &d, "x".into()).expect_err("refused");
        assert!(e.to_string().contains("`max_tokens`"), "{e}");
        let f = SamplingFields {
            logit_bias: Some([("abc".to_string(), 1.0)].into()),
            ..Default::default()
        };
        let e = request_from_openai(&f, None, None, None, &d, "x".into()).expect_err("refused");
        assert!(e.to_string().contains("`logit_bias`"), "{e}");
        let f = SamplingFields {
            grammar: Some("root ::= \"a\"".into()),
            ..Default::default()
        };
        let e = request_from_openai(
            &f,
            None,
            None,
            Some(&ResponseFormat::JsonObject),
            &d,
            "x".into(),
        )
        .expect_err("refused");
        assert!(e.to_string().contains("at most one"), "{e}");
        let f = SamplingFields {
            samplers: Some(vec!["nope".into()]),
            ..Default::default()
        };
        let e = request_from_openai(&f, None, None, None, &d, "x".into()).expect_err("refused");
        assert!(e.to_string().contains("`samplers`"), "{e}");
    }

    #[test]
    fn counts_are_narrowed_here_and_ruled_by_the_engine() {
        let d = SamplingParams::default();
        let f = SamplingFields::default();
        // Past the engine's limits, but the engine's type holds them: the
        // engine decides (and says so naming the field).
        let r =
            request_from_openai(&f, Some(1 << 20), Some(21), None, &d, "x".into()).expect("maps");
        assert_eq!((r.max_tokens, r.logprobs), (Some(1 << 20), Some(21)));
        let e = crate::engine::validate::logprobs(r.logprobs.expect("given")).expect_err("refused");
        assert!(e.to_string().contains("`logprobs`"), "{e}");
        // What the engine's type cannot hold is refused here, naming the field.
        for (max_tokens, logprobs, field) in [
            (Some(-1), None, "`max_tokens`"),
            (Some(1 << 40), None, "`max_tokens`"),
            (None, Some(-1), "`logprobs`"),
            (None, Some(1 << 40), "`logprobs`"),
        ] {
            let e = request_from_openai(&f, max_tokens, logprobs, None, &d, "x".into())
                .expect_err("refused");
            assert!(e.to_string().contains(field), "{e} should name {field}");
        }
        assert_eq!(wire_count("n", 0).expect("fits"), 0);
        assert_eq!(wire_count("n", u32::MAX.into()).expect("fits"), u32::MAX);
    }

    #[test]
    fn openai_requests_name_the_engine_fields_their_way() {
        let chat: ChatCompletionRequest = serde_json::from_value(serde_json::json!({
            "messages": [], "logprobs": true, "top_logprobs": 3, "max_completion_tokens": 4
        }))
        .expect("parses");
        let names = FieldNames::openai_chat(&chat);
        assert_eq!(names.wire_name("logprobs"), "top_logprobs");
        assert_eq!(names.wire_name("max_tokens"), "max_completion_tokens");
        assert_eq!(names.wire_name("penalty_last_n"), "repeat_last_n");
        assert_eq!(names.wire_name("stop"), "stop");
        let chat = ChatCompletionRequest {
            max_tokens: Some(4),
            ..Default::default()
        };
        assert_eq!(
            FieldNames::openai_chat(&chat).wire_name("max_tokens"),
            "max_tokens"
        );
        let cmpl = CompletionRequest {
            n_predict: Some(4),
            ..Default::default()
        };
        let names = FieldNames::openai_completion(&cmpl);
        assert_eq!(names.wire_name("max_tokens"), "n_predict");
        assert_eq!(names.wire_name("logprobs"), "logprobs");
        let cmpl = CompletionRequest {
            max_tokens: Some(4),
            n_predict: Some(4),
            ..Default::default()
        };
        assert_eq!(
            FieldNames::openai_completion(&cmpl).wire_name("max_tokens"),
            "max_tokens"
        );
    }

    #[test]
    fn json_bounds_switch_off_or_override_the_targets() {
        let d = SamplingParams::default();
        let bounds_of = |v: serde_json::Value| {
            let f: SamplingFields =
                serde_json::from_value(serde_json::json!({ "json_bounds": v })).expect("parses");
            request_from_openai(&f, None, None, None, &d, "x".into())
                .expect("maps")
                .sampling
                .expect("sampling")
                .json_bounds
        };
        use crate::sampling::JsonBounds;
        assert_eq!(bounds_of(serde_json::json!(false)), JsonBounds::unbounded());
        assert_eq!(bounds_of(serde_json::json!(true)), JsonBounds::default());
        let b = bounds_of(serde_json::json!({"max_string_chars": 40}));
        assert_eq!(b.max_string_chars, 40);
        assert_eq!(b.max_depth, JsonBounds::default().max_depth);
        assert!(serde_json::from_value::<SamplingFields>(
            serde_json::json!({"json_bounds": {"max_strings": 3}})
        )
        .is_err());
    }
}
