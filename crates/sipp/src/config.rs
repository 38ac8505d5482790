//! Runtime configuration: one typed tree, deserializable from TOML.
//!
//! Every default lives in this file, next to the field it belongs to, so the
//! documentation and the behaviour cannot drift apart. A TOML file only has to
//! name the values it changes:
//!
//! ```toml
//! [context]
//! n_ctx = 4096
//! n_parallel = 8
//!
//! [sampling]
//! temperature = 0.7
//!
//! [sampling.json_bounds]      # JSON mode and open schemas (0 turns a bound off)
//! max_string_chars = 64
//!
//! [cache]
//! mode = "shared_prefix"
//! ```

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

use crate::sampling::SamplingParams;

/// The whole configuration of one local model endpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NativeRuntimeConfig {
    /// Context, batch and thread sizes.
    pub context: ContextConfig,
    /// Default sampling settings; a request overrides them field by field.
    pub sampling: SamplingParams,
    /// Slot and queue limits, and the per-step token budget.
    pub scheduler: SchedulerConfig,
    /// KV prefix reuse and snapshots.
    pub cache: CacheConfig,
    /// Where the weights live (CPU, GPU layers) and how they are mapped.
    pub placement: PlacementConfig,
    /// Logging.
    pub observability: ObservabilityConfig,
    /// Speculative decoding (drafted tokens verified in the step's batch).
    pub speculative: SpeculativeConfig,
    /// LoRA adapters loaded with the model (`[[lora]]`), in id order.
    pub lora: Vec<LoraAdapterConfig>,
    /// A multimodal projector (llama.cpp's `mmproj` GGUF) that lets the model
    /// take images (`--mmproj`). None by default.
    pub mmproj: Option<PathBuf>,
    /// What one request may send in images.
    pub images: ImageConfig,
}

/// Limits on the images of one request (with a projector loaded).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ImageConfig {
    /// Images per request. Default 8.
    pub max_images: usize,
    /// Encoded bytes per image. Default 20 MiB.
    pub max_image_bytes: usize,
    /// Pixels per side. Default 8192.
    pub max_image_side: u32,
}

impl Default for ImageConfig {
    fn default() -> Self {
        let d = crate::media::ImageLimits::default();
        Self {
            max_images: d.max_images,
            max_image_bytes: d.max_bytes,
            max_image_side: d.max_side,
        }
    }
}

impl ImageConfig {
    /// As the limits the image decoder checks.
    pub fn limits(&self) -> crate::media::ImageLimits {
        crate::media::ImageLimits {
            max_images: self.max_images,
            max_bytes: self.max_image_bytes,
            max_side: self.max_image_side,
        }
    }
}

/// A LoRA adapter (GGUF) loaded with the model. Its id is its place in the
/// list. Requests choose adapters with `lora: [{"id", "scale"}]`, or by
/// naming the model `TARGET:NAME`; requests that choose none get every
/// adapter at its global scale (`GET`/`POST /lora-adapters`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraAdapterConfig {
    /// The adapter's GGUF file (made for this model's architecture).
    pub path: PathBuf,
    /// The name that selects it as `model: "TARGET:NAME"`. Default: the
    /// file name without `.gguf`.
    #[serde(default)]
    pub name: Option<String>,
    /// Its scale when applied. Default 1.0.
    #[serde(default = "one")]
    pub scale: f32,
    /// Apply it to requests that choose no adapters (its global scale starts
    /// at `scale`, else at 0: llama-server's `--lora-init-without-apply`).
    /// Default true.
    #[serde(default = "yes")]
    pub apply: bool,
    /// Other model names that select it, as `TARGET:NAME` does (`sipp
    /// serve`).
    #[serde(default)]
    pub aliases: Vec<String>,
}

fn one() -> f32 {
    1.0
}

fn yes() -> bool {
    true
}

impl LoraAdapterConfig {
    /// An adapter applied at `scale` (llama-server's `--lora-scaled`).
    pub fn new(path: PathBuf, scale: f32) -> Self {
        Self {
            path,
            name: None,
            scale,
            apply: true,
            aliases: Vec::new(),
        }
    }

