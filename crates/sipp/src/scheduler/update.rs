//! [`Scheduler::update`]: applies a carried-out plan and its output to the
//! slots and returns the events to send and the slots to release.

use std::time::Instant;

use super::generation::Generation;
use super::plan::{
    Admission, BatchOutcome, BatchSpan, Release, SpanKind, SpanResult, StepOutput, StepPlan,
};
use super::slot::{Running, Slot, SlotCounters, SlotPhase, SlotTokens, Task, Timing};
use super::{Emit, Scheduler, SlotId};
use crate::engine::{Completion, EmbeddingOutput, EngineError, PreparedKind, RequestEvent, Usage};
use crate::runtime::Pooling;
use crate::text::FinishReason;

/// What an update produced: events to send (after metrics are published)
/// and slots whose KV lease and sampler the executor releases.
#[derive(Debug, Default)]
pub struct Updated {
    /// Events, in order.
    pub emits: Vec<Emit>,
    /// Freed slots.
    pub releases: Vec<Release>,
}

impl Updated {
    fn emit(&mut self, r: &Running, event: RequestEvent) {
        self.emits.push(Emit {
            sink: r.sink.clone(),
            event,
        });
    }
}

impl Scheduler {
    /// Applies a plan the executor carried out, in the order it was decided.
    pub fn update(&mut self, plan: &StepPlan, out: StepOutput) -> Updated {
        let mut u = Updated::default();
        let now = Instant::now();
        let started = out.started.unwrap_or(now);
        // The plan resumed what a freed slot made room for; slots freed from
        // here on make the next plan resume again.
        self.resume_due = false;
        for a in &plan.admissions {
            self.apply_admission(a, started, &mut u);
        }
        for (slot, e) in out.sampler_failures {
            self.fail(slot, e, &mut u);
        }
        for ps in &plan.prefix_shares {
            let Some(r) = self.slots[ps.slot].running_mut() else {
                continue;
            };
            r.tokens.prefix_wait = None;
            if let Some(n) = ps.shared {
                r.tokens.prefill_cursor = n;
                r.counters.cached_tokens = n;
            }
        }
        for rs in &plan.resumes {
            if let Some(r) = self.slots[rs.slot].running_mut() {
                r.tokens.preempted = false;
                r.tokens.prefill_cursor = rs.cursor;
            }
        }
        for &slot in &plan.preemptions {
            if let Some(r) = self.slots[slot].running_mut() {
                r.tokens.prefill_cursor = 0;
                r.tokens.preempted = true;
                r.tokens.prefix_wait = None;
                r.counters.preemptions += 1;
                r.phase = SlotPhase::Prefill;
            }
        }
        for (slot, e) in &plan.failures {
            self.fail(*slot, e.clone(), &mut u);
        }
        for &(seq, n) in &out.short {
            self.came_up_short(seq, n);
        }
        if let Some((rows, ns)) = out.timing {
            self.step_cost.observe(rows, ns);
            self.ngram_acceptance.tick();
        }
        if let BatchOutcome::Ran(outcomes) = out.batch {
            self.rotation += 1;
            for (span, o) in plan.batch.spans.iter().zip(outcomes) {
                debug_assert_eq!(span.slot, o.slot);
                if self.slots[span.slot].serves(o.request_id) {
                    self.apply_span(span, o.result, o.drafted, now, &mut u);
                }
            }
        }
        u
    }

    /// A sequence holds fewer tokens than the plan expected: its slot's
    /// cursor moves back to what is there, and the rest is computed.
    fn came_up_short(&mut self, seq: crate::runtime::SeqId, n: usize) {
        let mut running = self.slots.iter_mut().filter_map(Slot::running_mut);
        if let Some(r) = running.find(|r| r.tokens.lease.seq_id == seq) {
            r.tokens.prefill_cursor = r.tokens.prefill_cursor.min(n);
            r.counters.cached_tokens = r.counters.cached_tokens.min(n);
        }
    }

    fn apply_admission(&mut self, a: &Admission, now: Instant, u: &mut Updated) {
        let q = self
            .queue
            .pop_front()
            .expect("an admission has a queued request");
        debug_assert_eq!(q.req.id, a.request_id, "admissions follow the queue");
        self.admissions += 1;
        let req = q.req;
        // An encoder-decoder request's prompt is its encoded input.
        let prompt_len = req
            .encoder_input
            .as_ref()
            .map_or(req.prompt.len(), |i| i.len());
        let task = match req.kind {
            PreparedKind::Generate(spec) => Task::Generate(Box::new(Generation::new(spec))),
            PreparedKind::Embed { normalize } => Task::Embed { normalize },
        };
        let r = Running {
            phase: SlotPhase::Admitted,
            tokens: SlotTokens::admitted(a, req.prompt, req.media),
            counters: SlotCounters {
                prompt_tokens: prompt_len,
                cached_tokens: a.reused_tokens,
                ..SlotCounters::default()
            },
            task,
            sink: req.sink,
            timing: Timing {
                submitted: req.submitted_at,
                admitted: now,
                prefill_done: None,
                first_token: None,
            },
            cache_prompt: a.cache_prompt,
            repeatable: req.repeatable,
            spec: Default::default(),
        };
        let r = Box::new(r);
        u.emit(&r, RequestEvent::Started);
        self.slots[a.slot] = Slot::Busy(r);
    }

