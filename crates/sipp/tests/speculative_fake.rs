//! Speculative decoding on the fake backend, through the public engine API:
//! the same text with and without drafts, the sampling distribution kept,
//! per-request settings, and cancellation in the middle of a draft.

use sipp::config::{CacheMode, NativeRuntimeConfig, SpeculativeMode};
use sipp::engine::{
    Engine, EngineError, GenerateRequest, PromptInput, RequestEvent, SpeculativeRequest,
};
use sipp::runtime::fake::{FakeBackend, FakeConfig};
use sipp::runtime::Token;
use sipp::sampling::SamplingParams;
use sipp::text::FinishReason;

/// A fake model that predicts from its last 2 tokens: its text repeats, as
/// copying traffic does, so n-gram drafts get accepted.
fn fake() -> FakeConfig {
    FakeConfig {
        n_seq_max: 8,
        n_batch: 128,
        n_ubatch: 128,
        eos_one_in: 0,
        window: 2,
        ..FakeConfig::default()
    }
}

/// The engine's config for `slots` slots, with the speculative mode left at
/// its default.
fn config(slots: u32) -> NativeRuntimeConfig {
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_parallel = slots;
    cfg.context.n_batch = 128;
    cfg.context.n_ubatch = 128;
    cfg.cache.mode = CacheMode::SharedPrefix;
    cfg.cache.idle_sequences = 8 - slots;
    cfg.speculative.n_max = 6;
    // Rows nearly free against a step (as on a GPU): every likely draft pays.
    cfg.speculative.row_cost_ratio = 100.0;
    cfg
}

fn engine(mode: SpeculativeMode, slots: u32) -> Engine {
    let mut cfg = config(slots);
    cfg.speculative.mode = mode;
    Engine::start(FakeBackend::new(fake()), cfg)
}

fn prompt(i: usize) -> Vec<Token> {
    format!("Question {i}: tell me about speculative decoding.")
        .bytes()
        .map(Token::from)
        .collect()
}

fn request(i: usize, n: u32, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        max_tokens: Some(n),
        sampling: Some(sampling),
        ..GenerateRequest::new(PromptInput::Tokens(prompt(i)))
    }
}

/// Runs requests concurrently; returns their tokens and the engine's steps.
fn run_all(e: &Engine, reqs: Vec<GenerateRequest>) -> Vec<Vec<Token>> {
    let handles: Vec<_> = reqs
        .into_iter()
        .map(|r| e.generate(r).expect("submit"))
        .collect();
    handles
        .into_iter()
        .map(|h| h.blocking_completion().expect("completes").tokens)
        .collect()
}

#[test]
fn greedy_tokens_are_the_same_with_drafts_in_fewer_steps() {
    let reqs = || {
        (0..4)
            .map(|i| request(i, 64, SamplingParams::greedy()))
            .collect()
    };
    let off = engine(SpeculativeMode::Off, 4);
    let off_tokens = run_all(&off, reqs());
    let on = engine(SpeculativeMode::Ngram, 4);
    let on_tokens = run_all(&on, reqs());
    assert_eq!(off_tokens, on_tokens);
    let (m_off, m_on) = (off.metrics(), on.metrics());
    assert_eq!(m_off.draft_tokens, 0);
    assert!(
        m_on.draft_accepted_tokens > 0 && m_on.draft_accepted_tokens <= m_on.draft_tokens,
        "{m_on:?}"
    );
    // Every accepted token is a step saved for its request.
    assert!(
        m_on.steps < m_off.steps,
        "{} vs {}",
        m_on.steps,
        m_off.steps
    );
    assert_eq!(m_on.generated_tokens, m_off.generated_tokens);
}