    /// Its name: the configured one, else the file name without `.gguf`.
    pub fn resolved_name(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            let file = self
                .path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            file.strip_suffix(".gguf").unwrap_or(&file).to_string()
        })
    }
}

/// The most LoRA adapters one model loads.
pub const MAX_LORA_ADAPTERS: usize = 64;

/// Context, batch and thread sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContextConfig {
    /// KV cache size in tokens, shared by every sequence (a unified KV cache: the
    /// context is never divided by the slot count). 0 means the model's training
    /// context, capped at 8192. Default 0.
    pub n_ctx: u32,
    /// The most tokens one engine step sends to llama.cpp. Default 512.
    pub n_batch: u32,
    /// The physical micro-batch llama.cpp computes at once. Default 512.
    pub n_ubatch: u32,
    /// Concurrent sequences (slots). Default 8.
    pub n_parallel: u32,
    /// Threads for single-token decoding. 0 means the machine's available
    /// parallelism (never llama.cpp's own default of 4). Default 0.
    pub n_threads: u32,
    /// Threads for prompt batches. 0 means the same as `n_threads`. Default 0.
    pub n_threads_batch: u32,
    /// Flash attention: "auto", "on" or "off". Default "auto".
    pub flash_attention: FlashAttention,
    /// Compute embeddings in this context (needed by the embed operation on
    /// decoder models; encoder-only models always have it). Default false.
    pub embeddings: bool,
    /// Pooling for embeddings; `None` uses the model's own from its GGUF metadata.
    pub pooling: Option<crate::runtime::Pooling>,
}

impl Default for ContextConfig {
    fn default() -> Self {
        Self {
            n_ctx: 0,
            n_batch: 512,
            n_ubatch: 512,
            n_parallel: 8,
            n_threads: 0,
            n_threads_batch: 0,
            flash_attention: FlashAttention::Auto,
            embeddings: false,
            pooling: None,
        }
    }
}

/// llama.cpp's flash-attention policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlashAttention {
    /// Let llama.cpp decide per device.
    Auto,
    /// Always on.
    On,
    /// Always off.
    Off,
}

impl ContextConfig {
    /// Threads for decoding after resolving 0 to the machine's parallelism.
    pub fn resolved_threads(&self) -> u32 {
        if self.n_threads == 0 {
            available_threads()
        } else {
            self.n_threads
        }
    }

    /// Threads for prompt batches after resolving 0.
    pub fn resolved_threads_batch(&self) -> u32 {
        if self.n_threads_batch == 0 {
            self.resolved_threads()
        } else {
            self.n_threads_batch
        }
    }

    /// The context size to allocate for a model trained on `n_ctx_train` tokens.
    pub fn resolved_n_ctx(&self, n_ctx_train: u32) -> u32 {
        if self.n_ctx == 0 {
            n_ctx_train.clamp(1, 8192)
        } else {
            self.n_ctx
        }
    }
}

/// The machine's available parallelism, at least 1.
pub fn available_threads() -> u32 {
    std::thread::available_parallelism()
        .map(|n| u32::try_from(n.get()).unwrap_or(1))
        .unwrap_or(1)
}

/// Slot and queue limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Requests running at once (slots). 0 means `context.n_parallel`. Default 0.
    pub max_running_requests: u32,
    /// Requests waiting for a slot; one more is rejected at once with "queue full".
    /// Default 256.
    pub max_queued_requests: u32,
    /// Token budget of one engine step (decode tokens first, then prompt chunks).
    /// 0 means `context.n_batch`. Default 0.
    pub prefill_chunk_size: u32,
    /// Upper bound on `max_tokens` a request may ask for; 0 means no bound beyond
    /// the context. Default 0.
    pub max_tokens_limit: u32,
    /// `max_tokens` when a request gives none. 0 means "until the context is full".
    /// Default 0.
    pub default_max_tokens: u32,
    /// How a step runs slots on different LoRA adapter sets (llama.cpp
    /// applies adapters per context): `per_set`, one batch per set in every
    /// step, or `rotate`, one set per step in turn (llama-server's way: the
    /// other sets wait). Default `per_set` (see the README's LoRA figures).
    pub mixed_adapters: MixedAdapters,
}

