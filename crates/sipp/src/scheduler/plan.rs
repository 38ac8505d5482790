//! One step as data: what the scheduler decided ([`StepPlan`]) and what the
//! executor got back ([`StepOutput`]).

use super::slot::{PrefillKind, PrefixWait, SlotExecutionPlan};
use super::{RequestId, SlotId};
use crate::engine::{EngineError, GenerateSpec};
use crate::runtime::{AdapterSet, MediaChunk, Pooling, SampledLogprobs, SeqId, Token};
use crate::session::{KvOp, Reuse, SeqLease};

/// A queued request taking a slot. Admissions are in queue order: the n-th
/// admission of a plan is the n-th request of the queue.
#[derive(Debug, Clone)]
pub struct Admission {
    /// The request.
    pub request_id: RequestId,
    /// The slot it takes.
    pub slot: SlotId,
    /// Its KV lease.
    pub lease: SeqLease,
    /// Its prompt's length.
    pub prompt_tokens: usize,
    /// Where its reused prefix comes from.
    pub reuse: Reuse,
    /// Prompt tokens reused (the plan's `kv_ops` bring them into place).
    pub reused_tokens: usize,
    /// Reuse cached KV, and keep this request's KV as a prefix candidate when
    /// it finishes.
    pub cache_prompt: bool,
    /// A longer prefix another slot is computing, to share once it is done.
    pub prefix_wait: Option<PrefixWait>,
    /// Admission order.
    pub order: u64,
    /// How it runs.
    pub exec: SlotExecutionPlan,
    /// Its sampler, built by the executor (generation requests only).
    pub sampler: Option<SamplerSetup>,
    /// The LoRA adapters it runs with.
    pub adapters: AdapterSet,
    /// An encoder-decoder model's input, encoded before the step's batch.
    pub encoder_input: Option<std::sync::Arc<[Token]>>,
}

/// What the executor needs to build a request's sampler.
#[derive(Debug, Clone)]
pub struct SamplerSetup {
    /// Sampling settings, constraint and seed.
    pub spec: GenerateSpec,
    /// The prompt (penalty samplers see it).
    pub prompt: Vec<Token>,
}

/// A prefix wait that ended this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixShare {
    /// The waiting slot.
    pub slot: SlotId,
    /// Tokens shared into it (`None`: its source went away; it computes the
    /// prefix itself).
    pub shared: Option<usize>,
    /// Its prefill cursor before (tokens it already had, counted as reused
    /// at its admission).
    pub from: usize,
}

/// A preempted slot that resumes, sharing `cursor` tokens still resident
/// elsewhere (0: recomputed from scratch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    /// The slot.
    pub slot: SlotId,
    /// Its new prefill cursor.
    pub cursor: usize,
}

/// Whether a span's rows are prompt tokens or sampled tokens fed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// A chunk of the context still to compute.
    Prompt,
    /// The sampled token fed back, and the tokens drafted after it.
    Decode,
    /// An image of the prompt: its rows hold placeholders, and the backend
    /// encodes the image and decodes its embeddings as a batch of its own.
    Media,
}

/// One slot's rows in the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSpan {
    /// The slot.
    pub slot: SlotId,
    /// Its request.
    pub request_id: RequestId,
    /// Its lease.
    pub lease: SeqLease,
    /// Prompt chunk or decode.
    pub kind: SpanKind,
    /// Position of the first row.
    pub start: usize,
    /// Token of each row.
    pub tokens: Vec<Token>,
    /// Rows (offsets in this span) that need logits or an embedding.
    pub outputs: Vec<usize>,
    /// What to do at each output row.
    pub read: ReadKind,
    /// Top log-probabilities to return with each sampled token.
    pub logprobs: Option<usize>,
    /// The token the last output row must produce instead of sampling.
    pub forced: Option<Token>,
    /// The last `draft` rows are drafted tokens to verify: a token sampled at
    /// row k is kept, and row k + 1 read, only while it equals row k + 1's
    /// token; the rows of rejected tokens leave the KV cache.
    pub draft: usize,
    /// The length of the n-gram match the draft continues (0: no n-gram
    /// draft), for the scheduler's acceptance estimate.
    pub draft_match: usize,
    /// Set when the draft model drafts those rows as the step runs (they hold
    /// placeholders until then): the slot's tokens, context and pending.
    pub draft_history: Option<Vec<Token>>,
    /// The LoRA adapters its rows are computed under (the executor runs one
    /// batch per set).
    pub adapters: AdapterSet,
    /// The image of a [`SpanKind::Media`] span.
    pub media: Option<MediaChunk>,
}

impl BatchSpan {
    /// Rows before the draft: the prompt chunk, or the pending token.
    pub fn fed_rows(&self) -> usize {
        self.tokens.len() - self.draft
    }
}

