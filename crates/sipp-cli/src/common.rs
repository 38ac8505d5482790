//! What every command shares: model arguments, config assembly, loading with a
//! progress bar, and errors with exit codes.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sipp::config::SpeculativeMode;
use sipp::engine::StartError;
use sipp::models::ModelError;
use sipp::runtime::RuntimeError;
use sipp::{Engine, EngineError, NativeRuntimeConfig};

/// A command failure: a one-line message and an exit status (2 for bad input).
#[derive(Debug)]
pub struct CliError {
    pub code: u8,
    pub message: String,
}

impl CliError {
    pub fn usage(message: impl Into<String>) -> Self {
        Self {
            code: 2,
            message: message.into(),
        }
    }

    pub fn runtime(message: impl Into<String>) -> Self {
        Self {
            code: 1,
            message: message.into(),
        }
    }
}

impl From<ModelError> for CliError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::NotFetched { .. } | ModelError::NotPulled { .. } => {
                CliError::usage(e.to_string())
            }
            _ => CliError::runtime(e.to_string()),
        }
    }
}

impl From<StartError> for CliError {
    fn from(e: StartError) -> Self {
        match &e {
            StartError::Config(_) | StartError::Runtime(RuntimeError::InvalidModel(_)) => {
                CliError::usage(e.to_string())
            }
            StartError::Runtime(_) => CliError::runtime(e.to_string()),
        }
    }
}

impl From<EngineError> for CliError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::EmptyPrompt
            | EngineError::PromptTooLong { .. }
            | EngineError::InputTooLong { .. }
            | EngineError::InvalidRequest { .. }
            | EngineError::Sampling(_)
            | EngineError::Chat(_)
            | EngineError::Unsupported(_) => CliError::usage(e.to_string()),
            _ => CliError::runtime(e.to_string()),
        }
    }
}

/// Model and runtime arguments shared by the commands that load a model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF path, or a known model name (`default`).
    #[arg(long, short = 'm', default_value = "default")]
    pub model: String,
    /// A TOML runtime config (flags override it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Threads (default: the machine's available parallelism).
    #[arg(long, short = 't')]
    pub threads: Option<u32>,
    /// Context size in tokens.
    #[arg(long = "ctx-size", short = 'c')]
    pub ctx_size: Option<u32>,
    /// Slots (concurrent sequences).
    #[arg(long)]
    pub parallel: Option<u32>,
    /// Tokens per engine step.
    #[arg(long = "batch-size", short = 'b')]
    pub batch_size: Option<u32>,
    /// Speculative decoding: `ngram` drafts by matching the last tokens
    /// against the prompt and the text so far; `draft` by a draft model
    /// (`--draft-model`); `off` decodes one token per step.
    #[arg(long, value_parser = ["off", "ngram", "draft"])]
    pub speculative: Option<String>,
    /// Most tokens drafted per slot and step.
    #[arg(long = "draft-max")]
    pub draft_max: Option<u32>,
    /// A draft model (GGUF path or known name) sharing the model's vocabulary.
    #[arg(long = "draft-model")]
    pub draft_model: Option<String>,
    /// llama.cpp RPC servers (`rpc-server`) to spread the model's layers
    /// over, as host:port[,host:port...].
    #[arg(long, value_delimiter = ',')]
    pub rpc: Vec<String>,
}

impl ModelArgs {
    /// The runtime config: defaults, then the file, then flags.
    pub fn runtime_config(&self) -> Result<NativeRuntimeConfig, CliError> {
        let mut cfg = match &self.config {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| {
                    CliError::usage(format!("cannot read config {}: {e}", p.display()))
                })?;
                NativeRuntimeConfig::from_toml(&text).map_err(|e| CliError::usage(e.to_string()))?
            }
            None => NativeRuntimeConfig::default(),
        };
        if let Some(t) = self.threads {
            cfg.context.n_threads = t;
            cfg.context.n_threads_batch = t;
        }
        if let Some(c) = self.ctx_size {
            cfg.context.n_ctx = c;
        }
        if let Some(p) = self.parallel {
            cfg.context.n_parallel = p;
            cfg.scheduler.max_running_requests = 0;
        }
        if let Some(b) = self.batch_size {
            cfg.context.n_batch = b;
            cfg.context.n_ubatch = cfg.context.n_ubatch.min(b);
        }
        if let Some(m) = &self.speculative {
            cfg.speculative.mode = match m.as_str() {
                "off" => SpeculativeMode::Off,
                "draft" => SpeculativeMode::Draft,
                _ => SpeculativeMode::Ngram,
            };
        }
        if let Some(d) = &self.draft_model {
            cfg.speculative.draft_model = Some(sipp::models::resolve_or_fetch(d)?);
        }
        if !self.rpc.is_empty() {
            cfg.placement.rpc = self.rpc.clone();
        }
        if let Some(n) = self.draft_max {
            cfg.speculative.n_max = n;
        }
        Ok(cfg)
    }
}

/// Resolves the model (fetching a named one when missing) and loads it, with a
/// progress bar on a terminal; reports the load time on stderr.
pub fn load_engine(model: &str, cfg: NativeRuntimeConfig, quiet: bool) -> Result<Engine, CliError> {
    let path =
        sipp::models::resolve_or_fetch_with(model, &mut crate::commands::store::Bar::new(quiet))?;
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::with_draw_target(Some(100), ProgressDrawTarget::stderr());
        b.set_style(
            ProgressStyle::with_template("loading {msg} [{bar:30}] {percent}%")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        b.set_message(
            path.file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        b
    };
    let start = Instant::now();
    let b2 = bar.clone();
    let engine = Engine::load_with_progress(
        &path,
        cfg,
        Some(Box::new(move |p| b2.set_position((p * 100.0) as u64))),
    );
    bar.finish_and_clear();
    let engine = engine?;
    if !quiet {
        eprintln!(
            "loaded {} ({}) in {:.2} s",
            path.display(),
            engine.info().model.description,
            start.elapsed().as_secs_f64()
        );
    }
    Ok(engine)
}