    /// Applies one span's result; `drafted` of its planned draft rows were
    /// verified.
    fn apply_span(
        &mut self,
        span: &BatchSpan,
        result: SpanResult,
        drafted: usize,
        now: Instant,
        u: &mut Updated,
    ) {
        let slot = span.slot;
        match result {
            SpanResult::Failed(e) => return self.fail(slot, e, u),
            SpanResult::Deferred => return,
            _ => {}
        }
        let r = self.slots[slot].running_mut().expect("served slot is busy");
        let t = &mut r.tokens;
        // Rows past the pending tokens are drafts: only accepted ones stay.
        let fed = span.fed_rows();
        if span.kind == SpanKind::Decode {
            t.context.extend(t.pending.drain(..fed));
            r.counters.decode_steps += 1;
        } else {
            r.counters.prefill_steps += 1;
        }
        t.prefill_cursor = span.start + fed;
        let caught_up = t.prefill_cursor == t.context.len();
        if caught_up && r.timing.prefill_done.is_none() {
            r.timing.prefill_done = Some(now);
        }
        let accepted = result.accepted_drafts(span.kind, drafted);
        match result {
            SpanResult::Sampled(tokens) => {
                if let Task::Generate(g) = &r.task {
                    if span.kind == SpanKind::Decode && g.spec.speculative.is_on() {
                        r.spec.record(drafted, accepted);
                        if span.draft_match > 0 {
                            self.ngram_acceptance
                                .record(span.draft_match, drafted, accepted);
                        }
                    }
                }
                self.accept(slot, tokens, now, u);
                // Accepted drafts are already in the KV cache: they move from
                // the pending tokens into the context.
                if let Some(r) = self.slots[slot].running_mut() {
                    if accepted > 0 && r.tokens.request_id == span.request_id {
                        let t = &mut r.tokens;
                        t.context.extend(t.pending.drain(..accepted));
                        t.prefill_cursor += accepted;
                    }
                }
            }
            SpanResult::GrammarExhausted => {
                let generated = r.counters.generated_tokens;
                self.fail(slot, EngineError::GrammarExhausted { generated }, u);
            }
            SpanResult::Embedding { values, pooling } => {
                self.embedded(slot, values, pooling, now, u)
            }
            SpanResult::Computed => {
                r.phase = if caught_up && !t.pending.is_empty() {
                    SlotPhase::Decode
                } else {
                    SlotPhase::Prefill
                };
            }
            SpanResult::Failed(_) | SpanResult::Deferred => unreachable!("handled above"),
        }
    }

    fn accept(
        &mut self,
        slot: SlotId,
        tokens: Vec<super::plan::SampledToken>,
        now: Instant,
        u: &mut Updated,
    ) {
        let n_ctx = self.n_ctx;
        let vocab = self.vocab.clone();
        let r = self.slots[slot]
            .running_mut()
            .expect("sampling slot is busy");
        let sink = r.sink.clone();
        let Task::Generate(g) = &mut r.task else {
            unreachable!("only generations sample")
        };
        let mut finish = None;
        for (i, s) in tokens.into_iter().enumerate() {
            r.counters.generated_tokens += 1;
            r.timing.first_token.get_or_insert(now);
            let context_len = r.tokens.context.len() + i;
            let a = g.accept(vocab.as_ref(), s.token, s.logprobs, context_len, n_ctx);
            u.emits.push(Emit {
                sink: sink.clone(),
                event: RequestEvent::Delta(a.delta),
            });
            if a.finish.is_some() {
                finish = a.finish;
                break;
            }
            r.tokens.pending.push(s.token);
            r.phase = if a.buffering {
                SlotPhase::EmitBuffered
            } else {
                SlotPhase::Decode
            };
        }
        if let Some(reason) = finish {
            self.finish(slot, reason, now, u);
        }
    }

