//! The traffic policy, applied to every request before its handler runs:
//! the client's address against the allow and deny lists, the API key and
//! its role, request-rate, token-rate and in-flight limits per key and per
//! address. The handler then runs with its [`Caller`] in scope, so model
//! routing ([`crate::AppState::target`]) can hold a key to its models and
//! charge its tokens.

pub mod client_ip;
pub mod config;
pub mod limits;

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use sipp::engine::{EngineError, UsageMeter};

pub use config::{ApiKey, ApiKeyEntry, CidrList, IpPolicy, Limits, LimitsSection, Role};
use limits::{InFlight, InFlightGuard, OverLimit, RequestRate, TokenRate};

use crate::config::ServeConfig;
use crate::error::ApiError;
use crate::state::AppState;

/// The limiters of one kind of caller (one key, or every address).
struct Limiters<K: std::hash::Hash + Eq + Clone> {
    requests: Option<RequestRate<K>>,
    tokens: Option<TokenRate<K>>,
    in_flight: Option<InFlight<K>>,
}

impl<K: std::hash::Hash + Eq + Clone> Limiters<K> {
    fn new(l: Limits) -> Self {
        Self {
            requests: l.requests_per_minute.map(RequestRate::new),
            tokens: l.tokens_per_minute.map(TokenRate::new),
            in_flight: l.concurrent_requests.map(InFlight::new),
        }
    }

    /// Counts a request, checks the token allowance is not overdrawn, and
    /// takes an in-flight place.
    fn enter(&self, key: &K) -> Result<Option<InFlightGuard<K>>, OverLimit> {
        if let Some(r) = &self.requests {
            r.check(key)?;
        }
        if let Some(t) = &self.tokens {
            t.settle(key)?;
        }
        self.in_flight.as_ref().map(|f| f.enter(key)).transpose()
    }

    fn forget_idle(&self) {
        if let Some(r) = &self.requests {
            r.forget_idle();
        }
        if let Some(t) = &self.tokens {
            t.forget_idle();
        }
    }
}

/// One configured key.
struct KeyRule {
    label: String,
    role: Role,
    /// Target ids it may use; `None` for all.
    models: Option<HashSet<String>>,
    limits: Limiters<()>,
}

/// The policy built from `[server]`.
pub struct Policy {
    digests: Vec<[u8; 32]>,
    keys: Vec<KeyRule>,
    protect_health: bool,
    public_metrics: bool,
    ip: IpPolicy,
    per_ip: Limiters<IpAddr>,
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

impl Policy {
    /// The policy of a (validated) configuration. Model names in a key's
    /// list are resolved to target ids through the aliases.
    pub fn new(config: &ServeConfig) -> Self {
        let s = &config.server;
        let target_id = |name: &str| {
            config
                .models
                .iter()
                .find(|m| m.id == name || m.aliases.iter().any(|a| a == name))
                .map_or_else(|| name.to_string(), |m| m.id.clone())
        };
        let keys = s
            .api_keys
            .iter()
            .enumerate()
            .map(|(i, k)| KeyRule {
                label: k.label(i),
                role: k.role(),
                models: (!k.models().is_empty())
                    .then(|| k.models().iter().map(|m| target_id(m.get_ref())).collect()),
                limits: Limiters::new(k.limits().over(s.limits.per_key)),
            })
            .collect();
        Self {
            digests: s
                .api_keys
                .iter()
                .map(|k| crate::auth::digest(k.key()))
                .collect(),
            keys,
            protect_health: s.protect_health,
            public_metrics: s.public_metrics,
            ip: s.ip.clone(),
            per_ip: Limiters::new(s.limits.per_ip),
        }
    }

    /// Whether clients must send a key.
    pub fn requires_keys(&self) -> bool {
        !self.digests.is_empty()
    }

    /// Drops the state of limiter entries that are back to full (called
    /// now and then, so per-address state does not grow without bound).
    pub fn forget_idle(&self) {
        self.per_ip.forget_idle();
        for k in &self.keys {
            k.limits.forget_idle();
        }
    }

