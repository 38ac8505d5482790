//! Which in-process models are in memory: loading on demand, a cap on
//! models resident at once (the least recently used is unloaded to make
//! room), unloading after an idle time, and admin loads and unloads.
//!
//! Every in-process local target (not a provider, not an RPC-backed target
//! in a supervised child) has a gate: each request holds a read lease on
//! it from before its route runs until its response body ends (see
//! [`middleware`]), and an unload takes the write side, so it waits for the
//! requests in flight. One switch lock lets one load or unload happen at a
//! time, so the cap holds. A request for a model being loaded waits for it,
//! up to `server.load_wait_secs`.
//!
//! All of this engages only when some target is `load = "on_demand"`, or
//! `server.models_max` or `server.idle_unload_secs` is set (or an admin
//! unloads a model); otherwise requests pass without reading their bodies.

pub mod middleware;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use sipp::Engine;
use tokio::sync::{OwnedRwLockReadGuard, RwLock as Gate};
use tokio::time::Instant;

use crate::config::{LoadWhen, ModelTarget, ServeConfig};
use crate::error::ApiError;
use crate::state::{AppState, Target, TargetState};

/// Starts a local target's engine (on a blocking thread).
pub type Loader = Arc<dyn Fn(&ModelTarget) -> Result<Engine, String> + Send + Sync>;

/// Why a model left memory (the `reason` label of
/// `sipp_model_unloads_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnloadReason {
    /// To make room under `server.models_max`.
    Lru,
    /// Unused for `server.idle_unload_secs`.
    Idle,
    /// `POST /models/unload`.
    Admin,
}

impl UnloadReason {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            UnloadReason::Lru => "lru",
            UnloadReason::Idle => "idle",
            UnloadReason::Admin => "admin",
        }
    }
}

/// Why a model could not be brought in or taken out.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ResidencyError {
    /// A provider or supervised target: nothing in this process to load.
    #[error("the model `{0}` does not run in this process (a provider or an RPC-backed target); it cannot be loaded or unloaded")]
    NotManaged(String),
    /// Its load failed.
    #[error("the model `{id}` failed to load: {message}")]
    LoadFailed {
        /// The target.
        id: String,
        /// The loader's error.
        message: String,
    },
    /// The wait for it ran out while it (or another) was loading.
    #[error(
        "the model `{id}` is still loading after {secs} s (server.load_wait_secs); retry later"
    )]
    StillLoading {
        /// The target.
        id: String,
        /// The wait.
        secs: u64,
    },
    /// A model to unload kept requests in flight for the whole wait.
    #[error("the model `{id}` still has {in_flight} request(s) in flight after {secs} s (server.load_wait_secs), so it cannot be unloaded yet")]
    Busy {
        /// The model that would be unloaded.
        id: String,
        /// Its requests in flight.
        in_flight: usize,
        /// The wait.
        secs: u64,
    },
}

impl From<ResidencyError> for ApiError {
    fn from(e: ResidencyError) -> Self {
        let message = e.to_string();
        let code = match &e {
            ResidencyError::NotManaged(_) => return ApiError::bad_field("model", message),
            ResidencyError::LoadFailed { .. } => "unavailable",
            ResidencyError::StillLoading { .. } => "model_loading",
            ResidencyError::Busy { .. } => "model_busy",
        };
        ApiError {
            code: Some(code),
            ..ApiError::unavailable(message)
        }
    }
}

/// One in-process target's residency.
struct Managed {
    target: ModelTarget,
    /// Requests hold the read side; an unload takes the write side.
    gate: Arc<Gate<()>>,
    /// When a request last started or finished on it (or it loaded).
    last_used: Mutex<std::time::Instant>,
    /// Leases held now.
    leases: AtomicUsize,
    /// Its first load has finished (or it loads on demand): loading it
    /// again does not make /health answer `loading`.
    settled: AtomicBool,
}

impl Managed {
    fn touch(&self) {
        if let Ok(mut t) = self.last_used.lock() {
            *t = std::time::Instant::now();
        }
    }

    fn idle_for(&self) -> Duration {
        self.last_used
            .lock()
            .map(|t| t.elapsed())
            .unwrap_or_default()
    }
}

