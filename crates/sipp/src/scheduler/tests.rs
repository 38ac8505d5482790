//! Every decision kind, and their interactions, as values: no backend. The
//! KV mirror stands in for the cache; outputs are written by hand.

use std::collections::HashMap;
use std::time::Instant;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::*;
use crate::config::{CacheConfig, CacheMode};
use crate::engine::{GenerateSpec, PreparedKind, PreparedRequest, RequestEvent};
use crate::runtime::fake::{FakeBackend, FakeConfig};
use crate::runtime::{Backend, SeqId, Token};
use crate::sampling::SamplingParams;
use crate::session::{KvOp, KvSessions, Reuse};
use crate::text::FinishReason;

struct Harness {
    s: Scheduler,
    kv: KvSessions,
    rx: HashMap<RequestId, UnboundedReceiver<RequestEvent>>,
    next_id: RequestId,
}

fn harness(slots: usize, n_seq: u32, n_ctx: u32, budget: usize, mode: CacheMode) -> Harness {
    let vocab = FakeBackend::new(FakeConfig::default()).vocab();
    let cache = CacheConfig {
        mode,
        min_prefix_tokens: 4,
        max_snapshot_bytes: 0,
        max_snapshot_entries: 0,
        ..CacheConfig::default()
    };
    Harness {
        s: Scheduler::new(
            SchedulerConfig {
                slots,
                limits: StepLimits {
                    budget,
                    n_ubatch: budget,
                },
                n_ctx,
                min_prefix: 4,
                model_is_encoder: false,
                log_requests: false,
                row_cost_ratio: 0.0,
                rotate_adapters: false,
            },
            vocab,
        ),
        kv: KvSessions::new(n_seq, n_ctx, &cache, "test", None),
        rx: HashMap::new(),
        next_id: 1,
    }
}

fn spec(max_tokens: usize) -> GenerateSpec {
    GenerateSpec {
        max_tokens,
        stop: Vec::new(),
        ignore_eos: true,
        sampling: SamplingParams::greedy(),
        seed: 0,
        constraint: None,
        logprobs: None,
        reasoning_budget: None,
        speculative: Default::default(),
        skip_special_tokens: true,
        include_stop: false,
    }
}

/// `prefix` followed by `n` tokens that no other call's suffix shares.
fn prompt(prefix: &[Token], n: usize) -> Vec<Token> {
    use std::sync::atomic::{AtomicI32, Ordering};
    static NEXT: AtomicI32 = AtomicI32::new(1000);
    let base = NEXT.fetch_add(n as i32 + 1, Ordering::Relaxed);
    prefix
        .iter()
        .copied()
        .chain((0..n as Token).map(|i| base + i))
        .collect()
}

impl Harness {
    fn submit(&mut self, prompt: Vec<Token>, max_tokens: usize, cache_prompt: bool) -> RequestId {
        let id = self.next_id;
        self.next_id += 1;
        let (tx, rx) = unbounded_channel();
        self.rx.insert(id, rx);
        self.s.enqueue(
            PreparedRequest {
                id,
                kind: PreparedKind::Generate(spec(max_tokens)),
                prompt,
                media: std::sync::Arc::from(Vec::new()),
                encoder_input: None,
                context_key: None,
                adapters: crate::runtime::AdapterSet::none(),
                cache_prompt,
                repeatable: false,
                submitted_at: Instant::now(),
                sink: tx,
            },
            None,
        );
        id
    }

    fn plan(&self) -> StepPlan {
        self.s.schedule(&self.kv, false)
    }

    /// Carries a plan out on the mirror alone; every output row samples `token`.
    fn execute(&mut self, plan: &StepPlan, token: Token) -> StepOutput {
        for op in &plan.kv_ops {
            self.kv.apply_to_mirror(op);
        }
        let outcomes = plan
            .batch
            .spans
            .iter()
            .map(|span| {
                self.kv
                    .record_decoded(span.lease, &span.tokens)
                    .expect("current lease");
                let result = if span.outputs.is_empty() {
                    SpanResult::Computed
                } else {
                    SpanResult::Sampled(vec![SampledToken {
                        token,
                        logprobs: None,
                    }])
                };
                SpanOutcome {
                    slot: span.slot,
                    request_id: span.request_id,
                    result,
                    drafted: 0,
                }
            })
            .collect();
        StepOutput {
            batch: if plan.batch.spans.is_empty() {
                BatchOutcome::NotRun
            } else {
                BatchOutcome::Ran(outcomes)
            },
            ..StepOutput::default()
        }
    }

