//! KV bookkeeping: sequence leases, the mirror of what each sequence holds,
//! prefix matching and sharing between sequences, and prefix snapshots.
//!
//! Every KV operation goes through this module, which updates its mirror in the
//! same call, so the mirror always equals what the backend holds. Cells are
//! tracked by identity: a prefix shared into another sequence is the same cells
//! (llama.cpp's unified KV cache tags cells with sequence ids), which makes the
//! count of used cells exact.

mod snapshot;

pub use snapshot::{SnapshotStore, SpillHeader};

use std::collections::HashMap;

use crate::config::{CacheConfig, CacheMode};
use crate::runtime::{Backend, SeqId, Token};

/// A sequence lease: the right to write one KV sequence. The generation makes a
/// stale lease (kept after release) unable to touch the sequence's next holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeqLease {
    /// The sequence.
    pub seq_id: SeqId,
    /// Bumped every time the sequence is leased.
    pub lease_generation: u64,
}

/// Where a new request's reused prefix comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheCandidate {
    /// Nothing is reused.
    None,
    /// The leased sequence already held the prefix (live-slot reuse).
    SameSequence,
    /// The prefix was shared from another sequence's cells.
    SharedFrom(SeqId),
    /// The prefix was restored from a snapshot.
    Snapshot,
}

/// What admission decided about a request's KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheAdmission {
    /// The lease.
    pub lease: SeqLease,
    /// Where the reused prefix came from.
    pub cache_candidate: CacheCandidate,
    /// Whether the sequence had to be cleared (fully or past the prefix).
    pub requires_kv_clear: bool,
    /// Prompt tokens already resident (not to be computed).
    pub reused_tokens: usize,
}

/// Counters of prefix reuse and snapshots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Admissions that reused at least one token.
    pub prefix_hits: u64,
    /// Prompt tokens reused instead of computed.
    pub reused_tokens: u64,
    /// Snapshots saved.
    pub snapshot_saves: u64,
    /// Snapshots restored.
    pub snapshot_restores: u64,
    /// Bytes of snapshots saved.
    pub snapshot_bytes_saved: u64,
    /// Bytes of snapshots restored.
    pub snapshot_bytes_restored: u64,
    /// Snapshot files refused (wrong model, size or hash).
    pub snapshot_files_rejected: u64,
    /// Idle sequences evicted.
    pub evictions: u64,
}

type CellId = u64;

#[derive(Debug, Default)]
struct SequenceEntry {
    /// The mirror: tokens resident in this sequence, with the cell holding each.
    resident: Vec<(Token, CellId)>,
    lease_generation: u64,
    leased: bool,
    last_used: u64,
    context_key: Option<String>,
}

impl SequenceEntry {
    /// Lower is evicted first: sequences without a context key (no session
    /// expects to continue them), then the least recently used.
    fn eviction_rank(&self) -> (bool, u64) {
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

/// The KV sequences of one context and what they hold.
#[derive(Debug)]
pub struct KvSessions {
    seqs: Vec<SequenceEntry>,
    mode: CacheMode,
    min_prefix: usize,
    n_ctx: u32,
    next_cell: CellId,
    cell_refs: HashMap<CellId, u32>,
    tick: u64,
    snapshots: SnapshotStore,
    stats: CacheStats,
}

fn common_prefix(a: &[(Token, CellId)], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|((x, _), y)| x == *y).count()
}

impl KvSessions {
    /// Bookkeeping for `n_seq` sequences on a KV cache of `n_ctx` cells.
    pub fn new(n_seq: u32, n_ctx: u32, cache: &CacheConfig, model_fingerprint: &str) -> Self {
        let mut stats = CacheStats::default();
        let snapshots = SnapshotStore::new(cache, model_fingerprint, &mut stats);
        Self {
            seqs: (0..n_seq).map(|_| SequenceEntry::default()).collect(),
            mode: cache.mode,
            min_prefix: cache.min_prefix_tokens.max(1) as usize,
            n_ctx,
            next_cell: 0,
            cell_refs: HashMap::new(),
            tick: 0,
            snapshots,
            stats,
        }
    }

    /// The cache mode.
    pub fn mode(&self) -> CacheMode {
        self.mode
    }

    /// Counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
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

    /// Snapshots in memory and their bytes.
    pub fn snapshot_usage(&self) -> (usize, u64) {
        self.snapshots.usage()
    }

