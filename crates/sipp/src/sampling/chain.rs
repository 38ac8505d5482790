//! The sampler chain as a plan: which llama.cpp samplers a request gets, in
//! which order and with which parameters, decided from [`SamplingParams`]
//! alone. The runtime only maps each [`ChainStage`] to its llama.cpp sampler.
//!
//! The order follows llama.cpp's `common_sampler_init` (what llama-server
//! runs): logit biases first; then either greedy (with penalties), Mirostat
//! (temperature, then Mirostat 1 or 2, in place of the whole configurable
//! tail), or the configurable stages in [`SamplingParams::order`] followed by
//! `dist`. A stage whose value leaves the distribution as it is (top-k 0, top-p
//! 1, min-p 0, typical 1, XTC probability 0, neutral penalties, DRY multiplier 0,
//! top-n-sigma <= 0, a look-back of 0) is left out. The grammar of an output
//! constraint is never in the chain: see [`GrammarPlacement`].

use super::{LogitBias, SamplerStage, SamplingParams};

/// `min_keep` of the truncating samplers (typical, top-p, min-p, XTC).
pub const MIN_KEEP: usize = 1;

/// Mirostat 1's `m`: how many of the most likely tokens estimate `s_hat`
/// (the paper's and llama.cpp's value).
pub const MIROSTAT_M: i32 = 100;

/// One llama.cpp sampler of the chain, with its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum ChainStage {
    /// `logit_bias`: adds each bias to its target's logits. The biases are
    /// already effective ([`LogitBias::effective_bias`]: -100 and below are
    /// -inf); text targets are tokenized by the runtime.
    LogitBias(Vec<LogitBias>),
    /// `penalties`: repetition, frequency and presence penalties over the last
    /// `last_n` tokens (-1: the whole context).
    Penalties {
        /// Look-back; -1 means the whole context.
        last_n: i32,
        /// Repetition penalty (1 is neutral).
        repeat: f32,
        /// Frequency penalty (0 is neutral).
        frequency: f32,
        /// Presence penalty (0 is neutral).
        presence: f32,
    },
    /// `dry`: "don't repeat yourself".
    Dry {
        /// Multiplier (0 disables).
        multiplier: f32,
        /// Base of the exponential penalty.
        base: f32,
        /// Repeats up to this length go unpenalized.
        allowed_length: i32,
        /// Look-back; -1 means the whole context.
        last_n: i32,
        /// Texts that end a repeated sequence.
        sequence_breakers: Vec<String>,
    },
    /// `top_n_sigma`.
    TopNSigma(f32),
    /// `top_k`.
    TopK(i32),
    /// `typical`: locally typical sampling.
    Typical {
        /// Cumulative probability kept.
        p: f32,
        /// Candidates always kept.
        min_keep: usize,
    },
    /// `top_p`: nucleus sampling.
    TopP {
        /// Cumulative probability kept.
        p: f32,
        /// Candidates always kept.
        min_keep: usize,
    },
    /// `min_p`: drops tokens below `p` times the best probability.
    MinP {
        /// Fraction of the best probability.
        p: f32,
        /// Candidates always kept.
        min_keep: usize,
    },
    /// `xtc`: exclude top choices.
    Xtc {
        /// Chance that it applies at a step.
        probability: f32,
        /// Tokens at or above this probability are the "top choices".
        threshold: f32,
        /// Candidates always kept.
        min_keep: usize,
        /// Seed of its own draw.
        seed: u32,
    },
    /// `temp`: divides the logits by the temperature.
    Temperature(f32),
    /// `mirostat` (version 1); picks the token.
    Mirostat {
        /// Target surprise, in bits.
        tau: f32,
        /// Learning rate.
        eta: f32,
        /// Tokens that estimate `s_hat` ([`MIROSTAT_M`]).
        m: i32,
        /// Seed.
        seed: u32,
    },
    /// `mirostat_v2`; picks the token.
    MirostatV2 {
        /// Target surprise, in bits.
        tau: f32,
        /// Learning rate.
        eta: f32,
        /// Seed.
        seed: u32,
    },
    /// `greedy`: picks the most likely token.
    Greedy,
    /// `dist`: draws a token from the distribution.
    Dist {
        /// Seed.
        seed: u32,
    },
}

/// Where the grammar of an output constraint goes.
///
/// It stays outside the chain, as in llama.cpp's `common_sampler`: the chain
/// picks from the whole row; the grammar checks that one token; only when it
/// rejects it does the grammar mask the candidates, and the chain picks again
/// among what is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarPlacement {
    /// No constraint: the chain alone picks.
    None,
    /// The chain picks; the grammar checks the pick and, when it refuses it,
    /// masks the candidates before the chain runs again.
    CheckThenResample,
}

