//! Choosing where a new request's KV comes from: a pure decision over the
//! mirror and the snapshot index. It returns the lease and the [`KvOp`]s that
//! bring the reused prefix into place; the executor carries them out.

use crate::config::CacheMode;
use crate::runtime::{SeqId, Token};

use super::mirror::{common_prefix, KvMirror, KvOp};
use super::{SeqLease, SnapshotStore};

/// Where a new request's reused prefix comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// Nothing is reused: the prompt is computed from scratch.
    Cold,
    /// The leased sequence already holds the prefix (live-slot reuse).
    SameSequence,
    /// The prefix is shared from another sequence's cells.
    SharedFrom(SeqId),
    /// The prefix is restored from a snapshot.
    Snapshot,
}

/// The cache settings the decision follows.
#[derive(Debug, Clone, Copy)]
pub struct ReusePolicy {
    /// The cache mode.
    pub mode: CacheMode,
    /// Shortest prefix worth reusing.
    pub min_prefix: usize,
    /// Whether evicted sequences are snapshotted.
    pub snapshots: bool,
}

impl ReusePolicy {
    /// Whether evicting a sequence of `len` tokens saves a snapshot.
    pub fn snapshot_on_evict(&self, len: usize) -> bool {
        self.snapshots && self.mode == CacheMode::SharedPrefix && len >= self.min_prefix
    }
}

/// An admission's KV decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquired {
    /// The lease the request holds.
    pub lease: SeqLease,
    /// Where the reused prefix comes from.
    pub reuse: Reuse,
    /// Prompt tokens already resident (not to be computed).
    pub reused_tokens: usize,
    /// What the executor does, in order.
    pub ops: Vec<KvOp>,
}

/// What a request asks of the cache.
#[derive(Debug, Clone, Copy)]
pub struct AcquireAsk<'a> {
    /// The prompt.
    pub prompt: &'a [Token],
    /// Session affinity key.
    pub context_key: Option<&'a str>,
    /// The key of its LoRA adapter set (0: none): only KV computed under
    /// the same set is reused.
    pub adapters: u64,
    /// Reuse cached KV.
    pub use_cache: bool,
    /// Cells to keep free for prompts admitted before this one.
    pub reserve: u32,
}

/// Leases a sequence for a prompt and brings as much of its prefix into it as
/// the cache holds; at least the last prompt token is left to compute (its
/// logits are needed). The decision is applied to `kv` (the planning copy)
/// as it is made. Returns `None`, leaving `kv` as it was, when every sequence
/// is leased, or when the prompt does not fit in free cells even after
/// evicting idle sequences.
pub fn plan_acquire(
    kv: &mut KvMirror,
    snapshots: &SnapshotStore,
    policy: &ReusePolicy,
    ask: AcquireAsk<'_>,
) -> Option<Acquired> {
    // Evictions to make room are tried on a copy: when the prompt does not
    // fit even so, nothing is evicted for it.
    let mut trial = kv.clone();
    let (seq, reuse, reused, mut ops) = choose_fitting(&mut trial, snapshots, policy, ask)?;
    *kv = trial;
    let lease = kv.next_lease(seq);
    let lease_op = KvOp::Lease {
        seq,
        context_key: ask.context_key.map(str::to_string),
        adapters: ask.adapters,
    };
    kv.apply(&lease_op);
    ops.push(lease_op);
    let resident = kv.resident_len(seq);
    let mut push = |kv: &mut KvMirror, op: KvOp| {
        kv.apply(&op);
        ops.push(op);
    };
    let evict = |seq| KvOp::Evict {
        seq,
        snapshot: policy.snapshot_on_evict(resident),
    };
    match reuse {
        Reuse::Cold if resident > 0 => push(kv, evict(seq)),
        Reuse::Cold => {}
        Reuse::SameSequence if resident > reused => push(kv, KvOp::Truncate { seq, from: reused }),
        Reuse::SameSequence => {}
        Reuse::SharedFrom(src) => {
            if resident > 0 {
                push(kv, evict(seq));
            }
            push(
                kv,
                KvOp::Share {
                    src,
                    dst: seq,
                    len: reused,
                },
            );
        }
        Reuse::Snapshot => {
            if resident > 0 {
                push(kv, evict(seq));
            }
            let prefix = ask.prompt[..reused].to_vec();
            push(kv, KvOp::Restore { seq, prefix });
        }
    }
    Some(Acquired {
        lease,
        reuse,
        reused_tokens: reused,
        ops,
    })
}

