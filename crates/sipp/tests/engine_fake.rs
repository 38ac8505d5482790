//! Engine behaviour on the fake backend, through the public threaded API:
//! prefix sharing, snapshots, preemption, failure isolation, cancellation,
//! queue limits and embeddings.

use std::time::Duration;

use sipp::config::{CacheMode, NativeRuntimeConfig};
use sipp::engine::{EmbedRequest, Engine, EngineError, GenerateRequest, PromptInput, RequestEvent};
use sipp::runtime::fake::{FakeBackend, FakeConfig, EXHAUSTING_GRAMMAR, INVALID_GRAMMAR};
use sipp::runtime::Pooling;
use sipp::sampling::{OutputConstraint, SamplingParams};
use sipp::text::FinishReason;

fn config(slots: u32, mode: CacheMode) -> NativeRuntimeConfig {
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_parallel = slots;
    cfg.context.n_batch = 64;
    cfg.context.n_ubatch = 64;
    cfg.cache.mode = mode;
    cfg.cache.idle_sequences = 2;
    cfg.cache.min_prefix_tokens = 8;
    cfg
}

fn engine(slots: u32, mode: CacheMode, fake: FakeConfig) -> Engine {
    engine_with(config(slots, mode), fake)
}

fn engine_with(cfg: NativeRuntimeConfig, fake: FakeConfig) -> Engine {
    let fake = FakeConfig {
        n_seq_max: cfg.context.n_parallel + cfg.cache.idle_sequences,
        n_batch: 64,
        n_ubatch: 64,
        ..fake
    };
    Engine::start(FakeBackend::new(fake), cfg)
}

fn greedy(prompt: &str, n: u32) -> GenerateRequest {
    GenerateRequest {
        max_tokens: Some(n),
        ignore_eos: true,
        ..GenerateRequest::new(prompt).greedy()
    }
}

const SYSTEM: &str =
    "You are a careful assistant. Always answer in one short sentence, and never use lists. ";

#[test]
fn shared_prefix_is_computed_once_for_concurrent_requests() {
    let run = |mode| {
        let e = engine(4, mode, FakeConfig::default());
        let handles: Vec<_> = (0..4)
            .map(|i| {
                e.generate(greedy(&format!("{SYSTEM}Question {i}?"), 8))
                    .expect("submit")
            })
            .collect();
        let texts: Vec<_> = handles
            .into_iter()
            .map(|h| h.blocking_completion().expect("completes"))
            .collect();
        (texts, e.metrics())
    };
    let (off, m_off) = run(CacheMode::Off);
    let (shared, m_shared) = run(CacheMode::SharedPrefix);
    for (a, b) in off.iter().zip(&shared) {
        assert_eq!(a.text, b.text);
    }
    let cached: usize = shared.iter().map(|c| c.usage.cached_tokens).sum();
    assert!(
        cached >= 3 * (SYSTEM.len() - 8),
        "three requests should share the system prompt, cached {cached}"
    );
    assert!(
        m_shared.batch_rows + 3 * 60 < m_off.batch_rows,
        "rows {} vs {}",
        m_shared.batch_rows,
        m_off.batch_rows
    );
    assert_eq!(m_off.prefix_reused_tokens, 0);
    assert_eq!(m_shared.prefix_reused_tokens as usize, cached);
}

/// The reuse counter is what requests report as cached, and never more
/// than the prompt tokens: a request that reused part of a prefix at
/// admission and then waited for a longer one in progress is counted once.
#[test]
fn reuse_counters_equal_what_requests_report_as_cached() {
    let e = engine(4, CacheMode::SharedPrefix, FakeConfig::default());
    // An idle sequence holds the system prompt.
    e.generate(greedy(&format!("{SYSTEM}Warm up?"), 2))
        .expect("submit")
        .blocking_completion()
        .expect("completes");
    let context = "Here is a long document to read before the question. ".repeat(6);
    let handles: Vec<_> = (0..4)
        .map(|i| {
            e.generate(greedy(&format!("{SYSTEM}{context}Question {i}?"), 4))
                .expect("submit")
        })
        .collect();
    let done: Vec<_> = handles
        .into_iter()
        .map(|h| h.blocking_completion().expect("completes"))
        .collect();
    let m = e.metrics();
    let cached: usize = done.iter().map(|c| c.usage.cached_tokens).sum::<usize>();
    let prompt: usize = done.iter().map(|c| c.usage.prompt_tokens).sum::<usize>();
    assert!(
        cached >= 3 * context.len(),
        "three requests share the document: cached {cached}"
    );
    // The warm-up reused nothing; the rest is these four requests.
    assert_eq!(m.prefix_reused_tokens as usize, cached, "metrics vs usage");
    assert!(m.prefix_reused_tokens <= m.prompt_tokens, "{m:?}");
    assert!(cached < prompt);
}

