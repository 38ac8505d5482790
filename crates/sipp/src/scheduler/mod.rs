//! Pure scheduling decisions: slots and their phases, the per-step batch plan
//! under a token budget, and the request lifecycle callers see.
//!
//! Nothing here calls llama.cpp or blocks. The engine asks [`plan_step`] for a
//! plan, runs it on the backend, then applies the results to the slots.

use std::collections::VecDeque;

use serde::Serialize;

use crate::runtime::Token;
use crate::session::SeqLease;

/// A request id, unique per engine.
pub type RequestId = u64;
/// A slot index.
pub type SlotId = usize;

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
    /// Finished; freed at the end of the step.
    Completed,
    /// Failed; freed at the end of the step.
    Failed,
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

/// The lifecycle of a request as its caller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum RequestLifecycle {
    /// Waiting for a slot.
    Queued,
    /// In a slot.
    Running,
    /// Finished normally.
    Completed,
    /// Failed.
    Failed,
    /// Cancelled.
    Cancelled,
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
    /// Sampled but not yet fed.
    pub pending_token: Option<Token>,
    /// Waiting for a shared prefix.
    pub prefix_wait: Option<PrefixWait>,
    /// KV dropped for space; recomputed once room frees up.
    pub preempted: bool,
    /// Admission order (higher is newer).
    pub admission_order: u64,
}

impl SlotTokens {
    /// Tokens still to compute before sampling (or reading an embedding).
    pub fn prefill_remaining(&self) -> usize {
        self.context.len() - self.prefill_cursor
    }
}

/// One slot.
#[derive(Debug)]
pub struct SlotState<W> {
    /// Index.
    pub slot_id: SlotId,
    /// Phase.
    pub phase: SlotPhase,
    /// The request's work, when busy.
    pub work: Option<W>,
}

/// Access to a slot's token state, for planning.
pub trait HasTokens {
    /// The token state.
    fn tokens(&self) -> &SlotTokens;
}

/// One slot's share of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotSpan {
    /// The slot.
    pub slot: SlotId,
    /// Its request at planning time.
    pub request_id: RequestId,
    /// Rows (tokens) in the batch.
    pub n_tokens: usize,
    /// Whether this is the slot's decode token (else a prompt chunk).
    pub decode: bool,
    /// Whether the last row needs logits (or an embedding).
    pub output: bool,
}

/// The batch of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPlan {
    /// Decode or encode.
    pub kind: PrefillKind,
    /// Per-slot spans, in row order: decode tokens first, then prompt chunks.
    pub spans: Vec<SlotSpan>,
}

impl BatchPlan {
    /// Rows in the batch.
    pub fn n_rows(&self) -> usize {
        self.spans.iter().map(|s| s.n_tokens).sum()
    }
}

/// Step limits.
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    /// Token budget of one step.
    pub budget: usize,
    /// Micro-batch size: a pooled embedding must fit in one.
    pub n_ubatch: usize,
}