    fn deliver(&mut self, u: Updated) {
        for r in u.releases {
            self.kv.apply_to_mirror(&KvOp::Release {
                lease: r.lease,
                keep: r.keep,
            });
        }
        for e in u.emits {
            let _ = e.sink.send(e.event);
        }
    }

    /// Plans, executes and applies one step.
    fn step(&mut self, token: Token) -> StepPlan {
        let plan = self.plan();
        let out = self.execute(&plan, token);
        let u = self.s.update(&plan, out);
        self.deliver(u);
        plan
    }

    fn events(&mut self, id: RequestId) -> Vec<RequestEvent> {
        let rx = self.rx.get_mut(&id).expect("submitted");
        std::iter::from_fn(|| rx.try_recv().ok()).collect()
    }

    fn slot_of(&self, id: RequestId) -> Option<SlotId> {
        self.s.slots.iter().position(|s| s.serves(id))
    }

    fn tokens(&self, id: RequestId) -> &SlotTokens {
        let slot = self.slot_of(id).expect("running");
        self.s.slots[slot].tokens().expect("busy")
    }

    fn seq_of(&self, id: RequestId) -> SeqId {
        self.tokens(id).lease.seq_id
    }
}

fn finals(events: &[RequestEvent]) -> Vec<&RequestEvent> {
    events.iter().filter(|e| e.is_final()).collect()
}

#[test]
fn admissions_follow_the_queue_while_slots_last() {
    let mut h = harness(2, 2, 1000, 64, CacheMode::Off);
    let ids: Vec<_> = (0..3).map(|i| h.submit(prompt(&[i], 5), 4, true)).collect();
    let plan = h.plan();
    let admitted: Vec<_> = plan.admissions.iter().map(|a| a.request_id).collect();
    assert_eq!(admitted, ids[..2]);
    assert!(plan.admissions.iter().all(|a| a.reuse == Reuse::Cold));
    assert_eq!(plan.batch.n_rows(), 12, "both prompts, whole");
    assert!(plan.batch.spans.iter().all(|s| s.outputs == vec![5]));
    // Planning changed nothing: the same plan comes out again.
    assert_eq!(h.plan().admissions.len(), 2);
    assert_eq!(h.s.queue_len(), 3);
    h.step(7);
    assert_eq!(h.s.queue_len(), 1);
    assert!(matches!(h.events(ids[0])[0], RequestEvent::Started));
}

#[test]
fn a_sampled_token_is_fed_back_at_the_next_position() {
    let mut h = harness(1, 1, 1000, 64, CacheMode::Off);
    let id = h.submit(prompt(&[1], 5), 4, true);
    h.step(42);
    let plan = h.plan();
    let span = &plan.batch.spans[0];
    assert_eq!(span.kind, SpanKind::Decode);
    assert_eq!((span.start, span.tokens.clone()), (6, vec![42]));
    assert_eq!(h.s.slots[0].phase(), SlotPhase::Decode);
    h.step(43);
    assert_eq!(h.tokens(id).context.len(), 7);
    assert_eq!(h.tokens(id).pending, vec![43]);
}

#[test]
fn the_budget_goes_to_decoders_first_then_prompt_chunks() {
    let mut h = harness(2, 2, 1000, 8, CacheMode::Off);
    h.submit(prompt(&[1], 3), 50, true);
    h.step(9);
    h.submit(prompt(&[2], 30), 50, true);
    let plan = h.plan();
    assert_eq!(plan.batch.spans[0].kind, SpanKind::Decode);
    assert_eq!(
        plan.batch.spans[1].tokens.len(),
        7,
        "the rest of the budget"
    );
    assert!(
        plan.batch.spans[1].outputs.is_empty(),
        "no logits mid-prompt"
    );
}

