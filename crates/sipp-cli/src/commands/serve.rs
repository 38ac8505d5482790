//! `sipp serve`: the HTTP server. Settings come from flags, then environment
//! variables (SIPP_HOST, SIPP_PORT, SIPP_MODEL, SIPP_API_KEY, SIPP_CONFIG), then
//! the TOML file, then the defaults.

use std::path::PathBuf;

use clap::Args;
use sipp_server::{ModelTarget, ServeConfig};

use crate::common::CliError;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Serve one model: a GGUF path or a known name (replaces the file's models).
    #[arg(long, short = 'm', env = "SIPP_MODEL")]
    pub model: Option<String>,
    /// A TOML server config ([server] and [[models]]).
    #[arg(long, env = "SIPP_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to bind (default 127.0.0.1).
    #[arg(long, env = "SIPP_HOST")]
    pub host: Option<String>,
    /// Port (default 8080; 0 picks a free one).
    #[arg(long, short = 'p', env = "SIPP_PORT")]
    pub port: Option<u16>,
    /// An API key clients must send as a Bearer token.
    #[arg(long = "api-key", env = "SIPP_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Allow this CORS origin (repeatable; "*" for any).
    #[arg(long = "cors-origin")]
    pub cors_origins: Vec<String>,
    /// Threads per model (default: the machine's available parallelism).
    #[arg(long, short = 't')]
    pub threads: Option<u32>,
    /// Context size per model.
    #[arg(long = "ctx-size", short = 'c')]
    pub ctx_size: Option<u32>,
    /// Slots per model.
    #[arg(long)]
    pub parallel: Option<u32>,
    /// Waiting requests per model before 429.
    #[arg(long = "max-queue")]
    pub max_queue: Option<u32>,
    /// Compute embeddings (for /v1/embeddings on a generation model).
    #[arg(long)]
    pub embeddings: bool,
    /// Pooling of embeddings (llama-server's `--pooling`); `rank` serves a
    /// cross-encoder for /v1/rerank.
    #[arg(long, value_enum)]
    pub pooling: Option<crate::commands::embed::PoolingArg>,
    /// Serve a reranker: embeddings with rank pooling (llama-server's
    /// `--reranking`, the same as `--embeddings --pooling rank`).
    #[arg(long, visible_alias = "rerank")]
    pub reranking: bool,
    /// Seconds in-flight requests get at shutdown.
    #[arg(long = "shutdown-grace")]
    pub shutdown_grace: Option<u64>,
    /// The shape of GET /get_load for routers: sglang (default) or vllm.
    #[arg(long = "load-format")]
    pub load_format: Option<sipp_server::config::LoadFormat>,
    /// Directory for slot files (server.slot_save_path): enables
    /// POST /slots/{id}?action=save|restore (llama-server's flag).
    #[arg(long = "slot-save-path", value_name = "DIR")]
    pub slot_save_path: Option<PathBuf>,
    /// The most local models in memory at once (server.models_max); loading
    /// another unloads the least recently used.
    #[arg(long = "models-max", value_name = "N")]
    pub models_max: Option<usize>,
    /// Unload a local model unused for this many seconds
    /// (server.idle_unload_secs); its next request loads it again.
    #[arg(long = "idle-unload", value_name = "SECS")]
    pub idle_unload: Option<u64>,
    /// llama.cpp RPC servers (`rpc-server`) to spread each model's layers
    /// over, as host:port[,host:port...]; such a target runs in a supervised
    /// child process.
    #[arg(long, value_delimiter = ',')]
    pub rpc: Vec<String>,
    /// Run as a supervised child: RPC-backed targets load in this process,
    /// the bound address goes to stdout as `{"listening": ADDR}`, and the
    /// server exits when stdin closes (its parent is gone).
    #[arg(long, hide = true)]
    pub supervised: bool,
    #[command(flatten)]
    pub placement: crate::common::PlacementArgs,
    #[command(flatten)]
    pub lora: crate::common::LoraArgs,
    #[command(flatten)]
    pub projector: crate::common::ProjectorArgs,
    /// Fetch http(s) image URLs in requests (server.fetch_image_urls; off
    /// by default: only data URLs are read).
    #[arg(long = "fetch-image-urls")]
    pub fetch_image_urls: bool,
}

