//! Engine counters and gauges, written by the engine thread and read by anyone.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use crate::scheduler::{Slot, SlotPhase};

/// One slot as the last step left it (for dashboards).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlotView {
    /// Where the slot is in serving its request (`Idle` when free).
    pub phase: SlotPhase,
    /// The request it serves.
    pub request_id: Option<u64>,
    /// Its prompt tokens.
    pub prompt_tokens: usize,
    /// Of them, reused from the KV cache.
    pub cached_tokens: usize,
    /// Tokens generated so far.
    pub generated_tokens: usize,
}

impl SlotView {
    /// The view of a slot.
    pub fn of(slot: &Slot) -> Self {
        match slot.running() {
            None => SlotView {
                phase: SlotPhase::Idle,
                request_id: None,
                prompt_tokens: 0,
                cached_tokens: 0,
                generated_tokens: 0,
            },
            Some(r) => SlotView {
                phase: r.phase,
                request_id: Some(r.tokens.request_id),
                prompt_tokens: r.tokens.prompt_len,
                cached_tokens: r.counters.cached_tokens,
                generated_tokens: r.counters.generated_tokens,
            },
        }
    }
}

/// Live engine figures. Counters only grow; gauges are set every step.
#[derive(Debug, Default)]
pub struct EngineMetrics {
    pub(crate) requests_completed: AtomicU64,
    pub(crate) requests_failed: AtomicU64,
    pub(crate) requests_cancelled: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generated_tokens: AtomicU64,
    pub(crate) steps: AtomicU64,
    pub(crate) batch_rows: AtomicU64,
    pub(crate) preemptions: AtomicU64,
    pub(crate) draft_tokens: AtomicU64,
    pub(crate) draft_accepted_tokens: AtomicU64,
    pub(crate) queue_depth: AtomicU64,
    pub(crate) busy_slots: AtomicU64,
    pub(crate) leased_sequences: AtomicU64,
    pub(crate) kv_cells_used: AtomicU64,
    pub(crate) prefix_hits: AtomicU64,
    pub(crate) prefix_reused_tokens: AtomicU64,
    pub(crate) snapshot_saves: AtomicU64,
    pub(crate) snapshot_restores: AtomicU64,
    pub(crate) idle_parks: AtomicU64,
    pub(crate) snapshot_bytes_saved: AtomicU64,
    pub(crate) snapshot_bytes_restored: AtomicU64,
    pub(crate) snapshot_files_rejected: AtomicU64,
    pub(crate) snapshot_entries: AtomicU64,
    pub(crate) snapshot_bytes: AtomicU64,
    pub(crate) step_ns: AtomicU64,
    pub(crate) batch_ns: AtomicU64,
    pub(crate) images: AtomicU64,
    pub(crate) image_ns: AtomicU64,
    pub(crate) idle_checks: AtomicU64,
    pub(crate) invariant_violations: AtomicU64,
    pub(crate) slots: Mutex<Vec<SlotView>>,
}

