//! Draft-model speculation: a second, smaller model sharing the target's
//! vocabulary drafts tokens greedily, on the engine thread, before the step's
//! batch; the batch verifies them like any other draft.
//!
//! The draft model has its own small context with one sequence per slot. What
//! each sequence holds is mirrored here; before drafting, a slot's sequence is
//! cut back to its longest common prefix with the slot's tokens (a rejected
//! draft, or a new request) and caught up, then the model decodes one token
//! per round for every drafting slot at once. Drafts are greedy, so a draft
//! is a point mass and verification keeps the target's distribution.

use crate::runtime::{Backend, BatchRow, Token};
use crate::scheduler::SlotId;

/// A draft model and what each of its sequences holds.
pub struct ModelDrafter<B: Backend> {
    backend: B,
    held: Vec<Vec<Token>>,
}

/// One slot's request for a draft.
pub struct DraftAsk<'a> {
    /// The slot (its draft sequence has the same id).
    pub slot: SlotId,
    /// The slot's tokens: context and the pending token.
    pub history: &'a [Token],
    /// Most tokens to draft.
    pub n: usize,
}

impl<B: Backend> ModelDrafter<B> {
    /// A drafter on `backend`, whose context has a sequence per slot.
    pub fn new(backend: B, slots: usize) -> Self {
        Self {
            backend,
            held: vec![Vec::new(); slots],
        }
    }