/// The best candidate, then given up step by step until the prompt fits:
/// idle sequences are evicted first (their ops returned), then the reuse.
fn choose_fitting(
    kv: &mut KvMirror,
    snapshots: &SnapshotStore,
    policy: &ReusePolicy,
    ask: AcquireAsk<'_>,
) -> Option<(SeqId, Reuse, usize, Vec<KvOp>)> {
    let (mut seq, mut reuse, mut reused) = choose(kv, snapshots, policy, ask)?;
    let mut ops = Vec::new();
    loop {
        let need = (ask.prompt.len() - reused) as u32 + ask.reserve;
        let keep = if reuse == Reuse::SameSequence {
            reused
        } else {
            0
        };
        if kv.cells_free() + kv.freed_by_truncating(seq, keep) >= need {
            return Some((seq, reuse, reused, ops));
        }
        let mut spare = vec![seq];
        if let Reuse::SharedFrom(s) = reuse {
            spare.push(s);
        }
        if let Some(v) = kv.eviction_victim(&spare) {
            let op = KvOp::Evict {
                seq: v,
                snapshot: policy.snapshot_on_evict(kv.resident_len(v)),
            };
            kv.apply(&op);
            ops.push(op);
            continue;
        }
        match reuse {
            // Continue in the idle source itself: truncating its tail frees cells.
            Reuse::SharedFrom(src) if !kv.is_leased(src) => {
                seq = src;
                reuse = Reuse::SameSequence;
            }
            Reuse::Cold => return None,
            _ => {
                reuse = Reuse::Cold;
                reused = 0;
            }
        }
    }
}

/// The reuse the cache offers, before checking room.
fn choose(
    kv: &KvMirror,
    snapshots: &SnapshotStore,
    policy: &ReusePolicy,
    ask: AcquireAsk<'_>,
) -> Option<(SeqId, Reuse, usize)> {
    let prompt = ask.prompt;
    let mode = if ask.use_cache {
        policy.mode
    } else {
        CacheMode::Off
    };
    let cap = prompt.len().saturating_sub(1);
    let unleased: Vec<SeqId> = (0..kv.n_seq() as SeqId)
        .filter(|&s| !kv.is_leased(s))
        .collect();
    let empty = unleased
        .iter()
        .copied()
        .filter(|&s| kv.resident_len(s) == 0)
        .min();
    // A fresh sequence: an empty one, else the least recently used idle one.
    let fresh = empty.or_else(|| {
        unleased
            .iter()
            .copied()
            .min_by_key(|&s| kv.seqs[s as usize].eviction_rank())
    })?;
    if mode == CacheMode::Off {
        return Some((fresh, Reuse::Cold, 0));
    }
    // Best idle sequence to continue in place (ties go to the context key).
    let (idle_seq, idle_n) = unleased
        .iter()
        .map(|&s| {
            let e = &kv.seqs[s as usize];
            let keyed = ask.context_key.is_some() && e.context_key.as_deref() == ask.context_key;
            let n = if e.adapters == ask.adapters {
                common_prefix(&e.resident, prompt).min(cap)
            } else {
                0
            };
            (s, kv.usable_prefix(s, n), keyed)
        })
        .max_by_key(|&(s, n, keyed)| (n, keyed, std::cmp::Reverse(s)))
        .map(|(s, n, _)| (s, n))
        .unwrap_or((unleased[0], 0));
    let shared_mode = mode == CacheMode::SharedPrefix;
    let other = kv
        .longest_resident_prefix(prompt, None, cap, ask.adapters)
        .filter(|&(s, n)| shared_mode && n >= policy.min_prefix && n > idle_n && s != idle_seq);
    // Snapshots hold KV of the base model only.
    let snap = (shared_mode && policy.snapshots && ask.adapters == 0)
        .then(|| snapshots.best_match(prompt))
        .flatten()
        .map(|(_, n)| n.min(cap))
        .filter(|&n| n >= policy.min_prefix && n > idle_n.max(other.map_or(0, |o| o.1)));
    if let Some(n) = snap {
        return Some((fresh, Reuse::Snapshot, n));
    }
    if let Some((src, n)) = other {
        return Some((fresh, Reuse::SharedFrom(src), n));
    }
    // A prefix shorter than `min_prefix` is not worth a sequence, except a
    // whole prompt (all but its last token, short prompts repeated): that
    // costs nothing to reuse and saves the whole prefill.
    let whole_prompt = idle_n > 0 && idle_n == cap;
    if idle_n < policy.min_prefix && !whole_prompt {
        return Some((fresh, Reuse::Cold, 0));
    }
    // Keep a longer history intact for others by sharing its prefix into an
    // empty sequence, when one exists.
    match empty.filter(|_| shared_mode && kv.resident_len(idle_seq) > idle_n) {
        Some(e) => Some((e, Reuse::SharedFrom(idle_seq), idle_n)),
        None => Some((idle_seq, Reuse::SameSequence, idle_n)),
    }
}