/// A request's hold on a resident model: while any is held, the model is
/// not unloaded.
pub struct Lease {
    _read: OwnedRwLockReadGuard<()>,
    managed: Arc<Managed>,
}

impl Lease {
    fn new(managed: Arc<Managed>, read: OwnedRwLockReadGuard<()>) -> Self {
        managed.leases.fetch_add(1, Ordering::Relaxed);
        managed.touch();
        Self {
            _read: read,
            managed,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.managed.touch();
        self.managed.leases.fetch_sub(1, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("model", &self.managed.target.id)
            .finish()
    }
}

/// The residency of every in-process target.
pub struct Residency {
    managed: HashMap<String, Arc<Managed>>,
    engaged: AtomicBool,
    cap: Option<usize>,
    idle: Option<Duration>,
    wait: Duration,
    /// One load or unload at a time.
    switch: Arc<tokio::sync::Mutex<()>>,
    loader: RwLock<Option<Loader>>,
}

impl std::fmt::Debug for Residency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Residency")
            .field("cap", &self.cap)
            .field("idle", &self.idle)
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

/// A target's `status.value` in /v1/models and the admin routes, with the
/// failure's message.
pub fn status_of(s: &TargetState) -> (&'static str, Option<String>) {
    match s {
        TargetState::Ready(_) | TargetState::Forwarded(_) => ("loaded", None),
        TargetState::Loading => ("loading", None),
        TargetState::Unloaded => ("unloaded", None),
        TargetState::Failed(e) => ("failed", Some(e.clone())),
    }
}

impl Residency {
    /// The residency of a (validated) configuration's in-process targets.
    pub fn new(config: &ServeConfig) -> Self {
        let now = std::time::Instant::now();
        let managed = config
            .models
            .iter()
            .filter(|m| m.is_in_process())
            .map(|m| {
                let on_demand = m.load == LoadWhen::OnDemand;
                let managed = Managed {
                    target: m.clone(),
                    gate: Arc::new(Gate::new(())),
                    last_used: Mutex::new(now),
                    leases: AtomicUsize::new(0),
                    settled: AtomicBool::new(on_demand),
                };
                (m.id.clone(), Arc::new(managed))
            })
            .collect();
        let s = &config.server;
        let engaged = s.models_max.is_some()
            || s.idle_unload_secs.is_some()
            || config.models.iter().any(|m| m.load == LoadWhen::OnDemand);
        Self {
            managed,
            engaged: AtomicBool::new(engaged),
            cap: s.models_max,
            idle: s.idle_unload_secs.map(Duration::from_secs),
            wait: Duration::from_secs(s.load_wait_secs.max(1)),
            switch: Arc::new(tokio::sync::Mutex::new(())),
            loader: RwLock::new(None),
        }
    }

    /// Whether requests must go through [`Self::acquire`]: on-demand
    /// targets, a cap or idle unloading are configured, or an admin has
    /// unloaded a model.
    pub fn engaged(&self) -> bool {
        self.engaged.load(Ordering::Relaxed)
    }

    /// Whether `id` is an in-process target (one that loads and unloads).
    pub fn manages(&self, id: &str) -> bool {
        self.managed.contains_key(id)
    }

    /// Whether `id`'s first load has finished (or it loads on demand), so
    /// its loading again does not count against /health.
    pub fn settled(&self, id: &str) -> bool {
        self.managed
            .get(id)
            .is_some_and(|m| m.settled.load(Ordering::Relaxed))
    }

    /// Sets the loader every later load uses.
    pub(crate) fn set_loader(&self, loader: Loader) {
        if let Ok(mut l) = self.loader.write() {
            *l = Some(loader);
        }
    }

    /// Marks `id`'s load as finished (its first load no longer counts
    /// against /health) and as used now.
    fn settle(&self, id: &str) {
        if let Some(m) = self.managed.get(id) {
            m.settled.store(true, Ordering::Relaxed);
            m.touch();
        }
    }

    fn managed(&self, id: &str) -> Result<&Arc<Managed>, ResidencyError> {
        self.managed
            .get(id)
            .ok_or_else(|| ResidencyError::NotManaged(id.to_string()))
    }

    fn still_loading(&self, id: &str) -> ResidencyError {
        ResidencyError::StillLoading {
            id: id.to_string(),
            secs: self.wait.as_secs(),
        }
    }

    /// A lease on `id`, loading it first when it is not in memory (and
    /// unloading the least recently used model when at the cap). Waits up
    /// to `server.load_wait_secs`. `None` for a target this does not
    /// manage.
    pub async fn acquire(
        self: &Arc<Self>,
        state: &AppState,
        id: &str,
    ) -> Result<Option<Lease>, ResidencyError> {
        let Some(m) = self.managed.get(id).cloned() else {
            return Ok(None);
        };
        let deadline = Instant::now() + self.wait;
        // Already resident: a read lease (which waits for an unload under
        // way to finish).
        let read = tokio::time::timeout_at(deadline, m.gate.clone().read_owned())
            .await
            .map_err(|_| self.still_loading(id))?;
        if is_resident(state, id) {
            return Ok(Some(Lease::new(m, read)));
        }
        drop(read);
        // The load runs in its own task so that a request giving up (or its
        // client leaving) never leaves a load half done; the lease is taken
        // before the switch is released, so no other load can unload it
        // first.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let this = self.clone();
        let st = state.clone();
        let target = id.to_string();
        tokio::spawn(async move {
            let _switch = this.switch.clone().lock_owned().await;
            if tx.is_closed() {
                return;
            }
            let r = match this.bring_in_locked(&st, &target, deadline).await {
                Ok(()) => {
                    let read = m.gate.clone().read_owned().await;
                    Ok(Lease::new(m, read))
                }
                Err(e) => Err(e),
            };
            let _ = tx.send(r);
        });
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(r)) => r.map(Some),
            Ok(Err(_)) | Err(_) => Err(self.still_loading(id)),
        }
    }

