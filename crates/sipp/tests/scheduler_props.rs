//! Property tests of the scheduler, KV bookkeeping and engine step against the
//! fake backend: random arrivals, prompt lengths, shared prefixes, max_tokens,
//! stop strings, cancellations, injected decode failures, speculative drafts
//! accepted and rejected (rejected rows are rolled back every step), and
//! prompts with images (spans of their own, shared like text, some failing).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use proptest::prelude::*;
use sipp::config::{CacheMode, NativeRuntimeConfig, SpeculativeMode};
use sipp::engine::{
    Completion, EngineCore, EngineError, EngineInfo, EngineMetrics, GenerateRequest, PromptInput,
    QueuePlace, RequestEvent, RequestPreparer,
};
use sipp::runtime::fake::{FakeBackend, FakeConfig};
use sipp::runtime::{Backend, Token};
use sipp::sampling::SamplingParams;
use sipp::scheduler::{Slot, SlotPhase};
use sipp::text::FinishReason;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[derive(Debug, Clone)]
struct Arrival {
    step: usize,
    base: usize,
    prefix_len: usize,
    suffix: Vec<u8>,
    max_tokens: u32,
    stop: Option<String>,
    cancel_after: Option<usize>,
    poison: bool,
    greedy: bool,
    repeatable: bool,
    /// An image after the base prefix: (which of a few images, its tokens).
    image: Option<(u8, usize)>,
}

#[derive(Debug, Clone)]
struct Scenario {
    slots: u32,
    budget: u32,
    n_ctx: u32,
    idle_sequences: u32,
    mode: CacheMode,
    arrivals: Vec<Arrival>,
    no_kv_steps: Vec<usize>,
    speculative: SpeculativeMode,
    /// The fake model's window (0: whole history); short windows repeat
    /// text, so drafts get accepted.
    window: usize,
}

const BASES: [&str; 3] = [
    "You are a helpful assistant. Answer briefly and clearly. ",
    "System: the following is a conversation log with tools. ",
    "Réponds en français, s'il te plaît. 日本語も ",
];

fn arrival() -> impl Strategy<Value = Arrival> {
    (
        0usize..30,
        0usize..3,
        0usize..60,
        proptest::collection::vec(proptest::sample::select(b"abcdest .".to_vec()), 1..30),
        1u32..24,
        proptest::option::weighted(
            0.3,
            proptest::sample::select(vec!["a", "e ", "st", "é"]).prop_map(String::from),
        ),
        proptest::option::weighted(0.2, 0usize..20),
        proptest::bool::weighted(0.08),
        proptest::bool::weighted(0.7),
        proptest::bool::weighted(0.1),
        proptest::option::weighted(0.3, (0u8..3, 1usize..24)),
    )
        .prop_map(
            |(
                step,
                base,
                prefix_len,
                suffix,
                max_tokens,
                stop,
                cancel_after,
                poison,
                greedy,
                repeatable,
                image,
            )| {
                Arrival {
                    step,
                    base,
                    prefix_len,
                    suffix,
                    max_tokens,
                    stop,
                    cancel_after,
                    poison,
                    greedy,
                    repeatable,
                    image,
                }
            },
        )
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        1u32..6,
        0u32..60,
        prop_oneof![Just(96u32), Just(160), Just(400), Just(2048)],
        0u32..4,
        prop_oneof![
            Just(CacheMode::Off),
            Just(CacheMode::LiveSlotPrefix),
            Just(CacheMode::SharedPrefix)
        ],
        proptest::collection::vec(arrival(), 1..14),
        proptest::collection::vec(0usize..80, 0..3),
        prop_oneof![Just(SpeculativeMode::Off), Just(SpeculativeMode::Ngram)],
        prop_oneof![Just(0usize), Just(2), Just(4)],
    )
        .prop_map(
            |(
                slots,
                extra,
                n_ctx,
                idle_sequences,
                mode,
                arrivals,
                no_kv_steps,
                speculative,
                window,
            )| {
                Scenario {
                    slots,
                    budget: slots + 4 + extra,
                    n_ctx,
                    idle_sequences,
                    mode,
                    arrivals,
                    no_kv_steps,
                    speculative,
                    window,
                }
            },
        )
}

fn prompt_text(a: &Arrival) -> String {
    let base = BASES[a.base];
    let cut = base
        .char_indices()
        .map(|(i, _)| i)
        .chain([base.len()])
        .take_while(|&i| i <= a.prefix_len)
        .last()
        .unwrap_or(0);
    let mut s = base[..cut].to_string();
    s.push_str(&String::from_utf8_lossy(&a.suffix));
    if a.poison {
        s.push_str("<poison>");
    }
    s
}

