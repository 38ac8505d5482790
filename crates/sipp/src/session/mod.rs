//! KV bookkeeping: sequence leases, the mirror of what each sequence holds,
//! the choice of a reused prefix, and prefix snapshots.
//!
//! Decisions are pure: [`plan_acquire`] and the scheduler work on a copy of
//! the [`KvMirror`] and return [`KvOp`]s. [`KvSessions::apply`] carries one out
//! on the backend and updates the mirror in the same call, so the mirror
//! always equals what the backend holds.

mod mirror;
mod reuse;
mod slot_file;
mod snapshot;

pub use mirror::{KvMirror, KvOp, StaleLease};
pub use reuse::{plan_acquire, AcquireAsk, Acquired, Reuse, ReusePolicy};
pub use slot_file::{read_slot_file, write_slot_file, RestoreError, SlotFile, SlotFileError};
pub use snapshot::{SnapshotStore, SpillHeader};

use std::borrow::Cow;
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
    /// Idle sequences parked in the snapshot store while others computed.
    pub parks: u64,
}

/// The KV sequences of one context: the mirror, the snapshots and counters.
#[derive(Debug)]
pub struct KvSessions {
    mirror: KvMirror,
    policy: ReusePolicy,
    snapshots: SnapshotStore,
    stats: CacheStats,
    /// `[cache] park_idle`.
    park_idle: bool,
    /// `[cache] park_min_cells`.
    park_min_cells: u32,
    /// Snapshot bytes per token, from the latest save (`None` before one).
    bytes_per_token: Option<u64>,
    /// The tokens of parked sequences; an entry goes when its sequence is
    /// leased again or a slot file is restored into it.
    parked: HashMap<SeqId, Vec<Token>>,
}

impl KvSessions {
    /// Bookkeeping for `n_seq` sequences on a KV cache of `n_ctx` cells, for
    /// a model whose sliding-window layers (if any) have window `swa_window`.
    /// Such a model takes no snapshots: llama.cpp saves only the positions
    /// its window still sees.
    pub fn new(
        n_seq: u32,
        n_ctx: u32,
        cache: &CacheConfig,
        model_fingerprint: &str,
        swa_window: Option<u32>,
    ) -> Self {
        let mut stats = CacheStats::default();
        let snapshots = SnapshotStore::new(cache, model_fingerprint, &mut stats);
        Self {
            mirror: KvMirror::new(n_seq, n_ctx).with_swa_window(swa_window.map(|w| w as usize)),
            policy: ReusePolicy {
                mode: cache.mode,
                min_prefix: cache.min_prefix_tokens.max(1) as usize,
                snapshots: snapshots.enabled() && swa_window.is_none(),
            },
            snapshots,
            stats,
            park_idle: cache.park_idle,
            park_min_cells: cache.park_min_cells.max(1),
            bytes_per_token: None,
            parked: HashMap::new(),
        }
    }

    /// Whether to park the idle sequence `seq` of `m` (the plan's copy of the
    /// mirror) now: the cache keeps snapshots in memory, the sequence holds
    /// at least `park_min_cells` cells no other sequence shares, it is no
    /// session's (a `context_key` pins it to the live cache) and holds no
    /// LoRA-computed KV (never snapshotted), and its snapshot would take at
    /// most a quarter of the store, so parking never flushes the store for
    /// one prefix.
    pub fn worth_parking(&self, m: &KvMirror, seq: SeqId) -> bool {
        let budget = self.snapshots.memory_budget();
        let e = &m.seqs[seq as usize];
        self.park_idle
            && self.policy.snapshots
            && self.policy.mode == CacheMode::SharedPrefix
            && budget > 0
            && !e.leased
            && e.context_key.is_none()
            && e.adapters == 0
            && e.resident.len() >= self.policy.min_prefix
            && self
                .bytes_per_token
                .is_none_or(|b| b.saturating_mul(e.resident.len() as u64) <= budget / 4)
            && m.holds_own_cells(seq, self.park_min_cells)
    }

