//! The engine's step loop body: admission, the batch, sampling, emission and
//! finalization. It owns the backend and is driven by one thread (or directly
//! by tests, step by step).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use super::metrics::EngineMetrics;
use super::request::{
    Completion, EmbeddingOutput, EngineError, RequestEvent, RequestStats, TextDelta, TokenLogprobs,
    Usage,
};
use crate::config::{CacheMode, NativeRuntimeConfig};
use crate::runtime::{
    Backend, BatchError, BatchRow, Pooling, SampleError, SamplerSpec, SeqId, Token, Vocab,
};
use crate::sampling::{OutputConstraint, SamplerCacheKey, SamplingParams};
use crate::scheduler::{
    plan_step, AdmissionQueue, BatchPlan, HasTokens, PrefillKind, PrefixWait, RequestId,
    SlotCounters, SlotExecutionPlan, SlotId, SlotPhase, SlotSpan, SlotState, SlotTokens,
    StepLimits, TerminalAction,
};
use crate::session::KvSessions;
use crate::text::{FinishReason, TextEmitter};

/// Where a request's events go. A closed channel means the caller left.
pub type EventSink = UnboundedSender<RequestEvent>;

/// Generation settings after validation.
#[derive(Debug, Clone)]
pub struct GenerateSpec {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// The seed in effect.
    pub seed: u32,
    /// Grammar or schema.
    pub constraint: Option<OutputConstraint>,
    /// Top-n log-probabilities, when asked for.
    pub logprobs: Option<usize>,
}

/// What a prepared request asks for.
#[derive(Debug, Clone)]
pub enum PreparedKind {
    /// Generate text.
    Generate(GenerateSpec),
    /// Compute an embedding.
    Embed {
        /// L2-normalize.
        normalize: bool,
    },
}

/// A validated, tokenized request on its way to a slot.
#[derive(Debug)]
pub struct PreparedRequest {
    /// Id.
    pub id: RequestId,
    /// What to do.
    pub kind: PreparedKind,
    /// Prompt tokens.
    pub prompt: Vec<Token>,
    /// Session affinity key.
    pub context_key: Option<String>,
    /// Reuse and keep KV.
    pub cache_prompt: bool,
    /// Run alone on a cleared KV cache (see `GenerateRequest::repeatable`).
    pub repeatable: bool,
    /// When it was submitted.
    pub submitted_at: Instant,
    /// Its event stream.
    pub sink: EventSink,
}

#[derive(Debug)]
struct Timing {
    submitted: Instant,
    admitted: Instant,
    prefill_done: Option<Instant>,
    first_token: Option<Instant>,
}

#[derive(Debug)]
struct Generation {
    spec: GenerateSpec,
    emitter: TextEmitter,
    text: String,
    generated: Vec<Token>,
    logprobs: Vec<TokenLogprobs>,
}

/// A busy slot's request state.
pub struct SlotWork<S> {
    tokens: SlotTokens,
    sampler: Option<(S, Option<SamplerCacheKey>)>,
    generation: Option<Generation>,
    normalize: bool,
    sink: EventSink,
    timing: Timing,
    /// Per-request counters.
    pub counters: SlotCounters,
    cache_prompt: bool,
    /// Runs alone: nothing else is admitted while it holds its slot.
    pub repeatable: bool,
    context_key: Option<String>,
    final_sent: bool,
}

impl<S> std::fmt::Debug for SlotWork<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotWork")
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}

impl<S> HasTokens for SlotWork<S> {
    fn tokens(&self) -> &SlotTokens {
        &self.tokens
    }
}

/// Engine state driven one step at a time.
pub struct EngineCore<B: Backend> {
    backend: B,
    vocab: Arc<dyn Vocab>,
    slots: Vec<SlotState<SlotWork<B::Sampler>>>,
    queue: AdmissionQueue<PreparedRequest>,
    sessions: KvSessions,
    sampler_pool: HashMap<SamplerCacheKey, Vec<B::Sampler>>,
    limits: StepLimits,
    n_ctx: u32,
    min_prefix: usize,
    metrics: Arc<EngineMetrics>,
    queued: Arc<AtomicUsize>,
    step_count: u64,
    admissions: u64,
    log_requests: bool,
}

