//! [`Scheduler::schedule`]: one step's decisions, made on a draft (a copy of
//! the KV mirror and copy-on-write slot states) so that each decision sees
//! the ones before it, and returned as a [`StepPlan`]. Nothing here touches
//! the backend or the scheduler itself.

use std::borrow::Cow;

use super::batch::{pack, Packing, SlotSpan};
use super::plan::{
    Admission, Batch, BatchSpan, PrefixShare, ReadKind, Resume, SamplerSetup, SpanKind, StepPlan,
};
use super::slot::{
    PrefillKind, PrefixWait, Proposal, SlotExecutionPlan, SlotPhase, SlotTokens, TerminalAction,
};
use super::speculate::{worth_keeping, SpecState};
use super::{Queued, Scheduler, SlotId};
use crate::config::CacheMode;
use crate::engine::{EngineError, PreparedKind};
use crate::runtime::{SeqId, Token};
use crate::session::{plan_acquire, AcquireAsk, KvMirror, KvOp, KvSessions, ReusePolicy};

/// A slot as the draft sees it.
#[derive(Debug, Clone)]
struct DraftSlot<'a> {
    phase: SlotPhase,
    tokens: Cow<'a, SlotTokens>,
    cache_prompt: bool,
    repeatable: bool,
    logprobs: Option<usize>,
    forced: Option<Token>,
    /// What it drafts for this step (speculative decoding).
    draft: Proposal,
    /// Its drafts' acceptance and record.
    spec: SpecState,
}

/// The state a plan is made on, changed decision by decision.
struct Draft<'a> {
    kv: KvMirror,
    slots: Vec<Option<DraftSlot<'a>>>,
    plan: StepPlan,
}

impl<'a> Draft<'a> {
    fn new(s: &'a Scheduler, kv: &KvSessions) -> Self {
        let slots = s
            .slots
            .iter()
            .map(|slot| {
                slot.running().map(|r| DraftSlot {
                    phase: r.phase,
                    tokens: Cow::Borrowed(&r.tokens),
                    cache_prompt: r.cache_prompt,
                    repeatable: r.repeatable,
                    logprobs: r.logprobs(),
                    forced: r.forced_next(),
                    draft: r.draft(s.n_ctx),
                    spec: r.spec,
                })
            })
            .collect();
        Draft {
            kv: kv.mirror().clone(),
            slots,
            plan: StepPlan {
                kv_ops: Vec::new(),
                admissions: Vec::new(),
                prefix_shares: Vec::new(),
                resumes: Vec::new(),
                preemptions: Vec::new(),
                failures: Vec::new(),
                batch: Batch {
                    kind: PrefillKind::Decode,
                    spans: Vec::new(),
                },
            },
        }
    }

    fn op(&mut self, op: KvOp) {
        self.kv.apply(&op);
        self.plan.kv_ops.push(op);
    }

    fn busy(&self) -> impl Iterator<Item = (SlotId, &DraftSlot<'a>)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i, s)))
    }

    fn tokens_mut(&mut self, slot: SlotId) -> &mut SlotTokens {
        self.slots[slot]
            .as_mut()
            .expect("drafted slot is busy")
            .tokens
            .to_mut()
    }

    /// Cells that prompts already admitted will still take.
    fn reserve(&self) -> u32 {
        self.busy().map(|(_, s)| s.tokens.reserve()).sum::<usize>() as u32
    }
}

impl Scheduler {
    /// Decides one step. `short_of_room` is set after the backend found no KV
    /// slot for the last batch although the mirror had room (fragmentation):
    /// room is then made at least once before a batch is planned.
    pub fn schedule(&self, kv: &KvSessions, short_of_room: bool) -> StepPlan {
        let mut d = Draft::new(self, kv);
        if self.resume_due {
            self.resume_preempted(&mut d);
        }
        self.admit(&mut d, kv);
        self.resolve_prefix_waits(&mut d);
        let others_running = d
            .busy()
            .any(|(_, s)| !s.tokens.preempted && s.tokens.prefix_wait.is_none());
        if !others_running {
            self.resume_preempted(&mut d);
        }
        self.park_idle(&mut d, kv);
        self.plan_batch(&mut d, kv.policy(), short_of_room);
        debug_assert!(
            {
                let mut replay = kv.mirror().clone();
                d.plan.kv_ops.iter().for_each(|op| replay.apply(op));
                replay.same_content(&d.kv)
            },
            "the plan's KV operations do not lead to the state it was made on"
        );
        d.plan
    }