    /// The tokens a parked sequence held, while it is still the same idle
    /// sequence (not leased since, nothing put back into it).
    pub fn parked_tokens(&self, seq: SeqId) -> Option<&[Token]> {
        self.parked.get(&seq).map(Vec::as_slice)
    }

    /// The mirror (plans work on a copy of it).
    pub fn mirror(&self) -> &KvMirror {
        &self.mirror
    }

    /// The snapshot index.
    pub fn snapshots(&self) -> &SnapshotStore {
        &self.snapshots
    }

    /// The reuse policy.
    pub fn policy(&self) -> &ReusePolicy {
        &self.policy
    }

    /// The cache mode.
    pub fn mode(&self) -> CacheMode {
        self.policy.mode
    }

    /// Counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Number of sequences.
    pub fn n_seq(&self) -> usize {
        self.mirror.n_seq()
    }

    /// Cells in use: distinct cells held by any sequence.
    pub fn cells_used(&self) -> u32 {
        self.mirror.cells_used()
    }

    /// Cells free.
    pub fn cells_free(&self) -> u32 {
        self.mirror.cells_free()
    }

    /// Snapshots in memory and their bytes.
    pub fn snapshot_usage(&self) -> (usize, u64) {
        self.snapshots.usage()
    }

    /// Leases currently held.
    pub fn leased_count(&self) -> usize {
        self.mirror.leased_count()
    }

    /// The tokens a sequence holds, by position.
    pub fn resident_tokens(&self, seq: SeqId) -> Vec<Token> {
        self.mirror.resident_tokens(seq)
    }

    /// How many tokens a sequence holds.
    pub fn resident_len(&self, seq: SeqId) -> usize {
        self.mirror.resident_len(seq)
    }

    /// Whether the lease is current.
    pub fn check(&self, lease: SeqLease) -> Result<(), StaleLease> {
        self.mirror.check(lease)
    }

    /// Counts an admission's reuse (after its ops ran).
    pub fn count_reuse(&mut self, reused_tokens: usize) {
        if reused_tokens > 0 {
            self.stats.prefix_hits += 1;
            self.stats.reused_tokens += reused_tokens as u64;
        }
    }

    /// Counts tokens shared into a waiting or resumed slot.
    pub fn count_shared(&mut self, tokens: usize) {
        self.stats.reused_tokens += tokens as u64;
    }

    /// Records tokens the backend just wrote at the end of a leased sequence.
    pub fn record_decoded(&mut self, lease: SeqLease, tokens: &[Token]) -> Result<(), StaleLease> {
        self.mirror.check(lease)?;
        self.mirror.record(lease.seq_id, tokens);
        Ok(())
    }

    /// Carries out one operation on the backend and the mirror. Returns how
    /// many tokens the operation's sequence holds afterwards for a `Restore`
    /// or a `Share`: fewer than planned when a snapshot is gone or fails to
    /// load, or when the source of a share came up short itself (it was
    /// restored short earlier in the same plan). `None` for other operations.
    pub fn apply<B: Backend>(&mut self, kv: &mut B, op: &KvOp) -> Option<usize> {
        let op = self.in_mode(op);
        match op.as_ref() {
            KvOp::Evict { seq, snapshot } => {
                if self.clear_sequence(kv, *seq, *snapshot) {
                    self.stats.evictions += 1;
                }
            }
            KvOp::Park { seq } => {
                let tokens = self.mirror.resident_tokens(*seq);
                if self.clear_sequence(kv, *seq, true) {
                    self.stats.parks += 1;
                    self.parked.insert(*seq, tokens);
                }
            }
            KvOp::Lease { seq, .. } => {
                self.parked.remove(seq);
            }
            KvOp::Truncate { seq, from } => {
                if self.mirror.resident_len(*seq) > *from {
                    kv.kv_truncate(*seq, *from as u32);
                }
            }
            KvOp::Share { src, dst, len } => {
                if self.mirror.resident_len(*dst) > 0 {
                    kv.kv_truncate(*dst, 0);
                }
                let len = (*len).min(self.mirror.resident_len(*src));
                kv.kv_share_prefix(*src, *dst, len as u32);
                let op = KvOp::Share {
                    src: *src,
                    dst: *dst,
                    len,
                };
                self.mirror.apply(&op);
                return Some(len);
            }
            KvOp::Restore { seq, prefix } => return Some(self.restore(kv, *seq, prefix)),
            KvOp::Release { lease, keep } => {
                if !keep && self.mirror.resident_len(lease.seq_id) > 0 {
                    kv.kv_truncate(lease.seq_id, 0);
                }
            }
            KvOp::ClearAll => kv.kv_clear(),
        }
        self.mirror.apply(&op);
        None
    }