/// How a step runs slots on different LoRA adapter sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MixedAdapters {
    /// Every set advances in every step: one llama.cpp batch per set.
    PerSet,
    /// One set per step, the sets in turn.
    Rotate,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_running_requests: 0,
            max_queued_requests: 256,
            prefill_chunk_size: 0,
            max_tokens_limit: 0,
            default_max_tokens: 0,
            mixed_adapters: MixedAdapters::PerSet,
        }
    }
}

/// How KV cache is reused between requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheMode {
    /// Every request prefills its whole prompt in a cleared sequence.
    Off,
    /// A request reuses the idle sequence whose resident tokens share its longest
    /// prefix; only the rest is prefilled.
    LiveSlotPrefix,
    /// Any resident prefix (active or idle sequence, or a snapshot) is copied into
    /// the new sequence instead of being recomputed, and a prefix that several
    /// queued requests share is prefilled once.
    SharedPrefix,
}

/// KV prefix reuse and snapshots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Default `shared_prefix`.
    pub mode: CacheMode,
    /// KV sequences kept in addition to the running slots, so idle prefixes survive
    /// while every slot is busy. Default 8.
    pub idle_sequences: u32,
    /// Shortest common prefix worth copying or waiting for. Default 16.
    pub min_prefix_tokens: u32,
    /// Byte budget of the in-memory snapshot LRU; 0 disables snapshots.
    /// Default 256 MiB.
    pub max_snapshot_bytes: u64,
    /// Entry budget of the snapshot LRU. Default 64.
    pub max_snapshot_entries: u32,
    /// Optional directory where evicted snapshots are spilled and looked up.
    pub snapshot_dir: Option<PathBuf>,
    /// Park idle prefixes in the in-memory snapshot store while other
    /// requests compute, instead of leaving them in the live KV cache: every
    /// decoded row's attention walks the cache's whole used span, so idle
    /// cells slow every step. A parked prefix comes back by a copy when a
    /// prompt continues it. Needs in-memory snapshots. Default true.
    pub park_idle: bool,
    /// Fewest cells of its own (not shared with another sequence) an idle
    /// sequence holds before it is parked: a few hundred idle cells barely
    /// slow a step, and each park costs a copy. Default 128.
    pub park_min_cells: u32,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            mode: CacheMode::SharedPrefix,
            idle_sequences: 8,
            min_prefix_tokens: 16,
            max_snapshot_bytes: 256 * 1024 * 1024,
            max_snapshot_entries: 64,
            snapshot_dir: None,
            park_idle: true,
            park_min_cells: 128,
        }
    }
}

/// Where the weights live: layers on GPUs (a build with the `cuda`, `vulkan`
/// or `metal` feature, or RPC servers) or the CPU, and how they are mapped.
///
/// ```toml
/// [placement]
/// gpu_layers = "auto"     # "auto" | "all" | a count (more than the model has = all)
/// main_gpu = 0
/// split_mode = "layer"    # "none" | "layer" | "row"
/// tensor_split = [3, 1]   # share of each GPU; empty = by free memory
/// kv_offload = true
/// fit = true              # llama.cpp's own fitting checks memory before the load
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlacementConfig {
    /// Layers offloaded to GPU devices. `auto` (the default): every layer
    /// when a GPU or RPC device exists, reduced by llama.cpp's fitting to what
    /// free memory holds; none on a CPU-only build. `all` or a count is taken
    /// as given (a count above the model's layers means all).
    pub gpu_layers: GpuLayers,
    /// The GPU (index among the GPU devices) for the whole model with
    /// `split_mode = "none"`, and for intermediate results. Default 0.
    pub main_gpu: u32,
    /// How layers are spread over several GPUs. Default `layer`.
    pub split_mode: SplitMode,
    /// Each GPU's share of the layers, in device order (e.g. `[3, 1]`).
    /// Empty (the default) spreads by free memory. Parts are at least 0 and
    /// at least one is above 0.
    pub tensor_split: Vec<f32>,
    /// Keep the KV cache (and attention) on the GPU with its layers.
    /// Default true.
    pub kv_offload: bool,
    /// Run llama.cpp's memory fitting (`common_fit_params`, llama-server's
    /// `--fit`) before the load: a model or context that does not fit is a
    /// clear error instead of an allocation failure, and `gpu_layers = "auto"`
    /// offloads only what fits. Default true.
    pub fit: bool,
    /// Memory the fitting leaves free on each device, in MiB (llama-server's
    /// `--fit-target`). Default 1024.
    pub fit_margin_mib: u32,
    /// Map the model file instead of reading it. Default true.
    pub use_mmap: bool,
    /// Lock the weights in RAM. Default false.
    pub use_mlock: bool,
    /// llama.cpp RPC servers (`rpc-server`, ggml devices over TCP) as
    /// `host:port`, to spread the model's layers over other hosts (with
    /// `gpu_layers = "auto"` every layer goes to them). ggml's RPC client
    /// aborts the process when a server drops, so `sipp serve` runs such a
    /// target in a supervised child process. Default: none.
    pub rpc: Vec<String>,
}

