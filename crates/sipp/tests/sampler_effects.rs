//! Each sampler changes the token distribution the way llama.cpp defines it.
//!
//! The chain under test is the runtime's own: `sampler_chain` plans it from
//! `SamplingParams`, `chain_sampler` maps it to llama.cpp samplers (what
//! `LlamaRuntime` builds for a request), and it is applied to hand-made logits
//! whose answer is known: the candidates a truncating sampler keeps, the logit
//! a DRY penalty removes, the surprise Mirostat settles at. Each test also runs
//! the same logits without the stage, so it fails if the stage were dropped
//! from the plan or from the mapping. The model (the default one) only serves
//! the vocabulary that DRY and logit biases need.
#![cfg(feature = "llama")]

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::LlamaToken;
use sipp::config::NativeRuntimeConfig;
use sipp::runtime::llama::{chain_sampler, configure_llama_logs, load_model, LlamaModelHandle};
use sipp::runtime::Vocab;
use sipp::sampling::{sampler_chain, BiasTarget, ChainStage, LogitBias, SamplingParams};

/// The context the look-back of -1 stands for.
const N_CTX: u32 = 4096;
/// Candidate ids start here (ordinary tokens, not special ones).
const BASE: i32 = 1000;

fn model() -> &'static LlamaModelHandle {
    static MODEL: OnceLock<Arc<LlamaModelHandle>> = OnceLock::new();
    MODEL.get_or_init(|| {
        configure_llama_logs(false);
        load_model(
            &common::default_model(),
            &NativeRuntimeConfig::default(),
            1,
            None,
        )
        .expect("the default model loads")
    })
}

/// The runtime's chain for `params`: its plan and the llama.cpp sampler.
fn chain(params: &SamplingParams, seed: u32) -> (Vec<ChainStage>, LlamaSampler) {
    params.validate().expect("valid settings");
    let plan = sampler_chain(params, seed);
    let sampler = chain_sampler(model(), N_CTX, &plan).expect("the chain builds");
    (plan, sampler)
}

/// Logits `ln(w)` for weights `w`, on ids `BASE..`.
fn from_weights(w: &[f64]) -> Vec<(i32, f32)> {
    w.iter()
        .enumerate()
        .map(|(i, &x)| (BASE + i as i32, x.ln() as f32))
        .collect()
}

/// Applies the chain to fresh candidates; the array holds what the chain kept
/// and the token it picked.
fn apply(sampler: &mut LlamaSampler, logits: &[(i32, f32)]) -> LlamaTokenDataArray {
    let mut arr = LlamaTokenDataArray::new(
        logits
            .iter()
            .map(|&(t, l)| LlamaTokenData::new(LlamaToken(t), l, 0.0))
            .collect(),
        false,
    );
    arr.apply_sampler(sampler);
    assert!(arr.selected_token().is_some(), "the chain picks a token");
    arr
}

fn kept(arr: &LlamaTokenDataArray) -> BTreeSet<i32> {
    arr.data.iter().map(|d| d.id().0).collect()
}

fn ids(offsets: impl IntoIterator<Item = i32>) -> BTreeSet<i32> {
    offsets.into_iter().map(|i| BASE + i).collect()
}

/// How often each token is picked over `n` draws, each on fresh candidates.
fn draws(params: &SamplingParams, logits: &[(i32, f32)], n: usize) -> Vec<i32> {
    let (_, mut s) = chain(params, 1234);
    (0..n)
        .map(|_| apply(&mut s, logits).selected_token().expect("picked").0)
        .collect()
}

#[test]
fn plain_chain_keeps_every_candidate() {
    let logits = from_weights(&[1.0, 0.5, 0.25, 0.125]);
    let (plan, mut s) = chain(&SamplingParams::neutral(), 1);
    assert_eq!(
        plan,
        vec![ChainStage::Temperature(1.0), ChainStage::Dist { seed: 1 }]
    );
    let arr = apply(&mut s, &logits);
    assert_eq!(kept(&arr), ids(0..4));
    for d in &arr.data {
        let want = logits.iter().find(|l| l.0 == d.id().0).expect("known").1;
        assert_eq!(d.logit(), want, "temperature 1 leaves logits as they are");
    }
}

