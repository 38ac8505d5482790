//! The KV mirror: what each sequence holds, cell by cell, and who leases it.
//!
//! It is plain data (`Clone`): the scheduler plans on a copy, applying each
//! [`KvOp`] it decides, and the executor applies the same operations to the
//! real mirror while it carries them out on the backend. One function,
//! [`KvMirror::apply`], says what an operation does to the mirror, so the plan
//! and the execution cannot disagree.

use std::collections::HashMap;

use crate::runtime::{SeqId, Token};

use super::SeqLease;

type CellId = u64;

/// One KV mutation, decided by a plan and carried out by the executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvOp {
    /// Clears an idle sequence, first saving a snapshot of it when `snapshot`.
    Evict {
        /// The sequence.
        seq: SeqId,
        /// Save its state as a prefix snapshot before clearing.
        snapshot: bool,
    },
    /// Moves an idle sequence out of the live cache into the snapshot store
    /// (a snapshot is saved, then the sequence is cleared), so its cells no
    /// longer widen the span every decoded row attends over. The sequence's
    /// slot still finds its tokens there (slot save and erase).
    Park {
        /// The sequence.
        seq: SeqId,
    },
    /// Leases a sequence (bumping its generation).
    Lease {
        /// The sequence.
        seq: SeqId,
        /// Session affinity key recorded on the sequence.
        context_key: Option<String>,
        /// The key of the LoRA adapter set the lease computes under
        /// ([`crate::runtime::AdapterSet::key`], 0: none): KV is reused only
        /// by requests with the same key.
        adapters: u64,
    },
    /// Removes positions `from..` of a sequence.
    Truncate {
        /// The sequence.
        seq: SeqId,
        /// First position removed.
        from: usize,
    },
    /// Replaces `dst`'s content with the first `len` tokens of `src`, sharing
    /// their cells.
    Share {
        /// The source.
        src: SeqId,
        /// The destination (cleared first).
        dst: SeqId,
        /// Tokens shared.
        len: usize,
    },
    /// Restores the best snapshot for `prefix` into an empty sequence and
    /// keeps the part of it that matches `prefix`.
    Restore {
        /// The sequence.
        seq: SeqId,
        /// The tokens the plan expects to get back.
        prefix: Vec<Token>,
    },
    /// Ends a lease; with `keep` the tokens stay as a prefix candidate (never
    /// with the cache off: [`super::KvSessions::apply`] clears `keep` then).
    Release {
        /// The lease.
        lease: SeqLease,
        /// Keep the tokens.
        keep: bool,
    },
    /// Clears the whole cache (every sequence must already be empty).
    ClearAll,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct SequenceEntry {
    /// Tokens resident in this sequence, with the cell holding each.
    pub(crate) resident: Vec<(Token, CellId)>,
    pub(crate) lease_generation: u64,
    pub(crate) leased: bool,
    pub(crate) last_used: u64,
    pub(crate) context_key: Option<String>,
    /// The adapter-set key its tokens were computed under (0: none).
    pub(crate) adapters: u64,
    /// The adapter-set key of its lease: tokens recorded from now on are
    /// computed under it.
    pub(crate) lease_adapters: u64,
    /// Sliding-window models: positions below this one may be missing from
    /// the window layers' cells (see [`KvMirror::usable_prefix`]).
    pub(crate) swa_floor: usize,
}

impl SequenceEntry {
    /// Lower is evicted first: sequences without a context key (no session
    /// expects to continue them), then the least recently used.
    pub(crate) fn eviction_rank(&self) -> (bool, u64) {
        (self.context_key.is_some(), self.last_used)
    }
}

/// Lease misuse: a holder whose lease was released.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stale lease on sequence {seq_id} (generation {held}, current {current})")]
pub struct StaleLease {
    /// The sequence.
    pub seq_id: SeqId,
    /// The generation the holder has.
    pub held: u64,
    /// The sequence's generation now.
    pub current: u64,
}