/// The prompt: text, or with an image the fake's byte tokens around the
/// image's placeholders (a poisoned arrival's image fails to compute).
fn prompt_input(a: &Arrival) -> PromptInput {
    let Some((which, n_tokens)) = a.image else {
        return PromptInput::Text(prompt_text(a));
    };
    let base = BASES[a.base].as_bytes();
    let mut tokens: Vec<Token> = base[..a.prefix_len.min(base.len())]
        .iter()
        .map(|&b| Token::from(b))
        .collect();
    let start = tokens.len();
    let hash = if a.poison {
        sipp::runtime::fake::POISON_IMAGE
    } else {
        u64::from(which) + 1
    };
    tokens.extend(sipp::media::placeholder_tokens(hash, n_tokens));
    tokens.extend(a.suffix.iter().map(|&b| Token::from(b)));
    PromptInput::Media(sipp::engine::MediaPrompt {
        tokens,
        media: vec![sipp::runtime::MediaSpan {
            start,
            chunk: sipp::runtime::MediaChunk {
                hash,
                n_tokens,
                handle: Arc::new(()),
            },
        }],
    })
}

struct Harness {
    core: EngineCore<FakeBackend>,
    preparer: RequestPreparer,
    queued: Arc<AtomicUsize>,
    budget: usize,
    n_seq: usize,
    metrics: Arc<EngineMetrics>,
}

fn harness(sc: &Scenario) -> Harness {
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_parallel = sc.slots;
    cfg.context.n_batch = sc.budget;
    cfg.context.n_ubatch = sc.budget;
    cfg.cache.mode = sc.mode;
    cfg.cache.idle_sequences = sc.idle_sequences;
    cfg.cache.min_prefix_tokens = 4;
    cfg.cache.max_snapshot_bytes = 4096;
    cfg.cache.max_snapshot_entries = 4;
    // Prompts here are short: park any idle prefix of 8 cells or more.
    cfg.cache.park_min_cells = 8;
    cfg.speculative.mode = sc.speculative;
    cfg.speculative.n_max = 6;
    cfg.speculative.ngram_min = 1;
    cfg.speculative.row_cost_ratio = 100.0;
    cfg.validate().expect("valid config");
    let n_seq = sc.slots + sc.idle_sequences;
    let backend = FakeBackend::new(FakeConfig {
        n_ctx: sc.n_ctx,
        n_seq_max: n_seq,
        n_batch: sc.budget,
        n_ubatch: sc.budget,
        window: sc.window,
        ..FakeConfig::default()
    });
    let info = EngineInfo::new(&backend, &cfg);
    let preparer = RequestPreparer::new(backend.vocab(), info);
    let queued = Arc::new(AtomicUsize::new(0));
    let metrics = Arc::new(EngineMetrics::default());
    let core = EngineCore::new(backend, &cfg, metrics.clone());
    Harness {
        core,
        preparer,
        queued,
        budget: sc.budget as usize,
        n_seq: n_seq as usize,
        metrics,
    }
}

struct Tracked {
    arrival: Arrival,
    rx: UnboundedReceiver<RequestEvent>,
    events: Vec<RequestEvent>,
    submitted_step: usize,
    rejected: Option<EngineError>,
}

fn check_invariants(h: &Harness) -> Result<(), TestCaseError> {
    let sessions = h.core.sessions();
    let backend = h.core.backend();
    // The mirror equals what the backend holds, sequence by sequence.
    for seq in 0..h.n_seq as i32 {
        prop_assert_eq!(
            sessions.resident_tokens(seq),
            backend.seq_tokens(seq),
            "mirror of sequence {}",
            seq
        );
    }
    prop_assert_eq!(
        sessions.cells_used(),
        backend.used_cells(),
        "cell accounting"
    );
    // Busy slots hold current leases on distinct sequences.
    let mut seqs = std::collections::HashSet::new();
    for (i, s) in h.core.slots().iter().enumerate() {
        if let Some(w) = s.running() {
            let lease = w.tokens.lease;
            prop_assert!(
                sessions.check(lease).is_ok(),
                "slot {} holds a stale lease",
                i
            );
            prop_assert!(
                seqs.insert(lease.seq_id),
                "sequence {} shared by two slots",
                lease.seq_id
            );
        } else {
            prop_assert_eq!(s.phase(), SlotPhase::Idle);
        }
    }
    prop_assert_eq!(
        sessions.leased_count(),
        seqs.len(),
        "a lease outlived its slot"
    );
    // A repeatable request runs alone.
    let busy: Vec<_> = h.core.slots().iter().filter_map(Slot::running).collect();
    if busy.iter().any(|w| w.repeatable) {
        prop_assert_eq!(busy.len(), 1, "a repeatable request shares the engine");
    }
    prop_assert!(
        backend.max_batch_rows <= h.budget,
        "batch of {} rows over budget {}",
        backend.max_batch_rows,
        h.budget
    );
    Ok(())
}