#[test]
fn min_p_keeps_exactly_the_tokens_at_half_the_best() {
    // Probabilities relative to the best: 1, 0.8, 0.6, 0.45, 0.3, 0.1.
    let logits = from_weights(&[1.0, 0.8, 0.6, 0.45, 0.3, 0.1]);
    let p = SamplingParams {
        min_p: 0.5,
        ..SamplingParams::neutral()
    };
    let (plan, mut s) = chain(&p, 7);
    assert!(plan.contains(&ChainStage::MinP {
        p: 0.5,
        min_keep: 1
    }));
    assert_eq!(kept(&apply(&mut s, &logits)), ids(0..3));
    // Without min-p every candidate stays.
    assert_eq!(
        kept(&apply(&mut chain(&SamplingParams::neutral(), 7).1, &logits)),
        ids(0..6)
    );
    // And the draws shift: the three tokens below half the best never come
    // out with min-p (a quarter of the mass without it).
    let low = ids(3..6);
    let with = draws(&p, &logits, 400);
    assert!(with.iter().all(|t| !low.contains(t)), "{with:?}");
    let without = draws(&SamplingParams::neutral(), &logits, 400);
    let n_low = without.iter().filter(|t| low.contains(t)).count();
    assert!(
        n_low > 50,
        "{n_low} of 400 below half the best without min-p"
    );
}

#[test]
fn typical_keeps_the_tokens_nearest_the_entropy_not_the_most_likely() {
    // A = 0.4, B = 0.2 and forty tokens of 0.01: the entropy is 2.53 nats.
    // B's surprise (1.61) is nearest it, then A's (0.92), then the small
    // ones' (4.61). Typical sampling keeps by that order until the mass
    // exceeds p: at 0.15 only B, at 0.5 B and A.
    let mut w = vec![0.4, 0.2];
    w.extend(std::iter::repeat_n(0.01, 40));
    let logits = from_weights(&w);
    let typical = |typical_p| SamplingParams {
        typical_p,
        ..SamplingParams::neutral()
    };
    let (plan, mut s) = chain(&typical(0.15), 3);
    assert!(plan.contains(&ChainStage::Typical {
        p: 0.15,
        min_keep: 1
    }));
    let arr = apply(&mut s, &logits);
    assert_eq!(kept(&arr), ids([1]), "the mode is dropped");
    assert_eq!(arr.selected_token(), Some(LlamaToken(BASE + 1)));
    assert_eq!(
        kept(&apply(&mut chain(&typical(0.5), 3).1, &logits)),
        ids(0..2)
    );
    assert_eq!(
        kept(&apply(&mut chain(&SamplingParams::neutral(), 3).1, &logits)),
        ids(0..42)
    );
    // Every draw is B with typical 0.15; without it A is the most frequent.
    assert!(draws(&typical(0.15), &logits, 200)
        .iter()
        .all(|&t| t == BASE + 1));
    let without = draws(&SamplingParams::neutral(), &logits, 400);
    let count = |t| without.iter().filter(|&&x| x == t).count();
    assert!(count(BASE) > count(BASE + 1), "{without:?}");
}