/// What the runtime builds for one request's sampler.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerPlan {
    /// The chain, in order; it always ends with the stage that picks.
    pub chain: Vec<ChainStage>,
    /// Where the grammar goes.
    pub grammar: GrammarPlacement,
}

impl SamplerPlan {
    /// When the whole plan is an argmax with some tokens banned (greedy, no
    /// grammar, and no stage but biases that are all -inf): the banned
    /// targets, so the runtime can take the argmax of the row directly.
    pub fn argmax_bans(&self) -> Option<Vec<&LogitBias>> {
        if self.grammar != GrammarPlacement::None {
            return None;
        }
        match self.chain.as_slice() {
            [ChainStage::Greedy] => Some(Vec::new()),
            [ChainStage::LogitBias(biases), ChainStage::Greedy]
                if biases.iter().all(|b| b.bias == f32::NEG_INFINITY) =>
            {
                Some(biases.iter().collect())
            }
            _ => None,
        }
    }
}

/// The plan for these settings: the chain ([`sampler_chain`]) and where the
/// grammar goes when there is a constraint.
pub fn sampler_plan(params: &SamplingParams, constraint_present: bool, seed: u32) -> SamplerPlan {
    SamplerPlan {
        chain: sampler_chain(params, seed),
        grammar: if constraint_present {
            GrammarPlacement::CheckThenResample
        } else {
            GrammarPlacement::None
        },
    }
}

/// The llama.cpp samplers for these settings, in order. `seed` goes to every
/// stage that draws (XTC, Mirostat, dist).
pub fn sampler_chain(params: &SamplingParams, seed: u32) -> Vec<ChainStage> {
    let p = params;
    let mut chain = Vec::new();
    let biases: Vec<LogitBias> = p
        .logit_bias
        .iter()
        .map(|b| LogitBias {
            target: b.target.clone(),
            bias: b.effective_bias(),
        })
        .collect();
    if !biases.is_empty() {
        chain.push(ChainStage::LogitBias(biases));
    }
    let penalties = (p.penalty_last_n != 0
        && (p.repeat_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0))
        .then_some(ChainStage::Penalties {
            last_n: p.penalty_last_n,
            repeat: p.repeat_penalty,
            frequency: p.frequency_penalty,
            presence: p.presence_penalty,
        });
    if p.is_greedy() {
        chain.extend(penalties);
        chain.push(ChainStage::Greedy);
        return chain;
    }
    match p.mirostat {
        1 => {
            chain.push(ChainStage::Temperature(p.temperature));
            chain.push(ChainStage::Mirostat {
                tau: p.mirostat_tau,
                eta: p.mirostat_eta,
                m: MIROSTAT_M,
                seed,
            });
        }
        2 => {
            chain.push(ChainStage::Temperature(p.temperature));
            chain.push(ChainStage::MirostatV2 {
                tau: p.mirostat_tau,
                eta: p.mirostat_eta,
                seed,
            });
        }
        _ => {
            for stage in p.order() {
                let s = match stage {
                    SamplerStage::Penalties => penalties.clone(),
                    SamplerStage::Dry => (p.dry_multiplier > 0.0 && p.dry_penalty_last_n != 0)
                        .then(|| ChainStage::Dry {
                            multiplier: p.dry_multiplier,
                            base: p.dry_base,
                            allowed_length: p.dry_allowed_length,
                            last_n: p.dry_penalty_last_n,
                            sequence_breakers: p.dry_sequence_breakers.clone(),
                        }),
                    SamplerStage::TopNSigma => {
                        (p.top_n_sigma > 0.0).then_some(ChainStage::TopNSigma(p.top_n_sigma))
                    }
                    SamplerStage::TopK => (p.top_k > 0).then_some(ChainStage::TopK(p.top_k)),
                    SamplerStage::TypicalP => (p.typical_p < 1.0).then_some(ChainStage::Typical {
                        p: p.typical_p,
                        min_keep: MIN_KEEP,
                    }),
                    SamplerStage::TopP => (p.top_p < 1.0).then_some(ChainStage::TopP {
                        p: p.top_p,
                        min_keep: MIN_KEEP,
                    }),
                    SamplerStage::MinP => (p.min_p > 0.0).then_some(ChainStage::MinP {
                        p: p.min_p,
                        min_keep: MIN_KEEP,
                    }),
                    SamplerStage::Xtc => (p.xtc_probability > 0.0).then_some(ChainStage::Xtc {
                        probability: p.xtc_probability,
                        threshold: p.xtc_threshold,
                        min_keep: MIN_KEEP,
                        seed,
                    }),
                    SamplerStage::Temperature => Some(ChainStage::Temperature(p.temperature)),
                };
                chain.extend(s);
            }
            chain.push(ChainStage::Dist { seed });
        }
    }
    chain
}

