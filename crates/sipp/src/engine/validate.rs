//! The rule and the limit of every generation and embedding request field, one
//! function each.
//!
//! Every entry point (the library client, the CLI, the server's OpenAI and
//! first-party routes) reaches [`RequestPreparer`](super::RequestPreparer),
//! which calls these; so the protocol layers leave the rules to the engine and
//! keep only what is theirs: parsing a wire shape into a
//! [`GenerateRequest`](super::GenerateRequest) (a `logit_bias` key that is not
//! a number, an integer that does not fit the engine's type) and naming the
//! engine's fields as their request does in errors (`top_logprobs` in OpenAI
//! chat is the engine's `logprobs`).
//!
//! | field | rule | function |
//! |---|---|---|
//! | `prompt` (token ids) | each in `0..n_vocab` | [`token_id`] |
//! | `prompt` | not empty, shorter than the context | [`prompt_length`] |
//! | `input` (embeddings) | at most one micro-batch | [`embedding_input_length`] |
//! | `max_tokens` | at least 1, at most the endpoint's limit | [`max_tokens`] |
//! | `logprobs` | at most [`MAX_TOP_LOGPROBS`] alternatives | [`logprobs`] |
//! | `stop` | at most [`MAX_STOP_STRINGS`] strings | [`stop`] |
//! | sampling fields, `logit_bias` | [`SamplingParams::validate_for_vocab`] | [`sampling`] |
//! | `grammar`, `json_schema` | parses, fits the vocabulary | [`constraint`] |

use crate::runtime::{Token, Vocab};
use crate::sampling::{JsonBounds, OutputConstraint, SamplingParams};

use super::EngineError;

/// Largest `logprobs` (top alternatives per token) a request may ask for:
/// OpenAI's limit on `top_logprobs` (llama-server sets none).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;

fn invalid(field: &'static str, message: String) -> EngineError {
    EngineError::InvalidRequest { field, message }
}

/// `max_tokens`: at least 1, and at most `endpoint_limit` when that is not 0.
pub fn max_tokens(n: u32, endpoint_limit: u32) -> Result<(), EngineError> {
    if n == 0 {
        return Err(invalid("max_tokens", "must be at least 1, got 0".into()));
    }
    if endpoint_limit > 0 && n > endpoint_limit {
        return Err(invalid(
            "max_tokens",
            format!("at most {endpoint_limit} on this endpoint, got {n}"),
        ));
    }
    Ok(())
}

/// `logprobs`: the number of top alternatives per token, 0 to
/// [`MAX_TOP_LOGPROBS`].
pub fn logprobs(n: u32) -> Result<(), EngineError> {
    if n > MAX_TOP_LOGPROBS {
        return Err(invalid(
            "logprobs",
            format!("must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
        ));
    }
    Ok(())
}

/// `speculative.n_max`: at most [`crate::config::MAX_DRAFT_TOKENS`].
pub fn draft_tokens(n: u32) -> Result<(), EngineError> {
    let max = crate::config::MAX_DRAFT_TOKENS;
    if n > max {
        return Err(invalid(
            "speculative.n_max",
            format!("must be between 0 and {max}, got {n}"),
        ));
    }
    Ok(())
}

/// `stop`: at most [`MAX_STOP_STRINGS`] strings.
pub fn stop(stop: &[String]) -> Result<(), EngineError> {
    if stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings, got {}",
                stop.len()
            ),
        ));
    }
    Ok(())
}

/// A token id given in `field` (a prompt's token ids, /detokenize's `tokens`):
/// in the vocabulary, `0..n_vocab`. Takes the widest integer a caller holds.
pub fn token_id(field: &'static str, t: i64, n_vocab: usize) -> Result<Token, EngineError> {
    if u64::try_from(t).is_ok_and(|t| t < n_vocab as u64) {
        Ok(t as Token)
    } else {
        Err(invalid(
            field,
            format!("token id {t} is outside the vocabulary (0..{n_vocab})"),
        ))
    }
}

/// A generation prompt of `tokens` tokens: not empty, and leaving room for at
/// least one generated token in a context of `n_ctx`.
pub fn prompt_length(tokens: usize, n_ctx: u32) -> Result<(), EngineError> {
    if tokens == 0 {
        return Err(EngineError::EmptyPrompt);
    }
    if tokens >= n_ctx as usize {
        return Err(EngineError::PromptTooLong {
            prompt_tokens: tokens,
            n_ctx,
        });
    }
    Ok(())
}

/// An embedding input of `tokens` tokens: not empty, at most `max` (one
/// micro-batch).
pub fn embedding_input_length(tokens: usize, max: usize) -> Result<(), EngineError> {
    if tokens == 0 {
        return Err(EngineError::EmptyPrompt);
    }
    if tokens > max {
        return Err(EngineError::InputTooLong { tokens, max });
    }
    Ok(())
}

/// The sampling fields, `logit_bias` token ids against a vocabulary of
/// `n_vocab`. Their rules live with the settings, in
/// [`SamplingParams::validate_for_vocab`], because a configuration's default
/// settings are checked by the same rules before any model is loaded.
pub fn sampling(params: &SamplingParams, n_vocab: usize) -> Result<(), EngineError> {
    Ok(params.validate_for_vocab(n_vocab)?)
}