#[test]
fn xtc_removes_the_top_choices_but_the_least_likely_of_them() {
    // Probabilities 0.4, 0.25, 0.15, 0.08, 0.07, 0.05.
    let logits = from_weights(&[0.4, 0.25, 0.15, 0.08, 0.07, 0.05]);
    let xtc = |threshold| SamplingParams {
        xtc_probability: 1.0,
        xtc_threshold: threshold,
        ..SamplingParams::neutral()
    };
    let (plan, mut s) = chain(&xtc(0.1), 11);
    assert!(plan.contains(&ChainStage::Xtc {
        probability: 1.0,
        threshold: 0.1,
        min_keep: 1,
        seed: 11
    }));
    // Three tokens reach 0.1: the two most likely go, 0.15 stays.
    for _ in 0..20 {
        assert_eq!(kept(&apply(&mut s, &logits)), ids(2..6));
    }
    // At 0.2 only the best goes; at 0.3 one token reaches it, and a single
    // top choice is never removed.
    assert_eq!(
        kept(&apply(&mut chain(&xtc(0.2), 11).1, &logits)),
        ids(1..6)
    );
    assert_eq!(
        kept(&apply(&mut chain(&xtc(0.3), 11).1, &logits)),
        ids(0..6)
    );
    assert_eq!(
        kept(&apply(
            &mut chain(&SamplingParams::neutral(), 11).1,
            &logits
        )),
        ids(0..6)
    );
    // The best two never come out of XTC; without it they are 65% of draws.
    let top = ids(0..2);
    assert!(draws(&xtc(0.1), &logits, 300)
        .iter()
        .all(|t| !top.contains(t)));
    let without = draws(&SamplingParams::neutral(), &logits, 300);
    assert!(without.iter().filter(|t| top.contains(t)).count() > 150);
}

/// One token per word, checked.
fn word_tokens(words: &[&str]) -> Vec<i32> {
    words
        .iter()
        .map(|w| {
            let t = model().tokenize(w, false, false).expect("tokenizes");
            assert_eq!(t.len(), 1, "{w:?} should be one token: {t:?}");
            t[0]
        })
        .collect()
}

#[test]
fn dry_penalizes_the_token_that_extends_a_repeat_by_multiplier_times_base_power() {
    let w = word_tokens(&[" apple", " banana", " cherry", " date", " elder"]);
    let (a, b, c, d) = (w[0], w[1], w[2], w[3]);
    // "apple banana cherry date apple banana cherry": the last three tokens
    // repeat, and "date" would extend the repeat to four.
    let history = [a, b, c, d, a, b, c];
    let logits: Vec<(i32, f32)> = w.iter().map(|&t| (t, 0.5)).collect();
    let run = |p: &SamplingParams, history: &[i32]| {
        let (plan, mut s) = chain(p, 5);
        for &t in history {
            s.accept(LlamaToken(t));
        }
        (plan, apply(&mut s, &logits))
    };
    let logit_of = |arr: &LlamaTokenDataArray, t: i32| {
        arr.data
            .iter()
            .find(|x| x.id().0 == t)
            .expect("kept")
            .logit()
    };
    // The default look-back (-1) is the whole context.
    let dry = |allowed_length| SamplingParams {
        dry_multiplier: 0.8,
        dry_base: 1.75,
        dry_allowed_length: allowed_length,
        ..SamplingParams::neutral()
    };
    for (allowed, penalty) in [(2, 0.8 * 1.75), (3, 0.8), (1, 0.8 * 1.75 * 1.75)] {
        let (plan, arr) = run(&dry(allowed), &history);
        assert!(
            plan.iter()
                .any(|s| matches!(s, ChainStage::Dry { last_n: -1, .. })),
            "{plan:?}"
        );
        let got = 0.5 - logit_of(&arr, d);
        assert!(
            (got - penalty).abs() < 1e-4,
            "allowed length {allowed}: penalty {got}, want {penalty}"
        );
        for &t in [a, b, c, w[4]].iter() {
            assert_eq!(
                logit_of(&arr, t),
                0.5,
                "only the extending token is penalized"
            );
        }
    }
    // A repeat shorter than the allowed length, or no DRY: nothing changes.
    let (_, arr) = run(&dry(4), &history);
    assert_eq!(logit_of(&arr, d), 0.5);
    let (plan, arr) = run(&SamplingParams::neutral(), &history);
    assert!(!plan.iter().any(|s| matches!(s, ChainStage::Dry { .. })));
    assert_eq!(logit_of(&arr, d), 0.5);
    // An explicit look-back shorter than the repeat sees no repeat.
    let short = SamplingParams {
        dry_penalty_last_n: 3,
        ..dry(2)
    };
    let (_, arr) = run(&short, &history);
    assert_eq!(logit_of(&arr, d), 0.5);
    // The draws shift away from the extending token: with a strong penalty it
    // never comes out, while without DRY it is a fifth of the draws.
    let strong = SamplingParams {
        dry_multiplier: 5.0,
        ..dry(2)
    };
    let count_d = |p: &SamplingParams| {
        let (_, mut s) = chain(p, 99);
        for &t in &history {
            s.accept(LlamaToken(t));
        }
        (0..300)
            .filter(|_| apply(&mut s, &logits).selected_token() == Some(LlamaToken(d)))
            .count()
    };
    assert!(count_d(&strong) < 10, "{}", count_d(&strong));
    assert!(
        count_d(&SamplingParams::neutral()) > 30,
        "{}",
        count_d(&SamplingParams::neutral())
    );
}