/// What every sequence holds. Cells are tracked by identity: a prefix shared
/// into another sequence is the same cells (llama.cpp's unified KV cache tags
/// cells with sequence ids), which makes the count of used cells exact.
#[derive(Debug, Clone)]
pub struct KvMirror {
    pub(crate) seqs: Vec<SequenceEntry>,
    n_ctx: u32,
    next_cell: CellId,
    cell_refs: HashMap<CellId, u32>,
    tick: u64,
    /// The model's attention window, when it has sliding-window layers.
    swa_window: Option<usize>,
}

pub(crate) fn common_prefix(a: &[(Token, CellId)], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|((x, _), y)| x == *y).count()
}

impl KvMirror {
    /// `n_seq` empty sequences on a cache of `n_ctx` cells.
    pub fn new(n_seq: u32, n_ctx: u32) -> Self {
        Self {
            seqs: (0..n_seq).map(|_| SequenceEntry::default()).collect(),
            n_ctx,
            next_cell: 0,
            cell_refs: HashMap::new(),
            tick: 0,
            swa_window: None,
        }
    }

    /// The same, for a model with sliding-window attention layers of window
    /// `window` (none: every layer keeps every position).
    pub fn with_swa_window(mut self, window: Option<usize>) -> Self {
        self.swa_window = window.filter(|&w| w > 0);
        self
    }

    /// How much of a `n`-token prefix of `seq` can be continued from: `n`,
    /// or 0 when the window layers may have lost a position that a token at
    /// position `n` attends to.
    ///
    /// llama.cpp lets any new token take a cell whose position is outside
    /// its sequence's window (masked), so once a sequence has held `len`
    /// tokens, its window-layer cells below `len - window + 1` may be gone.
    /// A token at position `n` sees positions `n - window + 1 ..= n`, so a
    /// prefix is usable when none of those is below the floor: in practice
    /// a continuation of everything the sequence ever held, or any prefix
    /// of a sequence that never outgrew the window. Models without
    /// sliding-window layers reuse every prefix.
    pub fn usable_prefix(&self, seq: SeqId, n: usize) -> usize {
        let floor = self.seqs[seq as usize].swa_floor;
        match self.swa_window {
            Some(w) if floor > 0 && n + 1 < floor + w => 0,
            _ => n,
        }
    }

    /// Raises a sequence's floor to what its current length implies.
    fn raise_floor(&mut self, seq: SeqId) {
        if let Some(w) = self.swa_window {
            let e = &mut self.seqs[seq as usize];
            e.swa_floor = e.swa_floor.max((e.resident.len() + 1).saturating_sub(w));
        }
    }

    /// Number of sequences.
    pub fn n_seq(&self) -> usize {
        self.seqs.len()
    }

    /// Cells in use: distinct cells held by any sequence.
    pub fn cells_used(&self) -> u32 {
        self.cell_refs.len() as u32
    }

    /// Cells free.
    pub fn cells_free(&self) -> u32 {
        self.n_ctx.saturating_sub(self.cells_used())
    }

    /// Leases currently held.
    pub fn leased_count(&self) -> usize {
        self.seqs.iter().filter(|s| s.leased).count()
    }

    /// Whether a sequence is leased.
    pub fn is_leased(&self, seq: SeqId) -> bool {
        self.seqs[seq as usize].leased
    }

    /// The tokens a sequence holds, by position.
    pub fn resident_tokens(&self, seq: SeqId) -> Vec<Token> {
        self.seqs[seq as usize]
            .resident
            .iter()
            .map(|(t, _)| *t)
            .collect()
    }

    /// How many tokens a sequence holds.
    pub fn resident_len(&self, seq: SeqId) -> usize {
        self.seqs[seq as usize].resident.len()
    }

    /// Whether the lease is current.
    pub fn check(&self, lease: SeqLease) -> Result<(), StaleLease> {
        let e = &self.seqs[lease.seq_id as usize];
        if e.leased && e.lease_generation == lease.lease_generation {
            Ok(())
        } else {
            Err(StaleLease {
                seq_id: lease.seq_id,
                held: lease.lease_generation,
                current: e.lease_generation,
            })
        }
    }