/// The effective configuration.
pub fn effective_config(args: &ServeArgs) -> Result<ServeConfig, CliError> {
    let mut cfg = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| CliError::usage(format!("cannot read {}: {e}", p.display())))?;
            ServeConfig::from_toml(&text).map_err(CliError::usage)?
        }
        None => ServeConfig::default(),
    };
    if let Some(h) = &args.host {
        cfg.server.host = h.clone();
    }
    if let Some(p) = args.port {
        cfg.server.port = p;
    }
    if let Some(k) = &args.api_key {
        if !k.is_empty() {
            cfg.server.api_keys.push(k.clone().into());
        }
    }
    cfg.server
        .cors_origins
        .extend(args.cors_origins.iter().cloned());
    if let Some(g) = args.shutdown_grace {
        cfg.server.shutdown_grace_secs = g;
    }
    if let Some(f) = args.load_format {
        cfg.server.load_format = f;
    }
    if let Some(d) = &args.slot_save_path {
        cfg.server.slot_save_path = Some(d.clone());
    }
    if args.fetch_image_urls {
        cfg.server.fetch_image_urls = true;
    }
    if let Some(n) = args.models_max {
        cfg.server.models_max = Some(n);
    }
    if let Some(s) = args.idle_unload {
        cfg.server.idle_unload_secs = Some(s);
    }
    if let Some(m) = &args.model {
        let runtime = cfg
            .models
            .first()
            .map(|t| t.runtime.clone())
            .unwrap_or_default();
        let stem = std::path::Path::new(m)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .filter(|s| s != m);
        cfg.models = vec![ModelTarget {
            id: m.clone(),
            model: m.clone(),
            default: true,
            aliases: stem.into_iter().collect(),
            provider: None,
            runtime,
            load: Default::default(),
        }];
    }
    if cfg.models.is_empty() {
        cfg.models.push(ModelTarget {
            id: "default".into(),
            model: "default".into(),
            default: true,
            aliases: vec![sipp::models::DEFAULT_MODEL
                .file_name
                .trim_end_matches(".gguf")
                .to_string()],
            provider: None,
            runtime: Default::default(),
            load: Default::default(),
        });
    }
    for t in &mut cfg.models {
        if let Some(n) = args.threads {
            t.runtime.context.n_threads = n;
            t.runtime.context.n_threads_batch = n;
        }
        if let Some(c) = args.ctx_size {
            t.runtime.context.n_ctx = c;
        }
        if let Some(p) = args.parallel {
            t.runtime.context.n_parallel = p;
            t.runtime.scheduler.max_running_requests = 0;
        }
        if let Some(q) = args.max_queue {
            t.runtime.scheduler.max_queued_requests = q;
        }
        if args.embeddings || args.reranking {
            t.runtime.context.embeddings = true;
        }
        if let Some(p) = args.pooling {
            t.runtime.context.pooling = Some(p.into());
        }
        if args.reranking {
            t.runtime.context.pooling = Some(sipp::runtime::Pooling::Rank);
        }
        if !args.rpc.is_empty() && t.provider.is_none() {
            t.runtime.placement.rpc = args.rpc.clone();
        }
        args.placement.apply(&mut t.runtime);
        if t.provider.is_none() {
            args.lora.apply(&mut t.runtime);
            args.projector.apply(&mut t.runtime);
        }
    }
    cfg.child = args.supervised;
    cfg.validate().map_err(CliError::usage)?;
    Ok(cfg)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// Resolves when stdin reaches its end: a supervised child's parent closed