    /// Admits queued requests, in order, while a slot and KV room allow.
    fn admit(&self, d: &mut Draft<'_>, kv: &KvSessions) {
        let encoder = self.model_is_encoder;
        // Encoder-decoder requests run in waves: llama.cpp keeps one encoder
        // output per context (for all the sequences of one encode), so a wave
        // is admitted, and encoded together, only when the last one is done,
        // and only as much as one encode batch holds.
        let busy_before = d.busy().next().is_some();
        let mut wave_tokens = 0usize;
        for q in &self.queue {
            let Some(slot) = d.slots.iter().position(Option::is_none) else {
                break;
            };
            let req = &q.req;
            if let Some(input) = &req.encoder_input {
                if busy_before
                    || (wave_tokens > 0 && wave_tokens + input.len() > self.limits.n_ubatch)
                {
                    break;
                }
                wave_tokens += input.len();
            }
            // A repeatable request runs alone: it waits for the others to
            // finish, and nothing joins it.
            let any_busy = d.busy().next().is_some();
            if d.busy().any(|(_, s)| s.repeatable) || (req.repeatable && any_busy) {
                break;
            }
            let is_embed = matches!(req.kind, PreparedKind::Embed { .. });
            // Embeddings never reuse KV: pooling needs the whole input in one batch.
            let use_cache = req.cache_prompt && !is_embed && !req.repeatable;
            if req.repeatable {
                self.clear_all(d, kv);
            }
            let ask = AcquireAsk {
                prompt: &req.prompt,
                context_key: req.context_key.as_deref(),
                adapters: req.adapters.key(),
                use_cache,
                reserve: if encoder { 0 } else { d.reserve() },
            };
            let Some(mut acq) = plan_acquire(&mut d.kv, kv.snapshots(), kv.policy(), ask) else {
                break;
            };
            d.plan.kv_ops.append(&mut acq.ops);
            // KV is reused up to an image's start, never into one.
            let floor = crate::runtime::media_floor(&req.media, acq.reused_tokens);
            if floor < acq.reused_tokens {
                d.op(KvOp::Truncate {
                    seq: acq.lease.seq_id,
                    from: floor,
                });
                acq.reused_tokens = floor;
            }
            let nth = d.plan.admissions.len();
            let mut admission = self.admission(q, slot, acq, use_cache, nth);
            let mut tokens =
                SlotTokens::admitted(&admission, req.prompt.clone(), req.media.clone());
            if use_cache && kv.mode() == CacheMode::SharedPrefix {
                admission.prefix_wait = self.shared_prefix_in_progress(d, &tokens);
                tokens.prefix_wait = admission.prefix_wait;
            }
            d.slots[slot] = Some(DraftSlot {
                phase: SlotPhase::Admitted,
                tokens: Cow::Owned(tokens),
                cache_prompt: use_cache,
                repeatable: req.repeatable,
                logprobs: admission.sampler.as_ref().and_then(|s| s.spec.logprobs),
                forced: None,
                draft: Proposal::None,
                spec: SpecState::default(),
            });
            d.plan.admissions.push(admission);
        }
    }

    fn admission(
        &self,
        q: &Queued,
        slot: SlotId,
        acq: crate::session::Acquired,
        cache_prompt: bool,
        nth: usize,
    ) -> Admission {
        let req = &q.req;
        let embed = matches!(req.kind, PreparedKind::Embed { .. });
        Admission {
            request_id: req.id,
            slot,
            lease: acq.lease,
            prompt_tokens: req.prompt.len(),
            reuse: acq.reuse,
            reused_tokens: acq.reused_tokens,
            cache_prompt,
            prefix_wait: None,
            order: self.admissions + nth as u64 + 1,
            exec: SlotExecutionPlan {
                prefill: if embed && self.model_is_encoder {
                    PrefillKind::Encode
                } else {
                    PrefillKind::Decode
                },
                terminal: if embed {
                    TerminalAction::ReadEmbedding
                } else {
                    TerminalAction::SampleTokens
                },
            },
            sampler: match &req.kind {
                PreparedKind::Generate(spec) => Some(SamplerSetup {
                    spec: spec.clone(),
                    // Image placeholders are no tokens a sampler may see.
                    prompt: req
                        .prompt
                        .iter()
                        .copied()
                        .filter(|&t| !crate::media::is_placeholder(t))
                        .collect(),
                }),
                PreparedKind::Embed { .. } => None,
            },
            adapters: req.adapters.clone(),
            encoder_input: req.encoder_input.clone(),
        }
    }