/// A copy of the metrics at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MetricsSnapshot {
    /// Requests finished normally.
    pub requests_completed: u64,
    /// Requests failed.
    pub requests_failed: u64,
    /// Requests cancelled.
    pub requests_cancelled: u64,
    /// Prompt tokens admitted.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Rows sent to the backend.
    pub batch_rows: u64,
    /// Slots preempted for KV space.
    pub preemptions: u64,
    /// Tokens drafted by speculative decoding and verified.
    pub draft_tokens: u64,
    /// Of them, tokens accepted.
    pub draft_accepted_tokens: u64,
    /// Requests waiting for a slot.
    pub queue_depth: u64,
    /// Slots holding a request.
    pub busy_slots: u64,
    /// Sequence leases held.
    pub leased_sequences: u64,
    /// KV cells in use.
    pub kv_cells_used: u64,
    /// Admissions that reused a prefix.
    pub prefix_hits: u64,
    /// Prompt tokens reused from cache.
    pub prefix_reused_tokens: u64,
    /// Snapshots saved.
    pub snapshot_saves: u64,
    /// Snapshots restored.
    pub snapshot_restores: u64,
    /// Idle sequences parked in the snapshot store while others computed
    /// (`[cache] park_idle`).
    pub idle_parks: u64,
    /// Snapshot bytes saved.
    pub snapshot_bytes_saved: u64,
    /// Snapshot bytes restored.
    pub snapshot_bytes_restored: u64,
    /// Snapshot files refused.
    pub snapshot_files_rejected: u64,
    /// Snapshots in memory.
    pub snapshot_entries: u64,
    /// Bytes of snapshots in memory.
    pub snapshot_bytes: u64,
    /// Time spent in engine steps, in nanoseconds.
    pub step_ns: u64,
    /// Of that, time spent in llama.cpp batches (decode/encode), in nanoseconds.
    pub batch_ns: u64,
    /// Images computed (encoded, or taken from the projector's cache, and
    /// decoded into a sequence).
    pub images: u64,
    /// Of `batch_ns`, time spent on images, in nanoseconds.
    pub image_ns: u64,
    /// Times the engine checked its invariants on going idle.
    pub idle_checks: u64,
    /// Invariant violations found then (slots, leases, queue or KV cells).
    pub invariant_violations: u64,
}

impl EngineMetrics {
    /// The slots as last published.
    pub fn slot_views(&self) -> Vec<SlotView> {
        self.slots.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Publishes `n` idle slots (at start, before the engine thread runs).
    pub(crate) fn publish_idle_slots(&self, n: usize) {
        if let Ok(mut views) = self.slots.lock() {
            *views = vec![SlotView::of(&Slot::Idle); n];
        }
    }

    /// Publishes the slots (into the same buffer: no allocation per step).
    pub(crate) fn publish_slots(&self, slots: &[Slot]) {
        if let Ok(mut views) = self.slots.lock() {
            views.clear();
            views.extend(slots.iter().map(SlotView::of));
        }
    }

    /// Reads every figure.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            requests_completed: self.requests_completed.load(Relaxed),
            requests_failed: self.requests_failed.load(Relaxed),
            requests_cancelled: self.requests_cancelled.load(Relaxed),
            prompt_tokens: self.prompt_tokens.load(Relaxed),
            generated_tokens: self.generated_tokens.load(Relaxed),
            steps: self.steps.load(Relaxed),
            batch_rows: self.batch_rows.load(Relaxed),
            preemptions: self.preemptions.load(Relaxed),
            draft_tokens: self.draft_tokens.load(Relaxed),
            draft_accepted_tokens: self.draft_accepted_tokens.load(Relaxed),
            queue_depth: self.queue_depth.load(Relaxed),
            busy_slots: self.busy_slots.load(Relaxed),
            leased_sequences: self.leased_sequences.load(Relaxed),
            kv_cells_used: self.kv_cells_used.load(Relaxed),
            prefix_hits: self.prefix_hits.load(Relaxed),
            prefix_reused_tokens: self.prefix_reused_tokens.load(Relaxed),
            snapshot_saves: self.snapshot_saves.load(Relaxed),
            snapshot_restores: self.snapshot_restores.load(Relaxed),
            idle_parks: self.idle_parks.load(Relaxed),
            snapshot_bytes_saved: self.snapshot_bytes_saved.load(Relaxed),
            snapshot_bytes_restored: self.snapshot_bytes_restored.load(Relaxed),
            snapshot_files_rejected: self.snapshot_files_rejected.load(Relaxed),
            snapshot_entries: self.snapshot_entries.load(Relaxed),
            snapshot_bytes: self.snapshot_bytes.load(Relaxed),
            step_ns: self.step_ns.load(Relaxed),
            batch_ns: self.batch_ns.load(Relaxed),
            images: self.images.load(Relaxed),
            image_ns: self.image_ns.load(Relaxed),
            idle_checks: self.idle_checks.load(Relaxed),
            invariant_violations: self.invariant_violations.load(Relaxed),
        }
    }
}