    /// The operation as this cache's mode carries it out: with the cache off,
    /// a release keeps nothing for later requests.
    fn in_mode<'a>(&self, op: &'a KvOp) -> Cow<'a, KvOp> {
        match op {
            KvOp::Release { lease, keep: true } if self.policy.mode == CacheMode::Off => {
                Cow::Owned(KvOp::Release {
                    lease: *lease,
                    keep: false,
                })
            }
            op => Cow::Borrowed(op),
        }
    }

    /// Applies an operation to the mirror alone (scheduler unit tests, which
    /// run without a backend).
    #[cfg(test)]
    pub(crate) fn apply_to_mirror(&mut self, op: &KvOp) {
        let op = self.in_mode(op);
        self.mirror.apply(&op);
    }

    /// Clears an idle sequence from the backend, first saving a snapshot of
    /// it when `snapshot`; the mirror follows in [`Self::apply`]. Returns
    /// whether it held anything.
    fn clear_sequence<B: Backend>(&mut self, kv: &mut B, seq: SeqId, snapshot: bool) -> bool {
        self.save_snapshot(kv, seq, snapshot);
        let held = self.mirror.resident_len(seq) > 0;
        if held {
            kv.kv_truncate(seq, 0);
        }
        held
    }

    fn save_snapshot<B: Backend>(&mut self, kv: &mut B, seq: SeqId, wanted: bool) {
        // KV computed under LoRA adapters is not kept: snapshots are found
        // by tokens alone.
        if !wanted || self.mirror.resident_len(seq) == 0 || self.mirror.adapters_of(seq) != 0 {
            return;
        }
        let tokens = self.mirror.resident_tokens(seq);
        if self.snapshots.covers(&tokens) {
            return;
        }
        let state = kv.seq_state_save(seq);
        self.bytes_per_token = Some(state.len() as u64 / tokens.len() as u64);
        self.stats.snapshot_saves += 1;
        self.stats.snapshot_bytes_saved += state.len() as u64;
        self.snapshots.insert(tokens, state, &mut self.stats);
    }

    fn restore<B: Backend>(&mut self, kv: &mut B, seq: SeqId, prefix: &[Token]) -> usize {
        let Some((tokens, state)) = self.snapshots.take_for(prefix, &mut self.stats) else {
            return 0;
        };
        if self.mirror.cells_free() < tokens.len() as u32 {
            return 0;
        }
        if let Err(e) = kv.seq_state_restore(seq, &state) {
            tracing::warn!("snapshot restore failed: {e}");
            return 0;
        }
        self.stats.snapshot_restores += 1;
        self.stats.snapshot_bytes_restored += state.len() as u64;
        let n = tokens
            .iter()
            .zip(prefix)
            .take_while(|(a, b)| a == b)
            .count();
        if n < tokens.len() {
            kv.kv_truncate(seq, n as u32);
        }
        let op = KvOp::Restore {
            seq,
            prefix: tokens[..n].to_vec(),
        };
        self.mirror.apply(&op);
        n
    }
}