/// How many layers go to GPU devices: `"auto"`, `"all"` or a count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuLayers {
    /// Every layer when a GPU or RPC device exists (fitted to free memory),
    /// none otherwise.
    #[default]
    Auto,
    /// Every layer, without fitting the count.
    All,
    /// This many layers (more than the model has means all).
    Count(u32),
}

impl std::str::FromStr for GpuLayers {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(GpuLayers::Auto),
            "all" => Ok(GpuLayers::All),
            t => match t.parse::<i64>() {
                Ok(n) if n < 0 => Err(format!(
                    "a layer count is 0 or more, got {n} (use \"all\" or \"auto\")"
                )),
                Ok(n) => Ok(GpuLayers::Count(u32::try_from(n).unwrap_or(u32::MAX))),
                Err(_) => Err(format!(
                    "expected \"auto\", \"all\" or a layer count, got `{t}`"
                )),
            },
        }
    }
}

impl std::fmt::Display for GpuLayers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuLayers::Auto => f.write_str("auto"),
            GpuLayers::All => f.write_str("all"),
            GpuLayers::Count(n) => write!(f, "{n}"),
        }
    }
}

impl Serialize for GpuLayers {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            GpuLayers::Count(n) => s.serialize_u32(*n),
            other => s.serialize_str(&other.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for GpuLayers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            Text(String),
        }
        let text = match Raw::deserialize(d)? {
            Raw::Int(n) => n.to_string(),
            Raw::Text(t) => t,
        };
        text.parse()
            .map_err(|e: String| serde::de::Error::custom(format!("gpu_layers: {e}")))
    }
}

/// How llama.cpp spreads a model over several GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SplitMode {
    /// The whole model on `main_gpu`.
    None,
    /// Whole layers (and their KV) per GPU.
    #[default]
    Layer,
    /// Rows of each weight split across GPUs (tensor parallelism where the
    /// backend supports it).
    Row,
}

impl std::str::FromStr for SplitMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "none" => Ok(SplitMode::None),
            "layer" => Ok(SplitMode::Layer),
            "row" => Ok(SplitMode::Row),
            t => Err(format!("expected none, layer or row, got `{t}`")),
        }
    }
}

/// The most RPC servers one model may use (ggml's `GGML_RPC_MAX_SERVERS`).
pub const MAX_RPC_SERVERS: usize = 16;

/// The most GPUs a tensor split may name (llama.cpp's `LLAMA_MAX_DEVICES`).
pub const MAX_SPLIT_DEVICES: usize = 16;

impl PlacementConfig {
    /// Parses a tensor split as llama-server's `--tensor-split 3,1` writes it.
    pub fn parse_tensor_split(text: &str) -> Result<Vec<f32>, String> {
        text.split([',', '/'])
            .map(|p| {
                p.trim()
                    .parse::<f32>()
                    .map_err(|_| format!("`{}` is not a number", p.trim()))
            })
            .collect()
    }

