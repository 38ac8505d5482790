//! Sampling settings, their validation, output constraints (GBNF grammars, JSON
//! mode, JSON schema) and the key the sampler cache is indexed by.
//!
//! This module describes and checks settings and plans the sampler chain
//! ([`sampler_plan`]); the runtime only maps each planned stage to its llama.cpp
//! sampler. [`SamplerPool`] keeps built samplers for reuse.

mod bounds;
mod chain;
mod constraint;
mod pool;

pub use bounds::JsonBounds;
pub use chain::{
    look_back, sampler_chain, sampler_plan, ChainStage, GrammarPlacement, SamplerPlan, MIN_KEEP,
    MIROSTAT_M,
};
pub use constraint::{check_schema_supported, prefix_rules, ComposedGrammar, OutputConstraint};
pub use pool::SamplerPool;

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// One stage of the sampler chain, by llama.cpp's name for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplerStage {
    /// Repetition, frequency and presence penalties.
    Penalties,
    /// DRY ("don't repeat yourself") penalty.
    Dry,
    /// Top-n-sigma filtering.
    TopNSigma,
    /// Keep the k most likely tokens.
    TopK,
    /// Locally typical sampling.
    #[serde(alias = "typical", alias = "typ_p")]
    TypicalP,
    /// Nucleus sampling.
    TopP,
    /// Drop tokens below min_p times the best probability.
    MinP,
    /// Exclude top choices.
    Xtc,
    /// Temperature scaling.
    Temperature,
}

impl SamplerStage {
    /// llama.cpp's default order (`common_params_sampling::samplers`).
    pub const DEFAULT_ORDER: [SamplerStage; 9] = [
        SamplerStage::Penalties,
        SamplerStage::Dry,
        SamplerStage::TopNSigma,
        SamplerStage::TopK,
        SamplerStage::TypicalP,
        SamplerStage::TopP,
        SamplerStage::MinP,
        SamplerStage::Xtc,
        SamplerStage::Temperature,
    ];
}

impl FromStr for SamplerStage {
    type Err = SamplingError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "penalties" => Self::Penalties,
            "dry" => Self::Dry,
            "top_n_sigma" => Self::TopNSigma,
            "top_k" => Self::TopK,
            "typical_p" | "typ_p" | "typical" => Self::TypicalP,
            "top_p" => Self::TopP,
            "min_p" => Self::MinP,
            "xtc" => Self::Xtc,
            "temperature" => Self::Temperature,
            other => {
                return Err(SamplingError::Invalid {
                    field: "samplers",
                    message: format!(
                        "unknown sampler `{other}` (known: penalties, dry, top_n_sigma, top_k, \
                         typical_p, top_p, min_p, xtc, temperature)"
                    ),
                })
            }
        })
    }
}

/// What a logit bias applies to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BiasTarget {
    /// A token id.
    Token(i32),
    /// Every token of this text, as the model tokenizes it.
    Text(String),
}

/// A bias added to a token's logit. `-inf` (or anything at or below -100, as in
/// OpenAI's API) bans the token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogitBias {
    /// The token or text.
    pub target: BiasTarget,
    /// Added to the logit.
    pub bias: f32,
}

impl LogitBias {
    /// The rule of a `logit_bias` entry: a bias below +inf (not NaN), a token
    /// id in the vocabulary (`0..n_vocab`, or only `>= 0` when no vocabulary
    /// is known), a text that is not empty.
    pub fn validate(&self, n_vocab: Option<usize>) -> Result<(), SamplingError> {
        let bias = self.bias;
        check(
            !bias.is_nan() && bias != f32::INFINITY,
            "logit_bias",
            || format!("bias must be a number below +inf, got {bias}"),
        )?;
        match &self.target {
            BiasTarget::Token(t) => {
                let t = *t;
                check(t >= 0, "logit_bias", || {
                    format!("token id must be >= 0, got {t}")
                })?;
                if let Some(n) = n_vocab {
                    check((t as usize) < n, "logit_bias", || {
                        format!("token id {t} is outside the vocabulary (0..{n})")
                    })?;
                }
            }
            BiasTarget::Text(s) => {
                check(!s.is_empty(), "logit_bias", || {
                    "text must not be empty".into()
                })?;
            }
        }
        Ok(())
    }

    /// The bias llama.cpp should apply: OpenAI's "-100 bans" made exact.
    pub fn effective_bias(&self) -> f32 {
        if self.bias <= -100.0 {
            f32::NEG_INFINITY
        } else {
            self.bias
        }
    }
}