    /// Leases currently held.
    pub fn leased_count(&self) -> usize {
        self.seqs.iter().filter(|s| s.leased).count()
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

    fn touch(&mut self, seq: SeqId) {
        self.tick += 1;
        self.seqs[seq as usize].last_used = self.tick;
    }

    fn drop_cells(&mut self, seq: SeqId, from: usize) {
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

    fn truncate_raw<B: Backend>(&mut self, kv: &mut B, seq: SeqId, from: usize) {
        if self.seqs[seq as usize].resident.len() > from {
            kv.kv_truncate(seq, from as u32);
            self.drop_cells(seq, from);
        }
    }

    fn share_raw<B: Backend>(&mut self, kv: &mut B, src: SeqId, dst: SeqId, len: usize) {
        debug_assert!(self.seqs[dst as usize].resident.is_empty());
        kv.kv_share_prefix(src, dst, len as u32);
        let prefix: Vec<(Token, CellId)> = self.seqs[src as usize].resident[..len].to_vec();
        for (_, c) in &prefix {
            *self.cell_refs.entry(*c).or_insert(0) += 1;
        }
        self.seqs[dst as usize].resident = prefix;
    }

    fn restore_raw<B: Backend>(
        &mut self,
        kv: &mut B,
        seq: SeqId,
        tokens: &[Token],
        state: &[u8],
    ) -> bool {
        debug_assert!(self.seqs[seq as usize].resident.is_empty());
        if self.cells_free() < tokens.len() as u32 {
            return false;
        }
        if let Err(e) = kv.seq_state_restore(seq, state) {
            tracing::warn!("snapshot restore failed: {e}");
            return false;
        }
        let cells = self.alloc_cells(tokens);
        self.seqs[seq as usize].resident = cells;
        self.stats.snapshot_restores += 1;
        self.stats.snapshot_bytes_restored += state.len() as u64;
        true
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

    /// Saves a snapshot of an idle sequence (when worth it) and clears it.
    fn evict<B: Backend>(&mut self, kv: &mut B, seq: SeqId) {
        let len = self.seqs[seq as usize].resident.len();
        if len == 0 {
            return;
        }
        if self.mode == CacheMode::SharedPrefix
            && len >= self.min_prefix
            && self.snapshots.enabled()
        {
            let tokens = self.resident_tokens(seq);
            if !self.snapshots.covers(&tokens) {
                let state = kv.seq_state_save(seq);
                self.stats.snapshot_saves += 1;
                self.stats.snapshot_bytes_saved += state.len() as u64;
                self.snapshots.insert(tokens, state, &mut self.stats);
            }
        }
        self.truncate_raw(kv, seq, 0);
        self.seqs[seq as usize].context_key = None;
        self.stats.evictions += 1;
    }

    /// Evicts the least recently used idle sequence that holds tokens.
    /// Returns false when there is none.
    pub fn evict_idle_lru<B: Backend>(&mut self, kv: &mut B) -> bool {
        let victim = self
            .seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.leased && !s.resident.is_empty())
            .min_by_key(|(_, s)| s.eviction_rank())
            .map(|(i, _)| i as SeqId);
        match victim {
            Some(seq) => {
                self.evict(kv, seq);
                true
            }
            None => false,
        }
    }

    /// The longest prefix of `prompt` resident in any sequence other than
    /// `except`: (sequence, length).
    pub fn longest_resident_prefix(
        &self,
        prompt: &[Token],
        except: Option<SeqId>,
    ) -> Option<(SeqId, usize)> {
        self.seqs
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i as SeqId) != except)
            .map(|(i, s)| (i as SeqId, common_prefix(&s.resident, prompt)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))
    }

    fn lease(&mut self, seq: SeqId, context_key: Option<&str>) -> SeqLease {
        let e = &mut self.seqs[seq as usize];
        e.leased = true;
        e.lease_generation += 1;
        if context_key.is_some() {
            e.context_key = context_key.map(str::to_string);
        }
        let lease = SeqLease {
            seq_id: seq,
            lease_generation: e.lease_generation,
        };
        self.touch(seq);
        lease
    }