    /// Field ranges: RPC endpoints are `host:port` with a port in
    /// 1..=65535; tensor-split parts are finite, at least 0, not all 0.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |field: &'static str, message: String| Err(ConfigError::Invalid { field, message });
        if !self.tensor_split.is_empty() {
            let ts = &self.tensor_split;
            if ts.len() > MAX_SPLIT_DEVICES {
                return invalid(
                    "placement.tensor_split",
                    format!("at most {MAX_SPLIT_DEVICES} parts, got {}", ts.len()),
                );
            }
            if let Some(p) = ts.iter().find(|p| !p.is_finite() || **p < 0.0) {
                return invalid(
                    "placement.tensor_split",
                    format!("each part is a share of 0 or more, got {p} in {ts:?}"),
                );
            }
            if ts.iter().all(|p| *p == 0.0) {
                return invalid(
                    "placement.tensor_split",
                    format!("at least one part must be above 0, got {ts:?}"),
                );
            }
        }
        if self.rpc.len() > MAX_RPC_SERVERS {
            return invalid(
                "placement.rpc",
                format!("at most {MAX_RPC_SERVERS} servers, got {}", self.rpc.len()),
            );
        }
        for e in &self.rpc {
            let ok = e.rsplit_once(':').is_some_and(|(host, port)| {
                !host.trim().is_empty()
                    && !host.contains(char::is_whitespace)
                    && port.parse::<u16>().is_ok_and(|p| p > 0)
            });
            if !ok {
                return invalid(
                    "placement.rpc",
                    format!("`{e}` is not host:port (e.g. 10.0.0.5:50052)"),
                );
            }
        }
        Ok(())
    }
}

impl Default for PlacementConfig {
    fn default() -> Self {
        Self {
            gpu_layers: GpuLayers::Auto,
            main_gpu: 0,
            split_mode: SplitMode::Layer,
            tensor_split: Vec::new(),
            kv_offload: true,
            fit: true,
            fit_margin_mib: 1024,
            use_mmap: true,
            use_mlock: false,
            rpc: Vec::new(),
        }
    }
}

/// The most tokens a slot may draft in one step (config and requests).
pub const MAX_DRAFT_TOKENS: u32 = 64;

/// How a decoding slot drafts tokens for the next step to verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpeculativeMode {
    /// One token per step.
    Off,
    /// Prompt lookup: the slot's last tokens are matched against its prompt
    /// and what it generated, and what followed the match is drafted.
    Ngram,
    /// A draft model (`draft_model`, sharing the target's vocabulary) drafts
    /// greedily.
    Draft,
}

impl SpeculativeMode {
    /// The name used in config, flags and requests.
    pub fn as_str(self) -> &'static str {
        match self {
            SpeculativeMode::Off => "off",
            SpeculativeMode::Ngram => "ngram",
            SpeculativeMode::Draft => "draft",
        }
    }
}

/// Speculative decoding: each decoding slot drafts up to `n_max` tokens, and
/// the step verifies them in the same batch as everything else, as many as
/// the measured step costs and the drafts' acceptance say pay. A request may
/// choose its own mode and `n_max`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SpeculativeConfig {
    /// `off`, `ngram` or `draft`. Default `ngram`: drafts go into a step
    /// only where the measured step costs and the drafts' acceptance say
    /// they pay, so text that does not repeat itself loses nothing (see the
    /// README for the figures).
    pub mode: SpeculativeMode,
    /// Most tokens drafted per slot and step. Default 32.
    pub n_max: u32,
    /// Shortest n-gram match that drafts. Default 2.
    pub ngram_min: u32,
    /// Longest n-gram matched (a longer match drafts with more confidence).
    /// Default 64.
    pub ngram_max: u32,
    /// A GGUF draft model sharing the target's vocabulary, loaded next to it
    /// (needed by `draft`, and by requests that ask for it).
    pub draft_model: Option<PathBuf>,
    /// The draft model's context in tokens (one sequence per slot); 0 means
    /// the target's. Default 0.
    pub draft_n_ctx: u32,
    /// A step's fixed cost over the cost of one more batch row, which decides
    /// how many drafted tokens are worth verifying (a row pays when its
    /// token's chance of acceptance beats the step's tokens per cost). 0
    /// measures it from the batches that run. Default 0.
    pub row_cost_ratio: f32,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            mode: SpeculativeMode::Ngram,
            n_max: 32,
            ngram_min: 2,
            ngram_max: 64,
            draft_model: None,
            draft_n_ctx: 0,
            row_cost_ratio: 0.0,
        }
    }
}