/// What the executor does with an output row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadKind {
    /// Sample a token.
    Sample,
    /// Read the pooled embedding.
    Embedding,
}

/// The batch of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Decode or encode.
    pub kind: PrefillKind,
    /// Spans in row order: decode tokens first, then prompt chunks; an
    /// image span last (it runs after the rows, as its own batch).
    pub spans: Vec<BatchSpan>,
}

impl Batch {
    /// Rows in the batch.
    pub fn n_rows(&self) -> usize {
        self.spans.iter().map(|s| s.tokens.len()).sum()
    }
}

/// Everything decided in one step, in the order the executor carries it out:
/// KV operations, then the batch.
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// KV mutations for admissions, shares, resumes, preemptions and room.
    pub kv_ops: Vec<KvOp>,
    /// Requests taking slots.
    pub admissions: Vec<Admission>,
    /// Prefix waits that ended.
    pub prefix_shares: Vec<PrefixShare>,
    /// Preempted slots resuming.
    pub resumes: Vec<Resume>,
    /// Slots preempted for room (their KV is dropped by `kv_ops`).
    pub preemptions: Vec<SlotId>,
    /// Slots failed by the decision (nothing can make room for them).
    pub failures: Vec<(SlotId, EngineError)>,
    /// The batch.
    pub batch: Batch,
}

impl StepPlan {
    /// Whether the plan does anything.
    pub fn is_empty(&self) -> bool {
        self.kv_ops.is_empty()
            && self.admissions.is_empty()
            && self.prefix_shares.is_empty()
            && self.resumes.is_empty()
            && self.preemptions.is_empty()
            && self.failures.is_empty()
            && self.batch.spans.is_empty()
    }
}

/// A sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    /// The token.
    pub token: Token,
    /// Its log-probabilities, when asked for.
    pub logprobs: Option<SampledLogprobs>,
}

/// What became of one span.
#[derive(Debug, Clone, PartialEq)]
pub enum SpanResult {
    /// Its rows are in the KV cache; no output was asked for.
    Computed,
    /// Computed, and tokens were sampled at its output rows.
    Sampled(Vec<SampledToken>),
    /// Computed; the grammar allows no token at the output row.
    GrammarExhausted,
    /// Computed, and the pooled embedding read.
    Embedding {
        /// The values, as the model produced them.
        values: Vec<f32>,
        /// The pooling.
        pooling: Pooling,
    },
    /// Not computed: this span's rows failed.
    Failed(EngineError),
    /// Not computed, no error: its sequence came up short, or a part of a
    /// split batch found no KV slot. The slot tries again next step.
    Deferred,
}

impl SpanResult {
    /// Of the `drafted` tokens a span of `kind` verified, how many were
    /// accepted: a decode span's sampled tokens past the first (its pending
    /// token's) are accepted drafts; nothing else accepts any.
    pub fn accepted_drafts(&self, kind: SpanKind, drafted: usize) -> usize {
        match self {
            SpanResult::Sampled(tokens) if kind == SpanKind::Decode => {
                tokens.len().saturating_sub(1).min(drafted)
            }
            _ => 0,
        }
    }
}

/// One span's result.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanOutcome {
    /// The slot.
    pub slot: SlotId,
    /// Its request.
    pub request_id: RequestId,
    /// The result.
    pub result: SpanResult,
    /// Drafted tokens the span verified (fewer than planned when the draft
    /// model ended its text or had no room).
    pub drafted: usize,
}

/// What became of the batch.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum BatchOutcome {
    /// Nothing was planned (or every span's slot was left out).
    #[default]
    NotRun,
    /// The batch ran; every span has an outcome.
    Ran(Vec<SpanOutcome>),
    /// llama.cpp found no KV slot for the batch: the scheduler makes room
    /// and replans.
    NoKvSpace,
}

/// What the executor reports back.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    /// Sequences that hold fewer tokens than planned after the KV operations
    /// (a snapshot was gone, or a share's source came up short), and how many
    /// they hold. Their slots' spans did not run; their cursors move back.
    pub short: Vec<(SeqId, usize)>,
    /// Admissions whose sampler could not be built.
    pub sampler_failures: Vec<(SlotId, EngineError)>,
    /// The batch.
    pub batch: BatchOutcome,
    /// Rows run and the time they took (decode and sampling), in ns.
    pub timing: Option<(usize, u64)>,
    /// When the executor began the step: the step's admissions count from
    /// here, so a prompt computed within its admission step still shows
    /// the time it took (`None`: from the update).
    pub started: Option<std::time::Instant>,
}

/// A freed slot's KV and sampler, for the executor to release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    /// The slot.
    pub slot: SlotId,
    /// Its lease.
    pub lease: SeqLease,
    /// Keep its tokens as a prefix candidate.
    pub keep: bool,
}
