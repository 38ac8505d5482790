//! What the operator dashboard shows: a live view of every target (slots and
//! their phases, queue, KV cells, prefix-cache hits, snapshots), generated
//! tokens per second over the last minutes, and the most recent requests.
//! One JSON document, [`DashboardState`], served whole by `GET /v1/dashboard`
//! or as a server-sent event stream of it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;
use sipp::engine::{Completion, SlotView};

use crate::state::{AppState, Target, TargetState};

/// Requests kept in the recent list.
pub const RECENT_REQUESTS: usize = 50;
/// Throughput samples kept: one a second for five minutes.
pub const THROUGHPUT_SAMPLES: usize = 300;
/// Seconds between throughput samples.
pub const SAMPLE_SECS: u64 = 1;

/// A finished request, as the recent list shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecentRequest {
    /// When it finished (Unix milliseconds).
    pub finished_at_ms: u64,
    /// The target.
    pub model: String,
    /// Why it ended (`stop`, `eos`, `length`, `cancelled`).
    pub finish_reason: String,
    /// Time to first token (0 when none was generated).
    pub ttft_ms: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of them, reused from the KV cache.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// From submission to the end.
    pub total_ms: f64,
}

/// Generated tokens per second of each target over one sampling interval.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ThroughputSample {
    /// End of the interval (Unix seconds).
    pub t: u64,
    /// Tokens per second by target id.
    pub tokens_per_sec: BTreeMap<String, f64>,
}

/// The server's memory of recent activity.
#[derive(Debug, Default)]
pub struct DashboardLog {
    recent: Mutex<VecDeque<RecentRequest>>,
    samples: Mutex<VecDeque<ThroughputSample>>,
    last_generated: Mutex<HashMap<String, u64>>,
}

fn push_bounded<T>(q: &Mutex<VecDeque<T>>, item: T, cap: usize) {
    if let Ok(mut q) = q.lock() {
        if q.len() == cap {
            q.pop_front();
        }
        q.push_back(item);
    }
}

impl DashboardLog {
    /// Records a finished request.
    pub fn record(&self, model: &str, c: &Completion) {
        let s = &c.stats;
        let finish_reason = serde_json::to_value(c.finish_reason)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        push_bounded(
            &self.recent,
            RecentRequest {
                finished_at_ms: now_ms(),
                model: model.to_string(),
                finish_reason,
                ttft_ms: s.ttft_ms,
                prompt_tokens: s.prompt_tokens,
                cached_tokens: s.cached_tokens,
                generated_tokens: s.generated_tokens,
                total_ms: s.queue_ms + s.prefill_ms + s.decode_ms,
            },
            RECENT_REQUESTS,
        );
    }

    /// Takes one throughput sample from each engine's generated-token
    /// counter, `secs` after the previous one.
    pub fn sample(&self, engines: &[(String, sipp::Engine)], secs: f64) {
        let Ok(mut last) = self.last_generated.lock() else {
            return;
        };
        let mut tokens_per_sec = BTreeMap::new();
        for (id, e) in engines {
            let now = e.metrics().generated_tokens;
            // A target seen for the first time starts from its count now.
            let before = *last.get(id).unwrap_or(&now);
            last.insert(id.clone(), now);
            tokens_per_sec.insert(id.clone(), now.saturating_sub(before) as f64 / secs);
        }
        push_bounded(
            &self.samples,
            ThroughputSample {
                t: now_ms() / 1000,
                tokens_per_sec,
            },
            THROUGHPUT_SAMPLES,
        );
    }

    fn recent(&self) -> Vec<RecentRequest> {
        self.recent
            .lock()
            .map(|q| q.iter().rev().cloned().collect())
            .unwrap_or_default()
    }

    fn throughput(&self) -> Vec<ThroughputSample> {
        self.samples
            .lock()
            .map(|q| q.iter().cloned().collect())
            .unwrap_or_default()
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The prefix cache's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PrefixCache {
    /// Admissions that reused a cached prefix.
    pub hits: u64,
    /// Prompt tokens reused.
    pub hit_tokens: u64,
    /// Prompt tokens admitted.
    pub prompt_tokens: u64,
    /// `hit_tokens / prompt_tokens` (0 before any prompt).
    pub hit_rate: f64,
}

/// A slot in the dashboard: its number and view.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DashboardSlot {
    /// Slot number.
    pub index: usize,
    /// Phase and counts.
    #[serde(flatten)]
    pub view: SlotView,
}

