//! Shared server state: the served targets (loading, ready or failed), routing
//! by model id, auth keys and metrics.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use sipp::Engine;

use crate::config::{ModelTarget, ServeConfig};
use crate::error::ApiError;
use crate::metrics::ServerMetrics;

/// What answers requests for one model id.
#[derive(Clone, Debug)]
pub enum Target {
    /// An engine in this process.
    Local(Engine),
    /// A remote provider, reached with the server's own credentials.
    Remote(RemoteTarget),
}

/// A provider endpoint in the server's client.
#[derive(Clone, Debug)]
pub struct RemoteTarget {
    /// The client holding the endpoint.
    pub client: sipp::client::SippClient,
    /// The endpoint id in it.
    pub endpoint: String,
}

/// A target's state.
#[derive(Clone, Debug)]
pub enum TargetState {
    /// Still loading (or, for a supervised target, its child starting).
    Loading,
    /// Serving.
    Ready(Target),
    /// Serving from a supervised child process: requests naming it are
    /// forwarded there whole (see [`crate::child`]).
    Forwarded(crate::child::ChildLink),
    /// Failed to load (or, for a supervised target, its child is down and
    /// being restarted).
    Failed(String),
    /// Declared but not in memory: an on-demand target not yet used, or one
    /// unloaded (least recently used, idle, or by an admin). The next
    /// request for it loads it (see [`crate::residency`]).
    Unloaded,
}

/// 403: the caller's key may not use `model` (as the request named it).
pub(crate) fn not_allowed(caller: &crate::policy::Caller, model: &str) -> ApiError {
    ApiError {
        param: Some("model".into()),
        ..ApiError::forbidden(
            "model_not_allowed",
            format!(
                "the API key `{}` may not use the model `{model}`",
                caller.label().unwrap_or("?"),
            ),
        )
    }
}

/// Shared by every request.
#[derive(Clone)]
pub struct AppState {
    pub(crate) targets: Arc<RwLock<BTreeMap<String, TargetState>>>,
    pub(crate) aliases: Arc<HashMap<String, String>>,
    pub(crate) default_model: Arc<String>,
    pub(crate) policy: Arc<crate::policy::Policy>,
    pub(crate) dashboard: Arc<crate::dashboard::DashboardLog>,
    pub(crate) max_body_bytes: usize,
    pub(crate) load_format: crate::config::LoadFormat,
    pub(crate) metrics: Arc<ServerMetrics>,
    pub(crate) responses: Arc<crate::routes::responses::ResponseStore>,
    pub(crate) created: u64,
    /// Some target runs in a supervised child process.
    pub(crate) supervised: bool,
    /// The `[server]` settings a child process inherits.
    pub(crate) child_server: Arc<crate::config::ServerSection>,
    /// Which in-process models are resident, and their loads and unloads.
    pub(crate) residency: Arc<crate::residency::Residency>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("default_model", &self.default_model)
            .finish()
    }
}

/// Health of all targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// Every target serves.
    Ok,
    /// Some target is loading.
    Loading,
    /// Some target failed or its engine stopped.
    Failed(String),
}

impl AppState {
    /// State for a configuration; every target starts as loading, and the
    /// metrics read every engine that becomes ready.
    pub fn new(config: &ServeConfig) -> Self {
        let mut targets = BTreeMap::new();
        let mut aliases = HashMap::new();
        for m in &config.models {
            let first = if m.load == crate::config::LoadWhen::OnDemand {
                TargetState::Unloaded
            } else {
                TargetState::Loading
            };
            targets.insert(m.id.clone(), first);
            for a in &m.aliases {
                aliases.insert(a.clone(), m.id.clone());
            }
            // An adapter's alias names `TARGET:ADAPTER`.
            for l in &m.runtime.lora {
                for a in &l.aliases {
                    aliases.insert(a.clone(), format!("{}:{}", m.id, l.resolved_name()));
                }
            }
        }
        let default_model = config
            .models
            .iter()
            .find(|m| m.default)
            .or_else(|| config.models.first())
            .map(|m| m.id.clone())
            .unwrap_or_default();
        let targets = Arc::new(RwLock::new(targets));
        let metrics = ServerMetrics::default();
        metrics.attach_engines(targets.clone());
        Self {
            targets,
            aliases: Arc::new(aliases),
            default_model: Arc::new(default_model),
            policy: Arc::new(crate::policy::Policy::new(config)),
            dashboard: Arc::new(crate::dashboard::DashboardLog::default()),
            max_body_bytes: config.server.max_body_bytes,
            load_format: config.server.load_format,
            metrics: Arc::new(metrics),
            responses: Arc::new(crate::routes::responses::ResponseStore::new(
                config.server.responses_store,
            )),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            supervised: !config.child && config.models.iter().any(crate::child::is_supervised),
            child_server: Arc::new(config.server.clone()),
            residency: Arc::new(crate::residency::Residency::new(config)),
        }
    }