#[test]
fn snapshot_restores_an_evicted_prefix() {
    let mut cfg = config(1, CacheMode::SharedPrefix);
    cfg.cache.idle_sequences = 0;
    let e = Engine::start(
        FakeBackend::new(FakeConfig {
            n_seq_max: 1,
            n_batch: 64,
            n_ubatch: 64,
            ..FakeConfig::default()
        }),
        cfg,
    );
    let first = e
        .generate(greedy(&format!("{SYSTEM}First."), 4))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    // A different prompt evicts the only sequence: its KV is snapshotted.
    e.generate(greedy("Something else entirely, long enough to matter.", 4))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    let again = e
        .generate(greedy(&format!("{SYSTEM}First."), 4))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    let m = e.metrics();
    assert!(m.snapshot_saves >= 1 && m.snapshot_restores >= 1, "{m:?}");
    assert_eq!(first.text, again.text);
    assert!(
        again.usage.cached_tokens >= SYSTEM.len(),
        "cached {}",
        again.usage.cached_tokens
    );
}

#[test]
fn kv_pressure_preempts_and_everyone_finishes() {
    let e = engine(
        4,
        CacheMode::Off,
        FakeConfig {
            n_ctx: 160,
            eos_one_in: 0,
            // 30 steps of 2 ms: the four requests run at once even when this
            // thread is descheduled between two submissions.
            step_delay: std::time::Duration::from_millis(2),
            ..FakeConfig::default()
        },
    );
    let handles: Vec<_> = (0..4)
        .map(|i| {
            e.generate(greedy(
                &format!("Prompt number {i} with some padding text."),
                30,
            ))
            .expect("submit")
        })
        .collect();
    for h in handles {
        let c = h
            .blocking_completion()
            .expect("completes despite KV pressure");
        assert_eq!(c.usage.completion_tokens, 30);
    }
    assert!(e.metrics().preemptions > 0, "{:?}", e.metrics());
}

#[test]
fn a_failing_request_fails_alone() {
    let e = engine(4, CacheMode::SharedPrefix, FakeConfig::default());
    let bad = e
        .generate(greedy("This prompt is poisoned <poison> here.", 8))
        .expect("submit");
    let good: Vec<_> = (0..3)
        .map(|i| {
            e.generate(greedy(&format!("Healthy prompt {i}"), 8))
                .expect("submit")
        })
        .collect();
    let err = bad
        .blocking_completion()
        .expect_err("poisoned request fails");
    assert!(matches!(err, EngineError::Decode(_)), "{err}");
    for g in good {
        assert_eq!(
            g.blocking_completion()
                .expect("others finish")
                .usage
                .completion_tokens,
            8
        );
    }
}

#[test]
fn cancel_mid_stream_frees_the_slot() {
    let e = engine(
        1,
        CacheMode::SharedPrefix,
        FakeConfig {
            eos_one_in: 0,
            ..FakeConfig::default()
        },
    );
    let mut h = e
        .generate(greedy("Tell me a very long story.", 100_000))
        .expect("submit");
    let mut deltas = 0;
    while let Some(ev) = h.blocking_next_event() {
        if let RequestEvent::Delta(_) = ev {
            deltas += 1;
            if deltas == 3 {
                h.cancel();
            }
        }
        if let RequestEvent::Finished(c) = ev {
            assert_eq!(c.finish_reason, FinishReason::Cancelled);
            break;
        }
    }
    let next = e
        .generate(greedy("Next request", 4))
        .expect("submit")
        .blocking_completion()
        .expect("runs");
    assert_eq!(next.usage.completion_tokens, 4);
    assert_eq!(e.metrics().requests_cancelled, 1);
}