#[test]
fn a_finished_prompt_is_continued_in_its_own_sequence() {
    let mut h = harness(1, 1, 1000, 64, CacheMode::LiveSlotPrefix);
    let a = h.submit(prompt(&[1, 2, 3, 4, 5, 6], 2), 1, true);
    h.step(7);
    assert!(matches!(
        finals(&h.events(a))[0],
        RequestEvent::Finished(c) if c.finish_reason == FinishReason::Length
    ));
    h.submit(prompt(&[1, 2, 3, 4, 5, 6], 9), 1, true);
    let plan = h.plan();
    let adm = &plan.admissions[0];
    assert_eq!((adm.reuse, adm.reused_tokens), (Reuse::SameSequence, 6));
    assert!(plan.kv_ops.contains(&KvOp::Truncate { seq: 0, from: 6 }));
    assert_eq!(
        plan.batch.spans[0].start, 6,
        "only the new suffix is computed"
    );
}

#[test]
fn a_running_slots_prefix_is_shared_into_a_new_sequence() {
    let mut h = harness(2, 2, 1000, 64, CacheMode::SharedPrefix);
    let shared = prompt(&[1, 2, 3, 4, 5, 6, 7, 8], 0);
    let a = h.submit(prompt(&shared, 4), 20, true);
    h.step(9);
    h.submit(prompt(&shared, 6), 20, true);
    let plan = h.plan();
    let adm = &plan.admissions[0];
    let src = h.seq_of(a);
    assert_eq!(adm.reuse, Reuse::SharedFrom(src));
    assert_eq!(adm.reused_tokens, 8);
    assert!(plan.kv_ops.contains(&KvOp::Share {
        src,
        dst: adm.lease.seq_id,
        len: 8
    }));
}

#[test]
fn a_prefix_being_computed_is_waited_for_then_shared() {
    let mut h = harness(2, 2, 1000, 16, CacheMode::SharedPrefix);
    let shared: Vec<Token> = (1..=30).collect();
    let a = h.submit(prompt(&shared, 2), 20, true);
    h.step(9); // a computes 16 of 32
    let b = h.submit(prompt(&shared, 5), 20, true);
    let plan = h.step(9); // a reaches 32
    let wait = plan.admissions[0]
        .prefix_wait
        .expect("waits for a's prefix");
    assert_eq!((wait.source_request, wait.len), (a, 30));
    assert!(
        plan.batch.spans.iter().all(|s| s.request_id != b),
        "a waiting slot computes nothing"
    );
    let plan = h.plan();
    let shares: Vec<_> = plan
        .prefix_shares
        .iter()
        .map(|p| (p.slot, p.shared))
        .collect();
    assert_eq!(shares, vec![(h.slot_of(b).expect("b runs"), Some(30))]);
    assert!(
        plan.prefix_shares[0].from < 30,
        "b had less than the prefix"
    );
    h.step(9);
    assert!(h.tokens(b).prefill_cursor >= 30);
}

/// `a` computes a 32-token prompt 16 tokens a step; `b`, sharing its first
/// 30 tokens, arrives after a's first step and waits for them.
fn waiting_pair() -> (Harness, RequestId, RequestId) {
    let mut h = harness(2, 2, 1000, 16, CacheMode::SharedPrefix);
    let shared: Vec<Token> = (1..=30).collect();
    let a = h.submit(prompt(&shared, 2), 20, true);
    h.step(9);
    let b = h.submit(prompt(&shared, 5), 20, true);
    h.step(9);
    (h, a, b)
}

#[test]
fn a_prefix_wait_ends_when_its_source_is_cancelled() {
    let (mut h, a, b) = waiting_pair();
    assert!(h.tokens(b).prefix_wait.is_some());
    let u = h.s.cancel(a);
    assert_eq!(u.releases.len(), 1, "the source's slot is freed at once");
    h.deliver(u);
    let plan = h.plan();
    let slot = h.slot_of(b).expect("b runs");
    let shares: Vec<_> = plan
        .prefix_shares
        .iter()
        .map(|p| (p.slot, p.shared))
        .collect();
    assert_eq!(shares, vec![(slot, None)]);
    assert!(
        plan.batch.spans.iter().any(|s| s.request_id == b),
        "b computes the prefix itself in the same step"
    );
}