    /// Records a finished generation: its time to first token in /metrics
    /// and its line in the dashboard's recent requests.
    pub fn finished(&self, model: &str, c: &sipp::engine::Completion) {
        self.metrics.record_ttft(model, &c.stats);
        self.dashboard.record(model, c);
    }

    /// Sets a target's state.
    pub fn set_target(&self, id: &str, state: TargetState) {
        if let Ok(mut t) = self.targets.write() {
            t.insert(id.to_string(), state);
        }
    }

    /// A target's state now.
    pub fn target_state(&self, id: &str) -> Option<TargetState> {
        self.targets.read().ok().and_then(|t| t.get(id).cloned())
    }

    /// The ready target for a request's `model` (the default when absent).
    /// Inside a request, the caller's key must be allowed the target, and a
    /// local engine comes metered when token-rate limits apply to the caller.
    pub fn target(&self, model: Option<&str>) -> Result<(String, Target), ApiError> {
        let (id, target) = self.resolve(model)?;
        let Some(caller) = crate::policy::current() else {
            return Ok((id, target));
        };
        if !caller.may_use(&id) {
            return Err(not_allowed(&caller, model.unwrap_or(id.as_str())));
        }
        Ok(match target {
            Target::Local(engine) if caller.meters_tokens() => {
                (id, Target::Local(engine.metered(caller)))
            }
            t => (id, t),
        })
    }

    /// `TARGET:ADAPTER`: the local target with one of its LoRA adapters
    /// selected for every request that chooses none itself.
    fn with_adapter(
        &self,
        base: &str,
        adapter: &str,
        requested: &str,
    ) -> Result<(String, Target), ApiError> {
        if !self.is_target(self.named(Some(base)).1) {
            return Err(ApiError::unknown_model(requested));
        }
        let (id, target) = self.resolve(Some(base))?;
        let Target::Local(engine) = target else {
            return Err(ApiError::bad_field(
                "model",
                format!("`{requested}`: the model `{id}` is a remote provider, which has no LoRA adapters"),
            ));
        };
        match engine.with_adapter(adapter) {
            Some(e) => Ok((id, Target::Local(e))),
            None => {
                let names: Vec<String> = engine
                    .lora_adapters()
                    .into_iter()
                    .map(|a| a.info.name)
                    .collect();
                Err(ApiError::bad_field(
                    "model",
                    if names.is_empty() {
                        format!("`{requested}`: the model `{id}` has no LoRA adapters")
                    } else {
                        format!(
                            "`{requested}`: the model `{id}` has no LoRA adapter `{adapter}` (it has {})",
                            names.join(", ")
                        )
                    },
                ))
            }
        }
    }

    /// Whether the request being handled may use the target `id`.
    pub fn caller_may_use(&self, id: &str) -> bool {
        crate::policy::current().is_none_or(|c| c.may_use(id))
    }

    fn resolve(&self, model: Option<&str>) -> Result<(String, Target), ApiError> {
        if model.is_some_and(|m| m.trim().is_empty()) {
            return Err(ApiError::bad_field(
                "model",
                "must not be empty (omit it to use the default model)",
            ));
        }
        let (requested, id) = self.named(model);
        let targets = self
            .targets
            .read()
            .map_err(|_| ApiError::unavailable("server state is poisoned"))?;
        match targets.get(id) {
            None => match id.rsplit_once(':') {
                Some((base, adapter)) => {
                    drop(targets);
                    self.with_adapter(base, adapter, requested)
                }
                None => Err(ApiError::unknown_model(requested)),
            },
            Some(TargetState::Loading) => Err(ApiError::loading(id)),
            Some(TargetState::Failed(e)) => Err(ApiError::unavailable(format!(
                "the model `{id}` failed to load: {e}"
            ))),
            Some(TargetState::Ready(t)) => Ok((id.to_string(), t.clone())),
            // The residency middleware loads a model before its requests
            // reach a route; routes it does not cover (no `model` in a
            // body) find it unloaded.
            Some(TargetState::Unloaded) => Err(ApiError::not_loaded(id)),
            // Requests naming it are forwarded before any route sees them;
            // a route without a `model` in its body is not.
            Some(TargetState::Forwarded(_)) => Err(ApiError::bad_field(
                "model",
                format!("the model `{id}` runs in a supervised child process and this route is not forwarded to it"),
            )),
        }
    }