/// One target's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TargetStatus {
    /// Target id.
    pub id: String,
    /// `local` or `provider`.
    pub kind: &'static str,
    /// `loading`, `ready`, `failed` or `stopped` (the engine thread ended).
    pub state: &'static str,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The engine's live figures (local and ready only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineStatus>,
}

/// A local engine's live figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineStatus {
    /// Every slot.
    pub slots: Vec<DashboardSlot>,
    /// Slots holding a request.
    pub busy_slots: u64,
    /// Requests waiting for a slot.
    pub queue_depth: u64,
    /// KV cells in use.
    pub kv_cells_used: u64,
    /// KV cells in all.
    pub kv_cells_total: u32,
    /// Prefix-cache figures.
    pub prefix_cache: PrefixCache,
    /// Bytes of KV prefix snapshots in memory.
    pub snapshot_bytes: u64,
    /// Snapshots in memory.
    pub snapshot_entries: u64,
    /// Tokens generated since start.
    pub generated_tokens: u64,
    /// Requests finished since start, by outcome.
    pub requests_completed: u64,
    /// Failed.
    pub requests_failed: u64,
    /// Cancelled.
    pub requests_cancelled: u64,
}

/// The whole dashboard document.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DashboardState {
    /// When it was taken (Unix milliseconds).
    pub time_ms: u64,
    /// Seconds since the server started.
    pub uptime_secs: u64,
    /// Every target, in id order.
    pub targets: Vec<TargetStatus>,
    /// Generated tokens per second, oldest first, one sample a second.
    pub throughput: Vec<ThroughputSample>,
    /// Finished requests, newest first.
    pub recent_requests: Vec<RecentRequest>,
}

impl AppState {
    /// The dashboard document now.
    pub fn dashboard_state(&self) -> DashboardState {
        let targets = self
            .target_list()
            .into_iter()
            .map(|(id, s)| {
                let (kind, state, error, engine) = match s {
                    TargetState::Loading => ("local", "loading", None, None),
                    TargetState::Unloaded => ("local", "unloaded", None, None),
                    TargetState::Failed(e) => ("local", "failed", Some(e), None),
                    TargetState::Ready(Target::Remote(_)) => ("provider", "ready", None, None),
                    TargetState::Forwarded(_) => ("child", "ready", None, None),
                    TargetState::Ready(Target::Local(e)) if !e.is_alive() => {
                        ("local", "stopped", None, None)
                    }
                    TargetState::Ready(Target::Local(e)) => {
                        ("local", "ready", None, Some(engine_status(&e)))
                    }
                };
                TargetStatus {
                    id,
                    kind,
                    state,
                    error,
                    engine,
                }
            })
            .collect();
        DashboardState {
            time_ms: now_ms(),
            uptime_secs: (now_ms() / 1000).saturating_sub(self.created),
            targets,
            throughput: self.dashboard.throughput(),
            recent_requests: self.dashboard.recent(),
        }
    }

    /// Samples throughput every second and lets the limiters forget idle
    /// callers every minute, for as long as the runtime runs.
    pub fn spawn_sampler(&self) -> tokio::task::JoinHandle<()> {
        let state = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(SAMPLE_SECS));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last = tokio::time::Instant::now();
            for n in 0u64.. {
                tick.tick().await;
                let now = tokio::time::Instant::now();
                let secs = (now - last).as_secs_f64().max(1e-3);
                last = now;
                state.dashboard.sample(&state.engines(), secs);
                if n % 60 == 59 {
                    state.policy.forget_idle();
                }
            }
        })
    }
}

fn engine_status(e: &sipp::Engine) -> EngineStatus {
    let m = e.metrics();
    EngineStatus {
        slots: e
            .slot_views()
            .into_iter()
            .enumerate()
            .map(|(index, view)| DashboardSlot { index, view })
            .collect(),
        busy_slots: m.busy_slots,
        queue_depth: m.queue_depth,
        kv_cells_used: m.kv_cells_used,
        kv_cells_total: e.info().n_ctx,
        prefix_cache: PrefixCache {
            hits: m.prefix_hits,
            hit_tokens: m.prefix_reused_tokens,
            prompt_tokens: m.prompt_tokens,
            hit_rate: if m.prompt_tokens == 0 {
                0.0
            } else {
                m.prefix_reused_tokens as f64 / m.prompt_tokens as f64
            },
        },
        snapshot_bytes: m.snapshot_bytes,
        snapshot_entries: m.snapshot_entries,
        generated_tokens: m.generated_tokens,
        requests_completed: m.requests_completed,
        requests_failed: m.requests_failed,
        requests_cancelled: m.requests_cancelled,
    }
}