/// Sampling settings. Defaults match llama.cpp's `common_params_sampling`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 means greedy. Default 0.8.
    pub temperature: f32,
    /// 0 disables. Default 40.
    pub top_k: i32,
    /// In (0, 1]; 1 disables. Default 0.95.
    pub top_p: f32,
    /// In [0, 1]; 0 disables. Default 0.05.
    pub min_p: f32,
    /// In (0, 1]; 1 disables. Default 1.0.
    pub typical_p: f32,
    /// Top-n-sigma; negative disables. Default -1.
    pub top_n_sigma: f32,
    /// Repetition penalty; 1 disables. Default 1.0.
    pub repeat_penalty: f32,
    /// OpenAI-style frequency penalty; 0 disables. Default 0.
    pub frequency_penalty: f32,
    /// OpenAI-style presence penalty; 0 disables. Default 0.
    pub presence_penalty: f32,
    /// Tokens the penalties look back over; -1 means the whole context. Default 64.
    pub penalty_last_n: i32,
    /// 0 off, 1 Mirostat, 2 Mirostat 2.0. Default 0.
    pub mirostat: u8,
    /// Mirostat target entropy. Default 5.0.
    pub mirostat_tau: f32,
    /// Mirostat learning rate. Default 0.1.
    pub mirostat_eta: f32,
    /// DRY multiplier; 0 disables. Default 0.
    pub dry_multiplier: f32,
    /// DRY base. Default 1.75.
    pub dry_base: f32,
    /// DRY allowed length. Default 2.
    pub dry_allowed_length: i32,
    /// DRY look-back; -1 means the whole context. Default -1.
    pub dry_penalty_last_n: i32,
    /// DRY sequence breakers. Default newline, colon, quote, asterisk.
    pub dry_sequence_breakers: Vec<String>,
    /// XTC probability; 0 disables. Default 0.
    pub xtc_probability: f32,
    /// XTC threshold. Default 0.1.
    pub xtc_threshold: f32,
    /// Logit biases.
    pub logit_bias: Vec<LogitBias>,
    /// Random seed; `None` draws one per request.
    pub seed: Option<u32>,
    /// Explicit sampler order; `None` means llama.cpp's default order.
    pub samplers: Option<Vec<SamplerStage>>,
    /// Bounds on JSON mode and on what a JSON schema leaves open (string
    /// length, array items, members, depth), so constrained output stays
    /// finite. Default: `JsonBounds::default()`.
    pub json_bounds: JsonBounds,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            top_n_sigma: -1.0,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            penalty_last_n: 64,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: -1,
            dry_sequence_breakers: ["\n", ":", "\"", "*"].map(String::from).to_vec(),
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            logit_bias: Vec::new(),
            seed: None,
            samplers: None,
            json_bounds: JsonBounds::default(),
        }
    }
}

/// Settings that cannot be used, named by field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A field is outside its range.
    #[error("invalid `{field}`: {message}")]
    Invalid {
        /// The field as a request names it.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A GBNF grammar that llama.cpp cannot parse.
    #[error("invalid `grammar`: {0}")]
    Grammar(String),
    /// A JSON schema that cannot be turned into a grammar.
    #[error("invalid `json_schema`: {0}")]
    Schema(String),
}

fn check(
    ok: bool,
    field: &'static str,
    message: impl FnOnce() -> String,
) -> Result<(), SamplingError> {
    if ok {
        Ok(())
    } else {
        Err(SamplingError::Invalid {
            field,
            message: message(),
        })
    }
}