    /// What a request's `model` names (the default when absent) and the
    /// target id that is (aliases resolved).
    pub(crate) fn named<'a>(&'a self, model: Option<&'a str>) -> (&'a str, &'a str) {
        let requested = model.unwrap_or(self.default_model.as_str());
        let id = self
            .aliases
            .get(requested)
            .map_or(requested, String::as_str);
        (requested, id)
    }

    /// The target id a `model` names, `TARGET:ADAPTER` included (the
    /// target's), for the middlewares that load or forward a target before
    /// the route resolves the adapter.
    pub(crate) fn target_id_of<'a>(&'a self, model: Option<&'a str>) -> &'a str {
        let (_, id) = self.named(model);
        if self.is_target(id) {
            return id;
        }
        match id
            .rsplit_once(':')
            .map(|(base, _)| self.named(Some(base)).1)
        {
            Some(base) if self.is_target(base) => base,
            _ => id,
        }
    }

    /// Whether `id` is a target's id (aliases not resolved).
    fn is_target(&self, id: &str) -> bool {
        self.targets.read().is_ok_and(|t| t.contains_key(id))
    }

    /// Whether any target is served by a child process (the forwarding
    /// middleware reads bodies only then).
    pub fn has_supervised_targets(&self) -> bool {
        self.supervised
    }

    /// The child a request for `model` (the default when absent) is
    /// forwarded to, with its target id; `None` for every other target, which
    /// the routes answer (or refuse) themselves. A caller's key must be
    /// allowed the target.
    pub fn forward_link(
        &self,
        model: Option<&str>,
    ) -> Result<Option<(String, crate::child::ChildLink)>, ApiError> {
        let (requested, _) = self.named(model);
        let id = self.target_id_of(model);
        let link = match self.targets.read() {
            Ok(t) => match t.get(id) {
                Some(TargetState::Forwarded(link)) => link.clone(),
                _ => return Ok(None),
            },
            Err(_) => return Ok(None),
        };
        // The same refusal as for an in-process target.
        if let Some(caller) = crate::policy::current() {
            if !caller.may_use(id) {
                return Err(not_allowed(&caller, requested));
            }
        }
        Ok(Some((id.to_string(), link)))
    }

    /// Model ids and their state.
    pub fn target_list(&self) -> Vec<(String, TargetState)> {
        self.targets
            .read()
            .map(|t| t.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    /// Engines that are ready, by id.
    pub fn engines(&self) -> Vec<(String, Engine)> {
        self.target_list()
            .into_iter()
            .filter_map(|(id, s)| match s {
                TargetState::Ready(Target::Local(e)) => Some((id, e)),
                _ => None,
            })
            .collect()
    }

    /// Overall health.
    pub fn health(&self) -> Health {
        let list = self.target_list();
        if list.is_empty() {
            return Health::Failed("no model is configured".into());
        }
        let mut loading = false;
        for (id, s) in list {
            match s {
                // A model loaded again after an unload (or on demand) does
                // not take the server out of rotation.
                TargetState::Loading => loading |= !self.residency.settled(&id),
                TargetState::Unloaded => {}
                TargetState::Failed(e) => return Health::Failed(format!("{id}: {e}")),
                TargetState::Ready(Target::Local(e)) if !e.is_alive() => {
                    return Health::Failed(format!("{id}: the engine has stopped"))
                }
                TargetState::Ready(_) | TargetState::Forwarded(_) => {}
            }
        }
        if loading {
            Health::Loading
        } else {
            Health::Ok
        }
    }

    /// A load's outcome: the target becomes ready (or failed, with the
    /// reason), and the load is counted and logged.
    pub(crate) fn finish_load(
        &self,
        id: &str,
        result: Result<Engine, String>,
    ) -> Result<(), String> {
        self.metrics.record_model_load(id, result.is_ok());
        match result {
            Ok(engine) => {
                tracing::info!(model = %id, "model loaded");
                self.set_target(id, TargetState::Ready(Target::Local(engine)));
                Ok(())
            }
            Err(e) => {
                tracing::error!(model = %id, "model failed to load: {e}");
                self.set_target(id, TargetState::Failed(e.clone()));
                Err(e)
            }
        }
    }

    /// Starts the task that unloads models unused for
    /// `server.idle_unload_secs` (nothing when it is not set); [`crate::bind`]
    /// does.
    pub fn spawn_idle_unloader(&self) -> Option<tokio::task::JoinHandle<()>> {
        self.residency.spawn_idle_unloader(self)
    }

    /// Loads every startup target on blocking threads, one after another
    /// (on-demand targets stay unloaded until needed); provider targets are
    /// set up at once (nothing to load).
    pub fn spawn_loading(&self, models: Vec<ModelTarget>) -> tokio::task::JoinHandle<()> {
        self.spawn_loading_with(models, |m| {
            let path = sipp::models::resolve_or_fetch(&m.model).map_err(|e| e.to_string())?;
            Engine::load(&path, m.runtime.clone()).map_err(|e| e.to_string())
        })
    }

    /// [`spawn_loading`](Self::spawn_loading) with `load` starting each local
    /// target's engine (on a blocking thread, in order): a target is loading
    /// until its `load` returns, then ready or failed. Tests start engines on
    /// the fake backend this way.
    pub fn spawn_loading_with<F>(
        &self,
        models: Vec<ModelTarget>,
        load: F,
    ) -> tokio::task::JoinHandle<()>
    where
        F: Fn(&ModelTarget) -> Result<Engine, String> + Send + Sync + 'static,
    {
        let state = self.clone();
        let (remote, local): (Vec<_>, Vec<_>) =
            models.into_iter().partition(|m| m.provider.is_some());
        let client = sipp::client::SippClient::new();
        for m in remote {
            let Some(p) = m.provider.clone() else {
                continue;
            };
            let state = state.clone();
            let client = client.clone();
            tokio::spawn(async move {
                let kind = match p.kind.as_str() {
                    "anthropic" => sipp::client::ProviderKind::Anthropic,
                    "openai_compatible" => sipp::client::ProviderKind::OpenAiCompatible,
                    _ => sipp::client::ProviderKind::OpenAi,
                };
                let api_key = p
                    .api_key
                    .clone()
                    .or_else(|| p.api_key_env.as_ref().and_then(|v| std::env::var(v).ok()));
                let desc = sipp::client::EndpointDescriptor::Provider {
                    kind,
                    base_url: p.base_url.clone(),
                    api_key,
                    model: p.model.clone(),
                    headers: Vec::new(),
                    timeouts: sipp::client::Timeouts::default(),
                    max_retries: p.max_retries,
                };
                match client.add(m.id.clone(), desc).await {
                    Ok(_) => state.set_target(
                        &m.id,
                        TargetState::Ready(Target::Remote(RemoteTarget {
                            client,
                            endpoint: m.id.clone(),
                        })),
                    ),
                    Err(e) => state.set_target(&m.id, TargetState::Failed(e.to_string())),
                }
            });
        }
        // An RPC-backed target runs in a supervised child process (ggml's RPC
        // client aborts the process when a server drops); the child itself
        // loads it here, in-process.
        let (supervised, local): (Vec<_>, Vec<_>) = local
            .into_iter()
            .partition(|m| state.supervised && crate::child::is_supervised(m));
        for m in supervised {
            crate::child::spawn_supervisor(state.clone(), m, self.child_server.clone());
        }
        // Every in-process target can be loaded again later (on demand, or
        // by an admin), so the residency keeps the loader.
        let load: crate::residency::Loader = Arc::new(load);
        self.residency.set_loader(load.clone());
        let residency = self.residency.clone();
        let (managed, other): (Vec<_>, Vec<_>) = local
            .into_iter()
            .filter(|m| m.load == crate::config::LoadWhen::Startup)
            .partition(|m| residency.manages(&m.id));
        tokio::spawn(async move {
            // Targets the residency does not manage (an RPC-backed target in
            // this supervised child) load here once.
            if !other.is_empty() {
                let st = state.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    for m in other {
                        let _ = st.finish_load(&m.id, load(&m));
                    }
                })
                .await;
            }
            // The rest in order, each taking its turn with on-demand loads
            // (one at a time, within the cap).
            for m in managed {
                let _ = residency.bring_in(&state, &m.id).await;
            }
        })
    }
}
