//! The engine's step loop: the scheduler plans, the executor carries the
//! plan out, the scheduler applies the output, and the events go out. Driven
//! by one thread (or directly by tests, step by step).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use super::executor::Executor;
use super::metrics::EngineMetrics;
use super::request::{EngineError, PreparedRequest, QueuePlace, RequestEvent};
use crate::config::NativeRuntimeConfig;
use crate::runtime::{Backend, SeqId};
use crate::scheduler::{
    BatchOutcome, RequestId, Scheduler, SchedulerConfig, Slot, StepLimits, StepPlan, Updated,
};
use crate::session::KvSessions;
use crate::text::FinishReason;

/// How often one step replans after the backend refused a batch for KV room
/// or a KV operation did not go as planned.
const MAX_REPLANS: usize = 4;

/// Engine state driven one step at a time.
pub struct EngineCore<B: Backend> {
    scheduler: Scheduler,
    executor: Executor<B>,
    sessions: KvSessions,
    metrics: Arc<EngineMetrics>,
    /// The sequence each slot's latest request used (slot save/restore).
    slot_seqs: super::slots::SlotSequences,
}

impl<B: Backend> EngineCore<B> {
    /// State for a backend.
    pub fn new(backend: B, config: &NativeRuntimeConfig, metrics: Arc<EngineMetrics>) -> Self {
        let vocab = backend.vocab();
        let info = vocab.info();
        let slots = config.slots() as usize;
        let n_seq = backend.n_seq_max().max(slots as u32);
        let n_ctx = backend.n_ctx();
        let sessions = KvSessions::new(
            n_seq,
            n_ctx,
            &config.cache,
            &info.fingerprint,
            info.sliding_window,
        );
        let budget = (config.step_budget() as usize)
            .min(backend.n_batch() as usize)
            .max(1);
        let scheduler = Scheduler::new(
            SchedulerConfig {
                slots,
                limits: StepLimits {
                    budget,
                    n_ubatch: backend.n_ubatch() as usize,
                },
                n_ctx,
                min_prefix: config.cache.min_prefix_tokens as usize,
                model_is_encoder: info.has_encoder && !info.has_decoder,
                log_requests: config.observability.log_requests,
                row_cost_ratio: config.speculative.row_cost_ratio,
                rotate_adapters: config.scheduler.mixed_adapters
                    == crate::config::MixedAdapters::Rotate,
            },
            vocab.clone(),
        );
        Self {
            scheduler,
            executor: Executor::new(backend, slots, metrics.clone()),
            sessions,
            metrics,
            slot_seqs: super::slots::SlotSequences::new(slots),
        }
    }

    /// Adds a draft model for `draft` speculation.
    pub fn with_drafter(mut self, draft: B) -> Self {
        self.executor = self.executor.with_drafter(draft);
        self
    }

    /// The backend (for tests and diagnostics).
    pub fn backend(&self) -> &B {
        self.executor.backend()
    }

    /// Mutable backend access (failure injection in tests).
    pub fn backend_mut(&mut self) -> &mut B {
        self.executor.backend_mut()
    }

    /// The KV bookkeeping.
    pub fn sessions(&self) -> &KvSessions {
        &self.sessions
    }

    /// The scheduler (slots, queue).
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// The slots.
    pub fn slots(&self) -> &[Slot] {
        self.scheduler.slots()
    }

    /// The per-step limits.
    pub fn limits(&self) -> StepLimits {
        self.scheduler.limits()
    }

    /// Whether anything is queued or running.
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Requests waiting for a slot.
    pub fn queue_len(&self) -> usize {
        self.scheduler.queue_len()
    }

    /// Adds a prepared request to the queue, with its place in the queue
    /// gauge (released when it leaves the queue).
    pub fn enqueue(&mut self, req: PreparedRequest, place: Option<QueuePlace>) {
        self.scheduler.enqueue(req, place);
        self.publish_metrics();
    }

    /// Cancels a request wherever it is; its slot is free when this returns.
    pub fn cancel(&mut self, id: RequestId) {
        let u = self.scheduler.cancel(id);
        self.deliver(u);
    }

    /// Cancels every queued and running request.
    pub fn cancel_all(&mut self) {
        for id in self.scheduler.request_ids() {
            self.cancel(id);
        }
    }

    /// Saves, restores or erases a slot's KV, between steps.
    pub(super) fn slot_action(&mut self, action: super::slots::SlotAction) {
        let slots = self.scheduler.slots();
        let backend = self.executor.backend_mut();
        self.slot_seqs
            .run(slots, &mut self.sessions, backend, action);
        self.publish_metrics();
    }

    /// Fails everything (the engine is stopping).
    pub fn shutdown(&mut self) {
        let u = self.scheduler.fail_all(&EngineError::EngineStopped);
        self.deliver(u);
    }

    /// One engine step. Returns whether a batch ran.
    pub fn step(&mut self) -> bool {
        let started = Instant::now();
        for id in self.scheduler.departed() {
            self.cancel(id);
        }
        let mut ran = false;
        let mut short_of_room = false;
        for _ in 0..MAX_REPLANS {
            let plan = self.scheduler.schedule(&self.sessions, short_of_room);
            self.slot_seqs.note(&plan.admissions);
            if plan.is_empty() {
                break;
            }
            let out = self.executor.run(&mut self.sessions, &plan);
            let (batch_ran, no_room) = match &out.batch {
                BatchOutcome::Ran(_) => (true, false),
                BatchOutcome::NoKvSpace => (false, true),
                BatchOutcome::NotRun => (false, false),
            };
            self.count_plan(&plan);
            let u = self.scheduler.update(&plan, out);
            self.deliver(u);
            ran |= batch_ran;
            short_of_room = no_room;
            // Replan when the batch was refused for room, or when every
            // planned span was left out (its sequence came up short).
            if batch_ran || plan.batch.spans.is_empty() {
                break;
            }
        }
        self.publish_metrics();
        if ran {
            self.metrics
                .step_ns
                .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
        }
        ran
    }