impl SamplingParams {
    /// Greedy settings: temperature 0, nothing else.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Every optional stage at its neutral value and temperature 1: the chain
    /// draws from the distribution exactly as the model gives it.
    pub fn neutral() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            typical_p: 1.0,
            top_n_sigma: -1.0,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            dry_multiplier: 0.0,
            xtc_probability: 0.0,
            ..Self::default()
        }
    }

    /// Whether the chain picks the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.mirostat == 0
    }

    /// The sampler order in effect.
    pub fn order(&self) -> &[SamplerStage] {
        self.samplers
            .as_deref()
            .unwrap_or(&SamplerStage::DEFAULT_ORDER)
    }

    /// Checks every field; the error names the first bad one. `logit_bias`
    /// token ids are checked against no vocabulary (see
    /// [`Self::validate_for_vocab`]): this is the check of settings given
    /// before a model is known, such as a configuration's defaults.
    pub fn validate(&self) -> Result<(), SamplingError> {
        self.check_fields(None)
    }

    /// Checks every field, `logit_bias` token ids against a vocabulary of
    /// `n_vocab` tokens; the error names the first bad field.
    pub fn validate_for_vocab(&self, n_vocab: usize) -> Result<(), SamplingError> {
        self.check_fields(Some(n_vocab))
    }

    fn check_fields(&self, n_vocab: Option<usize>) -> Result<(), SamplingError> {
        let t = self.temperature;
        check(t.is_finite() && t >= 0.0, "temperature", || {
            format!("must be a finite number >= 0, got {t}")
        })?;
        let p = self.top_p;
        check(p > 0.0 && p <= 1.0, "top_p", || {
            format!("must be in (0, 1], got {p}")
        })?;
        let m = self.min_p;
        check((0.0..=1.0).contains(&m), "min_p", || {
            format!("must be in [0, 1], got {m}")
        })?;
        let ty = self.typical_p;
        check(ty > 0.0 && ty <= 1.0, "typical_p", || {
            format!("must be in (0, 1], got {ty}")
        })?;
        check(self.top_k >= 0, "top_k", || {
            format!("must be >= 0 (0 disables), got {}", self.top_k)
        })?;
        check(self.top_n_sigma.is_finite(), "top_n_sigma", || {
            "must be finite".into()
        })?;
        let rp = self.repeat_penalty;
        check(rp.is_finite() && rp > 0.0, "repeat_penalty", || {
            format!("must be a finite number > 0, got {rp}")
        })?;
        let fp = self.frequency_penalty;
        check(
            fp.is_finite() && (-2.0..=2.0).contains(&fp),
            "frequency_penalty",
            || format!("must be in [-2, 2], got {fp}"),
        )?;
        let pp = self.presence_penalty;
        check(
            pp.is_finite() && (-2.0..=2.0).contains(&pp),
            "presence_penalty",
            || format!("must be in [-2, 2], got {pp}"),
        )?;
        check(self.penalty_last_n >= -1, "penalty_last_n", || {
            format!("must be >= -1, got {}", self.penalty_last_n)
        })?;
        check(self.mirostat <= 2, "mirostat", || {
            format!("must be 0, 1 or 2, got {}", self.mirostat)
        })?;
        check(
            self.mirostat_tau.is_finite() && self.mirostat_tau > 0.0,
            "mirostat_tau",
            || format!("must be > 0, got {}", self.mirostat_tau),
        )?;
        check(
            self.mirostat_eta.is_finite() && self.mirostat_eta > 0.0,
            "mirostat_eta",
            || format!("must be > 0, got {}", self.mirostat_eta),
        )?;
        check(
            self.dry_multiplier.is_finite() && self.dry_multiplier >= 0.0,
            "dry_multiplier",
            || format!("must be >= 0, got {}", self.dry_multiplier),
        )?;
        check(
            self.dry_base.is_finite() && self.dry_base >= 1.0,
            "dry_base",
            || format!("must be >= 1, got {}", self.dry_base),
        )?;
        check(self.dry_allowed_length >= 0, "dry_allowed_length", || {
            format!("must be >= 0, got {}", self.dry_allowed_length)
        })?;
        check(self.dry_penalty_last_n >= -1, "dry_penalty_last_n", || {
            format!("must be >= -1, got {}", self.dry_penalty_last_n)
        })?;
        check(
            self.dry_sequence_breakers.iter().all(|b| !b.contains('\0')),
            "dry_sequence_breakers",
            || "must not contain NUL characters".into(),
        )?;
        check(
            (0.0..=1.0).contains(&self.xtc_probability),
            "xtc_probability",
            || format!("must be in [0, 1], got {}", self.xtc_probability),
        )?;
        check(
            (0.0..=1.0).contains(&self.xtc_threshold),
            "xtc_threshold",
            || format!("must be in [0, 1], got {}", self.xtc_threshold),
        )?;
        for b in &self.logit_bias {
            b.validate(n_vocab)?;
        }
        self.json_bounds.validate()?;
        if let Some(order) = &self.samplers {
            let mut seen = std::collections::HashSet::new();
            for s in order {
                check(seen.insert(*s), "samplers", || {
                    format!("`{s:?}` appears twice")
                })?;
            }
        }
        Ok(())
    }

    /// Parses a sampler order given as names ("top_k;top_p" or a list).
    pub fn parse_order<S: AsRef<str>>(names: &[S]) -> Result<Vec<SamplerStage>, SamplingError> {
        names.iter().map(|n| n.as_ref().trim().parse()).collect()
    }
}