    /// The lease a `Lease` operation on `seq` would hand out.
    pub fn next_lease(&self, seq: SeqId) -> SeqLease {
        SeqLease {
            seq_id: seq,
            lease_generation: self.seqs[seq as usize].lease_generation + 1,
        }
    }

    /// The adapter-set key of a sequence's tokens (0: none).
    pub fn adapters_of(&self, seq: SeqId) -> u64 {
        self.seqs[seq as usize].adapters
    }

    /// The longest usable prefix of `prompt`, at most `cap` tokens, resident
    /// in any sequence other than `except` computed under the adapter set
    /// `adapters`: (sequence, length).
    pub fn longest_resident_prefix(
        &self,
        prompt: &[Token],
        except: Option<SeqId>,
        cap: usize,
        adapters: u64,
    ) -> Option<(SeqId, usize)> {
        self.seqs
            .iter()
            .enumerate()
            .filter(|(i, s)| Some(*i as SeqId) != except && s.adapters == adapters)
            .map(|(i, s)| {
                let n = common_prefix(&s.resident, prompt).min(cap);
                (i as SeqId, self.usable_prefix(i as SeqId, n))
            })
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))
    }

    /// The idle sequence holding tokens that is evicted first, other than
    /// those in `keep`.
    pub fn eviction_victim(&self, keep: &[SeqId]) -> Option<SeqId> {
        self.seqs
            .iter()
            .enumerate()
            .filter(|(i, s)| !s.leased && !s.resident.is_empty() && !keep.contains(&(*i as SeqId)))
            .min_by_key(|(_, s)| s.eviction_rank())
            .map(|(i, _)| i as SeqId)
    }

    /// Cells that clearing `seq` from position `keep` on would free (cells
    /// shared with other sequences stay).
    pub fn freed_by_truncating(&self, seq: SeqId, keep: usize) -> u32 {
        self.seqs[seq as usize]
            .resident
            .iter()
            .skip(keep)
            .filter(|(_, c)| self.cell_refs.get(c) == Some(&1))
            .count() as u32
    }

    /// Whether `seq` holds at least `n` cells no other sequence shares. Cells
    /// are shared by prefix (a share copies a prefix), so the cells a
    /// sequence holds alone are a suffix of it: counted from the end, this
    /// stops at the first shared cell or at `n`, not walking the sequence.
    pub fn holds_own_cells(&self, seq: SeqId, n: u32) -> bool {
        let own = self.seqs[seq as usize]
            .resident
            .iter()
            .rev()
            .take(n as usize)
            .take_while(|(_, c)| self.cell_refs.get(c) == Some(&1))
            .count();
        own >= n as usize
    }

    fn touch(&mut self, seq: SeqId) {
        self.tick += 1;
        self.seqs[seq as usize].last_used = self.tick;
    }

    fn drop_cells(&mut self, seq: SeqId, from: usize) {
        if from == 0 {
            self.seqs[seq as usize].swa_floor = 0;
        }
        let len = self.seqs[seq as usize].resident.len();
        let tail: Vec<CellId> = self.seqs[seq as usize]
            .resident
            .drain(from.min(len)..)
            .map(|(_, c)| c)
            .collect();
        for c in tail {
            if let Some(n) = self.cell_refs.get_mut(&c) {
                *n -= 1;
                if *n == 0 {
                    self.cell_refs.remove(&c);
                }
            }
        }
    }

    fn alloc_cells(&mut self, tokens: &[Token]) -> Vec<(Token, CellId)> {
        tokens
            .iter()
            .map(|&t| {
                let c = self.next_cell;
                self.next_cell += 1;
                self.cell_refs.insert(c, 1);
                (t, c)
            })
            .collect()
    }

    /// Whether two mirrors hold the same tokens in the same sequences under
    /// the same leases (cell identities aside).
    pub fn same_content(&self, other: &KvMirror) -> bool {
        self.cells_used() == other.cells_used()
            && self.seqs.len() == other.seqs.len()
            && self.seqs.iter().zip(&other.seqs).all(|(a, b)| {
                a.leased == b.leased
                    && a.lease_generation == b.lease_generation
                    && a.resident
                        .iter()
                        .map(|r| r.0)
                        .eq(b.resident.iter().map(|r| r.0))
            })
    }

    /// Records tokens the backend just wrote at the end of a sequence.
    pub fn record(&mut self, seq: SeqId, tokens: &[Token]) {
        let cells = self.alloc_cells(tokens);
        let e = &mut self.seqs[seq as usize];
        e.resident.extend(cells);
        e.adapters = e.lease_adapters;
        self.raise_floor(seq);
        self.touch(seq);
    }

    /// What an operation does to the mirror. A `Restore` is applied with the
    /// tokens actually restored (the plan's `prefix` when planning).
    pub fn apply(&mut self, op: &KvOp) {
        match op {
            KvOp::Evict { seq, .. } | KvOp::Park { seq } => {
                self.drop_cells(*seq, 0);
                self.seqs[*seq as usize].context_key = None;
            }
            KvOp::Lease {
                seq,
                context_key,
                adapters,
            } => {
                let e = &mut self.seqs[*seq as usize];
                e.leased = true;
                e.lease_adapters = *adapters;
                e.lease_generation += 1;
                if context_key.is_some() {
                    e.context_key.clone_from(context_key);
                }
                self.touch(*seq);
            }
            KvOp::Truncate { seq, from } => self.drop_cells(*seq, *from),
            KvOp::Share { src, dst, len } => {
                self.drop_cells(*dst, 0);
                let prefix = self.seqs[*src as usize].resident[..*len].to_vec();
                for (_, c) in &prefix {
                    *self.cell_refs.entry(*c).or_insert(0) += 1;
                }
                // The shared cells lack what the source's lacked.
                let floor = self.seqs[*src as usize].swa_floor.min(*len);
                self.seqs[*dst as usize].resident = prefix;
                self.seqs[*dst as usize].swa_floor = floor;
                self.seqs[*dst as usize].adapters = self.seqs[*src as usize].adapters;
                self.raise_floor(*dst);
            }
            KvOp::Restore { seq, prefix } => {
                debug_assert!(self.seqs[*seq as usize].resident.is_empty());
                let cells = self.alloc_cells(prefix);
                self.seqs[*seq as usize].resident = cells;
                self.seqs[*seq as usize].adapters = 0;
                self.raise_floor(*seq);
            }
            KvOp::Release { lease, keep } => {
                if !keep {
                    self.drop_cells(lease.seq_id, 0);
                }
                self.seqs[lease.seq_id as usize].leased = false;
                self.touch(lease.seq_id);
            }
            KvOp::ClearAll => debug_assert_eq!(self.cells_used(), 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_cells_are_counted_once_and_freed_with_their_last_holder() {
        let mut m = KvMirror::new(3, 100);
        m.apply(&KvOp::Lease {
            seq: 0,
            context_key: None,
            adapters: 0,
        });
        m.record(0, &[1, 2, 3, 4]);
        m.apply(&KvOp::Share {
            src: 0,
            dst: 1,
            len: 3,
        });
        assert_eq!(m.cells_used(), 4);
        assert_eq!(m.freed_by_truncating(0, 0), 1);
        m.apply(&KvOp::Truncate { seq: 0, from: 0 });
        assert_eq!(m.cells_used(), 3);
        assert_eq!(m.resident_tokens(1), vec![1, 2, 3]);
        m.apply(&KvOp::Evict {
            seq: 1,
            snapshot: false,
        });
        assert_eq!(m.cells_used(), 0);
    }

    #[test]
    fn a_sequences_own_cells_are_the_suffix_after_what_others_share() {
        let mut m = KvMirror::new(3, 100);
        m.record(0, &[1, 2, 3, 4, 5, 6]);
        m.apply(&KvOp::Share {
            src: 0,
            dst: 1,
            len: 4,
        });
        m.record(1, &[7, 8, 9]);
        m.apply(&KvOp::Share {
            src: 1,
            dst: 2,
            len: 6,
        });
        // Seq 0: 4 shared, 2 own; seq 1: 6 shared (4 three ways), 1 own.
        for (seq, own) in [(0, 2), (1, 1), (2, 0)] {
            assert_eq!(m.freed_by_truncating(seq, 0), own);
            assert!(m.holds_own_cells(seq, own));
            assert!(!m.holds_own_cells(seq, own + 1), "seq {seq}");
        }
        // Once its sharers go, the whole sequence is its own.
        m.apply(&KvOp::Truncate { seq: 1, from: 0 });
        m.apply(&KvOp::Truncate { seq: 2, from: 0 });
        assert!(m.holds_own_cells(0, 6));
        assert!(!m.holds_own_cells(0, 7));
    }

    #[test]
    fn sliding_window_sequences_offer_only_prefixes_the_window_kept() {
        let lease = |m: &mut KvMirror, seq| {
            m.apply(&KvOp::Lease {
                seq,
                context_key: None,
                adapters: 0,
            })
        };
        let mut m = KvMirror::new(3, 100).with_swa_window(Some(4));
        lease(&mut m, 0);
        // Shorter than the window: every prefix is whole.
        m.record(0, &[1, 2, 3]);
        assert_eq!(m.usable_prefix(0, 2), 2);
        m.apply(&KvOp::Truncate { seq: 0, from: 1 });
        m.record(0, &[2, 3, 4, 5, 6, 7, 8, 9]);
        // Grown past it: only a continuation of everything it held.
        assert_eq!(m.resident_len(0), 9);
        assert_eq!(m.usable_prefix(0, 9), 9);
        assert_eq!(m.usable_prefix(0, 8), 0);
        assert_eq!(m.usable_prefix(0, 2), 0);
        assert_eq!(
            m.longest_resident_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], None, 9, 0),
            Some((0, 9))
        );
        assert_eq!(
            m.longest_resident_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 9], None, 8, 0),
            None
        );
        // A truncated sequence keeps its floor: its cut prefix stays unusable.
        m.apply(&KvOp::Truncate { seq: 0, from: 5 });
        assert_eq!(m.usable_prefix(0, 5), 0);
        // Shared cells carry the source's floor; a whole share continues.
        m.record(0, &[6, 7, 8, 9]);
        m.apply(&KvOp::Share {
            src: 0,
            dst: 1,
            len: 9,
        });
        assert_eq!(m.usable_prefix(1, 9), 9);
        // Emptied, a sequence starts clean.
        m.apply(&KvOp::Evict {
            seq: 0,
            snapshot: false,
        });
        m.record(0, &[1, 2]);
        assert_eq!(m.usable_prefix(0, 1), 1);
        // Without a window every prefix is usable.
        let mut plain = KvMirror::new(1, 100);
        lease(&mut plain, 0);
        plain.record(0, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(plain.usable_prefix(0, 2), 2);
    }

    #[test]
    fn a_released_lease_goes_stale_and_the_next_lease_is_predicted() {
        let mut m = KvMirror::new(1, 10);
        let want = m.next_lease(0);
        m.apply(&KvOp::Lease {
            seq: 0,
            context_key: Some("k".into()),
            adapters: 0,
        });
        assert!(m.check(want).is_ok());
        m.record(0, &[7]);
        m.apply(&KvOp::Release {
            lease: want,
            keep: true,
        });
        assert!(m.check(want).is_err());
        assert_eq!(m.resident_len(0), 1, "kept as a prefix candidate");
        assert_eq!(m.eviction_victim(&[]), Some(0));
        assert_eq!(m.eviction_victim(&[0]), None);
    }
}