/// The fake samples its most likely token three times in four. With drafts
/// (which propose the most likely continuation more often than not), the
/// share must stay 3/4: accepting a drafted token without sampling it would
/// push the share up. Chi-square with one degree of freedom, p = 0.001.
#[test]
fn sampled_tokens_keep_the_model_distribution() {
    let model = FakeBackend::new(fake());
    let on = engine(SpeculativeMode::Ngram, 8);
    let off = engine(SpeculativeMode::Off, 8);
    let (mut likely, mut total) = (0usize, 0usize);
    for batch in 0..25 {
        let reqs = |seed0: u32| -> Vec<GenerateRequest> {
            (0..8)
                .map(|k| {
                    let seed = seed0 + k as u32;
                    let s = SamplingParams {
                        temperature: 1.0,
                        seed: Some(seed),
                        ..SamplingParams::default()
                    };
                    request(seed as usize % 5, 24, s)
                })
                .collect()
        };
        let seed0 = batch * 8;
        let with = run_all(&on, reqs(seed0));
        let without = run_all(&off, reqs(seed0));
        assert_eq!(with, without, "a seeded request draws the same tokens");
        for (k, toks) in with.iter().enumerate() {
            let mut history = prompt((seed0 as usize + k) % 5);
            for &t in toks {
                total += 1;
                likely += usize::from(model.most_likely(&history) == t);
                history.push(t);
            }
        }
    }
    let m = on.metrics();
    assert!(
        m.draft_accepted_tokens > 0 && m.draft_accepted_tokens < m.draft_tokens,
        "drafts both accepted and rejected: {m:?}"
    );
    let n = total as f64;
    let (a, b) = (likely as f64, (total - likely) as f64);
    let chi2 = (a - 0.75 * n).powi(2) / (0.75 * n) + (b - 0.25 * n).powi(2) / (0.25 * n);
    assert!(
        chi2 < 10.83,
        "most likely token {likely} of {total} times (expected 3/4): chi2 {chi2:.2}"
    );
}

#[test]
fn a_request_chooses_its_own_speculation_and_bad_values_are_refused() {
    let e = engine(SpeculativeMode::Ngram, 1);
    let mut r = request(0, 48, SamplingParams::greedy());
    r.speculative = Some(SpeculativeRequest {
        mode: Some(SpeculativeMode::Off),
        n_max: None,
    });
    let c = e
        .generate(r)
        .expect("submit")
        .blocking_completion()
        .expect("runs");
    assert_eq!((c.stats.drafted_tokens, e.metrics().draft_tokens), (0, 0));

    let c = e
        .generate(request(0, 48, SamplingParams::greedy()))
        .expect("submit")
        .blocking_completion()
        .expect("runs");
    assert!(c.stats.accepted_tokens > 0 && c.stats.accepted_tokens <= c.stats.drafted_tokens);
    assert_eq!(e.metrics().draft_tokens as usize, c.stats.drafted_tokens);

    let mut r = request(0, 8, SamplingParams::greedy());
    r.speculative = Some(SpeculativeRequest {
        mode: None,
        n_max: Some(65),
    });
    match e.generate(r) {
        Err(EngineError::InvalidRequest { field, .. }) => assert_eq!(field, "speculative.n_max"),
        other => panic!("expected a refusal, got {:?}", other.map(|h| h.id())),
    }
}

#[test]
fn ngram_is_the_default_and_repeatable_requests_draft_only_when_they_ask() {
    let e = Engine::start(FakeBackend::new(fake()), config(1));
    let run = |r: GenerateRequest| {
        e.generate(r)
            .expect("submit")
            .blocking_completion()
            .expect("runs")
    };
    let plain = run(request(0, 48, SamplingParams::greedy()));
    assert!(plain.stats.drafted_tokens > 0, "the default drafts");
    let repeatable = run(GenerateRequest {
        repeatable: true,
        ..request(0, 48, SamplingParams::greedy())
    });
    assert_eq!(repeatable.stats.drafted_tokens, 0);
    assert_eq!(repeatable.tokens, plain.tokens);
    let asked = run(GenerateRequest {
        repeatable: true,
        speculative: Some(SpeculativeRequest {
            mode: Some(SpeculativeMode::Ngram),
            n_max: None,
        }),
        ..request(0, 48, SamplingParams::greedy())
    });
    assert!(asked.stats.drafted_tokens > 0);
    assert_eq!(asked.tokens, plain.tokens);
}

