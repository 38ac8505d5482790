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
            StartError::Config(_)
            | StartError::Runtime(
                RuntimeError::InvalidModel(_)
                | RuntimeError::Placement(_)
                | RuntimeError::Lora(_)
                | RuntimeError::Media(_),
            ) => CliError::usage(e.to_string()),
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
    #[command(flatten)]
    pub placement: PlacementArgs,
    #[command(flatten)]
    pub lora: LoraArgs,
    #[command(flatten)]
    pub projector: ProjectorArgs,
}

/// A multimodal projector loaded with the model (llama-server's flag).
#[derive(Args, Debug, Clone, Default)]
pub struct ProjectorArgs {
    /// A multimodal projector (llama.cpp's mmproj GGUF) for the model: it
    /// then takes images (`image_url` parts in chat requests).
    #[arg(long = "mmproj", value_name = "PATH")]
    pub mmproj: Option<PathBuf>,
}

impl ProjectorArgs {
    /// Sets the config's projector from the flag.
    pub fn apply(&self, cfg: &mut NativeRuntimeConfig) {
        if let Some(p) = &self.mmproj {
            cfg.mmproj = Some(p.clone());
        }
    }
}

/// LoRA adapters loaded with the model (llama-server's flags); they come
/// after the config's `[[lora]]` adapters, in flag order (ids follow).
#[derive(Args, Debug, Clone, Default)]
pub struct LoraArgs {
    /// A LoRA adapter (GGUF) applied at scale 1; comma-separated for several.
    #[arg(long = "lora", value_name = "FNAME", value_delimiter = ',')]
    pub lora: Vec<PathBuf>,
    /// LoRA adapters with their scales, as FNAME:SCALE[,FNAME:SCALE...].
    #[arg(long = "lora-scaled", value_name = "FNAME:SCALE", value_delimiter = ',',
          value_parser = parse_lora_scaled)]
    pub lora_scaled: Vec<(PathBuf, f32)>,
    /// Load the adapters without applying them to requests that choose none
    /// (apply later with POST /lora-adapters, or per request).
    #[arg(long = "lora-init-without-apply")]
    pub lora_init_without_apply: bool,
}

fn parse_lora_scaled(s: &str) -> Result<(PathBuf, f32), String> {
    let (path, scale) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("expected FNAME:SCALE, got `{s}`"))?;
    let scale: f32 = scale
        .trim()
        .parse()
        .ok()
        .filter(|v: &f32| v.is_finite())
        .ok_or_else(|| format!("the scale in `{s}` is not a finite number"))?;
    Ok((PathBuf::from(path), scale))
}

impl LoraArgs {
    /// Adds the flags' adapters to a runtime config.
    pub fn apply(&self, cfg: &mut NativeRuntimeConfig) {
        let flagged = self
            .lora
            .iter()
            .map(|p| (p.clone(), 1.0))
            .chain(self.lora_scaled.iter().cloned());
        for (path, scale) in flagged {
            cfg.lora
                .push(sipp::config::LoraAdapterConfig::new(path, scale));
        }
        if self.lora_init_without_apply {
            for l in &mut cfg.lora {
                l.apply = false;
            }
        }
    }
}

/// Where the layers go (llama-server's flags); each overrides the config's
/// `placement` (and `context.flash_attention`).
#[derive(Args, Debug, Clone, Default)]
pub struct PlacementArgs {
    /// Layers on GPU devices: auto (all that fit when a GPU exists), all, or
    /// a count.
    #[arg(long = "gpu-layers", visible_alias = "n-gpu-layers", value_name = "N|all|auto",
          allow_negative_numbers = true, value_parser = parse_gpu_layers)]
    pub gpu_layers: Option<sipp::config::GpuLayers>,
    /// The GPU (index among GPU devices) for the whole model with
    /// `--split-mode none`, and for intermediate results.
    #[arg(long = "main-gpu", value_name = "INDEX", allow_negative_numbers = true,
          value_parser = parse_main_gpu)]
    pub main_gpu: Option<u32>,
    /// How layers spread over several GPUs: none, layer or row.
    #[arg(long = "split-mode", value_name = "none|layer|row")]
    pub split_mode: Option<sipp::config::SplitMode>,
    /// Each GPU's share of the layers, e.g. 3,1.
    #[arg(long = "tensor-split", value_name = "A,B,...", allow_hyphen_values = true,
          value_parser = parse_tensor_split)]
    pub tensor_split: Option<TensorSplit>,
    /// Keep the KV cache on the CPU even when layers are on a GPU.
    #[arg(long = "no-kv-offload")]
    pub no_kv_offload: bool,
    /// Flash attention: on, off or auto.
    #[arg(long = "flash-attn", value_name = "on|off|auto", value_parser = ["on", "off", "auto"])]
    pub flash_attn: Option<String>,
    /// llama.cpp's memory fitting before a load (on by default).
    #[arg(long = "fit", value_name = "on|off", value_parser = ["on", "off"])]
    pub fit: Option<String>,
}

/// A parsed `--tensor-split` (a newtype so clap does not read it as a list).
#[derive(Debug, Clone)]
pub struct TensorSplit(pub Vec<f32>);

fn parse_gpu_layers(s: &str) -> Result<sipp::config::GpuLayers, String> {
    s.parse()
}

fn parse_main_gpu(s: &str) -> Result<u32, String> {
    s.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| format!("a GPU index is 0 or more, got `{s}`"))
}

fn parse_tensor_split(s: &str) -> Result<TensorSplit, String> {
    let mut p = sipp::config::PlacementConfig::default();
    p.tensor_split = sipp::config::PlacementConfig::parse_tensor_split(s)?;
    p.validate().map_err(|e| e.to_string())?;
    Ok(TensorSplit(p.tensor_split))
}

impl PlacementArgs {
    /// Writes the flags given into a runtime config.
    pub fn apply(&self, cfg: &mut NativeRuntimeConfig) {
        let p = &mut cfg.placement;
        if let Some(n) = self.gpu_layers {
            p.gpu_layers = n;
        }
        if let Some(g) = self.main_gpu {
            p.main_gpu = g;
        }
        if let Some(m) = self.split_mode {
            p.split_mode = m;
        }
        if let Some(t) = &self.tensor_split {
            p.tensor_split = t.0.clone();
        }
        if self.no_kv_offload {
            p.kv_offload = false;
        }
        if let Some(f) = &self.fit {
            p.fit = f == "on";
        }
        if let Some(fa) = &self.flash_attn {
            cfg.context.flash_attention = match fa.as_str() {
                "on" => sipp::config::FlashAttention::On,
                "off" => sipp::config::FlashAttention::Off,
                _ => sipp::config::FlashAttention::Auto,
            };
        }
    }
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
        self.placement.apply(&mut cfg);
        self.lora.apply(&mut cfg);
        self.projector.apply(&mut cfg);
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