/// Plans one step: one token for every decoding slot first, then prompt chunks
/// shared fairly (equal shares, the rest to the oldest, rotating) up to the
/// budget. An embedding input is computed whole in one step or waits.
pub fn plan_step<W: HasTokens>(
    slots: &[SlotState<W>],
    limits: StepLimits,
    rotation: usize,
) -> BatchPlan {
    let mut spans = Vec::new();
    let mut used = 0usize;
    let mut kind = PrefillKind::Decode;
    for s in slots {
        let Some(w) = &s.work else { continue };
        let t = w.tokens();
        if matches!(s.phase, SlotPhase::Decode | SlotPhase::EmitBuffered)
            && t.pending_token.is_some()
            && !t.preempted
            && used < limits.budget
        {
            spans.push(SlotSpan {
                slot: s.slot_id,
                request_id: t.request_id,
                n_tokens: 1,
                decode: true,
                output: true,
            });
            used += 1;
        }
    }
    let mut cands: Vec<(SlotId, &SlotTokens)> = slots
        .iter()
        .filter(|s| matches!(s.phase, SlotPhase::Admitted | SlotPhase::Prefill))
        .filter_map(|s| s.work.as_ref().map(|w| (s.slot_id, w.tokens())))
        .filter(|(_, t)| t.prefix_wait.is_none() && !t.preempted && t.prefill_remaining() > 0)
        .collect();
    if cands.is_empty() {
        return BatchPlan { kind, spans };
    }
    cands.sort_by_key(|(_, t)| t.admission_order);
    if spans.is_empty()
        && cands
            .iter()
            .any(|(_, t)| t.plan.prefill == PrefillKind::Encode)
    {
        kind = PrefillKind::Encode;
    }
    // Encoding and decoding never share a batch.
    cands.retain(|(_, t)| (t.plan.prefill == PrefillKind::Encode) == (kind == PrefillKind::Encode));
    let n = cands.len();
    if n > 0 {
        let r = rotation % n;
        cands.rotate_left(r);
    }

    let mut alloc = vec![0usize; cands.len()];
    // Whole-input candidates (embeddings) first: all of it, or nothing now.
    let mut embed_rows = 0usize;
    for (i, (_, t)) in cands.iter().enumerate() {
        if t.plan.terminal == TerminalAction::ReadEmbedding {
            let need = t.prefill_remaining();
            if used + need <= limits.budget && embed_rows + need <= limits.n_ubatch {
                alloc[i] = need;
                used += need;
                embed_rows += need;
            }
        }
    }
    // Water-filling for the rest.
    loop {
        let open: Vec<usize> = (0..cands.len())
            .filter(|&i| {
                cands[i].1.plan.terminal == TerminalAction::SampleTokens
                    && alloc[i] < cands[i].1.prefill_remaining()
            })
            .collect();
        let remaining = limits.budget.saturating_sub(used);
        if open.is_empty() || remaining == 0 {
            break;
        }
        let share = (remaining / open.len()).max(1);
        for i in open {
            let remaining = limits.budget - used;
            if remaining == 0 {
                break;
            }
            let take = share
                .min(cands[i].1.prefill_remaining() - alloc[i])
                .min(remaining);
            alloc[i] += take;
            used += take;
        }
    }
    for (i, (slot, t)) in cands.iter().enumerate() {
        if alloc[i] == 0 {
            continue;
        }
        let completes = alloc[i] == t.prefill_remaining();
        spans.push(SlotSpan {
            slot: *slot,
            request_id: t.request_id,
            n_tokens: alloc[i],
            decode: false,
            // Logits only where a token will be sampled: the end of a fresh
            // prompt. A context recomputed after preemption already has its
            // next token.
            output: completes
                && (t.plan.terminal == TerminalAction::ReadEmbedding || t.pending_token.is_none()),
        });
    }
    BatchPlan { kind, spans }
}

/// A FIFO admission queue.
#[derive(Debug)]
pub struct AdmissionQueue<R> {
    items: VecDeque<R>,
}

impl<R> Default for AdmissionQueue<R> {
    fn default() -> Self {
        Self {
            items: VecDeque::new(),
        }
    }
}