    /// Loads `id` unless it is in memory (unloading the least recently used
    /// model first when at the cap); waits for the loads and unloads before
    /// it.
    pub async fn bring_in(&self, state: &AppState, id: &str) -> Result<(), ResidencyError> {
        self.managed(id)?;
        let deadline = Instant::now() + self.wait;
        let _switch = self.switch.lock().await;
        self.bring_in_locked(state, id, deadline).await
    }

    /// Unloads `id` once its requests in flight finish (waiting up to
    /// `server.load_wait_secs`); whether it was in memory. A failed target
    /// becomes unloaded (its next request tries again).
    pub async fn unload(
        &self,
        state: &AppState,
        id: &str,
        reason: UnloadReason,
    ) -> Result<bool, ResidencyError> {
        self.managed(id)?;
        // From now on every request takes a lease, so the next one for this
        // model loads it again.
        self.engaged.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + self.wait;
        let _switch = self.switch.lock().await;
        if matches!(state.target_state(id), Some(TargetState::Failed(_))) {
            state.set_target(id, TargetState::Unloaded);
            return Ok(false);
        }
        self.unload_locked(state, id, reason, Some(deadline)).await
    }

    /// The models in memory other than `except`: the one to unload first
    /// (none in use before any in use, then the least recently used).
    fn lru_victim(&self, state: &AppState, except: &str) -> (usize, Option<String>) {
        let mut resident: Vec<(bool, Duration, &String)> = self
            .managed
            .iter()
            .filter(|(id, _)| id.as_str() != except && is_resident(state, id))
            .map(|(id, m)| (m.leases.load(Ordering::Relaxed) > 0, m.idle_for(), id))
            .collect();
        resident.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        (resident.len(), resident.first().map(|r| r.2.clone()))
    }