/// The look-back llama.cpp gets for a penalty's `last_n`: -1 (the whole
/// context) becomes `n_ctx`, as llama-server does before building its
/// samplers; llama.cpp itself treats any negative value as 0, which turns the
/// sampler off.
pub fn look_back(last_n: i32, n_ctx: u32) -> i32 {
    if last_n < 0 {
        i32::try_from(n_ctx).unwrap_or(i32::MAX)
    } else {
        last_n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::BiasTarget;

    fn bias(t: i32, b: f32) -> LogitBias {
        LogitBias {
            target: BiasTarget::Token(t),
            bias: b,
        }
    }

    /// Every optional stage on, with values that are easy to tell apart.
    fn everything() -> SamplingParams {
        SamplingParams {
            temperature: 0.7,
            top_k: 12,
            top_p: 0.9,
            min_p: 0.07,
            typical_p: 0.8,
            top_n_sigma: 1.5,
            repeat_penalty: 1.1,
            frequency_penalty: 0.2,
            presence_penalty: 0.3,
            penalty_last_n: 32,
            dry_multiplier: 0.8,
            dry_base: 1.5,
            dry_allowed_length: 3,
            dry_penalty_last_n: 48,
            dry_sequence_breakers: vec!["\n".into()],
            xtc_probability: 0.4,
            xtc_threshold: 0.2,
            ..SamplingParams::default()
        }
    }

    fn penalties_of(p: &SamplingParams) -> ChainStage {
        ChainStage::Penalties {
            last_n: p.penalty_last_n,
            repeat: p.repeat_penalty,
            frequency: p.frequency_penalty,
            presence: p.presence_penalty,
        }
    }

    #[test]
    fn greedy_is_greedy_alone() {
        assert_eq!(
            sampler_chain(&SamplingParams::greedy(), 9),
            vec![ChainStage::Greedy]
        );
        // Greedy ignores the truncating stages, DRY and XTC entirely.
        let p = SamplingParams {
            temperature: 0.0,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            ..everything()
        };
        assert_eq!(sampler_chain(&p, 9), vec![ChainStage::Greedy]);
    }

    #[test]
    fn greedy_keeps_biases_and_penalties() {
        let p = SamplingParams {
            temperature: 0.0,
            logit_bias: vec![bias(3, 2.0)],
            ..everything()
        };
        assert_eq!(
            sampler_chain(&p, 1),
            vec![
                ChainStage::LogitBias(vec![bias(3, 2.0)]),
                penalties_of(&p),
                ChainStage::Greedy
            ]
        );
    }

    #[test]
    fn defaults_are_llama_cpp_defaults() {
        let p = SamplingParams::default();
        assert_eq!(
            sampler_chain(&p, 42),
            vec![
                ChainStage::TopK(40),
                ChainStage::TopP {
                    p: 0.95,
                    min_keep: 1
                },
                ChainStage::MinP {
                    p: 0.05,
                    min_keep: 1
                },
                ChainStage::Temperature(0.8),
                ChainStage::Dist { seed: 42 },
            ]
        );
    }

    #[test]
    fn neutral_values_leave_their_stage_out() {
        assert_eq!(
            sampler_chain(&SamplingParams::neutral(), 5),
            vec![ChainStage::Temperature(1.0), ChainStage::Dist { seed: 5 }]
        );
        // A look-back of 0 turns penalties and DRY off even with strengths set.
        let p = SamplingParams {
            penalty_last_n: 0,
            dry_penalty_last_n: 0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            typical_p: 1.0,
            top_n_sigma: 0.0,
            xtc_probability: 0.0,
            ..everything()
        };
        assert_eq!(
            sampler_chain(&p, 5),
            vec![ChainStage::Temperature(0.7), ChainStage::Dist { seed: 5 }]
        );
        // Each stage alone, turned on, is the only one added.
        let one = |edit: fn(&mut SamplingParams)| {
            let mut p = SamplingParams::neutral();
            edit(&mut p);
            let chain = sampler_chain(&p, 5);
            assert_eq!(chain.len(), 3, "{chain:?}");
            chain[0].clone()
        };
        assert!(matches!(one(|p| p.top_k = 1), ChainStage::TopK(1)));
        assert!(matches!(one(|p| p.top_p = 0.5), ChainStage::TopP { .. }));
        assert!(matches!(one(|p| p.min_p = 0.1), ChainStage::MinP { .. }));
        assert!(matches!(
            one(|p| p.typical_p = 0.5),
            ChainStage::Typical { .. }
        ));
        assert!(matches!(
            one(|p| p.xtc_probability = 0.5),
            ChainStage::Xtc { .. }
        ));
        assert!(matches!(
            one(|p| p.top_n_sigma = 1.0),
            ChainStage::TopNSigma(_)
        ));
        assert!(matches!(
            one(|p| p.dry_multiplier = 0.5),
            ChainStage::Dry { .. }
        ));
        for edit in [
            (|p: &mut SamplingParams| p.repeat_penalty = 1.2) as fn(&mut SamplingParams),
            |p| p.frequency_penalty = 0.1,
            |p| p.presence_penalty = -0.1,
        ] {
            assert!(matches!(one(edit), ChainStage::Penalties { .. }));
        }
    }

    #[test]
    fn every_stage_in_default_order_with_its_parameters() {
        let p = everything();
        assert_eq!(
            sampler_chain(&p, 77),
            vec![
                penalties_of(&p),
                ChainStage::Dry {
                    multiplier: 0.8,
                    base: 1.5,
                    allowed_length: 3,
                    last_n: 48,
                    sequence_breakers: vec!["\n".into()],
                },
                ChainStage::TopNSigma(1.5),
                ChainStage::TopK(12),
                ChainStage::Typical {
                    p: 0.8,
                    min_keep: 1
                },
                ChainStage::TopP {
                    p: 0.9,
                    min_keep: 1
                },
                ChainStage::MinP {
                    p: 0.07,
                    min_keep: 1
                },
                ChainStage::Xtc {
                    probability: 0.4,
                    threshold: 0.2,
                    min_keep: 1,
                    seed: 77
                },
                ChainStage::Temperature(0.7),
                ChainStage::Dist { seed: 77 },
            ]
        );
    }

    #[test]
    fn custom_order_is_followed_and_omitted_stages_are_out() {
        let p = SamplingParams {
            samplers: Some(
                SamplingParams::parse_order(&["min_p", "temperature", "top_k"]).expect("known"),
            ),
            ..everything()
        };
        assert_eq!(
            sampler_chain(&p, 3),
            vec![
                ChainStage::MinP {
                    p: 0.07,
                    min_keep: 1
                },
                ChainStage::Temperature(0.7),
                ChainStage::TopK(12),
                ChainStage::Dist { seed: 3 },
            ]
        );
        // Without temperature in the order there is no temperature stage.
        let p = SamplingParams {
            samplers: Some(vec![SamplerStage::TopK]),
            ..everything()
        };
        assert_eq!(
            sampler_chain(&p, 3),
            vec![ChainStage::TopK(12), ChainStage::Dist { seed: 3 }]
        );
    }

    #[test]
    fn mirostat_replaces_the_configurable_tail() {
        for (version, tau, eta) in [(1u8, 3.0f32, 0.2f32), (2, 4.0, 0.05)] {
            let p = SamplingParams {
                mirostat: version,
                mirostat_tau: tau,
                mirostat_eta: eta,
                logit_bias: vec![bias(1, -100.0)],
                ..everything()
            };
            let picker = if version == 1 {
                ChainStage::Mirostat {
                    tau,
                    eta,
                    m: MIROSTAT_M,
                    seed: 8,
                }
            } else {
                ChainStage::MirostatV2 { tau, eta, seed: 8 }
            };
            // Biases stay first; penalties, DRY, top-k ... XTC and dist are gone.
            assert_eq!(
                sampler_chain(&p, 8),
                vec![
                    ChainStage::LogitBias(vec![bias(1, f32::NEG_INFINITY)]),
                    ChainStage::Temperature(0.7),
                    picker
                ],
                "mirostat {version}"
            );
        }
        // Mirostat at temperature 0 is still Mirostat, not greedy.
        let p = SamplingParams {
            mirostat: 2,
            temperature: 0.0,
            ..SamplingParams::default()
        };
        assert!(matches!(
            sampler_chain(&p, 1).as_slice(),
            [ChainStage::Temperature(t), ChainStage::MirostatV2 { .. }] if *t == 0.0
        ));
    }

    #[test]
    fn logit_bias_comes_first_with_effective_values() {
        let biases = vec![
            bias(4, 1.5),
            bias(5, -100.0),
            LogitBias {
                target: BiasTarget::Text("no".into()),
                bias: -3.0,
            },
        ];
        let want = ChainStage::LogitBias(vec![
            bias(4, 1.5),
            bias(5, f32::NEG_INFINITY),
            LogitBias {
                target: BiasTarget::Text("no".into()),
                bias: -3.0,
            },
        ]);
        for p in [
            SamplingParams::greedy(),
            SamplingParams::default(),
            everything(),
            SamplingParams {
                mirostat: 1,
                ..SamplingParams::default()
            },
        ] {
            let p = SamplingParams {
                logit_bias: biases.clone(),
                ..p
            };
            let chain = sampler_chain(&p, 0);
            assert_eq!(chain[0], want, "{chain:?}");
            assert_eq!(
                chain
                    .iter()
                    .filter(|s| matches!(s, ChainStage::LogitBias(_)))
                    .count(),
                1
            );
        }
    }

    #[test]
    fn the_stage_that_picks_comes_last_and_carries_the_seed() {
        let pickers = |p: &SamplingParams| {
            let chain = sampler_chain(p, 1234);
            let last = chain.last().cloned().expect("never empty");
            let n = chain
                .iter()
                .filter(|s| {
                    matches!(
                        s,
                        ChainStage::Greedy
                            | ChainStage::Dist { .. }
                            | ChainStage::Mirostat { .. }
                            | ChainStage::MirostatV2 { .. }
                    )
                })
                .count();
            assert_eq!(n, 1, "{chain:?}");
            last
        };
        assert_eq!(pickers(&SamplingParams::greedy()), ChainStage::Greedy);
        assert_eq!(
            pickers(&SamplingParams::default()),
            ChainStage::Dist { seed: 1234 }
        );
        assert!(matches!(
            pickers(&SamplingParams {
                mirostat: 1,
                ..Default::default()
            }),
            ChainStage::Mirostat { seed: 1234, .. }
        ));
        assert!(matches!(
            pickers(&SamplingParams {
                mirostat: 2,
                ..Default::default()
            }),
            ChainStage::MirostatV2 { seed: 1234, .. }
        ));
    }

    #[test]
    fn the_grammar_stays_outside_the_chain() {
        for p in [
            SamplingParams::greedy(),
            SamplingParams::default(),
            everything(),
        ] {
            let free = sampler_plan(&p, false, 6);
            let constrained = sampler_plan(&p, true, 6);
            assert_eq!(free.grammar, GrammarPlacement::None);
            assert_eq!(constrained.grammar, GrammarPlacement::CheckThenResample);
            // The chain itself is the same with or without a grammar.
            assert_eq!(free.chain, constrained.chain);
            assert_eq!(free.chain, sampler_chain(&p, 6));
        }
    }

    #[test]
    fn argmax_fast_path_only_for_plain_greedy() {
        let plan = |p: SamplingParams, constrained: bool| sampler_plan(&p, constrained, 0);
        let greedy = SamplingParams::greedy();
        assert_eq!(plan(greedy.clone(), false).argmax_bans(), Some(vec![]));
        // Bans (as ignore_eos adds) keep the fast path, with the banned targets.
        let banned = SamplingParams {
            logit_bias: vec![bias(2, -100.0), bias(7, f32::NEG_INFINITY)],
            ..greedy.clone()
        };
        let p = plan(banned.clone(), false);
        let bans: Vec<_> = p
            .argmax_bans()
            .expect("fast path")
            .into_iter()
            .map(|b| b.target.clone())
            .collect();
        assert_eq!(bans, vec![BiasTarget::Token(2), BiasTarget::Token(7)]);
        // A grammar, a finite bias, penalties or sampling: the chain runs.
        assert_eq!(plan(banned, true).argmax_bans(), None);
        let finite = SamplingParams {
            logit_bias: vec![bias(2, -100.0), bias(3, -5.0)],
            ..greedy.clone()
        };
        assert_eq!(plan(finite, false).argmax_bans(), None);
        let penalized = SamplingParams {
            repeat_penalty: 1.3,
            ..greedy.clone()
        };
        assert_eq!(plan(penalized, false).argmax_bans(), None);
        assert_eq!(plan(SamplingParams::default(), false).argmax_bans(), None);
        let mirostat = SamplingParams {
            mirostat: 2,
            ..greedy
        };
        assert_eq!(plan(mirostat, false).argmax_bans(), None);
    }

    #[test]
    fn look_back_of_minus_one_is_the_whole_context() {
        assert_eq!(look_back(-1, 4096), 4096);
        assert_eq!(look_back(0, 4096), 0);
        assert_eq!(look_back(64, 4096), 64);
        assert_eq!(look_back(-1, u32::MAX), i32::MAX);
    }
}