#[test]
fn cancel_mid_draft_frees_the_slot() {
    let e = engine(SpeculativeMode::Ngram, 1);
    let mut h = e
        .generate(request(1, 100_000, SamplingParams::greedy()))
        .expect("submit");
    let mut tokens = 0;
    while let Some(ev) = h.blocking_next_event() {
        match ev {
            RequestEvent::Delta(d) => {
                tokens += d.tokens.len();
                // Cancel once drafts are being accepted.
                if tokens >= 40 && e.metrics().draft_accepted_tokens > 0 {
                    h.cancel();
                }
            }
            RequestEvent::Finished(c) => {
                assert_eq!(c.finish_reason, FinishReason::Cancelled);
                break;
            }
            RequestEvent::Failed(e) => panic!("failed: {e}"),
            _ => {}
        }
    }
    let next = e
        .generate(request(2, 8, SamplingParams::greedy()))
        .expect("submit")
        .blocking_completion()
        .expect("runs");
    assert_eq!(next.usage.completion_tokens, 8);
    assert_eq!(e.metrics().requests_cancelled, 1);
    for _ in 0..100 {
        if e.metrics().busy_slots == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(e.metrics().busy_slots, 0);
}

/// An engine whose draft model is a fake predicting from its last `window`
/// tokens: the target's own window drafts what the target would say, another
/// one drafts something else most of the time.
fn engine_with_draft(window: usize) -> Engine {
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_parallel = 4;
    cfg.context.n_batch = 128;
    cfg.context.n_ubatch = 128;
    cfg.cache.idle_sequences = 4;
    cfg.speculative.mode = SpeculativeMode::Draft;
    cfg.speculative.n_max = 5;
    cfg.speculative.row_cost_ratio = 100.0;
    let draft = FakeBackend::new(FakeConfig {
        n_seq_max: 4,
        window,
        ..fake()
    });
    Engine::start_with_draft(FakeBackend::new(fake()), Some(draft), cfg)
}

#[test]
fn draft_model_drafts_are_verified_like_any_draft() {
    let greedy_reqs = || {
        (0..4)
            .map(|i| request(i, 40, SamplingParams::greedy()))
            .collect::<Vec<_>>()
    };
    let sampled_reqs = || {
        (0..4)
            .map(|i| {
                let s = SamplingParams {
                    temperature: 1.0,
                    seed: Some(100 + i as u32),
                    ..SamplingParams::default()
                };
                request(i, 40, s)
            })
            .collect::<Vec<_>>()
    };
    let off = engine(SpeculativeMode::Off, 4);
    let want_greedy = run_all(&off, greedy_reqs());
    let want_sampled = run_all(&off, sampled_reqs());
    for window in [2, 5] {
        let e = engine_with_draft(window);
        assert_eq!(run_all(&e, greedy_reqs()), want_greedy, "window {window}");
        assert_eq!(run_all(&e, sampled_reqs()), want_sampled, "window {window}");
        let m = e.metrics();
        assert!(m.draft_tokens > 0, "window {window}: {m:?}");
        if window == 2 {
            // The draft model is the target: greedy drafts are all accepted
            // (sampled ones only when the sample agrees).
            assert!(m.draft_accepted_tokens * 2 > m.draft_tokens, "{m:?}");
        } else {
            assert!(m.draft_accepted_tokens < m.draft_tokens, "{m:?}");
        }
    }
}

#[test]
fn draft_mode_needs_a_draft_model() {
    let e = engine(SpeculativeMode::Ngram, 1);
    let mut r = request(0, 8, SamplingParams::greedy());
    r.speculative = Some(SpeculativeRequest {
        mode: Some(SpeculativeMode::Draft),
        n_max: None,
    });
    match e.generate(r) {
        Err(EngineError::InvalidRequest { field, .. }) => assert_eq!(field, "speculative.mode"),
        other => panic!("expected a refusal, got {:?}", other.map(|h| h.id())),
    }
    let mut cfg = NativeRuntimeConfig::default();
    cfg.speculative.mode = SpeculativeMode::Draft;
    let err = cfg.validate().expect_err("draft without a model");
    assert!(err.to_string().contains("speculative.draft_model"), "{err}");
}