    /// [`Self::bring_in`] with the switch held.
    async fn bring_in_locked(
        &self,
        state: &AppState,
        id: &str,
        deadline: Instant,
    ) -> Result<(), ResidencyError> {
        let m = self.managed(id)?;
        if is_resident(state, id) {
            return Ok(());
        }
        let before = state.target_state(id).unwrap_or(TargetState::Unloaded);
        state.set_target(id, TargetState::Loading);
        if let Some(cap) = self.cap {
            loop {
                let (resident, victim) = self.lru_victim(state, id);
                let Some(victim) = victim.filter(|_| resident >= cap) else {
                    break;
                };
                match self
                    .unload_locked(state, &victim, UnloadReason::Lru, Some(deadline))
                    .await
                {
                    Ok(true) => {}
                    // Not in memory after all: nothing more to make room with.
                    Ok(false) => break,
                    Err(e) => {
                        state.set_target(id, before);
                        return Err(e);
                    }
                }
            }
        }
        let loader = self.loader.read().ok().and_then(|l| l.clone());
        let Some(loader) = loader else {
            let message = "the server has no loader for it".to_string();
            state.set_target(id, TargetState::Failed(message.clone()));
            return Err(ResidencyError::LoadFailed {
                id: id.to_string(),
                message,
            });
        };
        let target = m.target.clone();
        let started = std::time::Instant::now();
        let result = tokio::task::spawn_blocking(move || loader(&target))
            .await
            .unwrap_or_else(|e| Err(format!("the loading thread failed: {e}")));
        let outcome = state.finish_load(id, result);
        tracing::info!(model = %id, secs = started.elapsed().as_secs_f64(), "load finished");
        self.settle(id);
        outcome.map_err(|message| ResidencyError::LoadFailed {
            id: id.to_string(),
            message,
        })
    }

    /// Unloads `id` with the switch held, once its leases are released:
    /// waiting until `deadline`, or not at all without one (then a model
    /// in use stays). Whether it was in memory.
    async fn unload_locked(
        &self,
        state: &AppState,
        id: &str,
        reason: UnloadReason,
        deadline: Option<Instant>,
    ) -> Result<bool, ResidencyError> {
        let m = self.managed(id)?;
        if !is_resident(state, id) {
            return Ok(false);
        }
        let busy = || ResidencyError::Busy {
            id: id.to_string(),
            in_flight: m.leases.load(Ordering::Relaxed),
            secs: self.wait.as_secs(),
        };
        let write = match deadline {
            Some(d) => tokio::time::timeout_at(d, m.gate.clone().write_owned())
                .await
                .map_err(|_| busy())?,
            None => m.gate.clone().try_write_owned().map_err(|_| busy())?,
        };
        let Some(TargetState::Ready(Target::Local(engine))) = state.target_state(id) else {
            return Ok(false);
        };
        state.set_target(id, TargetState::Unloaded);
        drop(write);
        state.metrics.record_model_unload(id, reason.as_str());
        tracing::info!(model = %id, reason = reason.as_str(), "model unloaded");
        // The last handle joins the engine thread; its memory is free before
        // the next load starts.
        let _ = tokio::task::spawn_blocking(move || drop(engine)).await;
        Ok(true)
    }

    /// Unloads every model unused for `server.idle_unload_secs` (none with
    /// requests in flight).
    async fn unload_idle(&self, state: &AppState, idle: Duration) {
        for (id, m) in &self.managed {
            let due = |m: &Managed| m.leases.load(Ordering::Relaxed) == 0 && m.idle_for() >= idle;
            if !due(m) || !is_resident(state, id) {
                continue;
            }
            let _switch = self.switch.lock().await;
            if due(m) {
                let _ = self
                    .unload_locked(state, id, UnloadReason::Idle, None)
                    .await;
            }
        }
    }

    /// Starts the task that unloads idle models, when
    /// `server.idle_unload_secs` is set.
    pub fn spawn_idle_unloader(&self, state: &AppState) -> Option<tokio::task::JoinHandle<()>> {
        let idle = self.idle?;
        let tick = (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
        let state = state.clone();
        Some(tokio::spawn(async move {
            let mut every = tokio::time::interval(tick);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let residency = state.residency.clone();
                residency.unload_idle(&state, idle).await;
            }
        }))
    }
}

/// Whether `id` has an engine in memory.
fn is_resident(state: &AppState, id: &str) -> bool {
    matches!(
        state.target_state(id),
        Some(TargetState::Ready(Target::Local(_)))
    )
}