#[test]
fn dropping_the_handle_cancels() {
    let e = engine(
        1,
        CacheMode::SharedPrefix,
        FakeConfig {
            eos_one_in: 0,
            ..FakeConfig::default()
        },
    );
    let h = e.generate(greedy("Endless", 100_000)).expect("submit");
    std::thread::sleep(Duration::from_millis(20));
    drop(h);
    let c = e
        .generate(greedy("After", 3))
        .expect("submit")
        .blocking_completion()
        .expect("runs");
    assert_eq!(c.usage.completion_tokens, 3);
    for _ in 0..100 {
        if e.metrics().busy_slots == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(e.metrics().busy_slots, 0);
    assert_eq!(e.metrics().requests_cancelled, 1);
}

#[test]
fn queue_full_is_rejected_at_once() {
    let mut cfg = config(1, CacheMode::Off);
    cfg.scheduler.max_queued_requests = 2;
    let e = Engine::start(
        FakeBackend::new(FakeConfig {
            n_seq_max: 3,
            n_batch: 64,
            n_ubatch: 64,
            eos_one_in: 0,
            ..FakeConfig::default()
        }),
        cfg,
    );
    let held: Vec<_> = (0..2)
        .map(|_| e.generate(greedy("x", 100_000)).expect("queued"))
        .collect();
    // Whether or not one was admitted yet, a third and fourth exceed the limit
    // only when both are still waiting; fill until rejected.
    let mut rejected = None;
    let mut extra = Vec::new();
    for _ in 0..4 {
        match e.generate(greedy("y", 1)) {
            Ok(h) => extra.push(h),
            Err(err) => {
                rejected = Some(err);
                break;
            }
        }
    }
    assert!(
        matches!(rejected, Some(EngineError::QueueFull { max_queued: 2 })),
        "{rejected:?}"
    );
    drop(held);
}

#[test]
fn bad_input_is_rejected_before_a_slot() {
    let e = engine(
        1,
        CacheMode::Off,
        FakeConfig {
            n_ctx: 64,
            ..FakeConfig::default()
        },
    );
    let long = "z".repeat(100);
    assert!(matches!(
        e.generate(greedy(&long, 1)),
        Err(EngineError::PromptTooLong {
            prompt_tokens: 101,
            n_ctx: 64
        })
    ));
    assert!(matches!(
        e.generate(greedy("", 1)),
        Err(EngineError::EmptyPrompt)
    ));
    assert!(matches!(
        e.generate(GenerateRequest {
            max_tokens: Some(0),
            ..GenerateRequest::new("a")
        }),
        Err(EngineError::InvalidRequest {
            field: "max_tokens",
            ..
        })
    ));
    let bad = GenerateRequest {
        sampling: Some(SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        }),
        ..GenerateRequest::new("a")
    };
    let msg = e.generate(bad).unwrap_err().to_string();
    assert!(msg.contains("top_p"), "{msg}");
    let bad = GenerateRequest {
        constraint: Some(OutputConstraint::Grammar(INVALID_GRAMMAR.into())),
        ..GenerateRequest::new("a")
    };
    assert!(e.generate(bad).unwrap_err().to_string().contains("grammar"));
    assert!(matches!(
        e.generate(GenerateRequest::new(PromptInput::Tokens(vec![1, 999_999]))),
        Err(EngineError::InvalidRequest {
            field: "prompt",
            ..
        })
    ));
    assert_eq!(e.metrics().busy_slots, 0);
}

#[test]
fn exhausted_grammar_fails_with_a_clear_error() {
    let e = engine(
        1,
        CacheMode::Off,
        FakeConfig {
            eos_one_in: 0,
            ..FakeConfig::default()
        },
    );
    let req = GenerateRequest {
        constraint: Some(OutputConstraint::Grammar(EXHAUSTING_GRAMMAR.into())),
        ..greedy("abc", 50)
    };
    let err = e
        .generate(req)
        .expect("submit")
        .blocking_completion()
        .unwrap_err();
    assert_eq!(err, EngineError::GrammarExhausted { generated: 3 });
}