#[test]
fn a_prefix_wait_ends_when_its_source_is_preempted() {
    let (mut h, a, b) = waiting_pair();
    let slot_a = h.slot_of(a).expect("a runs");
    let r = h.s.slots[slot_a].running_mut().expect("busy");
    r.tokens.preempted = true;
    let plan = h.plan();
    let slot_b = h.slot_of(b).expect("b runs");
    assert!(plan
        .prefix_shares
        .iter()
        .any(|p| (p.slot, p.shared) == (slot_b, None)));
}

#[test]
fn cancelling_a_waiting_request_frees_its_slot_and_leaves_the_source_alone() {
    let (mut h, a, b) = waiting_pair();
    let u = h.s.cancel(b);
    assert_eq!(u.releases.len(), 1);
    h.deliver(u);
    assert_eq!(h.slot_of(b), None);
    let ev = h.events(b);
    assert!(matches!(
        finals(&ev)[..],
        [RequestEvent::Finished(c)] if c.finish_reason == FinishReason::Cancelled
    ));
    let plan = h.plan();
    assert!(plan.prefix_shares.is_empty());
    assert!(plan.batch.spans.iter().any(|s| s.request_id == a));
}

#[test]
fn when_the_cache_is_full_the_newest_slot_is_preempted() {
    // 2 slots of 10-token prompts on 21 cells: one decode step fits, the next not.
    let mut h = harness(2, 2, 21, 64, CacheMode::Off);
    let a = h.submit(prompt(&[1], 9), 50, false);
    let b = h.submit(prompt(&[2], 9), 50, false);
    h.step(5);
    assert_eq!(h.kv.cells_free(), 1);
    let plan = h.plan();
    let slot_b = h.slot_of(b).expect("b runs");
    assert_eq!(
        plan.preemptions,
        vec![slot_b],
        "the newer request gives way"
    );
    assert!(plan.kv_ops.contains(&KvOp::Truncate {
        seq: h.seq_of(b),
        from: 0
    }));
    assert_eq!(plan.batch.spans.len(), 1);
    assert_eq!(plan.batch.spans[0].request_id, a);
    h.step(5);
    assert!(h.tokens(b).preempted);
    assert_eq!(h.tokens(b).pending, vec![5], "its next token is kept");
}

#[test]
fn a_refused_batch_evicts_idle_kv_first_then_fails_a_lone_request() {
    let mut h = harness(1, 2, 100, 64, CacheMode::LiveSlotPrefix);
    h.submit(prompt(&[1, 2, 3, 4, 5], 3), 1, true);
    h.step(5);
    let a = h.submit(prompt(&[9], 9), 50, false);
    h.step(5);
    // The backend refused the last batch for room the mirror shows free.
    let plan = h.s.schedule(&h.kv, true);
    assert!(
        matches!(plan.kv_ops[..], [KvOp::Evict { seq: 0, .. }]),
        "the idle sequence goes first: {:?}",
        plan.kv_ops
    );
    assert_eq!(plan.batch.spans.len(), 1, "then the batch is planned again");
    h.kv.apply_to_mirror(&plan.kv_ops[0]);
    let plan = h.s.schedule(&h.kv, true);
    assert!(matches!(
        plan.failures[..],
        [(0, crate::engine::EngineError::KvCacheFull(_))]
    ));
    assert!(plan.batch.spans.is_empty());
    let out = h.execute(&plan, 5);
    let u = h.s.update(&plan, out);
    h.deliver(u);
    assert!(matches!(
        finals(&h.events(a))[..],
        [RequestEvent::Failed(
            crate::engine::EngineError::KvCacheFull(_)
        )]
    ));
    assert_eq!(h.kv.leased_count(), 0);
}