    fn embedded(
        &mut self,
        slot: SlotId,
        mut values: Vec<f32>,
        pooling: Pooling,
        now: Instant,
        u: &mut Updated,
    ) {
        let Slot::Busy(r) = std::mem::take(&mut self.slots[slot]) else {
            return;
        };
        let Task::Embed { normalize } = r.task else {
            unreachable!("only embeddings read embeddings")
        };
        if normalize {
            l2_normalize(&mut values);
        }
        let out = EmbeddingOutput {
            values,
            pooling,
            normalized: normalize,
            prompt_tokens: r.counters.prompt_tokens,
            stats: r.stats(now),
        };
        u.emit(&r, RequestEvent::Embedding(out));
        self.free(slot, &r, false, u);
    }

    /// Ends a generation: held text is flushed (for EOS and length), the
    /// final event is queued and the slot freed.
    pub(super) fn finish(
        &mut self,
        slot: SlotId,
        reason: FinishReason,
        now: Instant,
        u: &mut Updated,
    ) {
        let Slot::Busy(mut r) = std::mem::take(&mut self.slots[slot]) else {
            return;
        };
        let stats = r.stats(now);
        let (tail, text, tokens, logprobs) = match &mut r.task {
            Task::Generate(g) => {
                let tail = g.end(reason);
                let text = std::mem::take(&mut g.text);
                (
                    tail,
                    text,
                    std::mem::take(&mut g.tokens),
                    std::mem::take(&mut g.logprobs),
                )
            }
            Task::Embed { .. } => (None, String::new(), Vec::new(), Vec::new()),
        };
        if let Some(tail) = tail {
            u.emit(&r, RequestEvent::Delta(tail));
        }
        if self.log_requests {
            tracing::info!(
                request = r.tokens.request_id,
                reason = reason.as_str(),
                prompt_tokens = stats.prompt_tokens,
                cached = stats.cached_tokens,
                generated = stats.generated_tokens,
                ttft_ms = stats.ttft_ms,
                "request finished"
            );
        }
        let completion = Completion {
            text,
            tokens,
            finish_reason: reason,
            usage: Usage {
                prompt_tokens: r.counters.prompt_tokens,
                completion_tokens: r.counters.generated_tokens,
                cached_tokens: r.counters.cached_tokens,
            },
            stats,
            logprobs,
        };
        u.emit(&r, RequestEvent::Finished(completion));
        let keep = r.cache_prompt;
        self.free(slot, &r, keep, u);
    }

    /// Fails a slot's request and frees the slot (its KV is not kept).
    pub(super) fn fail(&mut self, slot: SlotId, err: EngineError, u: &mut Updated) {
        let Slot::Busy(r) = std::mem::take(&mut self.slots[slot]) else {
            return;
        };
        u.emit(&r, RequestEvent::Failed(err));
        self.free(slot, &r, false, u);
    }

    fn free(&mut self, slot: SlotId, r: &Running, keep: bool, u: &mut Updated) {
        u.releases.push(Release {
            slot,
            lease: r.tokens.lease,
            keep,
        });
        self.resume_due = true;
    }

    /// Cancels a request wherever it is; its slot is free (and its release
    /// returned) when this returns.
    pub fn cancel(&mut self, id: super::RequestId) -> Updated {
        let mut u = Updated::default();
        if let Some(i) = self.queue.iter().position(|q| q.req.id == id) {
            let q = self.queue.remove(i).expect("position is in the queue");
            u.emits.push(Emit {
                event: RequestEvent::Finished(cancelled_completion(&q.req)),
                sink: q.req.sink,
            });
            return u;
        }
        if let Some(slot) = self.slots.iter().position(|s| s.serves(id)) {
            self.finish(slot, FinishReason::Cancelled, Instant::now(), &mut u);
        }
        u
    }

    /// Fails everything (the engine is stopping).
    pub fn fail_all(&mut self, err: &EngineError) -> Updated {
        let mut u = Updated::default();
        for q in self.queue.drain(..) {
            u.emits.push(Emit {
                event: RequestEvent::Failed(err.clone()),
                sink: q.req.sink,
            });
        }
        for slot in 0..self.slots.len() {
            self.fail(slot, err.clone(), &mut u);
        }
        u
    }
}

fn l2_normalize(values: &mut [f32]) {
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

fn cancelled_completion(req: &crate::engine::PreparedRequest) -> Completion {
    Completion {
        text: String::new(),
        tokens: Vec::new(),
        finish_reason: FinishReason::Cancelled,
        usage: Usage {
            prompt_tokens: req.prompt.len(),
            completion_tokens: 0,
            cached_tokens: 0,
        },
        stats: crate::engine::RequestStats {
            queue_ms: req.submitted_at.elapsed().as_secs_f64() * 1000.0,
            prompt_tokens: req.prompt.len(),
            ..crate::engine::RequestStats::default()
        },
        logprobs: Vec::new(),
    }
}