    /// Brings the KV cache to the state of a fresh engine for a repeatable
    /// request: every idle sequence is evicted (snapshotted when snapshots
    /// are on), then llama.cpp's cache is cleared, which also resets where it
    /// places new cells. The same cells and KV window then give the same
    /// numerics as on a fresh engine (the flash-attention kernel changes its
    /// reduction with the window's size and the cells' places).
    fn clear_all(&self, d: &mut Draft<'_>, kv: &KvSessions) {
        while let Some(seq) = d.kv.eviction_victim(&[]) {
            let snapshot = kv.policy().snapshot_on_evict(d.kv.resident_len(seq));
            d.op(KvOp::Evict { seq, snapshot });
        }
        d.op(KvOp::ClearAll);
    }

    /// Moves idle prefixes out of the live cache into the snapshot store
    /// while this step computes (after admissions took what they reuse), so
    /// their cells stop widening what every row attends over; a prompt that
    /// continues one later gets it back by a copy. A parked sequence can
    /// leave a prefix it shared with another idle one as that one's own, so
    /// the sequences are looked at again until none is parked.
    fn park_idle(&self, d: &mut Draft<'_>, kv: &KvSessions) {
        let computing = d
            .busy()
            .any(|(_, s)| !s.tokens.preempted && s.tokens.prefix_wait.is_none() && !s.repeatable);
        if !computing {
            return;
        }
        loop {
            let Some(seq) = (0..d.kv.n_seq() as SeqId).find(|&s| kv.worth_parking(&d.kv, s)) else {
                return;
            };
            d.op(KvOp::Park { seq });
        }
    }

    /// A longer prefix of this prompt that another slot is computing right now;
    /// waiting for it and sharing it beats computing it twice.
    fn shared_prefix_in_progress(&self, d: &Draft<'_>, t: &SlotTokens) -> Option<PrefixWait> {
        let cap = t.prompt_len.saturating_sub(1);
        d.busy()
            .map(|(slot, s)| (slot, s.tokens.as_ref()))
            .filter(|(_, o)| {
                o.prefix_wait.is_none()
                    && o.plan.terminal == TerminalAction::SampleTokens
                    && o.adapters == t.adapters
            })
            .map(|(slot, o)| {
                let n = o.context[..o.prompt_len]
                    .iter()
                    .zip(&t.context)
                    .take_while(|(a, b)| a == b)
                    .count()
                    .min(cap);
                (slot, o, crate::runtime::media_floor(&t.media, n))
            })
            .filter(|&(_, o, n)| n >= t.prefill_cursor + self.min_prefix && o.prefill_cursor < n)
            .max_by_key(|&(_, _, n)| n)
            .map(|(slot, o, n)| PrefixWait {
                source_slot: slot,
                source_request: o.request_id,
                len: n,
            })
    }

    /// Ends prefix waits whose source has computed the prefix (it is shared)
    /// or went away (the slot computes the prefix itself).
    fn resolve_prefix_waits(&self, d: &mut Draft<'_>) {
        for slot in 0..d.slots.len() {
            let Some(s) = &d.slots[slot] else { continue };
            let Some(pw) = s.tokens.prefix_wait else {
                continue;
            };
            let seq = s.tokens.lease.seq_id;
            let src = d.slots[pw.source_slot]
                .as_ref()
                .map(|s| &s.tokens)
                .filter(|t| t.request_id == pw.source_request && !t.preempted)
                .map(|t| (t.lease.seq_id, t.prefill_cursor));
            let shared = match src {
                None => None,
                // On a sliding-window model the source may have outgrown the
                // window past the prefix: the slot computes it itself.
                Some((src, cursor))
                    if cursor >= pw.len && d.kv.usable_prefix(src, pw.len) < pw.len =>
                {
                    None
                }
                Some((src, cursor)) if cursor >= pw.len => {
                    d.op(KvOp::Share {
                        src,
                        dst: seq,
                        len: pw.len,
                    });
                    Some(pw.len)
                }
                Some(_) => continue,
            };
            let t = d.tokens_mut(slot);
            t.prefix_wait = None;
            let from = t.prefill_cursor;
            if let Some(n) = shared {
                t.prefill_cursor = n;
            }
            d.plan
                .prefix_shares
                .push(PrefixShare { slot, shared, from });
        }
    }