/// `grammar` / `json_schema` / JSON mode: it parses, and this vocabulary can
/// write it within `bounds`.
pub fn constraint(
    c: &OutputConstraint,
    vocab: &dyn Vocab,
    bounds: &JsonBounds,
) -> Result<(), EngineError> {
    c.validate()?;
    vocab.check_constraint(c, bounds)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{BiasTarget, LogitBias};

    /// The field an error names, as the engine reports it.
    fn field_of(e: EngineError) -> String {
        match e {
            EngineError::InvalidRequest { field, .. } => field.to_string(),
            EngineError::Sampling(crate::sampling::SamplingError::Invalid { field, .. }) => {
                field.to_string()
            }
            other => panic!("not a field error: {other}"),
        }
    }

    #[test]
    fn max_tokens_from_one_to_the_endpoint_limit() {
        assert_eq!(
            field_of(max_tokens(0, 0).expect_err("refused")),
            "max_tokens"
        );
        assert_eq!(
            field_of(max_tokens(0, 100).expect_err("refused")),
            "max_tokens"
        );
        max_tokens(1, 0).expect("1 is the least");
        max_tokens(1, 100).expect("1 is the least");
        max_tokens(100, 100).expect("at the limit");
        let e = max_tokens(101, 100).expect_err("refused");
        assert!(e.to_string().contains("at most 100"), "{e}");
        assert_eq!(field_of(e), "max_tokens");
        max_tokens(u32::MAX, 0).expect("0 means no endpoint limit");
    }

    #[test]
    fn logprobs_up_to_the_top_logprobs_limit() {
        logprobs(0).expect("0: the chosen token only");
        logprobs(MAX_TOP_LOGPROBS).expect("at the limit");
        let e = logprobs(MAX_TOP_LOGPROBS + 1).expect_err("refused");
        assert!(e.to_string().contains("between 0 and 20, got 21"), "{e}");
        assert_eq!(field_of(e), "logprobs");
    }

    #[test]
    fn stop_strings_up_to_the_limit() {
        let strings = |n: usize| (0..n).map(|i| format!("s{i}")).collect::<Vec<_>>();
        stop(&[]).expect("none");
        stop(&strings(MAX_STOP_STRINGS)).expect("at the limit");
        let e = stop(&strings(MAX_STOP_STRINGS + 1)).expect_err("refused");
        assert!(e.to_string().contains("got 17"), "{e}");
        assert_eq!(field_of(e), "stop");
    }

    #[test]
    fn token_ids_inside_the_vocabulary() {
        assert_eq!(token_id("prompt", 0, 100).expect("first"), 0);
        assert_eq!(token_id("prompt", 99, 100).expect("last"), 99);
        let e = token_id("prompt", 100, 100).expect_err("refused");
        assert!(e.to_string().contains("(0..100)"), "{e}");
        assert_eq!(field_of(e), "prompt");
        assert_eq!(
            field_of(token_id("tokens", -1, 100).expect_err("refused")),
            "tokens"
        );
        assert_eq!(
            field_of(token_id("prompt", i64::MAX, 100).expect_err("refused")),
            "prompt"
        );
    }

    #[test]
    fn prompt_length_leaves_room_for_one_token() {
        assert!(matches!(prompt_length(0, 8), Err(EngineError::EmptyPrompt)));
        prompt_length(7, 8).expect("one token of room");
        assert!(matches!(
            prompt_length(8, 8),
            Err(EngineError::PromptTooLong {
                prompt_tokens: 8,
                n_ctx: 8
            })
        ));
    }

    #[test]
    fn embedding_input_up_to_one_micro_batch() {
        assert!(matches!(
            embedding_input_length(0, 8),
            Err(EngineError::EmptyPrompt)
        ));
        embedding_input_length(8, 8).expect("at the limit");
        assert!(matches!(
            embedding_input_length(9, 8),
            Err(EngineError::InputTooLong { tokens: 9, max: 8 })
        ));
    }

    #[test]
    fn logit_bias_token_ids_inside_the_vocabulary() {
        let with = |t: i32| SamplingParams {
            logit_bias: vec![LogitBias {
                target: BiasTarget::Token(t),
                bias: -100.0,
            }],
            ..SamplingParams::default()
        };
        sampling(&with(0), 100).expect("first");
        sampling(&with(99), 100).expect("last");
        let e = sampling(&with(100), 100).expect_err("refused");
        assert!(e.to_string().contains("(0..100)"), "{e}");
        assert_eq!(field_of(e), "logit_bias");
        assert_eq!(
            field_of(sampling(&with(-1), 100).expect_err("refused")),
            "logit_bias"
        );
        let nan = SamplingParams {
            logit_bias: vec![LogitBias {
                target: BiasTarget::Token(1),
                bias: f32::NAN,
            }],
            ..SamplingParams::default()
        };
        assert_eq!(
            field_of(sampling(&nan, 100).expect_err("refused")),
            "logit_bias"
        );
        let empty_text = SamplingParams {
            logit_bias: vec![LogitBias {
                target: BiasTarget::Text(String::new()),
                bias: 1.0,
            }],
            ..SamplingParams::default()
        };
        assert_eq!(
            field_of(sampling(&empty_text, 100).expect_err("refused")),
            "logit_bias"
        );
    }
}