#[test]
fn embeddings_batch_across_slots_and_match_one_by_one() {
    let mut cfg = config(8, CacheMode::SharedPrefix);
    cfg.cache.idle_sequences = 0;
    let e = Engine::start(
        FakeBackend::new(FakeConfig {
            n_seq_max: 8,
            n_batch: 64,
            n_ubatch: 64,
            encoder_only: true,
            ..FakeConfig::default()
        }),
        cfg,
    );
    let inputs: Vec<String> = (0..16).map(|i| format!("sentence {i}")).collect();
    let one_by_one: Vec<_> = inputs
        .iter()
        .map(|s| {
            e.embed(EmbedRequest::new(s.as_str()))
                .expect("submit")
                .blocking_embedding()
                .expect("ok")
        })
        .collect();
    let steps_before = e.metrics().steps;
    let handles: Vec<_> = inputs
        .iter()
        .map(|s| e.embed(EmbedRequest::new(s.as_str())).expect("submit"))
        .collect();
    let together: Vec<_> = handles
        .into_iter()
        .map(|h| h.blocking_embedding().expect("ok"))
        .collect();
    let steps = e.metrics().steps - steps_before;
    assert!(steps < 16, "16 inputs took {steps} steps: not batched");
    for (a, b) in one_by_one.iter().zip(&together) {
        assert_eq!(a.values, b.values);
        assert_eq!(a.pooling, Pooling::Mean);
        let norm: f32 = a.values.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5);
    }
    let err = e.generate(greedy("hi", 2)).unwrap_err();
    assert!(matches!(err, EngineError::Unsupported(_)), "{err}");
}

#[test]
fn embedding_on_a_generation_context_is_rejected() {
    let e = engine(1, CacheMode::Off, FakeConfig::default());
    let err = e.embed(EmbedRequest::new("hello")).unwrap_err();
    assert!(err.to_string().contains("embeddings"), "{err}");
}

#[test]
fn chat_without_a_template_is_rejected_and_plain_prompts_still_work() {
    let e = engine(1, CacheMode::Off, FakeConfig::default());
    let err = e
        .chat(&[sipp::chat::ChatMessage::user("hi")], greedy("", 4))
        .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("tokenizer.chat_template"), "{msg}");
    assert!(e
        .generate(greedy("hi", 2))
        .expect("query works")
        .blocking_completion()
        .is_ok());
}

/// A reasoning budget forces the block's close through the executor: at the
/// budget, the next tokens are the close's, whatever the model would have
/// picked, and generation goes on after them.
#[test]
fn a_reasoning_budget_closes_the_block_at_its_token_count() {
    let e = engine(2, CacheMode::SharedPrefix, FakeConfig::default());
    let free = e
        .generate(greedy("Think about it.", 8))
        .expect("submit")
        .blocking_completion()
        .expect("completes");
    let budgeted = e
        .generate(GenerateRequest {
            reasoning_budget: Some(sipp::engine::ReasoningBudgetRequest {
                max_tokens: 3,
                close: "xy".into(),
                starts_inside: true,
            }),
            ..greedy("Think about it.", 8)
        })
        .expect("submit")
        .blocking_completion()
        .expect("completes");
    let vocab = e.vocab();
    let close = vocab.tokenize("xy", false, true).expect("tokenize");
    assert_eq!(budgeted.tokens.len(), 8);
    assert_eq!(
        budgeted.tokens[..3],
        free.tokens[..3],
        "free until the budget"
    );
    assert_eq!(budgeted.tokens[3..3 + close.len()], close[..]);
    assert_ne!(
        free.tokens[3..3 + close.len()],
        close[..],
        "the close was forced"
    );
}