    fn address_refusal(&self, ip: Option<IpAddr>) -> Option<ApiError> {
        let (allow, deny) = (&self.ip.allow, &self.ip.deny);
        if allow.is_empty() && deny.is_empty() {
            return None;
        }
        match ip {
            Some(ip) if deny.contains(&ip) => Some(ApiError::forbidden(
                "ip_denied",
                format!("the client address {ip} is denied (server.ip.deny)"),
            )),
            Some(ip) if !allow.is_empty() && !allow.contains(&ip) => Some(ApiError::forbidden(
                "ip_denied",
                format!("the client address {ip} is not allowed (server.ip.allow)"),
            )),
            None if !allow.is_empty() => Some(ApiError::forbidden(
                "ip_denied",
                "the client address is unknown and server.ip.allow is set",
            )),
            _ => None,
        }
    }
}

/// Who sent the request being handled, as the policy saw it.
pub struct Caller {
    key: Option<usize>,
    ip: Option<IpAddr>,
    policy: Arc<Policy>,
}

impl std::fmt::Debug for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caller")
            .field("key", &self.key)
            .field("ip", &self.ip)
            .finish()
    }
}

impl Caller {
    fn rule(&self) -> Option<&KeyRule> {
        self.key.and_then(|i| self.policy.keys.get(i))
    }

    /// The key's role; without keys configured everyone is an admin.
    pub fn role(&self) -> Role {
        self.rule().map_or(Role::Admin, |k| k.role)
    }

    /// Whether the key may use the target `id`.
    pub fn may_use(&self, id: &str) -> bool {
        self.rule()
            .and_then(|k| k.models.as_ref())
            .is_none_or(|m| m.contains(id))
    }

    /// The key's name in messages.
    pub fn label(&self) -> Option<&str> {
        self.rule().map(|k| k.label.as_str())
    }

    /// Whether any token-rate limit applies, so the engine should be metered.
    pub fn meters_tokens(&self) -> bool {
        self.rule().is_some_and(|k| k.limits.tokens.is_some())
            || (self.ip.is_some() && self.policy.per_ip.tokens.is_some())
    }

    fn rate_limited(&self, who: &str, o: &OverLimit) -> ApiError {
        ApiError::rate_limited(
            format!(
                "{who} is over its limit of {} {} (server.limits); retry in {} s",
                o.value,
                o.limit.replace('_', " "),
                o.retry_after_secs
            ),
            o.retry_after_secs,
        )
    }

    fn key_who(&self) -> String {
        format!("the API key `{}`", self.label().unwrap_or("?"))
    }
}

impl UsageMeter for Caller {
    fn admit(&self, prompt_tokens: usize) -> Result<(), EngineError> {
        let refuse = |who: String, o: OverLimit| {
            EngineError::RateLimited {
            message: format!(
                "{who} is over its limit of {} tokens per minute (server.limits): this prompt has {prompt_tokens} tokens; retry in {} s",
                o.value, o.retry_after_secs
            ),
            retry_after_secs: o.retry_after_secs,
        }
        };
        if let (Some(ip), Some(t)) = (self.ip, &self.policy.per_ip.tokens) {
            t.admit(&ip, prompt_tokens as u64)
                .map_err(|o| refuse(format!("the client address {ip}"), o))?;
        }
        if let Some(t) = self.rule().and_then(|k| k.limits.tokens.as_ref()) {
            t.admit(&(), prompt_tokens as u64)
                .map_err(|o| refuse(self.key_who(), o))?;
        }
        Ok(())
    }

    fn generated(&self, tokens: usize) {
        if let (Some(ip), Some(t)) = (self.ip, &self.policy.per_ip.tokens) {
            t.charge(&ip, tokens as u64);
        }
        if let Some(t) = self.rule().and_then(|k| k.limits.tokens.as_ref()) {
            t.charge(&(), tokens as u64);
        }
    }
}

tokio::task_local! {
    static CALLER: Arc<Caller>;
}