/// Logging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ObservabilityConfig {
    /// Forward llama.cpp's own log lines to `tracing` (they are silenced otherwise).
    /// Default false.
    pub llama_logs: bool,
    /// Log one line per finished request at info level. Default false.
    pub log_requests: bool,
}

impl Default for ObservabilityConfig {
    fn default() -> Self {
        Self {
            llama_logs: false,
            log_requests: false,
        }
    }
}

/// A configuration value that cannot work.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// A field is outside its range.
    #[error("invalid config `{field}`: {message}")]
    Invalid {
        /// Dotted path of the field.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The TOML text does not parse.
    #[error("invalid config file: {0}")]
    Parse(String),
}

impl NativeRuntimeConfig {
    /// Parses a TOML document.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))
    }

    /// Slots after resolving 0.
    pub fn slots(&self) -> u32 {
        if self.scheduler.max_running_requests == 0 {
            self.context.n_parallel.max(1)
        } else {
            self.scheduler.max_running_requests
        }
    }

    /// The per-step token budget after resolving 0.
    pub fn step_budget(&self) -> u32 {
        let chunk = if self.scheduler.prefill_chunk_size == 0 {
            self.context.n_batch
        } else {
            self.scheduler.prefill_chunk_size
        };
        chunk.min(self.context.n_batch)
    }

    /// Checks the values that llama.cpp would otherwise reject late or abort on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field, message: String| Err(ConfigError::Invalid { field, message });
        if self.context.n_batch == 0 {
            return invalid("context.n_batch", "must be at least 1".into());
        }
        if self.context.n_ubatch == 0 || self.context.n_ubatch > self.context.n_batch {
            return invalid(
                "context.n_ubatch",
                format!("must be between 1 and n_batch ({})", self.context.n_batch),
            );
        }
        let slots = self.slots();
        if slots == 0 || slots > 128 {
            return invalid(
                "scheduler.max_running_requests",
                format!("must be between 1 and 128, got {slots}"),
            );
        }
        if slots + self.cache.idle_sequences > 256 {
            return invalid(
                "cache.idle_sequences",
                "running slots plus idle sequences must be at most 256".into(),
            );
        }
        if self.step_budget() < slots {
            return invalid(
                "scheduler.prefill_chunk_size",
                format!(
                    "the step budget ({}) must fit one decode token per slot ({slots})",
                    self.step_budget()
                ),
            );
        }
        self.sampling.validate().map_err(|e| ConfigError::Invalid {
            field: "sampling",
            message: e.to_string(),
        })?;
        self.placement.validate()?;
        let spec = &self.speculative;
        if spec.n_max > MAX_DRAFT_TOKENS {
            return invalid(
                "speculative.n_max",
                format!("must be at most {MAX_DRAFT_TOKENS}, got {}", spec.n_max),
            );
        }
        if spec.mode == SpeculativeMode::Draft && spec.draft_model.is_none() {
            return invalid(
                "speculative.draft_model",
                "mode `draft` needs a draft model (a GGUF sharing the target's vocabulary)".into(),
            );
        }
        if spec.ngram_min == 0 || spec.ngram_max < spec.ngram_min || spec.ngram_max > 256 {
            return invalid(
                "speculative.ngram_min",
                format!(
                    "need 1 <= ngram_min <= ngram_max <= 256, got {} and {}",
                    spec.ngram_min, spec.ngram_max
                ),
            );
        }
        self.validate_lora()
    }

    fn validate_lora(&self) -> Result<(), ConfigError> {
        let invalid = |message: String| {
            Err(ConfigError::Invalid {
                field: "lora",
                message,
            })
        };
        if self.lora.len() > MAX_LORA_ADAPTERS {
            return invalid(format!(
                "at most {MAX_LORA_ADAPTERS} adapters, got {}",
                self.lora.len()
            ));
        }
        let mut names = std::collections::HashSet::new();
        for (id, a) in self.lora.iter().enumerate() {
            let name = a.resolved_name();
            if name.is_empty() || name.contains(':') || name.contains(char::is_whitespace) {
                return invalid(format!(
                    "adapter {id} ({}): a name is non-empty, without `:` or spaces, got {name:?}",
                    a.path.display()
                ));
            }
            if !names.insert(name.clone()) {
                return invalid(format!(
                    "two adapters are named `{name}`: give one a `name`"
                ));
            }
            if !a.scale.is_finite() {
                return invalid(format!(
                    "adapter `{name}`: scale must be finite, got {}",
                    a.scale
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_adapters_parse_with_names_and_refuse_clashes() {
        let cfg = NativeRuntimeConfig::from_toml(
            "[scheduler]\nmixed_adapters = \"rotate\"\n[[lora]]\npath = \"/a/pirate.gguf\"\n[[lora]]\npath = \"/a/b.gguf\"\nname = \"formal\"\nscale = 0.5\napply = false\naliases = [\"smol-formal\"]\n",
        )
        .unwrap();
        assert_eq!(cfg.scheduler.mixed_adapters, MixedAdapters::Rotate);
        assert_eq!(cfg.lora[0].resolved_name(), "pirate");
        assert_eq!((cfg.lora[0].scale, cfg.lora[0].apply), (1.0, true));
        assert_eq!(cfg.lora[1].resolved_name(), "formal");
        assert_eq!(cfg.lora[1].aliases, vec!["smol-formal".to_string()]);
        cfg.validate().unwrap();
        for (edit, why) in [
            ((1, Some("pirate")), "named `pirate`"),
            ((1, Some("a:b")), "without `:`"),
        ] {
            let mut c = cfg.clone();
            c.lora[edit.0].name = edit.1.map(str::to_string);
            let e = c.validate().expect_err(why).to_string();
            assert!(e.contains("lora") && e.contains(why), "{e}");
        }
        let mut c = cfg.clone();
        c.lora[0].scale = f32::NAN;
        assert!(c.validate().is_err());
        assert!(NativeRuntimeConfig::from_toml("[[lora]]\npath = \"x\"\nweight = 1\n").is_err());
    }

    #[test]
    fn placement_parses_and_refuses_what_llama_cpp_would_abort_on() {
        let cfg = NativeRuntimeConfig::from_toml(
            "[placement]\ngpu_layers = 12\nsplit_mode = \"row\"\ntensor_split = [3, 1]\nmain_gpu = 1\nkv_offload = false\n",
        )
        .unwrap();
        let p = &cfg.placement;
        assert_eq!(p.gpu_layers, GpuLayers::Count(12));
        assert_eq!(
            (p.split_mode, p.main_gpu, p.kv_offload),
            (SplitMode::Row, 1, false)
        );
        assert_eq!(p.tensor_split, vec![3.0, 1.0]);
        for (text, want) in [
            ("\"all\"", GpuLayers::All),
            ("\"auto\"", GpuLayers::Auto),
            ("\"7\"", GpuLayers::Count(7)),
        ] {
            let c = NativeRuntimeConfig::from_toml(&format!("[placement]\ngpu_layers = {text}\n"))
                .unwrap();
            assert_eq!(c.placement.gpu_layers, want, "{text}");
        }
        assert_eq!(
            NativeRuntimeConfig::default().placement.gpu_layers,
            GpuLayers::Auto
        );
        for bad in ["-1", "\"-3\"", "\"most\""] {
            let e = NativeRuntimeConfig::from_toml(&format!("[placement]\ngpu_layers = {bad}\n"))
                .expect_err(bad)
                .to_string();
            assert!(e.contains("gpu_layers"), "{bad}: {e}");
        }
        assert_eq!(
            "99999999999".parse::<GpuLayers>(),
            Ok(GpuLayers::Count(u32::MAX))
        );
        for (split, why) in [
            (vec![1.0, -1.0], "0 or more"),
            (vec![0.0, 0.0], "above 0"),
            (vec![f32::NAN], "0 or more"),
            (vec![1.0; 17], "at most 16"),
        ] {
            let mut c = NativeRuntimeConfig::default();
            c.placement.tensor_split = split.clone();
            let e = c.validate().expect_err("bad split").to_string();
            assert!(
                e.contains("placement.tensor_split") && e.contains(why),
                "{split:?}: {e}"
            );
        }
        assert_eq!(
            PlacementConfig::parse_tensor_split("3,1"),
            Ok(vec![3.0, 1.0])
        );
        assert_eq!(
            PlacementConfig::parse_tensor_split("1/0.5"),
            Ok(vec![1.0, 0.5])
        );
        assert!(PlacementConfig::parse_tensor_split("3,x").is_err());
        assert!("diagonal".parse::<SplitMode>().is_err());
    }

    #[test]
    fn rpc_endpoints_are_host_and_port() {
        let mut cfg = NativeRuntimeConfig::default();
        for good in ["127.0.0.1:50052", "gpu-box.lan:1", "[::1]:50052"] {
            cfg.placement.rpc = vec![good.into()];
            cfg.validate().expect(good);
        }
        for bad in [
            "127.0.0.1",
            ":50052",
            "host:0",
            "host:70000",
            "host:port",
            "a b:1",
        ] {
            cfg.placement.rpc = vec!["127.0.0.1:1".into(), bad.into()];
            let e = cfg.validate().expect_err(bad).to_string();
            assert!(e.contains("placement.rpc") && e.contains(bad), "{bad}: {e}");
        }
        cfg.placement.rpc = (0..17).map(|i| format!("h:{}", i + 1)).collect();
        assert!(cfg
            .validate()
            .expect_err("17")
            .to_string()
            .contains("at most 16"));
    }

    #[test]
    fn defaults_resolve_threads_from_machine() {
        let cfg = ContextConfig::default();
        assert_eq!(cfg.resolved_threads(), available_threads());
        assert_eq!(cfg.resolved_threads_batch(), available_threads());
        assert!(available_threads() >= 1);
    }

    #[test]
    fn toml_overrides_only_named_fields() {
        let cfg = NativeRuntimeConfig::from_toml(
            "[context]\nn_ctx = 1024\n[cache]\nmode = \"off\"\n[sampling]\ntemperature = 0.5\n\
             [sampling.json_bounds]\nmax_string_chars = 0\n",
        )
        .expect("parses");
        assert_eq!(cfg.sampling.json_bounds.max_string_chars, 0);
        assert_eq!(
            cfg.sampling.json_bounds.max_array_items,
            crate::sampling::JsonBounds::default().max_array_items
        );
        assert_eq!(cfg.context.n_ctx, 1024);
        assert_eq!(cfg.context.n_batch, 512);
        assert_eq!(cfg.cache.mode, CacheMode::Off);
        assert_eq!(cfg.sampling.temperature, 0.5);
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn unknown_field_is_rejected_with_its_name() {
        let err = NativeRuntimeConfig::from_toml("[context]\nn_ctxx = 3\n").unwrap_err();
        assert!(err.to_string().contains("n_ctxx"), "{err}");
    }

    #[test]
    fn budget_smaller_than_slots_is_invalid() {
        let mut cfg = NativeRuntimeConfig::default();
        cfg.context.n_parallel = 16;
        cfg.scheduler.prefill_chunk_size = 8;
        let err = cfg.validate().unwrap_err();
        assert!(err.to_string().contains("prefill_chunk_size"), "{err}");
    }

    #[test]
    fn n_ctx_zero_uses_training_context_capped() {
        let cfg = ContextConfig::default();
        assert_eq!(cfg.resolved_n_ctx(2048), 2048);
        assert_eq!(cfg.resolved_n_ctx(131072), 8192);
    }
}