/// the pipe (or died), so the child stops too. The reader is a detached
/// thread, so a child stopped by a signal does not wait for it.
async fn stdin_closed() {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut sink = [0u8; 64];
        let mut stdin = std::io::stdin();
        while let Ok(n) = std::io::Read::read(&mut stdin, &mut sink) {
            if n == 0 {
                break;
            }
        }
        let _ = tx.send(());
    });
    let _ = rx.await;
}

/// Refuses, before the port is bound, a local model whose placement cannot
/// work (a GPU that does not exist; a model and context that do not fit, by
/// llama.cpp's fitting on the file's metadata), as llama-server exits when
/// its model cannot load. Models not on disk yet, on-demand and RPC-backed
/// targets are checked when they load.
fn check_placements(cfg: &ServeConfig) -> Result<(), CliError> {
    for t in &cfg.models {
        let local = t.provider.is_none() && t.runtime.placement.rpc.is_empty();
        let Some(path) = local
            .then(|| sipp::models::resolve(&t.model).ok())
            .flatten()
        else {
            continue;
        };
        let r = &t.runtime;
        check_adapters(&t.id, &path, r)?;
        if t.load != sipp_server::config::LoadWhen::Startup {
            continue;
        }
        let n_seq = r.slots() + r.cache.idle_sequences;
        if let Err(e @ sipp::runtime::RuntimeError::Placement(_)) =
            sipp::runtime::llama::check_placement(&path, r, n_seq)
        {
            return Err(CliError::usage(format!("model `{}`: {e}", t.id)));
        }
    }
    Ok(())
}

/// Refuses, before the port is bound, a LoRA adapter that is not one or
/// is made for another architecture (as llama-server exits on a bad
/// `--lora`).
fn check_adapters(
    id: &str,
    model: &std::path::Path,
    r: &sipp::NativeRuntimeConfig,
) -> Result<(), CliError> {
    if let Some(p) = &r.mmproj {
        if !p.is_file() {
            return Err(CliError::usage(format!(
                "model `{id}`: projector {}: no such file",
                p.display()
            )));
        }
    }
    if r.lora.is_empty() {
        return Ok(());
    }
    let arch = sipp::runtime::gguf::check_gguf(model)
        .ok()
        .and_then(|h| h.architecture().map(str::to_string))
        .unwrap_or_default();
    for (i, a) in r.lora.iter().enumerate() {
        sipp::runtime::lora::check_adapter(i, &a.path, &arch)
            .map_err(|e| CliError::usage(format!("model `{id}`: {e}")))?;
    }
    Ok(())
}

pub fn run(args: ServeArgs) -> Result<(), CliError> {
    let cfg = effective_config(&args)?;
    check_placements(&cfg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::runtime(e.to_string()))?;
    rt.block_on(async move {
        let (listener, state) = sipp_server::bind(&cfg).await.map_err(|e| {
            CliError::usage(format!(
                "cannot listen on {}:{}: {e}",
                cfg.server.host, cfg.server.port
            ))
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| CliError::runtime(e.to_string()))?;
        let ids: Vec<&str> = cfg.models.iter().map(|m| m.id.as_str()).collect();
        eprintln!(
            "listening on http://{addr} (models: {}; /health is 503 until loaded)",
            ids.join(", ")
        );
        let supervised = cfg.child;
        if supervised {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            writeln!(
                out,
                "{}",
                serde_json::json!({ "listening": addr.to_string() })
            )
            .and_then(|()| out.flush())
            .map_err(|e| CliError::runtime(e.to_string()))?;
        }
        let stop = async move {
            if supervised {
                tokio::select! {
                    () = shutdown_signal() => {},
                    () = stdin_closed() => {},
                }
            } else {
                shutdown_signal().await;
            }
        };
        sipp_server::run(listener, state, &cfg, stop)
            .await
            .map_err(|e| CliError::runtime(e.to_string()))
    })?;
    eprintln!("stopped");
    Ok(())
}
