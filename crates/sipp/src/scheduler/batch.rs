//! Packing one step's batch under a token budget: every decoding slot first,
//! then prompt chunks shared fairly.

use super::slot::{PrefillKind, SlotPhase, SlotTokens, TerminalAction};
use super::SlotId;

/// One slot's share of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotSpan {
    /// The slot.
    pub slot: SlotId,
    /// Rows (tokens) in the batch.
    pub n_tokens: usize,
    /// Whether these are the slot's sampled tokens (else a prompt chunk).
    pub decode: bool,
    /// Whether the last row needs logits (or an embedding).
    pub output: bool,
    /// Of the rows, drafted tokens to verify (after the pending one).
    pub draft: usize,
    /// The rows are the image at the slot's cursor (its own batch).
    pub media: bool,
}

/// The packed batch of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packing {
    /// Decode or encode.
    pub kind: PrefillKind,
    /// Per-slot spans, in row order: decode tokens first, then prompt chunks.
    pub spans: Vec<SlotSpan>,
}

impl Packing {
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

/// One busy slot as packing sees it: its phase, tokens, and how many tokens
/// it drafted for this step.
pub type PackSlot<'a> = (SlotId, SlotPhase, &'a SlotTokens, usize);

/// Plans one step: the sampled tokens of every decoding slot first, then
/// their drafts while the budget allows, then prompt chunks shared fairly
/// (equal shares, the rest to the oldest, rotating) up to the budget. An
/// embedding input is computed whole in one step or waits.
pub fn pack(slots: &[PackSlot<'_>], limits: StepLimits, rotation: usize) -> Packing {
    let mut spans = Vec::new();
    let mut used = 0usize;
    for &(slot, phase, t, _) in slots {
        let n = t.pending.len();
        if matches!(phase, SlotPhase::Decode | SlotPhase::EmitBuffered)
            && n > 0
            && !t.preempted
            && used + n <= limits.budget
        {
            spans.push(SlotSpan {
                slot,
                n_tokens: n,
                decode: true,
                output: true,
                draft: 0,
                media: false,
            });
            used += n;
        }
    }
    for span in &mut spans {
        let draft = slots
            .iter()
            .find(|s| s.0 == span.slot)
            .map_or(0, |s| s.3)
            .min(limits.budget - used);
        span.draft = draft;
        span.n_tokens += draft;
        used += draft;
    }
    let (kind, cands) = prefill_candidates(slots, spans.is_empty(), rotation);
    let alloc = share_budget(&cands, limits, used);
    for (i, (slot, t)) in cands.iter().enumerate() {
        if alloc[i] == 0 {
            continue;
        }
        let completes = alloc[i] == t.prefill_remaining();
        spans.push(SlotSpan {
            slot: *slot,
            n_tokens: alloc[i],
            decode: false,
            // Logits only where a token will be sampled: the end of a fresh
            // prompt. A context recomputed after preemption already has its
            // next token.
            output: completes
                && (t.plan.terminal == TerminalAction::ReadEmbedding || t.pending.is_empty()),
            draft: 0,
            media: false,
        });
    }
    if kind == PrefillKind::Decode {
        if let Some(span) = media_span(slots) {
            spans.push(span);
        }
    }
    Packing { kind, spans }
}

/// The one image computed this step: the oldest slot whose cursor is at an
/// image. Its encode and embedding decode run as their own calls after the
/// step's batch, outside the token budget (an image is computed whole), one
/// per step so decoding slots still advance every step.
fn media_span(slots: &[PackSlot<'_>]) -> Option<SlotSpan> {
    slots
        .iter()
        .filter(|(_, phase, t, _)| {
            matches!(phase, SlotPhase::Admitted | SlotPhase::Prefill)
                && t.prefix_wait.is_none()
                && !t.preempted
        })
        .filter_map(|&(slot, _, t, _)| t.media_due().map(|m| (slot, t, m)))
        .min_by_key(|(_, t, _)| t.admission_order)
        .map(|(slot, _, m)| SlotSpan {
            slot,
            n_tokens: m.chunk.n_tokens,
            decode: false,
            output: false,
            draft: 0,
            media: true,
        })
}

/// Slots with prompt tokens to compute, oldest first, rotated. An encoder
/// batch is chosen only when nothing decodes: the two never share a batch.
fn prefill_candidates<'a>(
    slots: &[PackSlot<'a>],
    nothing_decodes: bool,
    rotation: usize,
) -> (PrefillKind, Vec<(SlotId, &'a SlotTokens)>) {
    let mut cands: Vec<(SlotId, &SlotTokens)> = slots
        .iter()
        .filter(|(_, phase, _, _)| matches!(phase, SlotPhase::Admitted | SlotPhase::Prefill))
        .map(|&(slot, _, t, _)| (slot, t))
        .filter(|(_, t)| t.prefix_wait.is_none() && !t.preempted && t.text_remaining() > 0)
        .collect();
    cands.sort_by_key(|(_, t)| t.admission_order);
    let encode = |t: &SlotTokens| t.plan.prefill == PrefillKind::Encode;
    let kind = if nothing_decodes && cands.iter().any(|(_, t)| encode(t)) {
        PrefillKind::Encode
    } else {
        PrefillKind::Decode
    };
    cands.retain(|(_, t)| encode(t) == (kind == PrefillKind::Encode));
    if !cands.is_empty() {
        let r = rotation % cands.len();
        cands.rotate_left(r);
    }
    (kind, cands)
}

/// Rows per candidate: whole embedding inputs first (all or nothing, within
/// one micro-batch), then water-filling for the rest.
fn share_budget(
    cands: &[(SlotId, &SlotTokens)],
    limits: StepLimits,
    mut used: usize,
) -> Vec<usize> {
    let mut alloc = vec![0usize; cands.len()];
    let mut embed_rows = 0usize;
    for (i, (_, t)) in cands.iter().enumerate() {
        if t.plan.terminal == TerminalAction::ReadEmbedding {
            let need = t.text_remaining();
            if used + need <= limits.budget && embed_rows + need <= limits.n_ubatch {
                alloc[i] = need;
                used += need;
                embed_rows += need;
            }
        }
    }
    loop {
        let open: Vec<usize> = (0..cands.len())
            .filter(|&i| {
                cands[i].1.plan.terminal == TerminalAction::SampleTokens
                    && alloc[i] < cands[i].1.text_remaining()
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
                .min(cands[i].1.text_remaining() - alloc[i])
                .min(remaining);
            alloc[i] += take;
            used += take;
        }
    }
    alloc
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::slot::SlotExecutionPlan;
    use crate::session::SeqLease;

    struct S {
        id: usize,
        phase: SlotPhase,
        t: SlotTokens,
        draft: usize,
    }

    const LIMITS: StepLimits = StepLimits {
        budget: 64,
        n_ubatch: 64,
    };

    fn plan_step(slots: &[S], limits: StepLimits, rotation: usize) -> Packing {
        let v: Vec<_> = slots
            .iter()
            .map(|s| (s.id, s.phase, &s.t, s.draft))
            .collect();
        pack(&v, limits, rotation)
    }

    fn slot(
        id: usize,
        phase: SlotPhase,
        ctx: usize,
        cursor: usize,
        pending: bool,
        order: u64,
    ) -> S {
        S {
            id,
            phase,
            t: SlotTokens {
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
                pending: if pending { vec![5] } else { Vec::new() },
                prefix_wait: None,
                preempted: false,
                admission_order: order,
                adapters: crate::runtime::AdapterSet::none(),
                media: std::sync::Arc::from(Vec::new()),
            },
            draft: 0,
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
        let plan = plan_step(&slots, LIMITS, 0);
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
        let plan = plan_step(&slots, LIMITS, 0);
        assert_eq!(
            plan.spans[0],
            SlotSpan {
                slot: 0,
                n_tokens: 5,
                decode: false,
                output: true,
                draft: 0,
                media: false,
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
        slots[0].t.prefix_wait = Some(super::super::slot::PrefixWait {
            source_slot: 1,
            source_request: 1,
            len: 40,
        });
        slots[1].t.preempted = true;
        assert!(plan_step(&slots, LIMITS, 0).spans.is_empty());
    }

    #[test]
    fn drafts_ride_after_every_pending_token_and_before_prompt_chunks() {
        let mut slots = vec![
            slot(0, SlotPhase::Decode, 10, 10, true, 0),
            slot(1, SlotPhase::Decode, 10, 10, true, 1),
            slot(2, SlotPhase::Prefill, 1000, 0, false, 2),
        ];
        slots[0].draft = 8;
        slots[1].draft = 3;
        let plan = plan_step(&slots, LIMITS, 0);
        assert_eq!((plan.spans[0].n_tokens, plan.spans[0].draft), (9, 8));
        assert_eq!((plan.spans[1].n_tokens, plan.spans[1].draft), (4, 3));
        assert_eq!(plan.spans[2].n_tokens, 64 - 13);
        // A tight budget keeps every pending token and cuts drafts first.
        let tight = StepLimits {
            budget: 6,
            n_ubatch: 64,
        };
        let plan = plan_step(&slots, tight, 0);
        assert_eq!(plan.spans.len(), 2);
        assert_eq!((plan.spans[0].n_tokens, plan.spans[0].draft), (5, 4));
        assert_eq!((plan.spans[1].n_tokens, plan.spans[1].draft), (1, 0));
    }

    fn with_image(mut s: S, start: usize, n: usize) -> S {
        s.t.media = std::sync::Arc::from(vec![crate::runtime::MediaSpan {
            start,
            chunk: crate::runtime::MediaChunk {
                hash: s.id as u64,
                n_tokens: n,
                handle: std::sync::Arc::new(()),
            },
        }]);
        s
    }

    #[test]
    fn text_stops_at_an_image_and_one_image_runs_per_step_beside_decoding() {
        let slots = vec![
            slot(0, SlotPhase::Decode, 10, 10, true, 0),
            // Cursor at its image (positions 4..20).
            with_image(slot(1, SlotPhase::Prefill, 30, 4, false, 1), 4, 16),
            with_image(slot(2, SlotPhase::Prefill, 30, 4, false, 2), 4, 16),
            // Text up to its image at 12.
            with_image(slot(3, SlotPhase::Prefill, 40, 0, false, 3), 12, 16),
        ];
        let plan = plan_step(&slots, LIMITS, 0);
        let by = |id| plan.spans.iter().filter(move |s| s.slot == id);
        assert_eq!(by(0).count(), 1, "the decoding slot is in the step");
        assert_eq!(
            plan.spans.iter().filter(|s| s.media).count(),
            1,
            "one image per step"
        );
        let image = plan.spans.iter().find(|s| s.media).expect("an image");
        assert_eq!(
            (image.slot, image.n_tokens),
            (1, 16),
            "the oldest waiting image"
        );
        assert_eq!(plan.spans.last(), Some(image), "images run after the rows");
        let text: Vec<_> = by(3).collect();
        assert_eq!(text.len(), 1);
        assert_eq!(text[0].n_tokens, 12, "text stops at the image");
        assert!(!text[0].output);
        assert_eq!(by(2).count(), 0, "the second image waits");
    }

    #[test]
    fn recomputed_context_needs_no_logits() {
        let slots = vec![slot(0, SlotPhase::Prefill, 20, 0, true, 0)];
        let plan = plan_step(&slots, LIMITS, 0);
        assert_eq!(plan.spans.len(), 1);
        assert!(!plan.spans[0].output);
    }
}
