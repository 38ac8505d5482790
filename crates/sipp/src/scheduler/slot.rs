//! Slots and the state of the request each one serves.

use std::time::Instant;

use serde::Serialize;

use super::generation::Generation;
use super::plan::Admission;
use super::speculate::{ngram_draft, SpecState};
use super::{RequestId, SlotId};
use crate::config::SpeculativeMode;
use crate::engine::{EventSink, RequestStats};
use crate::runtime::{MediaSpan, Token};
use crate::session::SeqLease;

/// Where a slot is in serving its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum SlotPhase {
    /// No request.
    Idle,
    /// Holds a request and a KV lease; its first prompt chunk is not computed
    /// yet (it may be waiting for a shared prefix another slot is computing).
    Admitted,
    /// Computing its prompt (or recomputing its context after preemption).
    Prefill,
    /// Generating: one token per step.
    Decode,
    /// Generating, with text held back because it may start a stop string.
    EmitBuffered,
}

impl SlotPhase {
    /// Whether the slot holds a request.
    pub fn is_busy(self) -> bool {
        self != SlotPhase::Idle
    }
}

/// How a slot's prompt is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PrefillKind {
    /// `llama_decode` over the prompt, in chunks.
    Decode,
    /// One `llama_encode` pass over the whole input (encoder models).
    Encode,
}

/// What happens once the prompt is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum TerminalAction {
    /// Sample tokens until a finish condition.
    SampleTokens,
    /// Read the pooled embedding and finish.
    ReadEmbedding,
}

/// Decided once, at admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SlotExecutionPlan {
    /// How the prompt is computed.
    pub prefill: PrefillKind,
    /// What follows it.
    pub terminal: TerminalAction,
}

/// Per-request counters kept by the slot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SlotCounters {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens reused from the KV cache.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Steps in which this slot computed prompt tokens.
    pub prefill_steps: usize,
    /// Steps in which this slot decoded a token.
    pub decode_steps: usize,
    /// Times the slot was preempted for KV space.
    pub preemptions: usize,
}

/// Waiting for another slot to compute a prefix this slot then shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixWait {
    /// The slot computing the prefix.
    pub source_slot: SlotId,
    /// Its request (so a reused slot is not mistaken for the source).
    pub source_request: RequestId,
    /// Tokens of prefix to share.
    pub len: usize,
}

/// The token state of a busy slot, as the planner sees it.
#[derive(Debug, Clone)]
pub struct SlotTokens {
    /// The request.
    pub request_id: RequestId,
    /// The execution plan.
    pub plan: SlotExecutionPlan,
    /// The KV lease.
    pub lease: SeqLease,
    /// Prompt followed by the generated tokens already fed to the model.
    pub context: Vec<Token>,
    /// Prompt length.
    pub prompt_len: usize,
    /// Tokens of `context` resident in the KV sequence (the prefill cursor).
    pub prefill_cursor: usize,
    /// Sampled but not yet fed (in order).
    pub pending: Vec<Token>,
    /// Waiting for a shared prefix.
    pub prefix_wait: Option<PrefixWait>,
    /// KV dropped for space; recomputed once room frees up.
    pub preempted: bool,
    /// Admission order (higher is newer).
    pub admission_order: u64,
    /// The LoRA adapters it runs with.
    pub adapters: crate::runtime::AdapterSet,
    /// The prompt's images, in order (their positions hold placeholders).
    pub media: std::sync::Arc<[MediaSpan]>,
}

impl SlotTokens {
    /// The token state of a request just admitted with `prompt`.
    pub fn admitted(a: &Admission, prompt: Vec<Token>, media: std::sync::Arc<[MediaSpan]>) -> Self {
        SlotTokens {
            request_id: a.request_id,
            plan: a.exec,
            lease: a.lease,
            prompt_len: prompt.len(),
            context: prompt,
            prefill_cursor: a.reused_tokens,
            pending: Vec::new(),
            prefix_wait: a.prefix_wait,
            preempted: false,
            admission_order: a.order,
            adapters: a.adapters.clone(),
            media,
        }
    }

    /// The image that starts at the prefill cursor: computed next, alone.
    pub fn media_due(&self) -> Option<&MediaSpan> {
        self.media.iter().find(|m| m.start == self.prefill_cursor)
    }

    /// Prompt tokens computable as text from the cursor: up to the next
    /// image, or to the end.
    pub fn text_remaining(&self) -> usize {
        let end = self
            .media
            .iter()
            .map(|m| m.start)
            .filter(|&s| s >= self.prefill_cursor)
            .min()
            .unwrap_or(self.context.len());
        end - self.prefill_cursor
    }

    /// Tokens still to compute before sampling (or reading an embedding).
    pub fn prefill_remaining(&self) -> usize {
        self.context.len() - self.prefill_cursor
    }

    /// Cells this slot will still take to finish its prompt.
    pub fn reserve(&self) -> usize {
        if self.plan.prefill != PrefillKind::Decode {
            return 0;
        }
        let start = self
            .prefix_wait
            .map_or(self.prefill_cursor, |p| p.len.max(self.prefill_cursor));
        self.context.len().saturating_sub(start)
    }
}

/// What a request does once admitted.
#[derive(Debug)]
pub enum Task {
    /// Generates text.
    Generate(Box<Generation>),
    /// Computes an embedding.
    Embed {
        /// L2-normalize it.
        normalize: bool,
    },
}