/// What makes two requests' samplers interchangeable: the sampling settings and
/// the output constraint. Used to build a grammar sampler once per distinct key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SamplerCacheKey(String);

impl SamplerCacheKey {
    /// The key of these settings. The seed is left out: it is applied on reset.
    pub fn new(params: &SamplingParams, constraint: Option<&OutputConstraint>) -> Self {
        let mut p = params.clone();
        p.seed = None;
        let text = serde_json::to_string(&(p, constraint)).unwrap_or_default();
        Self(text)
    }
}

impl fmt::Display for SamplerCacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_field(p: SamplingParams) -> String {
        p.validate().expect_err("should be rejected").to_string()
    }

    #[test]
    fn defaults_are_valid_and_follow_llama_cpp_order() {
        let p = SamplingParams::default();
        p.validate().expect("valid");
        assert_eq!(p.order(), &SamplerStage::DEFAULT_ORDER);
        assert!(!p.is_greedy());
        assert!(SamplingParams::greedy().is_greedy());
    }

    #[test]
    fn bad_values_name_their_field() {
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams {
                    temperature: -0.1,
                    ..Default::default()
                },
                "`temperature`",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "`temperature`",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "`top_p`",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                },
                "`top_p`",
            ),
            (
                SamplingParams {
                    min_p: -1.0,
                    ..Default::default()
                },
                "`min_p`",
            ),
            (
                SamplingParams {
                    typical_p: 0.0,
                    ..Default::default()
                },
                "`typical_p`",
            ),
            (
                SamplingParams {
                    top_k: -3,
                    ..Default::default()
                },
                "`top_k`",
            ),
            (
                SamplingParams {
                    mirostat: 3,
                    ..Default::default()
                },
                "`mirostat`",
            ),
            (
                SamplingParams {
                    frequency_penalty: 9.0,
                    ..Default::default()
                },
                "`frequency_penalty`",
            ),
            (
                SamplingParams {
                    presence_penalty: -9.0,
                    ..Default::default()
                },
                "`presence_penalty`",
            ),
            (
                SamplingParams {
                    xtc_probability: 2.0,
                    ..Default::default()
                },
                "`xtc_probability`",
            ),
            (
                SamplingParams {
                    logit_bias: vec![LogitBias {
                        target: BiasTarget::Token(-1),
                        bias: 1.0,
                    }],
                    ..Default::default()
                },
                "`logit_bias`",
            ),
            (
                SamplingParams {
                    samplers: Some(vec![SamplerStage::TopK, SamplerStage::TopK]),
                    ..Default::default()
                },
                "`samplers`",
            ),
        ];
        for (p, field) in cases {
            let msg = err_field(p);
            assert!(msg.contains(field), "{msg} should name {field}");
        }
    }

    #[test]
    fn unknown_sampler_name_is_named() {
        let err = SamplingParams::parse_order(&["top_k", "wobble"]).expect_err("unknown name");
        let msg = err.to_string();
        assert!(
            msg.contains("`samplers`") && msg.contains("wobble"),
            "{msg}"
        );
        let ok = SamplingParams::parse_order(&["top_k", "typ_p", "temperature"]).expect("known");
        assert_eq!(
            ok,
            vec![
                SamplerStage::TopK,
                SamplerStage::TypicalP,
                SamplerStage::Temperature
            ]
        );
    }

    #[test]
    fn minus_hundred_bans() {
        let b = LogitBias {
            target: BiasTarget::Token(5),
            bias: -100.0,
        };
        assert_eq!(b.effective_bias(), f32::NEG_INFINITY);
        let b = LogitBias {
            target: BiasTarget::Token(5),
            bias: 3.0,
        };
        assert_eq!(b.effective_bias(), 3.0);
    }

    #[test]
    fn cache_key_ignores_seed_but_not_settings() {
        let a = SamplingParams {
            seed: Some(1),
            ..Default::default()
        };
        let b = SamplingParams {
            seed: Some(2),
            ..Default::default()
        };
        let c = SamplingParams {
            top_k: 7,
            ..Default::default()
        };
        assert_eq!(
            SamplerCacheKey::new(&a, None),
            SamplerCacheKey::new(&b, None)
        );
        assert_ne!(
            SamplerCacheKey::new(&a, None),
            SamplerCacheKey::new(&c, None)
        );
        let g = OutputConstraint::Grammar("root ::= \"a\"".into());
        assert_ne!(
            SamplerCacheKey::new(&a, Some(&g)),
            SamplerCacheKey::new(&a, None)
        );
    }
}
