//! The scheduler decides; the engine executes; results come back as data.
//!
//! Each step, [`Scheduler::schedule`] looks at the slots, the queue and the
//! KV mirror and returns a [`StepPlan`]: admissions (with the reuse chosen by
//! [`crate::session::plan_acquire`]), prefix waits that end, preemptions and
//! resumes, the KV operations they need, and the batch rows of every slot. It
//! is pure: it changes nothing, not even the scheduler. The engine's executor
//! carries the plan out on the backend (KV operations, the batch, sampling)
//! and returns a [`StepOutput`]; [`Scheduler::update`] applies both to the
//! slots and returns the events to send and the slots to release.
//!
//! Token acceptance and stop rules are the pure [`Generation`] unit; batch
//! packing under the token budget is [`batch::pack`].

pub mod batch;
mod generation;
pub mod plan;
mod schedule;
mod slot;
pub mod speculate;
mod update;

#[cfg(test)]
mod tests;

pub use batch::{pack, Packing, SlotSpan, StepLimits};
pub use generation::{Accepted, Generation};
pub use plan::{
    Admission, Batch, BatchOutcome, BatchSpan, PrefixShare, ReadKind, Release, Resume,
    SampledToken, SamplerSetup, SpanKind, SpanOutcome, SpanResult, StepOutput, StepPlan,
};
pub use slot::{
    PrefillKind, PrefixWait, Proposal, Running, Slot, SlotCounters, SlotExecutionPlan, SlotPhase,
    SlotTokens, Task, TerminalAction, Timing,
};
pub use update::Updated;

use std::collections::VecDeque;
use std::sync::Arc;

use crate::engine::{EventSink, PreparedRequest, QueuePlace, RequestEvent};
use crate::runtime::Vocab;

/// A request id, unique per engine.
pub type RequestId = u64;
/// A slot index.
pub type SlotId = usize;

/// An event for one request's stream.
#[derive(Debug)]
pub struct Emit {
    /// The stream.
    pub sink: EventSink,
    /// The event.
    pub event: RequestEvent,
}

/// A request waiting for a slot, holding its place in the queue gauge.
#[derive(Debug)]
pub struct Queued {
    /// The request.
    pub req: PreparedRequest,
    /// Its place; the gauge drops when this does.
    pub place: Option<QueuePlace>,
}

/// Fixed settings of a scheduler.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Slots.
    pub slots: usize,
    /// Step limits.
    pub limits: StepLimits,
    /// KV cells.
    pub n_ctx: u32,
    /// Shortest prefix worth sharing.
    pub min_prefix: usize,
    /// The model is encoder-only (embeddings are encoded, not decoded).
    pub model_is_encoder: bool,
    /// Log each finished request.
    pub log_requests: bool,
    /// Fixed cost of a step over the cost of a batch row, for speculative
    /// drafts (0: measured from the batches that run).
    pub row_cost_ratio: f32,
    /// Run one LoRA adapter set per step, the sets in turn (else every set
    /// in every step, one batch each).
    pub rotate_adapters: bool,
}

/// Slots, the queue, and the decisions over them.
pub struct Scheduler {
    slots: Vec<Slot>,
    queue: VecDeque<Queued>,
    vocab: Arc<dyn Vocab>,
    limits: StepLimits,
    n_ctx: usize,
    min_prefix: usize,
    model_is_encoder: bool,
    log_requests: bool,
    /// Batches run (rotates who gets the leftover prefill budget).
    rotation: u64,
    /// Requests admitted so far.
    admissions: u64,
    /// A slot was freed: preempted slots resume at the next step.
    resume_due: bool,
    /// What a batch row costs against a step (which drafts pay).
    step_cost: speculate::StepCost,
    /// N-gram drafts' acceptance by match length.
    ngram_acceptance: speculate::NgramAcceptance,
    /// One adapter set per step (see [`SchedulerConfig::rotate_adapters`]).
    rotate_adapters: bool,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("slots", &self.slots)
            .field("queued", &self.queue.len())
            .finish_non_exhaustive()
    }
}

impl Scheduler {
    /// A scheduler with idle slots and an empty queue.
    pub fn new(config: SchedulerConfig, vocab: Arc<dyn Vocab>) -> Self {
        Self {
            slots: (0..config.slots).map(|_| Slot::Idle).collect(),
            queue: VecDeque::new(),
            vocab,
            limits: config.limits,
            n_ctx: config.n_ctx as usize,
            min_prefix: config.min_prefix.max(1),
            model_is_encoder: config.model_is_encoder,
            log_requests: config.log_requests,
            rotation: 0,
            admissions: 0,
            resume_due: false,
            step_cost: speculate::StepCost::new(config.row_cost_ratio),
            ngram_acceptance: speculate::NgramAcceptance::default(),
            rotate_adapters: config.rotate_adapters,
        }
    }

    /// The slots.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// The step limits.
    pub fn limits(&self) -> StepLimits {
        self.limits
    }

    /// Requests waiting for a slot.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// Whether anything is queued or running.
    pub fn has_work(&self) -> bool {
        !self.queue.is_empty() || self.slots.iter().any(|s| s.phase().is_busy())
    }

    /// Busy slots.
    pub fn busy_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.phase().is_busy()).count()
    }

    /// Adds a request at the back of the queue.
    pub fn enqueue(&mut self, req: PreparedRequest, place: Option<QueuePlace>) {
        self.queue.push_back(Queued { req, place });
    }

    /// Requests whose caller went away (their event stream is closed).
    pub fn departed(&self) -> Vec<RequestId> {
        let queued = self
            .queue
            .iter()
            .filter(|q| q.req.sink.is_closed())
            .map(|q| q.req.id);
        let running = self
            .slots
            .iter()
            .filter_map(Slot::running)
            .filter(|r| r.sink.is_closed())
            .map(|r| r.tokens.request_id);
        queued.chain(running).collect()
    }

    /// Every queued and running request.
    pub fn request_ids(&self) -> Vec<RequestId> {
        let queued = self.queue.iter().map(|q| q.req.id);
        let running = self
            .slots
            .iter()
            .filter_map(Slot::tokens)
            .map(|t| t.request_id);
        queued.chain(running).collect()
    }
}