/// When things happened to a request.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Submitted.
    pub submitted: Instant,
    /// Took a slot.
    pub admitted: Instant,
    /// Its prompt was computed.
    pub prefill_done: Option<Instant>,
    /// Its first token was sampled.
    pub first_token: Option<Instant>,
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A busy slot's request.
#[derive(Debug)]
pub struct Running {
    /// Phase (never `Idle`).
    pub phase: SlotPhase,
    /// Token state.
    pub tokens: SlotTokens,
    /// Counters.
    pub counters: SlotCounters,
    /// What it does.
    pub task: Task,
    /// Its event stream.
    pub sink: EventSink,
    /// Timestamps.
    pub timing: Timing,
    /// Reuse and keep KV.
    pub cache_prompt: bool,
    /// Runs alone: nothing else is admitted while it holds its slot.
    pub repeatable: bool,
    /// Speculative decoding's controller and counts.
    pub spec: SpecState,
}

impl Running {
    /// Top log-probabilities each sampled token carries.
    pub fn logprobs(&self) -> Option<usize> {
        match &self.task {
            Task::Generate(g) => g.spec.logprobs,
            Task::Embed { .. } => None,
        }
    }

    /// The token its next sample must be (a reasoning budget's close).
    pub fn forced_next(&self) -> Option<crate::runtime::Token> {
        match &self.task {
            Task::Generate(g) => g.forced_next(),
            Task::Embed { .. } => None,
        }
    }

    /// The request's timing and token counts.
    pub fn stats(&self, now: Instant) -> RequestStats {
        let t = &self.timing;
        RequestStats {
            queue_ms: ms(t.admitted - t.submitted),
            prompt_tokens: self.counters.prompt_tokens,
            cached_tokens: self.counters.cached_tokens,
            prefill_ms: t.prefill_done.map_or(0.0, |p| ms(p - t.admitted)),
            ttft_ms: t.first_token.map_or(0.0, |f| ms(f - t.submitted)),
            generated_tokens: self.counters.generated_tokens,
            decode_ms: t.first_token.map_or(0.0, |f| ms(now - f)),
            drafted_tokens: self.spec.drafted,
            accepted_tokens: self.spec.accepted,
        }
    }

    /// What this slot drafts for the next step to verify after its pending
    /// token: nothing unless it is decoding with speculation on, no token is
    /// forced next, and there is room in the context and in `max_tokens` for
    /// more than one more token.
    pub fn draft(&self, n_ctx: usize) -> Proposal {
        let Task::Generate(g) = &self.task else {
            return Proposal::None;
        };
        let spec = &g.spec.speculative;
        let t = &self.tokens;
        let decoding = matches!(self.phase, SlotPhase::Decode | SlotPhase::EmitBuffered);
        if !spec.is_on()
            || !decoding
            || t.pending.len() != 1
            || t.preempted
            || t.prefill_cursor != t.context.len()
            || g.forced_next().is_some()
        {
            return Proposal::None;
        }
        // The pending token takes position context.len(); drafts follow it.
        let fed = t.context.len() + 1;
        let room = n_ctx.saturating_sub(fed);
        let left = g.spec.max_tokens.saturating_sub(g.tokens.len() + 1);
        let n = spec.n_max.min(room).min(left);
        if n == 0 {
            return Proposal::None;
        }
        let mut history = Vec::with_capacity(fed);
        history.extend_from_slice(&t.context);
        history.extend_from_slice(&t.pending);
        match spec.mode {
            SpeculativeMode::Off => Proposal::None,
            SpeculativeMode::Ngram => {
                let (tokens, matched) = ngram_draft(&history, spec.ngram_min, spec.ngram_max, n);
                if tokens.is_empty() {
                    Proposal::None
                } else {
                    Proposal::Ngram { tokens, matched }
                }
            }
            SpeculativeMode::Draft => Proposal::Model { n, history },
        }
    }
}

/// What a decoding slot drafts for the next step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Proposal {
    /// Nothing: one token this step.
    #[default]
    None,
    /// Tokens drafted by n-gram lookup, continuing a match of `matched`
    /// tokens.
    Ngram {
        /// The drafted tokens.
        tokens: Vec<Token>,
        /// The match's length.
        matched: usize,
    },
    /// Up to `n` tokens, drafted by the draft model when the step runs, after
    /// the slot's tokens (`history`: its context and pending token).
    Model {
        /// Most tokens.
        n: usize,
        /// The slot's tokens.
        history: Vec<Token>,
    },
}

impl Proposal {
    /// Rows the draft may take.
    pub fn len(&self) -> usize {
        match self {
            Proposal::None => 0,
            Proposal::Ngram { tokens, .. } => tokens.len(),
            Proposal::Model { n, .. } => *n,
        }
    }

    /// Whether nothing is drafted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One slot: idle, or serving one request.
#[derive(Debug, Default)]
pub enum Slot {
    /// Free.
    #[default]
    Idle,
    /// Serving a request.
    Busy(Box<Running>),
}

impl Slot {
    /// The request, when busy.
    pub fn running(&self) -> Option<&Running> {
        match self {
            Slot::Idle => None,
            Slot::Busy(r) => Some(r),
        }
    }

    /// The request, mutably.
    pub fn running_mut(&mut self) -> Option<&mut Running> {
        match self {
            Slot::Idle => None,
            Slot::Busy(r) => Some(r),
        }
    }

    /// The phase.
    pub fn phase(&self) -> SlotPhase {
        self.running().map_or(SlotPhase::Idle, |r| r.phase)
    }

    /// The token state, when busy.
    pub fn tokens(&self) -> Option<&SlotTokens> {
        self.running().map(|r| &r.tokens)
    }

    /// Whether this slot serves `id`.
    pub fn serves(&self, id: RequestId) -> bool {
        self.tokens().is_some_and(|t| t.request_id == id)
    }
}