    /// Preempted slots resume, sharing any prefix still resident elsewhere.
    fn resume_preempted(&self, d: &mut Draft<'_>) {
        for slot in 0..d.slots.len() {
            let Some(s) = &d.slots[slot] else { continue };
            if !s.tokens.preempted {
                continue;
            }
            let seq = s.tokens.lease.seq_id;
            let mut cursor = 0;
            if s.cache_prompt {
                let context = &s.tokens.context;
                let cap = context.len().saturating_sub(1);
                let key = s.tokens.adapters.key();
                if let Some((src, n)) = d.kv.longest_resident_prefix(context, Some(seq), cap, key) {
                    let n = crate::runtime::media_floor(&s.tokens.media, n);
                    if n >= self.min_prefix {
                        d.op(KvOp::Share {
                            src,
                            dst: seq,
                            len: n,
                        });
                        cursor = n;
                    }
                }
            }
            let t = d.tokens_mut(slot);
            t.preempted = false;
            t.prefill_cursor = cursor;
            d.plan.resumes.push(Resume { slot, cursor });
        }
    }

    /// Packs the batch, making room first when it does not fit the free
    /// cells: drafts are dropped, then idle sequences are evicted, then the
    /// newest running slot is preempted, and a lone request that cannot fit
    /// fails.
    fn plan_batch(&self, d: &mut Draft<'_>, policy: &ReusePolicy, mut short_of_room: bool) {
        self.prune_drafts(d);
        let mut turn = self.adapter_turn(d);
        let mut drafts = true;
        let packing = loop {
            let packing = {
                let view: Vec<_> = d
                    .busy()
                    .filter(|(_, s)| turn.as_ref().is_none_or(|set| s.tokens.adapters == *set))
                    .map(|(i, s)| {
                        let draft = if drafts { s.draft.len() } else { 0 };
                        (i, s.phase, s.tokens.as_ref(), draft)
                    })
                    .collect();
                pack(&view, self.limits, self.rotation as usize)
            };
            // The set in turn has nothing to run: every set runs instead.
            if packing.spans.is_empty() && turn.take().is_some() {
                continue;
            }
            if packing.spans.is_empty() || packing.kind == PrefillKind::Encode {
                break packing;
            }
            let fits = d.kv.cells_free() >= packing.n_rows() as u32;
            if fits && !short_of_room {
                break packing;
            }
            if drafts && packing.spans.iter().any(|s| s.draft > 0) {
                drafts = false;
                continue;
            }
            let forced = std::mem::take(&mut short_of_room);
            if !self.make_room(d, policy, &packing) {
                // Nothing can be freed: a forced replan runs no batch; otherwise
                // the backend reports what does not fit.
                if forced {
                    return;
                }
                break packing;
            }
        };
        d.plan.batch = Batch {
            kind: packing.kind,
            spans: packing.spans.iter().map(|s| to_span(d, s)).collect(),
        };
    }

    /// With `rotate_adapters`, the LoRA adapter set whose slots run this
    /// step: the sets of busy slots in order of their oldest slot, taken in
    /// turn. `None`: every set runs.
    fn adapter_turn(&self, d: &Draft<'_>) -> Option<crate::runtime::AdapterSet> {
        if !self.rotate_adapters {
            return None;
        }
        let mut slots: Vec<&SlotTokens> = d
            .busy()
            .map(|(_, s)| s.tokens.as_ref())
            .filter(|t| t.prefix_wait.is_none() && !t.preempted)
            .collect();
        slots.sort_by_key(|t| t.admission_order);
        let mut sets: Vec<&crate::runtime::AdapterSet> = Vec::new();
        for t in slots {
            if !sets.contains(&&t.adapters) {
                sets.push(&t.adapters);
            }
        }
        if sets.len() < 2 {
            return None;
        }
        Some(sets[self.rotation as usize % sets.len()].clone())
    }

    /// Cuts each draft to the tokens worth their rows ([`worth_keeping`]),
    /// given the step's decode rows.
    fn prune_drafts(&self, d: &mut Draft<'_>) {
        let decoding: Vec<SlotId> = d
            .busy()
            .filter(|(_, s)| matches!(s.phase, SlotPhase::Decode | SlotPhase::EmitBuffered))
            .map(|(i, _)| i)
            .collect();
        // An n-gram draft's chance follows its match's length; a draft
        // model's, the slot's record (with a probe now and then).
        let asks: Vec<(usize, f64, bool)> = decoding
            .iter()
            .map(|&i| {
                let s = d.slots[i].as_ref().expect("busy");
                match &s.draft {
                    Proposal::Ngram { tokens, matched } => (
                        tokens.len(),
                        self.ngram_acceptance.estimate(*matched),
                        false,
                    ),
                    _ => (
                        s.draft.len(),
                        s.spec.acceptance(),
                        s.spec.probe_due(decoding.len()),
                    ),
                }
            })
            .collect();
        if asks.iter().all(|a| a.0 == 0) {
            return;
        }
        let curve = self.step_cost.curve();
        let keep = worth_keeping(&asks, decoding.len(), |rows| curve.cost(rows));
        for (&i, k) in decoding.iter().zip(keep) {
            let s = d.slots[i].as_mut().expect("busy");
            match &mut s.draft {
                Proposal::Ngram { tokens, .. } => tokens.truncate(k),
                Proposal::Model { n, .. } => *n = (*n).min(k),
                Proposal::None => {}
            }
            if s.draft.is_empty() {
                s.draft = Proposal::None;
            }
        }
    }

