//! The executor carries a [`StepPlan`] out on the backend: KV operations in
//! order, samplers for admitted requests, the batch, then sampling and
//! embedding reads at its output rows. What happened comes back as a
//! [`StepOutput`]; no decision is made here.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use super::metrics::EngineMetrics;
use super::request::EngineError;
use crate::runtime::{
    AdapterSet, Backend, BatchError, BatchRow, Pooling, SampleError, SamplerSpec,
};
use crate::sampling::{SamplerCacheKey, SamplerPool};
use crate::scheduler::{
    BatchOutcome, BatchSpan, PrefillKind, ReadKind, Release, SampledToken, SamplerSetup, SpanKind,
    SpanOutcome, SpanResult, StepOutput, StepPlan,
};
use crate::session::{KvOp, KvSessions};

use super::drafter::{DraftAsk, ModelDrafter};

/// The backend and what lives next to it: one sampler per busy slot, and a
/// pool of constrained samplers kept for reuse.
pub struct Executor<B: Backend> {
    backend: B,
    drafter: Option<ModelDrafter<B>>,
    samplers: Vec<Option<(B::Sampler, Option<SamplerCacheKey>)>>,
    pool: SamplerPool<B::Sampler>,
    metrics: Arc<EngineMetrics>,
}

impl<B: Backend> Executor<B> {
    /// An executor for `slots` slots.
    pub fn new(backend: B, slots: usize, metrics: Arc<EngineMetrics>) -> Self {
        Self {
            backend,
            drafter: None,
            samplers: (0..slots).map(|_| None).collect(),
            pool: SamplerPool::new(),
            metrics,
        }
    }