impl<R> AdmissionQueue<R> {
    /// Adds at the back.
    pub fn push(&mut self, r: R) {
        self.items.push_back(r);
    }
    /// The oldest.
    pub fn front(&self) -> Option<&R> {
        self.items.front()
    }
    /// Removes the oldest.
    pub fn pop(&mut self) -> Option<R> {
        self.items.pop_front()
    }
    /// Removes the first item matching.
    pub fn remove_where(&mut self, f: impl Fn(&R) -> bool) -> Option<R> {
        let i = self.items.iter().position(f)?;
        self.items.remove(i)
    }
    /// Length.
    pub fn len(&self) -> usize {
        self.items.len()
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
    /// Drains everything.
    pub fn drain(&mut self) -> impl Iterator<Item = R> + '_ {
        self.items.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct W(SlotTokens);
    impl HasTokens for W {
        fn tokens(&self) -> &SlotTokens {
            &self.0
        }
    }

    fn slot(
        id: usize,
        phase: SlotPhase,
        ctx: usize,
        cursor: usize,
        pending: bool,
        order: u64,
    ) -> SlotState<W> {
        SlotState {
            slot_id: id,
            phase,
            work: Some(W(SlotTokens {
                request_id: id as u64,
                plan: SlotExecutionPlan {
                    prefill: PrefillKind::Decode,
                    terminal: TerminalAction::SampleTokens,
                },
                lease: SeqLease {
                    seq_id: id as i32,
                    lease_generation: 1,
                },
                context: vec![1; ctx],
                prompt_len: ctx,
                prefill_cursor: cursor,
                pending_token: pending.then_some(5),
                prefix_wait: None,
                preempted: false,
                admission_order: order,
            })),
        }
    }

    #[test]
    fn decoders_first_then_fair_prefill_within_budget() {
        let slots = vec![
            slot(0, SlotPhase::Decode, 10, 10, true, 0),
            slot(1, SlotPhase::Prefill, 1000, 0, false, 1),
            slot(2, SlotPhase::Prefill, 1000, 0, false, 2),
            slot(3, SlotPhase::EmitBuffered, 10, 10, true, 3),
        ];
        let plan = plan_step(
            &slots,
            StepLimits {
                budget: 64,
                n_ubatch: 64,
            },
            0,
        );
        assert_eq!(plan.n_rows(), 64);
        assert!(plan.spans[0].decode && plan.spans[1].decode);
        let prefill: Vec<usize> = plan
            .spans
            .iter()
            .filter(|s| !s.decode)
            .map(|s| s.n_tokens)
            .collect();
        assert_eq!(prefill, vec![31, 31]);
        assert!(plan.spans.iter().filter(|s| !s.decode).all(|s| !s.output));
    }

    #[test]
    fn short_prompt_gets_logits_and_leftover_goes_to_others() {
        let slots = vec![
            slot(0, SlotPhase::Prefill, 5, 0, false, 0),
            slot(1, SlotPhase::Prefill, 500, 0, false, 1),
        ];
        let plan = plan_step(
            &slots,
            StepLimits {
                budget: 64,
                n_ubatch: 64,
            },
            0,
        );
        assert_eq!(
            plan.spans[0],
            SlotSpan {
                slot: 0,
                request_id: 0,
                n_tokens: 5,
                decode: false,
                output: true
            }
        );
        assert_eq!(plan.spans[1].n_tokens, 59);
    }

    #[test]
    fn waiting_and_preempted_slots_are_skipped() {
        let mut slots = vec![
            slot(0, SlotPhase::Admitted, 50, 0, false, 0),
            slot(1, SlotPhase::Prefill, 50, 0, true, 1),
        ];
        if let Some(w) = &mut slots[0].work {
            w.0.prefix_wait = Some(PrefixWait {
                source_slot: 1,
                source_request: 1,
                len: 40,
            });
        }
        if let Some(w) = &mut slots[1].work {
            w.0.preempted = true;
        }
        assert!(plan_step(
            &slots,
            StepLimits {
                budget: 64,
                n_ubatch: 64
            },
            0
        )
        .spans
        .is_empty());
    }

    #[test]
    fn recomputed_context_needs_no_logits() {
        let slots = vec![slot(0, SlotPhase::Prefill, 20, 0, true, 0)];
        let plan = plan_step(
            &slots,
            StepLimits {
                budget: 64,
                n_ubatch: 64,
            },
            0,
        );
        assert_eq!(plan.spans.len(), 1);
        assert!(!plan.spans[0].output);
    }
}
