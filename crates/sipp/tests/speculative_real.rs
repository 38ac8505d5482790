//! Speculative decoding on the real default model: greedy output with n-gram
//! drafts equals output without them, over 20 prompts, most of which copy
//! from their input as grounded traffic does. With sipp's CPU kernels a row's
//! logits do not depend on the batch around it, so the outputs are equal
//! token for token, with equal logprobs; with ggml's own kernels verifying a
//! draft batches rows differently, and they are equal up to a near-tie.

mod common;

use common::{assert_same_up_to_near_tie, engine_with, greedy};
use sipp::config::SpeculativeMode;
use sipp::engine::SpeculativeRequest;
use sipp::runtime::cpu_kernels;

/// Same threshold as the other batching comparisons (see real_model.rs).
const NEAR_TIE: f32 = 1.0;

const FUNCTION: &str = "def area(width, height):\n    result = width * height\n    return result\n";

fn prompts() -> Vec<String> {
    let mut p = vec![
        "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1,".to_string(),
        "red green blue red green blue red green blue red".to_string(),
        format!("{FUNCTION}\nThe same function again:\n{FUNCTION}\nAnd once more:\n"),
        format!("Code:\n{FUNCTION}\nThe code with `result` renamed to `value`:\n"),
        "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick".to_string(),
        "Copy this sentence exactly: The library opened in 1921 in Westmere.\nCopy: The library".to_string(),
        "Q: What is 2+2?\nA: 4\nQ: What is 3+3?\nA: 6\nQ: What is 4+4?\nA:".to_string(),
        "{\"name\": \"Ada\", \"age\": 36}\n{\"name\": \"Alan\", \"age\": 41}\n{\"name\":".to_string(),
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,".to_string(),
        "<li>apple</li>\n<li>banana</li>\n<li>cherry</li>\n<li>".to_string(),
        "Passage: Eleanor Voss gave 40,000 dollars to build the library.\nQuote the passage: \"Eleanor".to_string(),
        "SELECT id, name FROM users;\nSELECT id, name FROM orders;\nSELECT id, name FROM".to_string(),
    ];
    p.extend(
        [
            "The capital of France is",
            "Water boils at a temperature of",
            "A recipe for pancakes needs",
            "In 1969, astronauts",
            "The best way to learn a language is",
            "Photosynthesis is the process by which",
            "My favourite animal is the cat because",
            "Once upon a time, in a small village,",
        ]
        .map(String::from),
    );
    p
}

#[test]
fn greedy_output_with_ngram_drafts_equals_output_without() {
    let e = engine_with(1, |c| {
        c.speculative.mode = SpeculativeMode::Ngram;
        c.speculative.n_max = 8;
        // Every likely draft verified, whatever this CPU's row cost.
        c.speculative.row_cost_ratio = 100.0;
    });
    let prompts = prompts();
    assert_eq!(prompts.len(), 20);
    let mode = |m| {
        Some(SpeculativeRequest {
            mode: Some(m),
            n_max: None,
        })
    };
    let mut diverged = 0;
    for p in &prompts {
        let run = |m| {
            let mut r = greedy(p, 48);
            r.speculative = mode(m);
            e.generate(r)
                .expect("submit")
                .blocking_completion()
                .expect("completes")
        };
        let off = run(SpeculativeMode::Off);
        let on = run(SpeculativeMode::Ngram);
        assert_eq!(off.stats.drafted_tokens, 0);
        assert!(on.stats.accepted_tokens <= on.stats.drafted_tokens);
        if cpu_kernels::active() {
            assert_eq!(off.tokens, on.tokens, "{p:?}");
            let logprobs = |c: &sipp::engine::Completion| -> Vec<f32> {
                c.logprobs
                    .iter()
                    .map(|l| l.logprobs.top[0].logprob)
                    .collect()
            };
            assert_eq!(logprobs(&off), logprobs(&on), "{p:?}: logprobs");
        } else if let Some(gap) = assert_same_up_to_near_tie(&off, &on, NEAR_TIE, p) {
            diverged += 1;
            eprintln!("{p:?} diverged at a near-tie (gap {gap:.3})");
        }
    }
    let m = e.metrics();
    eprintln!(
        "drafted {}, accepted {}, {diverged} of 20 diverged at near-ties",
        m.draft_tokens, m.draft_accepted_tokens
    );
    // The first dozen prompts repeat themselves: a model continuing a
    // repetition repeats it, so some drafts must have been accepted.
    assert!(m.draft_accepted_tokens > 0, "{m:?}");
}

/// Draft-model mode on the real model: no smaller model shares the default
/// model's vocabulary here, so the default model drafts for itself (a
/// requantized copy made by llama-quantize is used by the benchmark script).
/// Greedy output must equal output without drafts up to a near-tie, and a
/// model drafting for itself must see most greedy drafts accepted.
#[test]
fn a_draft_model_drafts_and_the_output_is_unchanged() {
    let e = engine_with(2, |c| {
        c.speculative.mode = SpeculativeMode::Draft;
        c.speculative.draft_model = Some(common::default_model());
        c.speculative.n_max = 4;
        // Rows as cheap as on a GPU, so drafts are verified whatever this
        // CPU's row cost is: the test is about correctness.
        c.speculative.row_cost_ratio = 100.0;
    });
    for p in &prompts()[..6] {
        let run = |m| {
            let mut r = greedy(p, 32);
            r.speculative = Some(SpeculativeRequest {
                mode: Some(m),
                n_max: None,
            });
            e.generate(r)
                .expect("submit")
                .blocking_completion()
                .expect("completes")
        };
        let off = run(SpeculativeMode::Off);
        let on = run(SpeculativeMode::Draft);
        assert_same_up_to_near_tie(&off, &on, NEAR_TIE, p);
    }
    let m = e.metrics();
    eprintln!(
        "draft model: drafted {}, accepted {}",
        m.draft_tokens, m.draft_accepted_tokens
    );
    assert!(m.draft_tokens > 0, "{m:?}");
    assert!(m.draft_accepted_tokens * 2 > m.draft_tokens, "{m:?}");
}