    /// Leases a sequence for a prompt and brings as much of the prompt's prefix
    /// into it as the cache holds. At least the last prompt token is always left
    /// to compute (its logits are needed). `reserve` cells are kept free for
    /// prompts already admitted. Returns `None` when every sequence is leased,
    /// or when the prompt's remaining tokens do not fit in free KV cells even
    /// after evicting idle sequences.
    pub fn acquire<B: Backend>(
        &mut self,
        kv: &mut B,
        prompt: &[Token],
        context_key: Option<&str>,
        use_cache: bool,
        reserve: u32,
    ) -> Option<KvCacheAdmission> {
        let mode = if use_cache { self.mode } else { CacheMode::Off };
        let cap = prompt.len().saturating_sub(1);
        let unleased: Vec<SeqId> = (0..self.seqs.len() as SeqId)
            .filter(|&s| !self.seqs[s as usize].leased)
            .collect();
        if unleased.is_empty() {
            return None;
        }
        // Best idle sequence to continue in place (ties go to the context key).
        let idle_best = unleased
            .iter()
            .map(|&s| {
                let e = &self.seqs[s as usize];
                let keyed = context_key.is_some() && e.context_key.as_deref() == context_key;
                (s, common_prefix(&e.resident, prompt).min(cap), keyed)
            })
            .max_by_key(|&(s, n, keyed)| (n, keyed, std::cmp::Reverse(s)));
        let any_best = self
            .longest_resident_prefix(prompt, None)
            .map(|(s, n)| (s, n.min(cap)));
        let snap_best = if mode == CacheMode::SharedPrefix {
            self.snapshots
                .best_match(prompt)
                .map(|(id, n)| (id, n.min(cap)))
        } else {
            None
        };

        let empty = unleased
            .iter()
            .copied()
            .filter(|&s| self.seqs[s as usize].resident.is_empty())
            .min();
        // A fresh sequence: an empty one, else the least recently used idle one.
        let fresh_victim = || {
            unleased
                .iter()
                .copied()
                .min_by_key(|&s| self.seqs[s as usize].eviction_rank())
                .expect("unleased is not empty")
        };

        let (seq, candidate, reused) = match mode {
            CacheMode::Off => (empty.unwrap_or_else(fresh_victim), CacheCandidate::None, 0),
            CacheMode::LiveSlotPrefix | CacheMode::SharedPrefix => {
                let (idle_seq, idle_n, _) = idle_best.unwrap_or((unleased[0], 0, false));
                let idle_useful = idle_n >= self.min_prefix;
                let shared_mode = mode == CacheMode::SharedPrefix;
                let other = any_best.filter(|&(s, n)| {
                    shared_mode && n >= self.min_prefix && n > idle_n && s != idle_seq
                });
                let snap = snap_best.filter(|&(_, n)| {
                    n >= self.min_prefix && n > idle_n.max(other.map_or(0, |o| o.1))
                });
                if let Some((_, n)) = snap {
                    let seq = empty.unwrap_or_else(fresh_victim);
                    (seq, CacheCandidate::Snapshot, n)
                } else if let Some((src, n)) = other {
                    let seq = empty.unwrap_or_else(fresh_victim);
                    (seq, CacheCandidate::SharedFrom(src), n)
                } else if idle_useful {
                    let idle_len = self.seqs[idle_seq as usize].resident.len();
                    // Keep a longer history intact for others by sharing its prefix
                    // into an empty sequence, when one exists.
                    match empty.filter(|_| shared_mode && idle_len > idle_n) {
                        Some(e) => (e, CacheCandidate::SharedFrom(idle_seq), idle_n),
                        None => (idle_seq, CacheCandidate::SameSequence, idle_n),
                    }
                } else {
                    (empty.unwrap_or_else(fresh_victim), CacheCandidate::None, 0)
                }
            }
        };
        let (mut seq, mut candidate, mut reused) = (seq, candidate, reused);
        // Room check before touching anything: the tokens still to compute must
        // fit, counting what clearing the chosen sequence frees. Idle sequences
        // go first; then the reuse plan is given up step by step.
        loop {
            let need = (prompt.len() - reused) as u32 + reserve;
            if self.cells_free() + self.freed_by_clearing(seq, reused, &candidate) >= need {
                break;
            }
            let keep_src = match candidate {
                CacheCandidate::SharedFrom(s) => Some(s),
                _ => None,
            };
            let victim = self
                .seqs
                .iter()
                .enumerate()
                .filter(|(i, s)| {
                    let i = *i as SeqId;
                    !s.leased && !s.resident.is_empty() && i != seq && Some(i) != keep_src
                })
                .min_by_key(|(_, s)| s.eviction_rank())
                .map(|(i, _)| i as SeqId);
            if let Some(v) = victim {
                self.evict(kv, v);
                continue;
            }
            match candidate {
                // Continue in the idle source itself: truncating its tail frees cells.
                CacheCandidate::SharedFrom(src) if !self.seqs[src as usize].leased => {
                    seq = src;
                    candidate = CacheCandidate::SameSequence;
                }
                CacheCandidate::None => return None,
                _ => {
                    candidate = CacheCandidate::None;
                    reused = 0;
                }
            }
        }
        let cleared = {
            let len = self.seqs[seq as usize].resident.len();
            match candidate {
                CacheCandidate::SameSequence => len > reused,
                _ => len > 0,
            }
        };

        let lease = self.lease(seq, context_key);
        let mut reused_tokens = reused;
        let mut candidate = candidate;
        match &candidate {
            CacheCandidate::None => {
                if !self.seqs[seq as usize].resident.is_empty() {
                    self.evict(kv, seq);
                }
            }
            CacheCandidate::SameSequence => self.truncate_raw(kv, seq, reused),
            CacheCandidate::SharedFrom(src) => {
                let src = *src;
                if !self.seqs[seq as usize].resident.is_empty() {
                    self.evict(kv, seq);
                }
                self.share_raw(kv, src, seq, reused);
            }
            CacheCandidate::Snapshot => {
                if !self.seqs[seq as usize].resident.is_empty() {
                    self.evict(kv, seq);
                }
                // Evicting the sequence above may have pushed snapshots out of
                // the LRU, so what is restored is matched against the prompt again.
                let restored = match self.snapshots.take_for(prompt, &mut self.stats) {
                    Some((tokens, state)) if self.restore_raw(kv, seq, &tokens, &state) => Some(
                        tokens
                            .iter()
                            .zip(prompt)
                            .take_while(|(a, b)| a == b)
                            .count()
                            .min(cap),
                    ),
                    _ => None,
                };
                if let Some(n) = restored {
                    self.truncate_raw(kv, seq, n);
                    reused_tokens = n;
                } else {
                    candidate = CacheCandidate::None;
                    reused_tokens = 0;
                }
            }
        }
        if reused_tokens > 0 {
            self.stats.prefix_hits += 1;
            self.stats.reused_tokens += reused_tokens as u64;
        }
        debug_assert_eq!(self.seqs[seq as usize].resident.len(), reused_tokens);
        tracing::debug!(
            seq,
            ?candidate,
            reused_tokens,
            prompt_tokens = prompt.len(),
            "KV admission"
        );
        Some(KvCacheAdmission {
            lease,
            cache_candidate: candidate,
            requires_kv_clear: cleared,
            reused_tokens,
        })
    }