    /// One room-making decision. Returns false when nothing could be freed.
    fn make_room(&self, d: &mut Draft<'_>, policy: &ReusePolicy, packing: &Packing) -> bool {
        if let Some(seq) = d.kv.eviction_victim(&[]) {
            let snapshot = policy.snapshot_on_evict(d.kv.resident_len(seq));
            d.op(KvOp::Evict { seq, snapshot });
            return true;
        }
        let holders: Vec<(SlotId, u64)> = d
            .busy()
            .filter(|(_, s)| !s.tokens.preempted && d.kv.resident_len(s.tokens.lease.seq_id) > 0)
            .map(|(i, s)| (i, s.tokens.admission_order))
            .collect();
        let planned: Vec<SlotId> = packing.spans.iter().map(|s| s.slot).collect();
        if holders.len() <= 1 && planned.len() <= 1 {
            let Some(&slot) = planned.first() else {
                return false;
            };
            let msg = format!(
                "{} cells are in use and this request needs more",
                d.kv.cells_used()
            );
            d.slots[slot] = None;
            d.plan.failures.push((slot, EngineError::KvCacheFull(msg)));
            return true;
        }
        let Some(&(victim, _)) = holders.iter().max_by_key(|(_, order)| *order) else {
            return false;
        };
        let seq = d.slots[victim]
            .as_ref()
            .map(|s| s.tokens.lease.seq_id)
            .expect("holder is busy");
        d.op(KvOp::Truncate { seq, from: 0 });
        let s = d.slots[victim].as_mut().expect("holder is busy");
        s.phase = SlotPhase::Prefill;
        let t = s.tokens.to_mut();
        t.prefill_cursor = 0;
        t.preempted = true;
        t.prefix_wait = None;
        d.plan.preemptions.push(victim);
        true
    }
}

/// A packed span with its rows' tokens and positions.
fn to_span(d: &Draft<'_>, s: &SlotSpan) -> BatchSpan {
    let ds = d.slots[s.slot].as_ref().expect("packed slot is busy");
    let t = ds.tokens.as_ref();
    let start = t.prefill_cursor;
    let media = s
        .media
        .then(|| t.media_due().map(|m| m.chunk.clone()))
        .flatten();
    let (kind, tokens, outputs) = if s.media {
        let rows = t.context[start..start + s.n_tokens].to_vec();
        (SpanKind::Media, rows, Vec::new())
    } else if s.decode {
        let mut rows = t.pending.clone();
        match &ds.draft {
            Proposal::Ngram { tokens, .. } => rows.extend_from_slice(&tokens[..s.draft]),
            // Placeholders: the draft model fills them in when the step runs.
            Proposal::Model { .. } => rows.extend(std::iter::repeat_n(rows[0], s.draft)),
            Proposal::None => {}
        }
        (SpanKind::Decode, rows, (0..s.n_tokens).collect())
    } else {
        let rows = t.context[start..start + s.n_tokens].to_vec();
        let outputs = if s.output {
            vec![s.n_tokens - 1]
        } else {
            Vec::new()
        };
        (SpanKind::Prompt, rows, outputs)
    };
    BatchSpan {
        slot: s.slot,
        request_id: t.request_id,
        lease: t.lease,
        kind,
        start,
        tokens,
        outputs,
        read: match t.plan.terminal {
            TerminalAction::SampleTokens => ReadKind::Sample,
            TerminalAction::ReadEmbedding => ReadKind::Embedding,
        },
        logprobs: ds.logprobs,
        forced: ds.forced,
        draft: s.draft,
        draft_match: match &ds.draft {
            Proposal::Ngram { matched, .. } if s.decode => *matched,
            _ => 0,
        },
        draft_history: match &ds.draft {
            Proposal::Model { history, .. } if s.decode && s.draft > 0 => Some(history.clone()),
            _ => None,
        },
        adapters: t.adapters.clone(),
        media,
    }
}