fn send(sink: &EventSink, ev: RequestEvent) -> bool {
    sink.send(ev).is_ok()
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl<B: Backend> EngineCore<B> {
    /// State for a backend. `queued` counts requests submitted but not admitted;
    /// submitters increment it, the core decrements it.
    pub fn new(
        backend: B,
        config: &NativeRuntimeConfig,
        metrics: Arc<EngineMetrics>,
        queued: Arc<AtomicUsize>,
    ) -> Self {
        let vocab = backend.vocab();
        let n_slots = config.slots() as usize;
        let n_seq = backend.n_seq_max().max(n_slots as u32);
        let n_ctx = backend.n_ctx();
        let sessions = KvSessions::new(n_seq, n_ctx, &config.cache, &vocab.info().fingerprint);
        let budget = (config.step_budget() as usize)
            .min(backend.n_batch() as usize)
            .max(1);
        Self {
            limits: StepLimits {
                budget,
                n_ubatch: backend.n_ubatch() as usize,
            },
            n_ctx,
            min_prefix: config.cache.min_prefix_tokens.max(1) as usize,
            slots: (0..n_slots)
                .map(|i| SlotState {
                    slot_id: i,
                    phase: SlotPhase::Idle,
                    work: None,
                })
                .collect(),
            queue: AdmissionQueue::default(),
            sessions,
            sampler_pool: HashMap::new(),
            backend,
            vocab,
            metrics,
            queued,
            step_count: 0,
            admissions: 0,
            log_requests: config.observability.log_requests,
        }
    }

    /// The backend (for tests and diagnostics).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Mutable backend access (failure injection in tests).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// The KV bookkeeping.
    pub fn sessions(&self) -> &KvSessions {
        &self.sessions
    }

    /// The slots.
    pub fn slots(&self) -> &[SlotState<SlotWork<B::Sampler>>] {
        &self.slots
    }

    /// The per-step limits.
    pub fn limits(&self) -> StepLimits {
        self.limits
    }

    /// Whether anything is queued or running.
    pub fn has_work(&self) -> bool {
        !self.queue.is_empty() || self.slots.iter().any(|s| s.phase.is_busy())
    }

    /// Requests waiting for a slot.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// Adds a prepared request to the queue.
    pub fn enqueue(&mut self, req: PreparedRequest) {
        self.queue.push(req);
        self.publish_metrics();
    }

    /// Cancels a request wherever it is; its slot is free when this returns.
    pub fn cancel(&mut self, id: RequestId) {
        if let Some(req) = self.queue.remove_where(|r| r.id == id) {
            self.queued.fetch_sub(1, Relaxed);
            self.metrics.requests_cancelled.fetch_add(1, Relaxed);
            let _ = send(
                &req.sink,
                RequestEvent::Finished(cancelled_completion(&req)),
            );
            return;
        }
        if let Some(i) = self
            .slots
            .iter()
            .position(|s| s.work.as_ref().is_some_and(|w| w.tokens.request_id == id))
        {
            self.finish(i, FinishReason::Cancelled);
            self.finalize();
        }
    }

    /// Checks, with nothing to do, that nothing is held: every slot idle, no
    /// lease, an empty queue, and (where the backend can tell) the KV mirror's
    /// cell count equal to the backend's. Returns what is wrong, if anything.
    pub fn check_idle_invariants(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(s) = self
            .slots
            .iter()
            .find(|s| s.phase != SlotPhase::Idle || s.work.is_some())
        {
            problems.push(format!(
                "slot {} is {:?} while the engine is idle",
                s.slot_id, s.phase
            ));
        }
        if self.sessions.leased_count() != 0 {
            problems.push(format!(
                "{} sequence leases held while idle",
                self.sessions.leased_count()
            ));
        }
        // (The submitters' queue gauge is not checked: a request counted there
        // may still be on its way to this thread.)
        if !self.queue.is_empty() {
            problems.push(format!(
                "queue holds {} requests while idle",
                self.queue.len()
            ));
        }
        if let Some(cells) = self.backend.kv_cells_used() {
            if cells != self.sessions.cells_used() {
                problems.push(format!(
                    "backend holds {cells} KV cells, the mirror {}",
                    self.sessions.cells_used()
                ));
            }
        }
        // The mirror against the backend's own positions: a KV copy or
        // removal that silently failed shows up here.
        for seq in 0..self.sessions.n_seq() as SeqId {
            let len = self.sessions.resident_len(seq) as u32;
            let want = (len > 0).then(|| (0, len - 1));
            let held = self.backend.kv_seq_positions(seq);
            if held != want {
                problems.push(format!(
                    "sequence {seq}: the backend holds positions {held:?}, the mirror {want:?}"
                ));
            }
        }
        self.metrics.idle_checks.fetch_add(1, Relaxed);
        if !problems.is_empty() {
            self.metrics
                .invariant_violations
                .fetch_add(problems.len() as u64, Relaxed);
            tracing::error!("engine invariants broken at idle: {}", problems.join("; "));
        }
        problems
    }

    /// Cancels every queued and running request.
    pub fn cancel_all(&mut self) {
        let ids: Vec<RequestId> = self
            .queue_ids()
            .into_iter()
            .chain(
                self.slots
                    .iter()
                    .filter_map(|s| s.work.as_ref().map(|w| w.tokens.request_id)),
            )
            .collect();
        for id in ids {
            self.cancel(id);
        }
    }

    fn queue_ids(&mut self) -> Vec<RequestId> {
        let mut ids = Vec::new();
        let mut rest = AdmissionQueue::default();
        while let Some(r) = self.queue.pop() {
            ids.push(r.id);
            rest.push(r);
        }
        self.queue = rest;
        ids
    }

    /// Fails everything (the engine is stopping).
    pub fn shutdown(&mut self) {
        for req in self.queue.drain().collect::<Vec<_>>() {
            self.queued.fetch_sub(1, Relaxed);
            let _ = send(&req.sink, RequestEvent::Failed(EngineError::EngineStopped));
        }
        for i in 0..self.slots.len() {
            if self.slots[i].work.is_some() {
                self.fail(i, EngineError::EngineStopped);
            }
        }
        self.finalize();
    }

    /// One engine step. Returns whether a batch ran.
    pub fn step(&mut self) -> bool {
        let started = Instant::now();
        self.step_count += 1;
        self.drop_departed();
        self.admit();
        self.resolve_prefix_waits();
        self.resume_preempted_if_alone();
        let plan = loop {
            let plan = plan_step(&self.slots, self.limits, self.step_count as usize);
            if plan.spans.is_empty() || plan.kind == PrefillKind::Encode {
                break plan;
            }
            let need = plan.n_rows() as u32;
            if self.sessions.cells_free() >= need {
                break plan;
            }
            if !self.make_room(&plan) {
                // Nothing could be freed; the backend will report it per slot.
                break plan;
            }
        };
        let ran = !plan.spans.is_empty();
        if ran {
            self.metrics.steps.fetch_add(1, Relaxed);
            self.metrics
                .batch_rows
                .fetch_add(plan.n_rows() as u64, Relaxed);
            self.execute(plan.kind, &plan.spans);
        }
        self.finalize();
        self.publish_metrics();
        if ran {
            self.metrics
                .step_ns
                .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
        }
        ran
    }

    /// Requests whose caller went away are cancelled before doing more work.
    fn drop_departed(&mut self) {
        let gone: Vec<RequestId> = self
            .queue_ids_closed()
            .into_iter()
            .chain(self.slots.iter().filter_map(|s| {
                s.work
                    .as_ref()
                    .filter(|w| w.sink.is_closed())
                    .map(|w| w.tokens.request_id)
            }))
            .collect();
        for id in gone {
            self.cancel(id);
        }
    }

    fn queue_ids_closed(&mut self) -> Vec<RequestId> {
        let mut ids = Vec::new();
        let mut rest = AdmissionQueue::default();
        while let Some(r) = self.queue.pop() {
            if r.sink.is_closed() {
                ids.push(r.id);
            }
            rest.push(r);
        }
        self.queue = rest;
        ids
    }

    fn free_slot(&self) -> Option<SlotId> {
        self.slots.iter().position(|s| s.phase == SlotPhase::Idle)
    }

    fn build_sampler(
        &mut self,
        spec: &GenerateSpec,
    ) -> Result<(B::Sampler, Option<SamplerCacheKey>), EngineError> {
        let sspec = SamplerSpec {
            params: &spec.sampling,
            constraint: spec.constraint.as_ref(),
            seed: spec.seed,
        };
        // Only constrained samplers are worth caching: building one parses a grammar.
        let key = spec
            .constraint
            .as_ref()
            .map(|c| SamplerCacheKey::new(&spec.sampling, Some(c)));
        if let Some(k) = &key {
            if let Some(mut s) = self.sampler_pool.get_mut(k).and_then(Vec::pop) {
                self.backend.reset_sampler(&mut s, sspec)?;
                return Ok((s, key));
            }
        }
        let s = self.backend.new_sampler(sspec)?;
        Ok((s, key))
    }

    fn admit(&mut self) {
        while let Some(slot_id) = self.free_slot() {
            let Some(front) = self.queue.front() else {
                break;
            };
            let is_embed = matches!(front.kind, PreparedKind::Embed { .. });
            let encoder = self.vocab.info().has_encoder && !self.vocab.info().has_decoder;
            let busy = self.slots.iter().filter_map(|s| s.work.as_ref());
            let (any_busy, exclusive_running) =
                busy.fold((false, false), |(_, ex), w| (true, ex || w.repeatable));
            // A repeatable request runs alone: it waits for the others to
            // finish, and nothing joins it.
            if exclusive_running || (front.repeatable && any_busy) {
                break;
            }
            // Embeddings never reuse KV: pooling needs the whole input in one batch.
            let use_cache = front.cache_prompt && !is_embed && !front.repeatable;
            if front.repeatable {
                self.clear_kv_for_repeatable();
            }
            let Some(front) = self.queue.front() else {
                break;
            };
            // Cells that prompts already admitted will still take: admitting
            // past them would only lead to preemption.
            let reserve: usize = self
                .slots
                .iter()
                .filter_map(|s| s.work.as_ref())
                .filter(|w| w.tokens.plan.prefill == PrefillKind::Decode)
                .map(|w| {
                    let t = &w.tokens;
                    let start = t
                        .prefix_wait
                        .map_or(t.prefill_cursor, |p| p.len.max(t.prefill_cursor));
                    t.context.len().saturating_sub(start)
                })
                .sum();
            let reserve = if encoder { 0 } else { reserve as u32 };
            let Some(adm) = self.sessions.acquire(
                &mut self.backend,
                &front.prompt,
                front.context_key.as_deref(),
                use_cache,
                reserve,
            ) else {
                break;
            };
            let req = self.queue.pop().expect("front exists");
            self.queued.fetch_sub(1, Relaxed);
            self.admissions += 1;
            let now = Instant::now();
            let plan = SlotExecutionPlan {
                prefill: if is_embed && encoder {
                    PrefillKind::Encode
                } else {
                    PrefillKind::Decode
                },
                terminal: if is_embed {
                    TerminalAction::ReadEmbedding
                } else {
                    TerminalAction::SampleTokens
                },
            };
            let (sampler, generation, normalize) = match &req.kind {
                PreparedKind::Generate(spec) => match self.build_sampler(spec) {
                    Ok(mut s) => {
                        self.backend.sampler_accept_prompt(&mut s.0, &req.prompt);
                        let generation = Generation {
                            emitter: TextEmitter::new(&spec.stop),
                            spec: spec.clone(),
                            text: String::new(),
                            generated: Vec::new(),
                            logprobs: Vec::new(),
                        };
                        (Some(s), Some(generation), false)
                    }
                    Err(e) => {
                        let _ = self.sessions.release(&mut self.backend, adm.lease, true);
                        self.metrics.requests_failed.fetch_add(1, Relaxed);
                        let _ = send(&req.sink, RequestEvent::Failed(e));
                        continue;
                    }
                },
                PreparedKind::Embed { normalize } => (None, None, *normalize),
            };
            let prompt_len = req.prompt.len();
            self.metrics
                .prompt_tokens
                .fetch_add(prompt_len as u64, Relaxed);
            let mut tokens = SlotTokens {
                request_id: req.id,
                plan,
                lease: adm.lease,
                context: req.prompt,
                prompt_len,
                prefill_cursor: adm.reused_tokens,
                pending_token: None,
                prefix_wait: None,
                preempted: false,
                admission_order: self.admissions,
            };
            if use_cache && self.sessions.mode() == CacheMode::SharedPrefix {
                tokens.prefix_wait = self.shared_prefix_in_progress(&tokens);
            }
            let _ = send(&req.sink, RequestEvent::Started);
            let slot = &mut self.slots[slot_id];
            slot.phase = SlotPhase::Admitted;
            slot.work = Some(SlotWork {
                tokens,
                sampler,
                generation,
                normalize,
                sink: req.sink,
                timing: Timing {
                    submitted: req.submitted_at,
                    admitted: now,
                    prefill_done: None,
                    first_token: None,
                },
                counters: SlotCounters {
                    prompt_tokens: prompt_len,
                    cached_tokens: adm.reused_tokens,
                    ..SlotCounters::default()
                },
                cache_prompt: use_cache,
                repeatable: req.repeatable,
                context_key: req.context_key,
                final_sent: false,
            });
        }
    }

    /// Brings the KV cache to the state of a fresh engine for a repeatable
    /// request: every idle sequence is evicted (snapshotted when snapshots
    /// are on), then llama.cpp's cache is cleared, which also resets where it
    /// places new cells. The same cells and KV window then give the same
    /// numerics as on a fresh engine (the flash-attention kernel changes its
    /// reduction with the window's size and the cells' places).
    fn clear_kv_for_repeatable(&mut self) {
        self.sessions.evict_all_idle(&mut self.backend);
        debug_assert_eq!(self.sessions.cells_used(), 0, "no lease is held");
        self.backend.kv_clear();
    }

    /// A longer prefix of this prompt that another slot is computing right now;
    /// waiting for it and sharing it beats computing it twice.
    fn shared_prefix_in_progress(&self, t: &SlotTokens) -> Option<PrefixWait> {
        let cap = t.prompt_len.saturating_sub(1);
        self.slots
            .iter()
            .filter_map(|s| s.work.as_ref().map(|w| (s.slot_id, &w.tokens)))
            .filter(|(_, o)| {
                o.prefix_wait.is_none() && o.plan.terminal == TerminalAction::SampleTokens
            })
            .map(|(slot, o)| {
                let n = o.context[..o.prompt_len]
                    .iter()
                    .zip(&t.context)
                    .take_while(|(a, b)| a == b)
                    .count()
                    .min(cap);
                (slot, o, n)
            })
            .filter(|&(_, o, n)| n >= t.prefill_cursor + self.min_prefix && o.prefill_cursor < n)
            .max_by_key(|&(_, _, n)| n)
            .map(|(slot, o, n)| PrefixWait {
                source_slot: slot,
                source_request: o.request_id,
                len: n,
            })
    }

    fn resolve_prefix_waits(&mut self) {
        for i in 0..self.slots.len() {
            let Some(w) = &self.slots[i].work else {
                continue;
            };
            let Some(pw) = w.tokens.prefix_wait else {
                continue;
            };
            let lease = w.tokens.lease;
            let src = self.slots[pw.source_slot]
                .work
                .as_ref()
                .filter(|s| s.tokens.request_id == pw.source_request && !s.tokens.preempted)
                .map(|s| (s.tokens.lease.seq_id, s.tokens.prefill_cursor));
            let ready = match src {
                None => Some(None),
                Some((seq, cursor)) if cursor >= pw.len => Some(Some(seq)),
                Some(_) => None,
            };
            let Some(ready) = ready else { continue };
            if let Some(src_seq) = ready {
                if self
                    .sessions
                    .share_into(&mut self.backend, lease, src_seq, pw.len)
                    .is_ok()
                {
                    let w = self.slots[i].work.as_mut().expect("busy");
                    w.tokens.prefill_cursor = pw.len;
                    w.counters.cached_tokens = pw.len;
                }
            }
            let w = self.slots[i].work.as_mut().expect("busy");
            w.tokens.prefix_wait = None;
        }
    }

    /// Preempted slots wait while others run; when nothing else can run they
    /// resume (sharing any prefix still resident elsewhere).
    fn resume_preempted_if_alone(&mut self) {
        let others_running = self.slots.iter().any(|s| {
            s.work
                .as_ref()
                .is_some_and(|w| !w.tokens.preempted && w.tokens.prefix_wait.is_none())
        });
        if !others_running {
            self.resume_preempted();
        }
    }

    fn resume_preempted(&mut self) {
        for i in 0..self.slots.len() {
            let Some(w) = &self.slots[i].work else {
                continue;
            };
            if !w.tokens.preempted {
                continue;
            }
            let lease = w.tokens.lease;
            let context = w.tokens.context.clone();
            let mut cursor = 0;
            if w.cache_prompt {
                if let Some((src, n)) = self
                    .sessions
                    .longest_resident_prefix(&context, Some(lease.seq_id))
                {
                    let n = n.min(context.len().saturating_sub(1));
                    if n >= self.min_prefix
                        && self
                            .sessions
                            .share_into(&mut self.backend, lease, src, n)
                            .is_ok()
                    {
                        cursor = n;
                    }
                }
            }
            let w = self.slots[i].work.as_mut().expect("busy");
            w.tokens.preempted = false;
            w.tokens.prefill_cursor = cursor;
        }
    }

    /// Frees KV for a plan that does not fit: idle sequences first, then the
    /// newest running slot is preempted (its KV dropped, recomputed later).
    /// Returns false when nothing could be freed.
    fn make_room(&mut self, plan: &BatchPlan) -> bool {
        if self.sessions.evict_idle_lru(&mut self.backend) {
            return true;
        }
        let holders: Vec<(SlotId, u64)> = self
            .slots
            .iter()
            .filter_map(|s| s.work.as_ref().map(|w| (s.slot_id, w)))
            .filter(|(_, w)| {
                !w.tokens.preempted && self.sessions.resident_len(w.tokens.lease.seq_id) > 0
            })
            .map(|(i, w)| (i, w.tokens.admission_order))
            .collect();
        let planned: Vec<SlotId> = plan.spans.iter().map(|s| s.slot).collect();
        if holders.len() <= 1 && planned.len() <= 1 {
            if let Some(&slot) = planned.first() {
                self.fail(
                    slot,
                    EngineError::KvCacheFull(format!(
                        "{} cells are in use and this request needs more",
                        self.sessions.cells_used()
                    )),
                );
                self.finalize();
                return true;
            }
            return false;
        }
        let Some(&(victim, _)) = holders.iter().max_by_key(|(_, order)| *order) else {
            return false;
        };
        self.preempt(victim);
        true
    }

    fn preempt(&mut self, slot: SlotId) {
        let w = self.slots[slot].work.as_mut().expect("busy");
        let lease = w.tokens.lease;
        let _ = self.sessions.truncate(&mut self.backend, lease, 0);
        w.tokens.prefill_cursor = 0;
        w.tokens.preempted = true;
        w.tokens.prefix_wait = None;
        w.counters.preemptions += 1;
        self.slots[slot].phase = SlotPhase::Prefill;
        self.metrics.preemptions.fetch_add(1, Relaxed);
    }

    fn build_rows(&self, spans: &[SlotSpan]) -> Vec<BatchRow> {
        let mut rows = Vec::with_capacity(spans.iter().map(|s| s.n_tokens).sum());
        for span in spans {
            let w = self.slots[span.slot]
                .work
                .as_ref()
                .expect("planned slot is busy");
            let t = &w.tokens;
            let start = t.prefill_cursor;
            if span.decode {
                rows.push(BatchRow {
                    token: t.pending_token.expect("decode span has a pending token"),
                    pos: start as u32,
                    seq: t.lease.seq_id,
                    output: true,
                });
            } else {
                for (k, &tok) in t.context[start..start + span.n_tokens].iter().enumerate() {
                    rows.push(BatchRow {
                        token: tok,
                        pos: (start + k) as u32,
                        seq: t.lease.seq_id,
                        output: span.output && k + 1 == span.n_tokens,
                    });
                }
            }
        }
        rows
    }

    /// Runs spans; on a failure of several slots' rows, splits them and retries
    /// each half, so a failure lands only on the rows that cause it.
    fn execute(&mut self, kind: PrefillKind, spans: &[SlotSpan]) {
        // A span whose slot was freed or reused since planning is dropped.
        let spans: Vec<SlotSpan> = spans
            .iter()
            .copied()
            .filter(|s| {
                self.slots[s.slot]
                    .work
                    .as_ref()
                    .is_some_and(|w| w.tokens.request_id == s.request_id && !w.tokens.preempted)
            })
            .collect();
        if spans.is_empty() {
            return;
        }
        let rows = self.build_rows(&spans);
        let batch_start = Instant::now();
        let result = match kind {
            PrefillKind::Decode => self.backend.decode(&rows),
            PrefillKind::Encode => self.backend.encode(&rows),
        };
        self.metrics
            .batch_ns
            .fetch_add(batch_start.elapsed().as_nanos() as u64, Relaxed);
        match result {
            Ok(()) => self.apply(kind, &spans),
            Err(BatchError::NoKvSpace) => {
                let plan = BatchPlan {
                    kind,
                    spans: spans.clone(),
                };
                if self.make_room(&plan) {
                    self.execute(kind, &spans);
                }
            }
            Err(BatchError::Failed(code)) => {
                if spans.len() > 1 {
                    let (a, b) = spans.split_at(spans.len() / 2);
                    self.execute(kind, a);
                    self.execute(kind, b);
                } else {
                    self.fail(
                        spans[0].slot,
                        EngineError::Decode(format!(
                            "llama.cpp returned {code} for this request's batch"
                        )),
                    );
                }
            }
        }
    }

    fn apply(&mut self, kind: PrefillKind, spans: &[SlotSpan]) {
        let mut row = 0usize;
        let now = Instant::now();
        for span in spans {
            let out_row = row + span.n_tokens - 1;
            row += span.n_tokens;
            let w = self.slots[span.slot]
                .work
                .as_mut()
                .expect("planned slot is busy");
            let t = &mut w.tokens;
            if span.decode {
                let tok = t
                    .pending_token
                    .take()
                    .expect("decode span has a pending token");
                t.context.push(tok);
                w.counters.decode_steps += 1;
            } else {
                w.counters.prefill_steps += 1;
            }
            let start = t.prefill_cursor;
            let end = start + span.n_tokens;
            if kind == PrefillKind::Decode {
                let lease = t.lease;
                if let Err(e) = self.sessions.record_decoded(lease, &t.context[start..end]) {
                    // A stale lease here is a bookkeeping bug; fail loudly, alone.
                    tracing::error!("{e}");
                    self.fail(span.slot, EngineError::Decode(e.to_string()));
                    continue;
                }
            }
            t.prefill_cursor = end;
            if end == t.context.len() && w.timing.prefill_done.is_none() {
                w.timing.prefill_done = Some(now);
            }
            if span.output {
                match t.plan.terminal {
                    TerminalAction::SampleTokens => self.sample_slot(span.slot, out_row),
                    TerminalAction::ReadEmbedding => self.read_embedding(span.slot, out_row),
                }
            } else if end == t.context.len() && t.pending_token.is_some() {
                self.slots[span.slot].phase = SlotPhase::Decode;
            } else {
                self.slots[span.slot].phase = SlotPhase::Prefill;
            }
        }
    }

    fn read_embedding(&mut self, slot: SlotId, row: usize) {
        let w = self.slots[slot].work.as_ref().expect("busy");
        let seq = w.tokens.lease.seq_id;
        let pooling = self.backend.embedding_pooling().unwrap_or(Pooling::None);
        let Some(mut values) = self.backend.embedding(seq, row) else {
            self.fail(
                slot,
                EngineError::Unsupported("the context produced no embedding".into()),
            );
            return;
        };
        let w = self.slots[slot].work.as_mut().expect("busy");
        if w.normalize {
            let norm = values
                .iter()
                .map(|v| f64::from(*v) * f64::from(*v))
                .sum::<f64>()
                .sqrt();
            if norm > 0.0 {
                values
                    .iter_mut()
                    .for_each(|v| *v = (f64::from(*v) / norm) as f32);
            }
        }
        let stats = stats_of(w, Instant::now());
        let out = EmbeddingOutput {
            values,
            pooling,
            normalized: w.normalize,
            prompt_tokens: w.tokens.prompt_len,
            stats,
        };
        w.final_sent = true;
        self.metrics.requests_completed.fetch_add(1, Relaxed);
        self.publish_metrics();
        let w = self.slots[slot].work.as_mut().expect("busy");
        let _ = send(&w.sink, RequestEvent::Embedding(out));
        self.slots[slot].phase = SlotPhase::Completed;
    }

    fn sample_slot(&mut self, slot: SlotId, row: usize) {
        let w = self.slots[slot].work.as_mut().expect("busy");
        let (sampler, _) = w.sampler.as_mut().expect("generation has a sampler");
        let n_logprobs = w.generation.as_ref().and_then(|g| g.spec.logprobs);
        match self.backend.sample(sampler, row, n_logprobs) {
            Ok(s) => self.accept_token(slot, s.token, s.logprobs),
            Err(SampleError::GrammarExhausted) => {
                let generated = w.counters.generated_tokens;
                self.fail(slot, EngineError::GrammarExhausted { generated });
            }
        }
    }

    fn accept_token(
        &mut self,
        slot: SlotId,
        token: Token,
        logprobs: Option<crate::runtime::SampledLogprobs>,
    ) {
        let now = Instant::now();
        let n_ctx = self.n_ctx as usize;
        let vocab = self.vocab.clone();
        let w = self.slots[slot].work.as_mut().expect("busy");
        let g = w.generation.as_mut().expect("generation state");
        w.counters.generated_tokens += 1;
        self.metrics.generated_tokens.fetch_add(1, Relaxed);
        if w.timing.first_token.is_none() {
            w.timing.first_token = Some(now);
        }
        g.generated.push(token);
        let mut delta = TextDelta::default();
        delta.tokens.push(token);
        if let Some(lp) = logprobs {
            let entry = TokenLogprobs {
                token,
                text: String::from_utf8_lossy(&vocab.token_bytes(token)).into_owned(),
                logprobs: lp,
            };
            g.logprobs.push(entry.clone());
            delta.logprobs.push(entry);
        }
        let finish = if vocab.is_eog(token) && !g.spec.ignore_eos {
            Some(FinishReason::Eos)
        } else {
            let scan = g.emitter.push(&vocab.token_bytes(token));
            delta.text = scan.emit;
            if scan.stopped {
                Some(FinishReason::Stop)
            } else if w.counters.generated_tokens >= g.spec.max_tokens
                || w.tokens.context.len() + 1 > n_ctx
            {
                // The next token would need a position past the context.
                Some(FinishReason::Length)
            } else {
                None
            }
        };
        g.text.push_str(&delta.text);
        let buffering = g.emitter.is_buffering();
        let alive = send(&w.sink, RequestEvent::Delta(delta));
        if !alive {
            self.finish(slot, FinishReason::Cancelled);
            return;
        }
        match finish {
            Some(reason) => self.finish(slot, reason),
            None => {
                let w = self.slots[slot].work.as_mut().expect("busy");
                w.tokens.pending_token = Some(token);
                self.slots[slot].phase = if buffering {
                    SlotPhase::EmitBuffered
                } else {
                    SlotPhase::Decode
                };
            }
        }
    }

    /// Ends a generation: flushes held text (unless a stop matched), sends the
    /// final event, and marks the slot for freeing.
    fn finish(&mut self, slot: SlotId, reason: FinishReason) {
        let now = Instant::now();
        let w = self.slots[slot].work.as_mut().expect("busy");
        if w.final_sent {
            return;
        }
        let stats = stats_of(w, now);
        let (text, tokens, logprobs) = match &mut w.generation {
            Some(g) => {
                if matches!(reason, FinishReason::Eos | FinishReason::Length) {
                    let tail = g.emitter.finish();
                    if !tail.is_empty() {
                        g.text.push_str(&tail);
                        let _ = send(
                            &w.sink,
                            RequestEvent::Delta(TextDelta {
                                text: tail,
                                ..TextDelta::default()
                            }),
                        );
                    }
                }
                (g.text.clone(), g.generated.clone(), g.logprobs.clone())
            }
            None => (String::new(), Vec::new(), Vec::new()),
        };
        let completion = Completion {
            text,
            tokens,
            finish_reason: reason,
            usage: Usage {
                prompt_tokens: w.tokens.prompt_len,
                completion_tokens: w.counters.generated_tokens,
                cached_tokens: w.counters.cached_tokens,
            },
            stats,
            logprobs,
        };
        if self.log_requests {
            tracing::info!(
                request = w.tokens.request_id,
                reason = reason.as_str(),
                prompt_tokens = stats.prompt_tokens,
                cached = stats.cached_tokens,
                generated = stats.generated_tokens,
                ttft_ms = stats.ttft_ms,
                "request finished"
            );
        }
        w.final_sent = true;
        let counter = if reason == FinishReason::Cancelled {
            &self.metrics.requests_cancelled
        } else {
            &self.metrics.requests_completed
        };
        counter.fetch_add(1, Relaxed);
        // Metrics first: a caller that reads them on its final event must see
        // this request counted (on one core the engine thread can be paused
        // right after the send, before the step publishes).
        self.publish_metrics();
        let w = self.slots[slot].work.as_mut().expect("busy");
        let _ = send(&w.sink, RequestEvent::Finished(completion));
        self.slots[slot].phase = SlotPhase::Completed;
    }

    fn fail(&mut self, slot: SlotId, err: EngineError) {
        let Some(w) = self.slots[slot].work.as_mut() else {
            return;
        };
        if !w.final_sent {
            w.final_sent = true;
            self.metrics.requests_failed.fetch_add(1, Relaxed);
            self.publish_metrics();
            if let Some(w) = self.slots[slot].work.as_ref() {
                let _ = send(&w.sink, RequestEvent::Failed(err));
            }
        }
        self.slots[slot].phase = SlotPhase::Failed;
    }

    /// Frees completed and failed slots: leases end (KV kept as a prefix
    /// candidate when the request allowed it), samplers return to the pool.
    fn finalize(&mut self) {
        let mut freed = false;
        for i in 0..self.slots.len() {
            if !matches!(
                self.slots[i].phase,
                SlotPhase::Completed | SlotPhase::Failed
            ) {
                continue;
            }
            let failed = self.slots[i].phase == SlotPhase::Failed;
            let Some(w) = self.slots[i].work.take() else {
                continue;
            };
            self.slots[i].phase = SlotPhase::Idle;
            freed = true;
            let keep =
                w.cache_prompt && !failed && w.tokens.plan.terminal == TerminalAction::SampleTokens;
            if let Err(e) = self
                .sessions
                .release(&mut self.backend, w.tokens.lease, keep)
            {
                tracing::error!("{e}");
            }
            if let Some((sampler, Some(key))) = w.sampler {
                let pool = self.sampler_pool.entry(key).or_default();
                if pool.len() < 4 {
                    pool.push(sampler);
                }
                if self.sampler_pool.len() > 64 {
                    self.sampler_pool.clear();
                }
            }
            let _ = w.context_key;
        }
        if freed {
            self.resume_preempted();
        }
    }

    fn publish_metrics(&self) {
        let m = &self.metrics;
        m.queue_depth.store(self.queue.len() as u64, Relaxed);
        m.busy_slots.store(
            self.slots.iter().filter(|s| s.phase.is_busy()).count() as u64,
            Relaxed,
        );
        m.leased_sequences
            .store(self.sessions.leased_count() as u64, Relaxed);
        m.kv_cells_used
            .store(u64::from(self.sessions.cells_used()), Relaxed);
        let c = self.sessions.stats();
        m.prefix_hits.store(c.prefix_hits, Relaxed);
        m.prefix_reused_tokens.store(c.reused_tokens, Relaxed);
        m.snapshot_saves.store(c.snapshot_saves, Relaxed);
        m.snapshot_restores.store(c.snapshot_restores, Relaxed);
        m.snapshot_bytes_saved
            .store(c.snapshot_bytes_saved, Relaxed);
        m.snapshot_bytes_restored
            .store(c.snapshot_bytes_restored, Relaxed);
        m.snapshot_files_rejected
            .store(c.snapshot_files_rejected, Relaxed);
        let (entries, bytes) = self.sessions.snapshot_usage();
        m.snapshot_entries.store(entries as u64, Relaxed);
        m.snapshot_bytes.store(bytes, Relaxed);
    }
}

fn stats_of<S>(w: &SlotWork<S>, now: Instant) -> RequestStats {
    let t = &w.timing;
    RequestStats {
        queue_ms: ms(t.admitted - t.submitted),
        prompt_tokens: w.tokens.prompt_len,
        cached_tokens: w.counters.cached_tokens,
        prefill_ms: t.prefill_done.map_or(0.0, |p| ms(p - t.admitted)),
        ttft_ms: t.first_token.map_or(0.0, |f| ms(f - t.submitted)),
        generated_tokens: w.counters.generated_tokens,
        decode_ms: t.first_token.map_or(0.0, |f| ms(now - f)),
    }
}

fn cancelled_completion(req: &PreparedRequest) -> Completion {
    Completion {
        text: String::new(),
        tokens: Vec::new(),
        finish_reason: FinishReason::Cancelled,
        usage: Usage {
            prompt_tokens: req.prompt.len(),
            completion_tokens: 0,
            cached_tokens: 0,
        },
        stats: RequestStats {
            queue_ms: ms(req.submitted_at.elapsed()),
            prompt_tokens: req.prompt.len(),
            ..RequestStats::default()
        },
        logprobs: Vec::new(),
    }
}