    fn count_plan(&self, plan: &StepPlan) {
        let m = &self.metrics;
        m.preemptions
            .fetch_add(plan.preemptions.len() as u64, Relaxed);
        let prompt: usize = plan.admissions.iter().map(|a| a.prompt_tokens).sum();
        m.prompt_tokens.fetch_add(prompt as u64, Relaxed);
    }

    /// Releases freed slots, publishes metrics, then sends the events: a
    /// caller that reads metrics on its final event sees its request counted.
    fn deliver(&mut self, u: Updated) {
        for r in &u.releases {
            self.executor.release(&mut self.sessions, r);
        }
        let m = &self.metrics;
        for e in &u.emits {
            match &e.event {
                RequestEvent::Delta(d) => {
                    m.generated_tokens.fetch_add(d.tokens.len() as u64, Relaxed);
                }
                RequestEvent::Finished(c) if c.finish_reason == FinishReason::Cancelled => {
                    m.requests_cancelled.fetch_add(1, Relaxed);
                }
                RequestEvent::Finished(_) | RequestEvent::Embedding(_) => {
                    m.requests_completed.fetch_add(1, Relaxed);
                }
                RequestEvent::Failed(_) => {
                    m.requests_failed.fetch_add(1, Relaxed);
                }
                RequestEvent::Started => {}
            }
        }
        if u.emits.iter().any(|e| e.event.is_final()) {
            self.publish_metrics();
        }
        for e in u.emits {
            let _ = e.sink.send(e.event);
        }
    }

    /// Checks, with nothing to do, that nothing is held: every slot idle, no
    /// lease, an empty queue, and (where the backend can tell) the mirror
    /// equal to the backend's cells and per-sequence positions. Returns what
    /// is wrong, if anything.
    pub fn check_idle_invariants(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(i) = self.slots().iter().position(|s| s.phase().is_busy()) {
            problems.push(format!("slot {i} is busy while the engine is idle"));
        }
        if self.sessions.leased_count() != 0 {
            problems.push(format!(
                "{} sequence leases held while idle",
                self.sessions.leased_count()
            ));
        }
        // (The submitters' queue gauge is not checked: a request counted there
        // may still be on its way to this thread.)
        if self.queue_len() != 0 {
            problems.push(format!(
                "queue holds {} requests while idle",
                self.queue_len()
            ));
        }
        problems.extend(self.kv_mismatches());
        self.metrics.idle_checks.fetch_add(1, Relaxed);
        if !problems.is_empty() {
            self.metrics
                .invariant_violations
                .fetch_add(problems.len() as u64, Relaxed);
            tracing::error!("engine invariants broken at idle: {}", problems.join("; "));
        }
        problems
    }

    /// The mirror against the backend's own cell count and positions: a KV
    /// copy or removal that silently failed shows up here.
    fn kv_mismatches(&self) -> Vec<String> {
        let backend = self.executor.backend();
        let mut problems = Vec::new();
        if let Some(cells) = backend.kv_cells_used() {
            if cells != self.sessions.cells_used() {
                problems.push(format!(
                    "backend holds {cells} KV cells, the mirror {}",
                    self.sessions.cells_used()
                ));
            }
        }
        for seq in 0..self.sessions.n_seq() as SeqId {
            let len = self.sessions.resident_len(seq) as u32;
            let want = (len > 0).then(|| (0, len - 1));
            let held = backend.kv_seq_positions(seq);
            if held != want {
                problems.push(format!(
                    "sequence {seq}: the backend holds positions {held:?}, the mirror {want:?}"
                ));
            }
        }
        problems
    }

    fn publish_metrics(&self) {
        let m = &self.metrics;
        let s = &self.sessions;
        m.publish_slots(self.scheduler.slots());
        m.queue_depth.store(self.queue_len() as u64, Relaxed);
        m.busy_slots
            .store(self.scheduler.busy_slots() as u64, Relaxed);
        m.leased_sequences.store(s.leased_count() as u64, Relaxed);
        m.kv_cells_used.store(u64::from(s.cells_used()), Relaxed);
        let c = s.stats();
        m.prefix_hits.store(c.prefix_hits, Relaxed);
        m.prefix_reused_tokens.store(c.reused_tokens, Relaxed);
        m.snapshot_saves.store(c.snapshot_saves, Relaxed);
        m.snapshot_restores.store(c.snapshot_restores, Relaxed);
        m.idle_parks.store(c.parks, Relaxed);
        m.snapshot_bytes_saved
            .store(c.snapshot_bytes_saved, Relaxed);
        m.snapshot_bytes_restored
            .store(c.snapshot_bytes_restored, Relaxed);
        m.snapshot_files_rejected
            .store(c.snapshot_files_rejected, Relaxed);
        let (entries, bytes) = s.snapshot_usage();
        m.snapshot_entries.store(entries as u64, Relaxed);
        m.snapshot_bytes.store(bytes, Relaxed);
    }
}