/// The caller of the request being handled (none outside a request, e.g.
/// in tests that call the state directly).
pub fn current() -> Option<Arc<Caller>> {
    CALLER.try_with(Arc::clone).ok()
}

/// Pages and their assets: no data in them, so no key (their scripts send
/// the key the user enters with every API call).
fn is_public_page(path: &str) -> bool {
    path == "/" || path == "/dashboard" || path.starts_with("/ui/")
}

/// Routes only an admin key may use.
fn is_admin_route(path: &str) -> bool {
    path == "/v1/dashboard"
        || path.starts_with("/v1/dashboard/")
        || crate::residency::middleware::is_model_admin_route(path)
        // Slot files: any user's KV, and files on the server's disk.
        || path.starts_with("/slots/")
        || path.starts_with("/v1/sessions/")
}

/// Whether `path` is one of Anthropic's routes, answered in its shapes.
pub(crate) fn is_anthropic_route(path: &str) -> bool {
    path.starts_with("/v1/messages")
}

/// An error in the shape of the route's API (Anthropic's on `/v1/messages`).
pub(crate) fn refuse(path: &str, e: ApiError) -> Response {
    if is_anthropic_route(path) {
        crate::routes::anthropic::AnthropicError(e).into_response()
    } else {
        e.into_response()
    }
}

/// The middleware applying the policy; see the module docs for the order.
pub async fn gate(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let policy = state.policy.clone();
    let path = req.uri().path().to_string();
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let ip = client_ip::client_ip(
        peer,
        req.headers(),
        &policy.ip.client_ip_header,
        &policy.ip.trusted_proxies,
    );
    if let Some(e) = policy.address_refusal(ip) {
        return refuse(&path, e);
    }
    let open = req.method() == Method::OPTIONS
        || is_public_page(&path)
        || (path == "/health" && !policy.protect_health)
        || (path == "/metrics" && policy.public_metrics);
    let key = if policy.requires_keys() && !open {
        match crate::auth::presented_key(req.headers(), &policy.digests) {
            Ok(k) => Some(k),
            Err(message) => return refuse(&path, ApiError::unauthorized(message)),
        }
    } else {
        None
    };
    let caller = Arc::new(Caller {
        key,
        ip,
        policy: policy.clone(),
    });
    if is_admin_route(&path) && caller.role() != Role::Admin {
        return refuse(
            &path,
            ApiError::forbidden(
                "admin_only",
                format!(
                    "{} is a user key; this route needs an admin key",
                    caller.key_who()
                ),
            ),
        );
    }
    let mut guards: Vec<Box<dyn Send + Sync>> = Vec::new();
    if !open {
        if let Some(rule) = caller.rule() {
            match rule.limits.enter(&()) {
                Ok(g) => guards.extend(g.map(|g| Box::new(g) as Box<dyn Send + Sync>)),
                Err(o) => return refuse(&path, caller.rate_limited(&caller.key_who(), &o)),
            }
        }
        if let Some(ip) = ip {
            match policy.per_ip.enter(&ip) {
                Ok(g) => guards.extend(g.map(|g| Box::new(g) as Box<dyn Send + Sync>)),
                Err(o) => {
                    return refuse(
                        &path,
                        caller.rate_limited(&format!("the client address {ip}"), &o),
                    )
                }
            }
        }
    }
    let resp = CALLER.scope(caller, next.run(req)).await;
    if guards.is_empty() {
        return resp;
    }
    // The in-flight places are held until the body (a stream too) ends.
    let (parts, body) = resp.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _held = &guards;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}

impl ApiError {
    /// 403 with a code saying which rule refused.
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::FORBIDDEN,
            message: message.into(),
            kind: "permission_error",
            code: Some(code),
            param: None,
            retry_after_secs: None,
        }
    }

    /// 429 for a rate or concurrency limit, with its `Retry-After`.
    pub fn rate_limited(message: impl Into<String>, retry_after_secs: u64) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            code: Some("rate_limit_exceeded"),
            param: None,
            retry_after_secs: Some(retry_after_secs),
        }
    }
}