    /// Greedy drafts for each ask, in order (shorter when the draft model
    /// ends its text; empty for everyone when its context is full, which
    /// also clears it).
    pub fn draft(&mut self, asks: &[DraftAsk<'_>]) -> Vec<Vec<Token>> {
        let mut drafts: Vec<Vec<Token>> = vec![Vec::new(); asks.len()];
        match self.try_draft(asks, &mut drafts) {
            Ok(()) => drafts,
            Err(()) => {
                self.backend.kv_clear();
                self.held.iter_mut().for_each(Vec::clear);
                vec![Vec::new(); asks.len()]
            }
        }
    }

    fn try_draft(&mut self, asks: &[DraftAsk<'_>], drafts: &mut [Vec<Token>]) -> Result<(), ()> {
        let n_batch = self.backend.n_batch().max(1) as usize;
        let vocab = self.backend.vocab();
        // Catch up: each sequence is cut to what it shares with the slot's
        // tokens (keeping at least the last token to compute, for its logits),
        // and the rest computed, in batches of at most n_batch rows. The last
        // row of each slot gives its first drafted token.
        let mut rows: Vec<BatchRow> = Vec::new();
        let mut outputs: Vec<(usize, usize)> = Vec::new(); // (ask, row)
        let mut open: Vec<usize> = Vec::new();
        for (k, a) in asks.iter().enumerate() {
            if a.n == 0 || a.history.is_empty() {
                continue;
            }
            let held = &mut self.held[a.slot];
            let common = held
                .iter()
                .zip(a.history)
                .take_while(|(x, y)| x == y)
                .count()
                .min(a.history.len() - 1);
            if held.len() > common {
                self.backend.kv_truncate(a.slot as i32, common as u32);
                held.truncate(common);
            }
            for (i, &token) in a.history.iter().enumerate().skip(common) {
                if rows.len() == n_batch {
                    self.flush(&mut rows, &mut outputs, drafts, &mut open)?;
                }
                let last = i + 1 == a.history.len();
                if last {
                    outputs.push((k, rows.len()));
                }
                rows.push(BatchRow {
                    token,
                    pos: i as u32,
                    seq: a.slot as i32,
                    output: last,
                });
                self.held[a.slot].push(token);
            }
        }
        self.flush(&mut rows, &mut outputs, drafts, &mut open)?;
        loop {
            open.retain(|&k| {
                let d = &drafts[k];
                d.len() < asks[k].n && !d.last().is_some_and(|&t| vocab.is_eog(t))
            });
            if open.is_empty() {
                return Ok(());
            }
            let rows: Vec<BatchRow> = open
                .iter()
                .map(|&k| {
                    let a = &asks[k];
                    let token = *drafts[k].last().expect("an open draft has a token");
                    BatchRow {
                        token,
                        pos: self.held[a.slot].len() as u32,
                        seq: a.slot as i32,
                        output: true,
                    }
                })
                .collect();
            self.decode(&rows)?;
            for (row, &k) in open.iter().enumerate() {
                let fed = *drafts[k].last().expect("an open draft has a token");
                self.held[asks[k].slot].push(fed);
                drafts[k].push(argmax(self.backend.logits(row)));
            }
        }
    }

    /// Decodes the catch-up rows gathered so far and reads the first drafted
    /// token of each slot whose last row was among them.
    fn flush(
        &mut self,
        rows: &mut Vec<BatchRow>,
        outputs: &mut Vec<(usize, usize)>,
        drafts: &mut [Vec<Token>],
        open: &mut Vec<usize>,
    ) -> Result<(), ()> {
        if rows.is_empty() {
            return Ok(());
        }
        self.decode(rows)?;
        for &(k, row) in outputs.iter() {
            drafts[k].push(argmax(self.backend.logits(row)));
            open.push(k);
        }
        rows.clear();
        outputs.clear();
        Ok(())
    }

    fn decode(&mut self, rows: &[BatchRow]) -> Result<(), ()> {
        self.backend.decode(rows).map_err(|e| {
            tracing::debug!("the draft model's batch failed ({e:?}); its context is cleared");
        })
    }
}

/// The most likely token of a logits row (the lowest id among equals).
fn argmax(logits: &[f32]) -> Token {
    let mut best = 0usize;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as Token
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::fake::{FakeBackend, FakeConfig};

    fn drafter() -> ModelDrafter<FakeBackend> {
        ModelDrafter::new(
            FakeBackend::new(FakeConfig {
                n_seq_max: 2,
                n_batch: 8,
                n_ubatch: 8,
                eos_one_in: 0,
                ..FakeConfig::default()
            }),
            2,
        )
    }

    #[test]
    fn drafts_follow_the_model_and_rejected_tokens_are_cut_back() {
        let model = FakeBackend::new(FakeConfig {
            eos_one_in: 0,
            ..FakeConfig::default()
        });
        let mut d = drafter();
        // A history longer than one batch, so the catch-up takes two.
        let history: Vec<Token> = "Once upon a time".bytes().map(Token::from).collect();
        let got = d.draft(&[DraftAsk {
            slot: 0,
            history: &history,
            n: 4,
        }]);
        let mut h = history.clone();
        let mut want = Vec::new();
        for _ in 0..4 {
            let t = model.most_likely(&h);
            want.push(t);
            h.push(t);
        }
        assert_eq!(got, vec![want.clone()]);
        // The sequence holds the history and the drafts it fed (not the last).
        assert_eq!(d.backend.seq_tokens(0), [&history[..], &want[..3]].concat());
        // Two drafted tokens accepted, then another token: the sequence is cut
        // back to the shared part and the new tokens computed.
        let mut next = history.clone();
        next.extend(&want[..2]);
        next.push(Token::from(b'z'));
        let got = d.draft(&[DraftAsk {
            slot: 0,
            history: &next,
            n: 2,
        }]);
        let mut h = next.clone();
        let a = model.most_likely(&h);
        h.push(a);
        assert_eq!(got, vec![vec![a, model.most_likely(&h)]]);
        assert_eq!(d.backend.seq_tokens(0), [&next[..], &[a][..]].concat());
    }

    #[test]
    fn a_full_draft_context_drafts_nothing_and_starts_over() {
        let mut d = ModelDrafter::new(
            FakeBackend::new(FakeConfig {
                n_ctx: 8,
                n_seq_max: 1,
                n_batch: 8,
                n_ubatch: 8,
                eos_one_in: 0,
                ..FakeConfig::default()
            }),
            1,
        );
        let long: Vec<Token> = (0..12).map(|i| Token::from(b'a' + i as u8)).collect();
        let got = d.draft(&[DraftAsk {
            slot: 0,
            history: &long,
            n: 3,
        }]);
        assert_eq!(got, vec![Vec::<Token>::new()]);
        assert_eq!(d.backend.used_cells(), 0);
        let short = &long[..3];
        let got = d.draft(&[DraftAsk {
            slot: 0,
            history: short,
            n: 2,
        }]);
        assert_eq!(got[0].len(), 2);
    }
}