/// Runs a scenario to the end; returns every request's events.
fn run(sc: &Scenario) -> Result<Vec<Tracked>, TestCaseError> {
    let mut h = harness(sc);
    let mut tracked: Vec<Tracked> = Vec::new();
    let mut ids: Vec<Option<u64>> = Vec::new();
    let mut step = 0usize;
    loop {
        for (i, a) in sc.arrivals.iter().enumerate() {
            if a.step != step {
                continue;
            }
            let (tx, rx) = unbounded_channel();
            let req = GenerateRequest {
                max_tokens: Some(a.max_tokens),
                stop: a.stop.iter().cloned().collect(),
                sampling: Some(if a.greedy {
                    SamplingParams::greedy()
                } else {
                    SamplingParams {
                        seed: Some(i as u32),
                        ..SamplingParams::default()
                    }
                }),
                repeatable: a.repeatable,
                ..GenerateRequest::new(prompt_input(a))
            };
            let id = 1000 + i as u64;
            let mut t = Tracked {
                arrival: a.clone(),
                rx,
                events: Vec::new(),
                submitted_step: step,
                rejected: None,
            };
            match h.preparer.prepare_generate(id, req, tx) {
                Ok(p) => {
                    let place = QueuePlace::reserve(&h.queued, usize::MAX);
                    h.core.enqueue(p, place);
                    ids.push(Some(id));
                }
                Err(e) => {
                    t.rejected = Some(e);
                    ids.push(None);
                }
            }
            tracked.push(t);
        }
        for (k, t) in tracked.iter().enumerate() {
            if let (Some(c), Some(id)) = (t.arrival.cancel_after, ids[k]) {
                if t.submitted_step + c == step {
                    let leased = h.core.sessions().leased_count();
                    let held = h.core.slots().iter().any(|s| s.serves(id));
                    h.core.cancel(id);
                    // A cancel frees its slot and lease at once, not at the next step.
                    prop_assert!(
                        !h.core.slots().iter().any(|s| s.serves(id)),
                        "request {} still holds a slot after its cancel",
                        id
                    );
                    prop_assert_eq!(
                        h.core.sessions().leased_count(),
                        leased - usize::from(held),
                        "the cancelled request's lease is released"
                    );
                }
            }
        }
        if sc.no_kv_steps.contains(&step) {
            h.core.backend_mut().inject_no_kv = 1;
        }
        // Decoding slots before the step must get their token in it.
        let decoding: HashMap<usize, (u64, usize, usize)> = h
            .core
            .slots()
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s.phase(), SlotPhase::Decode | SlotPhase::EmitBuffered))
            .filter_map(|(i, s)| {
                s.running().map(|w| {
                    (
                        i,
                        (
                            w.tokens.request_id,
                            w.counters.decode_steps,
                            w.counters.preemptions,
                        ),
                    )
                })
            })
            .collect();
        let injected = h.core.backend().inject_no_kv > 0;
        h.core.step();
        check_invariants(&h)?;
        if !injected {
            for (i, s) in h.core.slots().iter().enumerate() {
                if let (Some(w), Some(&(id, steps, pre))) = (s.running(), decoding.get(&i)) {
                    if w.tokens.request_id == id && w.counters.preemptions == pre {
                        prop_assert_eq!(
                            w.counters.decode_steps,
                            steps + 1,
                            "slot {} skipped a decode step",
                            i
                        );
                    }
                }
            }
        }
        for t in &mut tracked {
            while let Ok(ev) = t.rx.try_recv() {
                t.events.push(ev);
            }
        }
        step += 1;
        let arrivals_done = sc.arrivals.iter().all(|a| a.step < step);
        if arrivals_done && !h.core.has_work() {
            break;
        }
        prop_assert!(step < 5000, "scenario did not finish in 5000 steps");
    }
    prop_assert_eq!(h.core.sessions().leased_count(), 0, "leases leaked");
    prop_assert!(h.core.slots().iter().all(|s| s.phase() == SlotPhase::Idle));
    prop_assert_eq!(h.queued.load(Ordering::SeqCst), 0, "queue gauge leaked");
    let problems = h.core.check_idle_invariants();
    prop_assert!(problems.is_empty(), "idle invariants: {:?}", problems);
    let m = h.metrics.snapshot();
    prop_assert!(m.draft_accepted_tokens <= m.draft_tokens);
    if sc.speculative == SpeculativeMode::Off {
        prop_assert_eq!(m.draft_tokens, 0, "drafts with speculation off");
    }
    Ok(tracked)
}

