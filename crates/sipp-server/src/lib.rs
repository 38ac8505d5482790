//! `sipp serve`: OpenAI's API and sipp's first-party profile over sipp engines,
//! with API keys, Prometheus metrics, limits and graceful shutdown.
//!
//! [`app`] builds the router (tests call it without a port); [`bind`] and
//! [`run`] serve it.

pub mod auth;
pub mod child;
pub mod config;
pub mod dashboard;
pub mod error;
pub mod images;
pub mod metrics;
pub mod policy;
pub mod residency;
pub mod routes;
pub mod state;

use std::future::Future;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

pub use config::{LoadWhen, ModelTarget, ServeConfig, ServerSection};
pub use state::{AppState, Target, TargetState};

/// The router for a state and CORS settings.
pub fn app(state: AppState, cors_origins: &[String]) -> Router {
    let mut router = Router::new()
        .route("/v1/completions", post(routes::openai::completions))
        .route(
            "/v1/chat/completions",
            post(routes::openai::chat_completions),
        )
        .route(
            "/v1/completions/render",
            post(routes::worker::render_completions),
        )
        .route(
            "/v1/chat/completions/render",
            post(routes::worker::render_chat),
        )
        .route("/v1/embeddings", post(routes::openai::embeddings))
        .route(
            "/v1/messages",
            post(routes::anthropic::messages).fallback(routes::anthropic::method_not_allowed),
        )
        .route(
            "/v1/messages/count_tokens",
            post(routes::anthropic::count_tokens).fallback(routes::anthropic::method_not_allowed),
        )
        .route("/v1/responses", post(routes::responses::create))
        .route(
            "/v1/responses/{id}",
            get(routes::responses::retrieve).delete(routes::responses::delete),
        )
        .route("/v1/models", get(routes::ops::models))
        .route("/models/load", post(routes::ops::load_model))
        .route("/models/unload", post(routes::ops::unload_model))
        .route("/v1/query", post(routes::native::query))
        .route("/v1/chat", post(routes::native::chat))
        .route("/v1/embed", post(routes::native::embed))
        .route("/v1/rerank", post(routes::rerank::rerank))
        .route("/rerank", post(routes::rerank::rerank))
        .route("/infill", post(routes::infill::infill))
        .route("/health", get(routes::ops::health))
        .route("/metrics", get(routes::ops::metrics))
        .route("/tokenize", post(routes::ops::tokenize))
        .route("/model_info", get(routes::worker::model_info))
        .route("/get_model_info", get(routes::worker::model_info))
        .route("/server_info", get(routes::worker::server_info))
        .route("/get_server_info", get(routes::worker::server_info))
        .route("/get_load", get(routes::worker::get_load))
        .route("/slots", get(routes::worker::slots))
        .route(
            "/lora-adapters",
            get(routes::lora::list).post(routes::lora::set),
        )
        .route("/slots/{id}", post(routes::slots::slot_action))
        .route("/v1/sessions/{key}", post(routes::slots::session_action))
        .route("/detokenize", post(routes::ops::detokenize))
        .route("/v1/dashboard", get(routes::dashboard::state))
        .route("/", get(routes::web::chat_page))
        .route("/dashboard", get(routes::web::dashboard_page))
        .route("/ui/{*path}", get(routes::web::asset))
        .fallback(routes::ops::not_found)
        .method_not_allowed_fallback(routes::ops::method_not_allowed)
        // The JSON extractor enforces the configured limit itself.
        .layer(DefaultBodyLimit::disable())
        // Innermost: a model is brought into memory (and held there) for
        // the request's route.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            residency::middleware::ensure_loaded,
        ))
        // Inside the policy gate: forwarded requests are checked like any.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            child::proxy::forward,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            policy::gate,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            routes::record_metrics,
        ));
    if !cors_origins.is_empty() {
        let origins = if cors_origins.iter().any(|o| o == "*") {
            AllowOrigin::any()
        } else {
            AllowOrigin::list(cors_origins.iter().filter_map(|o| o.parse().ok()))
        };
        router = router.layer(
            CorsLayer::new()
                .allow_origin(origins)
                .allow_methods(Any)
                .allow_headers(Any),
        );
    }
    router.with_state(state)
}

/// Binds the listener and builds the state; models start loading at once,
/// while /health answers 503.
pub async fn bind(config: &ServeConfig) -> std::io::Result<(tokio::net::TcpListener, AppState)> {
    config
        .validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let listener =
        tokio::net::TcpListener::bind((config.server.host.as_str(), config.server.port)).await?;
    let state = AppState::new(config);
    state.spawn_loading(config.models.clone());
    state.spawn_sampler();
    state.spawn_idle_unloader();
    Ok((listener, state))
}

/// Serves until `shutdown` resolves; then stops accepting, lets in-flight
/// requests finish for the grace period, and cancels what is left.
pub async fn run(
    listener: tokio::net::TcpListener,
    state: AppState,
    config: &ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let grace = Duration::from_secs(config.server.shutdown_grace_secs);
    let router = app(state.clone(), &config.server.cors_origins);
    let st = state.clone();
    // The connection's address is the client's (or its proxy's) for the
    // traffic policy.
    let service = router.into_make_service_with_connect_info::<std::net::SocketAddr>();
    axum::serve(listener, service)
        .with_graceful_shutdown(async move {
            shutdown.await;
            tracing::info!("shutting down: finishing in-flight requests (up to {grace:?})");
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                for (id, engine) in st.engines() {
                    tracing::warn!(model = %id, "grace period over: cancelling what is left");
                    engine.cancel_all();
                }
            });
        })
        .await
}