    /// Cells that clearing `seq` down to `keep` tokens would free (cells shared
    /// with other sequences stay).
    fn freed_by_clearing(&self, seq: SeqId, keep: usize, candidate: &CacheCandidate) -> u32 {
        let keep = match candidate {
            CacheCandidate::SameSequence => keep,
            _ => 0,
        };
        self.seqs[seq as usize]
            .resident
            .iter()
            .skip(keep)
            .filter(|(_, c)| self.cell_refs.get(c) == Some(&1))
            .count() as u32
    }

    /// Records tokens the backend just wrote at the end of a leased sequence.
    pub fn record_decoded(&mut self, lease: SeqLease, tokens: &[Token]) -> Result<(), StaleLease> {
        self.check(lease)?;
        let cells = self.alloc_cells(tokens);
        self.seqs[lease.seq_id as usize].resident.extend(cells);
        self.touch(lease.seq_id);
        Ok(())
    }

    /// Removes positions `from..` of a leased sequence.
    pub fn truncate<B: Backend>(
        &mut self,
        kv: &mut B,
        lease: SeqLease,
        from: usize,
    ) -> Result<(), StaleLease> {
        self.check(lease)?;
        self.truncate_raw(kv, lease.seq_id, from);
        Ok(())
    }

    /// Replaces a leased sequence's content with the first `len` tokens of
    /// `src` (which must hold them), sharing their cells.
    pub fn share_into<B: Backend>(
        &mut self,
        kv: &mut B,
        lease: SeqLease,
        src: SeqId,
        len: usize,
    ) -> Result<(), StaleLease> {
        self.check(lease)?;
        assert!(
            self.seqs[src as usize].resident.len() >= len,
            "source holds fewer tokens than shared"
        );
        self.truncate_raw(kv, lease.seq_id, 0);
        self.share_raw(kv, src, lease.seq_id, len);
        self.stats.reused_tokens += len as u64;
        Ok(())
    }

    /// Ends a lease. With `keep`, the sequence's tokens stay as a prefix
    /// candidate for later requests; otherwise they are cleared.
    pub fn release<B: Backend>(
        &mut self,
        kv: &mut B,
        lease: SeqLease,
        keep: bool,
    ) -> Result<(), StaleLease> {
        self.check(lease)?;
        if !keep || self.mode == CacheMode::Off {
            self.truncate_raw(kv, lease.seq_id, 0);
        }
        let e = &mut self.seqs[lease.seq_id as usize];
        e.leased = false;
        self.touch(lease.seq_id);
        Ok(())
    }

    /// Clears every idle sequence (snapshotting them) and returns how many cells
    /// are still used: by leased sequences only.
    pub fn evict_all_idle<B: Backend>(&mut self, kv: &mut B) -> u32 {
        while self.evict_idle_lru(kv) {}
        self.cells_used()
    }
}