fn check_request(t: &Tracked, n_ctx: u32) -> Result<Option<Completion>, TestCaseError> {
    if let Some(e) = &t.rejected {
        prop_assert!(t.events.is_empty());
        prop_assert!(
            matches!(e, EngineError::PromptTooLong { .. }),
            "unexpected rejection {e}"
        );
        return Ok(None);
    }
    let finals: Vec<&RequestEvent> = t.events.iter().filter(|e| e.is_final()).collect();
    prop_assert_eq!(
        finals.len(),
        1,
        "exactly one final event, got {:?}",
        t.events
    );
    prop_assert!(
        t.events.last().is_some_and(RequestEvent::is_final),
        "final event is last"
    );
    let mut text = String::new();
    let mut tokens: Vec<Token> = Vec::new();
    for e in &t.events {
        if let RequestEvent::Delta(d) = e {
            text.push_str(&d.text);
            tokens.extend(&d.tokens);
        }
    }
    match finals[0] {
        RequestEvent::Finished(c) => {
            prop_assert!(
                !t.arrival.poison || c.finish_reason == FinishReason::Cancelled,
                "poisoned prompt finished normally"
            );
            prop_assert_eq!(&c.text, &text, "deltas add up to the text");
            prop_assert_eq!(&c.tokens, &tokens, "tokens arrive in order");
            prop_assert!(c.usage.completion_tokens <= t.arrival.max_tokens as usize);
            prop_assert!(
                !t.arrival.repeatable || c.usage.cached_tokens == 0,
                "a repeatable request reused KV"
            );
            if c.finish_reason == FinishReason::Length {
                prop_assert!(
                    c.usage.completion_tokens == t.arrival.max_tokens as usize
                        || c.usage.prompt_tokens + c.usage.completion_tokens >= n_ctx as usize - 1
                );
            }
            if c.finish_reason == FinishReason::Cancelled {
                prop_assert!(
                    t.arrival.cancel_after.is_some(),
                    "cancelled without a cancel"
                );
            }
            if let Some(stop) = &t.arrival.stop {
                prop_assert!(
                    !c.text.contains(stop.as_str()),
                    "stop string leaked: {:?} in {:?}",
                    stop,
                    c.text
                );
            }
            Ok(Some(c.clone()))
        }
        RequestEvent::Failed(e) => {
            let expected = t.arrival.poison || matches!(e, EngineError::KvCacheFull(_));
            prop_assert!(expected, "unexpected failure {e}");
            Ok(None)
        }
        other => {
            prop_assert!(false, "unexpected final event {other:?}");
            Ok(None)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn every_request_ends_once_and_kv_stays_consistent(sc in scenario()) {
        let tracked = run(&sc)?;
        for t in &tracked {
            check_request(t, sc.n_ctx)?;
        }
    }

    /// Greedy output does not depend on whether, or how, prefixes were reused:
    /// the fake's logits are a function of the whole resident history, so a
    /// wrong reused prefix would change the text.
    #[test]
    fn prefix_reuse_never_changes_greedy_output(mut sc in scenario()) {
        for a in &mut sc.arrivals {
            a.cancel_after = None;
            a.greedy = true;
        }
        sc.no_kv_steps.clear();
        let texts = |mode| -> Result<Vec<Option<String>>, TestCaseError> {
            let mut s = sc.clone();
            s.mode = mode;
            run(&s)?.iter().map(|t| check_request(t, s.n_ctx).map(|c| c.map(|c| c.text))).collect()
        };
        let off = texts(CacheMode::Off)?;
        let shared = texts(CacheMode::SharedPrefix)?;
        let live = texts(CacheMode::LiveSlotPrefix)?;
        for i in 0..off.len() {
            if let (Some(a), Some(b)) = (&off[i], &shared[i]) {
                prop_assert_eq!(a, b, "request {} differs with shared-prefix reuse", i);
            }
            if let (Some(a), Some(b)) = (&off[i], &live[i]) {
                prop_assert_eq!(a, b, "request {} differs with live-slot reuse", i);
            }
        }
    }

    /// Drafting never changes a request's text, greedy or seeded: a drafted
    /// token is kept only when it is what the request samples anyway, and
    /// the rows of rejected ones leave the KV cache (the invariants checked
    /// after every step compare each sequence, shared prefixes included, with
    /// the backend's cells).
    #[test]
    fn speculation_never_changes_output(mut sc in scenario()) {
        for a in &mut sc.arrivals {
            a.cancel_after = None;
        }
        sc.no_kv_steps.clear();
        let texts = |speculative| -> Result<Vec<Option<String>>, TestCaseError> {
            let mut s = sc.clone();
            s.speculative = speculative;
            run(&s)?.iter().map(|t| check_request(t, s.n_ctx).map(|c| c.map(|c| c.text))).collect()
        };
        let off = texts(SpeculativeMode::Off)?;
        let on = texts(SpeculativeMode::Ngram)?;
        for i in 0..off.len() {
            if let (Some(a), Some(b)) = (&off[i], &on[i]) {
                prop_assert_eq!(a, b, "request {} differs with drafts", i);
            }
        }
    }
}