#[test]
fn a_short_prompt_repeated_reuses_all_but_its_last_token() {
    // Shorter than `min_prefix_tokens` (8): only a whole-prompt hit is reused.
    let e = engine(2, CacheMode::SharedPrefix, FakeConfig::default());
    let first = e
        .generate(greedy("Hi yo", 4))
        .expect("submit")
        .blocking_completion()
        .expect("completes");
    assert_eq!(first.usage.cached_tokens, 0);
    let again = e
        .generate(greedy("Hi yo", 4))
        .expect("submit")
        .blocking_completion()
        .expect("completes");
    assert_eq!(again.usage.cached_tokens, again.usage.prompt_tokens - 1);
    assert_eq!(again.text, first.text);
    // A short prompt that only starts like the cached one computes afresh.
    let other = e
        .generate(greedy("Hi there", 4))
        .expect("submit")
        .blocking_completion()
        .expect("completes");
    assert_eq!(other.usage.cached_tokens, 0);
}

/// Two prompts of 600+ tokens (the fake tokenizer is one token per byte)
/// with nothing in common, so each holds more than `park_min_cells` (128)
/// cells of its own.
fn long_prompt(tag: char) -> String {
    let mut p = format!("{tag}: ");
    for i in 0..24 {
        p.push_str(&format!("{tag}{i} item of a long passage. "));
    }
    assert!(p.len() > 2 * NativeRuntimeConfig::default().cache.park_min_cells as usize);
    p
}

/// A short request and a long one at once, then a prompt continuing the
/// short one's: (short, long, continued) completions and the metrics once
/// the long one finished.
fn park_scenario(
    park_idle: bool,
    key: Option<&str>,
) -> (
    sipp::engine::Completion,
    sipp::engine::Completion,
    sipp::engine::MetricsSnapshot,
    sipp::engine::Completion,
) {
    let mut cfg = config(2, CacheMode::SharedPrefix);
    cfg.cache.park_idle = park_idle;
    let e = engine_with(cfg, FakeConfig::default());
    let short = e
        .generate(GenerateRequest {
            context_key: key.map(str::to_string),
            ..greedy(&long_prompt('A'), 4)
        })
        .expect("submit");
    let long = e.generate(greedy(&long_prompt('B'), 160)).expect("submit");
    let short = short.blocking_completion().expect("short");
    let long = long.blocking_completion().expect("long");
    // Metrics are published after each step; the release of the last
    // request is in the last one.
    let start = std::time::Instant::now();
    while e.metrics().busy_slots > 0 && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let m = e.metrics();
    let continued = e
        .generate(greedy(
            &format!("{}{} And then?", long_prompt('A'), short.text),
            8,
        ))
        .expect("submit")
        .blocking_completion()
        .expect("continued");
    (short, long, m, continued)
}

#[test]
fn idle_prefixes_are_parked_while_others_compute_and_come_back_by_a_copy() {
    let (short, long, m, continued) = park_scenario(true, None);
    // The short request's sequence left the live cache while the long one
    // decoded; the long one's own stays live once nothing computes.
    assert!(m.idle_parks >= 1, "{m:?}");
    assert_eq!(
        m.kv_cells_used as usize,
        long.usage.prompt_tokens + 159,
        "{m:?}"
    );
    // A prompt continuing the parked one gets it back from the store.
    assert!(
        continued.usage.cached_tokens >= short.usage.prompt_tokens,
        "{:?}",
        continued.usage
    );
    // The same requests on an engine that keeps idle prefixes live: same
    // texts, same reuse, both prefixes resident.
    let (short_live, long_live, m_live, continued_live) = park_scenario(false, None);
    assert_eq!(m_live.idle_parks, 0);
    assert_eq!(
        m_live.kv_cells_used as usize,
        long.usage.prompt_tokens + 159 + short.usage.prompt_tokens + 3
    );
    assert_eq!(
        (&short.text, &long.text, &continued.text),
        (&short_live.text, &long_live.text, &continued_live.text)
    );
    assert_eq!(
        continued.usage.cached_tokens,
        continued_live.usage.cached_tokens
    );
    assert!(m.snapshot_saves >= 1, "{m:?}");
}

#[test]
fn a_session_pinned_prefix_is_never_parked() {
    let (short, _, m, continued) = park_scenario(true, Some("pinned"));
    assert_eq!(m.idle_parks, 0, "{m:?}");
    assert!(continued.usage.cached_tokens >= short.usage.prompt_tokens);
}