    /// Adds a draft model (one context sequence per slot).
    pub fn with_drafter(mut self, draft: B) -> Self {
        let slots = self.samplers.len();
        self.drafter = Some(ModelDrafter::new(draft, slots));
        self
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably (failure injection in tests).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Carries out a plan.
    pub fn run(&mut self, kv: &mut KvSessions, plan: &StepPlan) -> StepOutput {
        let mut out = StepOutput {
            started: Some(std::time::Instant::now()),
            ..StepOutput::default()
        };
        for op in &plan.kv_ops {
            let got = kv.apply(&mut self.backend, op);
            let (seq, want) = match op {
                KvOp::Restore { seq, prefix } => (*seq, prefix.len()),
                KvOp::Share { dst, len, .. } => (*dst, *len),
                _ => continue,
            };
            out.short.retain(|(s, _)| *s != seq);
            if got.is_some_and(|n| n < want) {
                out.short.push((seq, kv.resident_len(seq)));
            }
        }
        count_reuse(kv, plan, &out);
        for a in &plan.admissions {
            let Some(setup) = &a.sampler else { continue };
            match self.build_sampler(setup) {
                Ok(s) => self.samplers[a.slot] = Some(s),
                Err(e) => out.sampler_failures.push((a.slot, e)),
            }
        }
        self.encode_wave(plan, &mut out);
        // Draft-model rows get their tokens now.
        let filled = self.fill_model_drafts(&plan.batch.spans);
        let all: &[BatchSpan] = filled.as_deref().unwrap_or(&plan.batch.spans);
        // A span whose sampler could not be built, or whose sequence came up
        // short, does not run.
        let (images, spans): (Vec<&BatchSpan>, Vec<&BatchSpan>) = all
            .iter()
            .filter(|s| !out.sampler_failures.iter().any(|(slot, _)| *slot == s.slot))
            .filter(|s| !out.short.iter().any(|(seq, _)| *seq == s.lease.seq_id))
            .partition(|s| s.kind == SpanKind::Media);
        if spans.is_empty() && images.is_empty() {
            return out;
        }
        self.metrics.steps.fetch_add(1, Relaxed);
        let rows: usize = spans.iter().map(|s| s.tokens.len()).sum();
        self.metrics.batch_rows.fetch_add(rows as u64, Relaxed);
        let started = Instant::now();
        let mut ran = if spans.is_empty() {
            Some(Vec::new())
        } else {
            self.run_by_adapters(kv, plan.batch.kind, &spans)
        };
        // Only decode steps (every row a sampled or drafted token with
        // logits) measure what a draft row costs: prompt rows are cheaper.
        if !spans.is_empty() && spans.iter().all(|s| s.kind == SpanKind::Decode) {
            out.timing = Some((rows, started.elapsed().as_nanos() as u64));
        }
        // Images run after the token rows, each as its own encode and
        // embedding batch.
        if let Some(outcomes) = ran.as_mut() {
            for span in images {
                outcomes.push(self.run_media(kv, span));
            }
        }
        out.batch = match ran {
            Some(outcomes) => BatchOutcome::Ran(
                all.iter()
                    .map(|s| {
                        outcomes
                            .iter()
                            .find(|o| o.slot == s.slot)
                            .cloned()
                            .unwrap_or_else(|| skipped(s))
                    })
                    .collect(),
            ),
            None => BatchOutcome::NoKvSpace,
        };
        if tracing::enabled!(target: "sipp::step", tracing::Level::DEBUG) {
            log_step(&spans, &out.batch, started.elapsed().as_nanos() as u64);
        }
        out
    }

    /// Runs the spans as one batch per LoRA adapter set (llama.cpp applies
    /// adapters to the whole context), in the order the sets first appear.
    /// `None`: no KV slot for the first batch; a later one that finds none
    /// defers its spans to the next step.
    fn run_by_adapters(
        &mut self,
        kv: &mut KvSessions,
        kind: PrefillKind,
        spans: &[&BatchSpan],
    ) -> Option<Vec<SpanOutcome>> {
        let mut groups: Vec<(&AdapterSet, Vec<&BatchSpan>)> = Vec::new();
        for s in spans {
            match groups.iter_mut().find(|(set, _)| **set == s.adapters) {
                Some((_, g)) => g.push(s),
                None => groups.push((&s.adapters, vec![s])),
            }
        }
        let mut out = Vec::with_capacity(spans.len());
        for (i, (set, group)) in groups.into_iter().enumerate() {
            if let Err(e) = self.backend.set_adapters(set) {
                out.extend(group.iter().map(|s| SpanOutcome {
                    slot: s.slot,
                    request_id: s.request_id,
                    result: SpanResult::Failed(EngineError::Decode(e.to_string())),
                    drafted: 0,
                }));
                continue;
            }
            out.extend(self.run_batch(kv, kind, &group, i == 0)?);
        }
        Some(out)
    }

    /// Runs spans as one batch; on a failure of several slots' rows, splits
    /// them and retries each half, so a failure lands only on the rows that
    /// cause it. `None`: no KV slot for the whole batch (`top` only).
    fn run_batch(
        &mut self,
        kv: &mut KvSessions,
        kind: PrefillKind,
        spans: &[&BatchSpan],
        top: bool,
    ) -> Option<Vec<SpanOutcome>> {
        let rows = build_rows(spans);
        let started = Instant::now();
        let result = match kind {
            PrefillKind::Decode => self.backend.decode(&rows),
            PrefillKind::Encode => self.backend.encode(&rows),
        };
        self.metrics
            .batch_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
        match result {
            Ok(()) => Some(self.read_outputs(kv, kind, spans)),
            Err(BatchError::NoKvSpace) if top => None,
            Err(BatchError::NoKvSpace) => Some(spans.iter().map(|s| skipped(s)).collect()),
            Err(BatchError::Failed(_)) if spans.len() > 1 => {
                let (a, b) = spans.split_at(spans.len() / 2);
                let mut out = self.run_batch(kv, kind, a, false)?;
                out.extend(self.run_batch(kv, kind, b, false)?);
                Some(out)
            }
            Err(BatchError::Failed(code)) => Some(vec![SpanOutcome {
                slot: spans[0].slot,
                request_id: spans[0].request_id,
                result: SpanResult::Failed(EngineError::Decode(format!(
                    "llama.cpp returned {code} for this request's batch"
                ))),
                drafted: 0,
            }]),
        }
    }

    /// Encodes the inputs of the encoder-decoder requests admitted this step
    /// in one llama_encode, each in its own sequence, before their decoders'
    /// first rows. llama.cpp keeps one encoder output per context, for every
    /// sequence of that encode: the scheduler admits such a wave only when the
    /// previous one is done. A failure fails the whole wave.
    fn encode_wave(&mut self, plan: &StepPlan, out: &mut StepOutput) {
        let wave: Vec<_> = plan
            .admissions
            .iter()
            .filter(|a| !out.sampler_failures.iter().any(|(s, _)| *s == a.slot))
            .filter_map(|a| a.encoder_input.as_ref().map(|input| (a, input)))
            .collect();
        if wave.is_empty() {
            return;
        }
        let rows: Vec<BatchRow> = wave
            .iter()
            .flat_map(|(a, input)| {
                input.iter().enumerate().map(|(i, &token)| BatchRow {
                    token,
                    pos: i as u32,
                    seq: a.lease.seq_id,
                    output: false,
                })
            })
            .collect();
        let started = Instant::now();
        let encoded = self.backend.encode(&rows);
        self.metrics
            .batch_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
        if let Err(e) = encoded {
            for (a, _) in wave {
                out.sampler_failures.push((
                    a.slot,
                    EngineError::Decode(format!("llama.cpp could not encode the input: {e}")),
                ));
            }
        }
    }

    /// Encodes an image span and decodes its embeddings into its sequence.
    /// A failure leaves none of its rows in the KV cache.
    fn run_media(&mut self, kv: &mut KvSessions, span: &BatchSpan) -> SpanOutcome {
        let outcome = |result| SpanOutcome {
            slot: span.slot,
            request_id: span.request_id,
            result,
            drafted: 0,
        };
        let Some(chunk) = span.media.as_ref() else {
            return outcome(SpanResult::Failed(EngineError::Decode(
                "an image span without its image".into(),
            )));
        };
        if let Err(e) = self.backend.set_adapters(&span.adapters) {
            return outcome(SpanResult::Failed(EngineError::Decode(e.to_string())));
        }
        let seq = span.lease.seq_id;
        let started = Instant::now();
        let result = self.backend.decode_media(seq, span.start as u32, chunk);
        let ns = started.elapsed().as_nanos() as u64;
        self.metrics.batch_ns.fetch_add(ns, Relaxed);
        self.metrics.images.fetch_add(1, Relaxed);
        self.metrics.image_ns.fetch_add(ns, Relaxed);
        match result {
            Ok(()) => match kv.record_decoded(span.lease, &span.tokens) {
                Ok(()) => outcome(SpanResult::Computed),
                Err(e) => {
                    tracing::error!("{e}");
                    outcome(SpanResult::Failed(EngineError::Decode(e.to_string())))
                }
            },
            Err(e) => {
                // An image larger than a batch may have left part of itself.
                self.backend.kv_truncate(seq, span.start as u32);
                match e {
                    BatchError::NoKvSpace => skipped(span),
                    BatchError::Failed(code) => outcome(SpanResult::Failed(EngineError::Decode(
                        format!("llama.cpp could not compute this request's image (code {code})"),
                    ))),
                }
            }
        }
    }

    /// After a batch ran: records its rows in the mirror, then samples or
    /// reads embeddings at the output rows.
    fn read_outputs(
        &mut self,
        kv: &mut KvSessions,
        kind: PrefillKind,
        spans: &[&BatchSpan],
    ) -> Vec<SpanOutcome> {
        let mut row = 0usize;
        let mut out = Vec::with_capacity(spans.len());
        for span in spans {
            let first = row;
            row += span.tokens.len();
            let outcome = |result| SpanOutcome {
                slot: span.slot,
                request_id: span.request_id,
                result,
                drafted: span.draft,
            };
            if kind == PrefillKind::Decode {
                if let Err(e) = kv.record_decoded(span.lease, &span.tokens) {
                    // A stale lease here is a bookkeeping bug; fail loudly, alone.
                    tracing::error!("{e}");
                    out.push(outcome(SpanResult::Failed(EngineError::Decode(
                        e.to_string(),
                    ))));
                    continue;
                }
            }
            let result = match (span.outputs.is_empty(), span.read) {
                (true, _) => SpanResult::Computed,
                (false, ReadKind::Embedding) => self.read_embedding(span, first),
                (false, ReadKind::Sample) => self.sample(span, first),
            };
            if let (true, SpanResult::Sampled(tokens)) = (span.draft > 0, &result) {
                self.drop_rejected(kv, span, tokens.len());
            }
            out.push(outcome(result));
        }
        out
    }

    fn read_embedding(&self, span: &BatchSpan, first_row: usize) -> SpanResult {
        let row = first_row + span.outputs[span.outputs.len() - 1];
        let pooling = self.backend.embedding_pooling().unwrap_or(Pooling::None);
        match self.backend.embedding(span.lease.seq_id, row) {
            Some(values) => SpanResult::Embedding { values, pooling },
            None => SpanResult::Failed(EngineError::Unsupported(
                "the context produced no embedding".into(),
            )),
        }
    }

    fn sample(&mut self, span: &BatchSpan, first_row: usize) -> SpanResult {
        let Some((sampler, _)) = self.samplers[span.slot].as_mut() else {
            return SpanResult::Failed(EngineError::Decode("the slot has no sampler".into()));
        };
        let mut tokens = Vec::with_capacity(span.outputs.len());
        for (k, &o) in span.outputs.iter().enumerate() {
            if let (Some(t), true) = (span.forced, k + 1 == span.outputs.len()) {
                let s = self
                    .backend
                    .accept_forced(sampler, first_row + o, t, span.logprobs);
                tokens.push(SampledToken {
                    token: s.token,
                    logprobs: s.logprobs,
                });
                continue;
            }
            match self.backend.sample(sampler, first_row + o, span.logprobs) {
                Ok(s) => {
                    let token = s.token;
                    tokens.push(SampledToken {
                        token,
                        logprobs: s.logprobs,
                    });
                    // The next row was fed a drafted token: its logits count
                    // only if that token is the one just sampled.
                    if span.draft > 0 && span.tokens.get(o + 1).is_some_and(|&d| d != token) {
                        break;
                    }
                }
                Err(SampleError::GrammarExhausted) => return SpanResult::GrammarExhausted,
            }
        }
        SpanResult::Sampled(tokens)
    }

    /// The plan's spans with the draft model's tokens in the rows it drafts
    /// (fewer rows when it drafted fewer); `None` when no span asks for it.
    fn fill_model_drafts(&mut self, spans: &[BatchSpan]) -> Option<Vec<BatchSpan>> {
        let asking: Vec<usize> = (0..spans.len())
            .filter(|&i| spans[i].draft_history.is_some())
            .collect();
        if asking.is_empty() {
            return None;
        }
        let mut filled = spans.to_vec();
        let got = match self.drafter.as_mut() {
            Some(d) => {
                let asks: Vec<DraftAsk<'_>> = asking
                    .iter()
                    .map(|&i| DraftAsk {
                        slot: spans[i].slot,
                        history: spans[i].draft_history.as_deref().unwrap_or_default(),
                        n: spans[i].draft,
                    })
                    .collect();
                d.draft(&asks)
            }
            None => vec![Vec::new(); asking.len()],
        };
        for (&i, draft) in asking.iter().zip(got) {
            let s = &mut filled[i];
            let fed = s.fed_rows();
            s.tokens.truncate(fed);
            s.draft = draft.len().min(s.draft);
            s.tokens.extend_from_slice(&draft[..s.draft]);
            s.outputs = (0..s.tokens.len()).collect();
        }
        Some(filled)
    }

    /// After verifying a draft: `sampled` tokens came out of the span, so
    /// `sampled - 1` drafted tokens were accepted; the KV rows of the rest
    /// leave the cache and the mirror before anything else runs.
    fn drop_rejected(&mut self, kv: &mut KvSessions, span: &BatchSpan, sampled: usize) {
        let fed = span.fed_rows();
        let accepted = sampled.saturating_sub(fed).min(span.draft);
        self.metrics
            .draft_tokens
            .fetch_add(span.draft as u64, Relaxed);
        self.metrics
            .draft_accepted_tokens
            .fetch_add(accepted as u64, Relaxed);
        if accepted < span.draft {
            let op = KvOp::Truncate {
                seq: span.lease.seq_id,
                from: span.start + fed + accepted,
            };
            kv.apply(&mut self.backend, &op);
        }
    }

    fn build_sampler(
        &mut self,
        setup: &SamplerSetup,
    ) -> Result<(B::Sampler, Option<SamplerCacheKey>), EngineError> {
        let spec = &setup.spec;
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
        let pooled = key.as_ref().and_then(|k| self.pool.take(k));
        let mut sampler = match pooled {
            Some(mut s) => {
                self.backend.reset_sampler(&mut s, sspec)?;
                s
            }
            None => self.backend.new_sampler(sspec)?,
        };
        self.backend
            .sampler_accept_prompt(&mut sampler, &setup.prompt);
        Ok((sampler, key))
    }

    /// Releases a freed slot: its lease (KV kept as a prefix candidate when
    /// allowed) and its sampler, back to the pool.
    pub fn release(&mut self, kv: &mut KvSessions, r: &Release) {
        if let Err(e) = kv.check(r.lease) {
            tracing::error!("{e}");
        } else {
            kv.apply(
                &mut self.backend,
                &KvOp::Release {
                    lease: r.lease,
                    keep: r.keep,
                },
            );
        }
        if let Some((sampler, Some(key))) = self.samplers[r.slot].take() {
            self.pool.put(key, sampler);
        }
    }
}

fn skipped(s: &BatchSpan) -> SpanOutcome {
    SpanOutcome {
        slot: s.slot,
        request_id: s.request_id,
        result: SpanResult::Deferred,
        drafted: 0,
    }
}

fn build_rows(spans: &[&BatchSpan]) -> Vec<BatchRow> {
    let mut rows = Vec::with_capacity(spans.iter().map(|s| s.tokens.len()).sum());
    for span in spans {
        for (k, &token) in span.tokens.iter().enumerate() {
            rows.push(BatchRow {
                token,
                pos: (span.start + k) as u32,
                seq: span.lease.seq_id,
                output: span.outputs.contains(&k),
            });
        }
    }
    rows
}

/// Prefix reuse counters, from what the ops actually brought back.
fn count_reuse(kv: &mut KvSessions, plan: &StepPlan, out: &StepOutput) {
    for a in &plan.admissions {
        let short = out.short.iter().find(|(seq, _)| *seq == a.lease.seq_id);
        let n = short.map_or(a.reused_tokens, |&(_, n)| n.min(a.reused_tokens));
        kv.count_reuse(n);
    }
    // A share brings a waiting slot from what its admission reused (counted
    // there) to the shared length: only the difference is new reuse. A
    // preempted slot that resumes gets its own tokens back; its prompt was
    // counted once, at admission, so it is no cache hit.
    for p in &plan.prefix_shares {
        if let Some(n) = p.shared {
            kv.count_shared(n.saturating_sub(p.from));
        }
    }
}

/// One step's shape, what its drafts gave and what it took, as a debug
/// event of target `sipp::step` (`SIPP_LOG=sipp::step=debug`), for
/// `scripts/step_gain.py`: decoding slots, prompt rows, decode rows (drafts
/// included), drafted and accepted tokens, nanoseconds.
fn log_step(spans: &[&BatchSpan], batch: &BatchOutcome, ns: u64) {
    let decode = spans.iter().filter(|s| s.kind == SpanKind::Decode);
    let accepted: usize = match batch {
        BatchOutcome::Ran(outcomes) => outcomes
            .iter()
            .filter_map(|o| {
                let span = spans.iter().find(|s| s.slot == o.slot)?;
                Some(o.result.accepted_drafts(span.kind, o.drafted))
            })
            .sum(),
        _ => 0,
    };
    tracing::debug!(
        target: "sipp::step",
        slots = decode.clone().count(),
        prompt_rows = spans
            .iter()
            .filter(|s| s.kind == SpanKind::Prompt)
            .map(|s| s.tokens.len())
            .sum::<usize>(),
        decode_rows = decode.clone().map(|s| s.tokens.len()).sum::<usize>(),
        drafted = decode.map(|s| s.draft).sum::<usize>(),
        accepted,
        ns,
        "step"
    );
}