#[test]
fn a_freed_slot_resumes_a_preempted_one_and_room_preempts_another_in_one_step() {
    let mut h = harness(3, 3, 40, 64, CacheMode::Off);
    let a = h.submit(prompt(&[1], 9), 50, false);
    let b = h.submit(prompt(&[2], 9), 50, false);
    let c = h.submit(prompt(&[3], 9), 50, false);
    h.step(5);
    // b was preempted earlier; then a finishes and frees its slot.
    let slot_b = h.slot_of(b).expect("b runs");
    h.kv.apply_to_mirror(&KvOp::Truncate {
        seq: h.seq_of(b),
        from: 0,
    });
    {
        let r = h.s.slots[slot_b].running_mut().expect("busy");
        r.tokens.preempted = true;
        r.tokens.prefill_cursor = 0;
        r.phase = SlotPhase::Prefill;
    }
    let u = h.s.cancel(a);
    h.deliver(u);
    // Fill the cache so that b's recompute does not fit next to c.
    let slot_c = h.slot_of(c).expect("c runs");
    let seq_c = h.seq_of(c);
    let lease_c = h.tokens(c).lease;
    h.kv.record_decoded(lease_c, &[5; 25]).expect("lease");
    let r = h.s.slots[slot_c].running_mut().expect("busy");
    r.tokens.context.extend([5; 25]);
    r.tokens.prefill_cursor += 25;
    let plan = h.plan();
    assert_eq!(
        plan.resumes,
        vec![Resume {
            slot: slot_b,
            cursor: 0
        }]
    );
    assert_eq!(plan.preemptions, vec![slot_c], "c is the newest holder");
    assert!(plan.kv_ops.contains(&KvOp::Truncate {
        seq: seq_c,
        from: 0
    }));
    h.step(5);
    assert!(!h.tokens(b).preempted && h.tokens(c).preempted);
    assert_eq!(h.tokens(b).pending, vec![5]);
}

#[test]
fn a_repeatable_request_waits_for_the_others_and_then_runs_alone() {
    let mut h = harness(2, 2, 1000, 64, CacheMode::SharedPrefix);
    let a = h.submit(prompt(&[1], 5), 2, true);
    let r = h.submit(prompt(&[1], 5), 2, true);
    if let Some(q) = h.s.queue.back_mut() {
        q.req.repeatable = true;
    }
    let plan = h.step(5);
    assert_eq!(plan.admissions.len(), 1, "the repeatable request waits");
    h.step(5); // a finishes
    assert_eq!(h.slot_of(a), None);
    h.submit(prompt(&[2], 5), 2, true);
    let plan = h.plan();
    assert_eq!(
        plan.admissions.len(),
        1,
        "nothing joins a repeatable request"
    );
    assert_eq!(plan.admissions[0].request_id, r);
    assert_eq!(plan.admissions[0].reuse, Reuse::Cold);
    assert!(plan.kv_ops.contains(&KvOp::ClearAll));
}

#[test]
fn every_admitted_request_gets_exactly_one_final_event() {
    let mut h = harness(2, 2, 1000, 64, CacheMode::SharedPrefix);
    let ids: Vec<_> = (0..5).map(|i| h.submit(prompt(&[i], 4), 3, true)).collect();
    let cancelled = ids[3];
    for step in 0..40 {
        if step == 1 {
            let u = h.s.cancel(cancelled);
            h.deliver(u);
        }
        h.step(7);
        if !h.s.has_work() {
            break;
        }
    }
    assert!(!h.s.has_work());
    for id in ids {
        let ev = h.events(id);
        assert_eq!(finals(&ev).len(), 1, "request {id}: {ev:?}");
        assert!(ev.last().is_some_and(RequestEvent::is_final));
    }
    assert_eq!(h.kv.leased_count(), 0);
}

#[test]
fn a_request_that_cannot_fit_evicts_nothing() {
    let mut h = harness(2, 3, 40, 8, CacheMode::LiveSlotPrefix);
    h.submit(prompt(&[1], 7), 1, true);
    h.step(5); // computes 8 of 8, finishes: 8 idle cells kept
    h.submit(prompt(&[2], 24), 50, true);
    h.step(5); // 8 of 25 computed; 17 still to come
    assert_eq!(h.kv.cells_used(), 16);
    // 20 more cells on top of the 17 reserved do not fit in 24 free + 8 idle.
    h.submit(prompt(&[3], 19), 50, true);
    let plan = h.plan();
    assert!(plan.admissions.is_empty());
    assert!(
        !plan
            .kv_ops
            .iter()
            .any(|op| matches!(op, KvOp::Evict { .. })),
        "the idle prefix stays: {:?}",
        plan.kv_ops
    );
}