/// Mean surprise (bits) of `n` picks of a chain on `logits`: under the given
/// distribution, and as the picking stage saw it (its own renormalized `p`).
fn surprises(params: &SamplingParams, logits: &[(i32, f32)], n: usize) -> (f64, f64) {
    let lse = logits
        .iter()
        .map(|l| f64::from(l.1).exp())
        .sum::<f64>()
        .ln();
    let (_, mut s) = chain(params, 2024);
    let (mut given, mut own) = (0.0, 0.0);
    for _ in 0..n {
        let arr = apply(&mut s, logits);
        let sel = &arr.data[arr.selected.expect("picked")];
        let l = logits.iter().find(|l| l.0 == sel.id().0).expect("known").1;
        given += (lse - f64::from(l)) / std::f64::consts::LN_2;
        own += -f64::from(sel.p()).log2();
    }
    (given / n as f64, own / n as f64)
}

#[test]
fn mirostat_holds_the_surprise_near_tau() {
    // Zipf (exponent 1.2) over 500 tokens: entropy 5.70 bits, the best
    // token's surprise 2.05 bits.
    let w: Vec<f64> = (1..=500).map(|i| f64::from(i).powf(-1.2)).collect();
    let logits = from_weights(&w);
    let tau = 3.0f32;
    let (plain_given, plain_own) = surprises(&SamplingParams::neutral(), &logits, 2000);
    // dist draws from the whole distribution: mean surprise = the entropy.
    assert!((plain_given - 5.70).abs() < 0.3, "dist: {plain_given}");
    assert!((plain_own - plain_given).abs() < 0.01, "{plain_own}");
    for version in [1u8, 2] {
        let p = SamplingParams {
            mirostat: version,
            mirostat_tau: tau,
            mirostat_eta: 0.1,
            ..SamplingParams::neutral()
        };
        let (plan, _) = chain(&p, 2024);
        let picker = plan.last().expect("never empty");
        assert!(
            matches!(
                (version, picker),
                (1, ChainStage::Mirostat { .. }) | (2, ChainStage::MirostatV2 { .. })
            ),
            "{plan:?}"
        );
        let (given, own) = surprises(&p, &logits, 2000);
        // Mirostat's feedback holds the surprise it sees at tau (the mean
        // error is bounded by mu's range over eta * n).
        assert!(
            (own - f64::from(tau)).abs() < 0.3,
            "mirostat {version}: own surprise {own}, tau {tau}"
        );
        // Under the real distribution its picks are far less surprising than
        // dist's.
        assert!(
            given < plain_given - 1.5,
            "mirostat {version}: {given} vs dist {plain_given}"
        );
    }
}

#[test]
fn logit_bias_runs_first_and_bans() {
    let logits = from_weights(&[1.0, 0.9, 0.8]);
    let p = SamplingParams {
        logit_bias: vec![LogitBias {
            target: BiasTarget::Token(BASE),
            bias: -100.0,
        }],
        // min-p after the ban is relative to the new best.
        min_p: 0.85,
        ..SamplingParams::neutral()
    };
    let (plan, mut s) = chain(&p, 1);
    assert!(matches!(plan[0], ChainStage::LogitBias(_)), "{plan:?}");
    // The ban removes the best; min-p then keeps 0.8 (>= 0.85 * 0.9).
    assert_eq!(kept(&apply(&mut s, &logits)), ids(1..3));
    assert!(draws(&p, &logits, 200).iter().all(|&t| t != BASE));
}
