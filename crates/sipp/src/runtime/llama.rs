//! The llama.cpp runtime on `llama-cpp-2`. Nothing outside this file uses it.

use std::num::NonZeroU32;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use llama_cpp_2::context::params::{LlamaContextParams, LlamaPoolingType};
use llama_cpp_2::context::session::LlamaStateSeqFlags;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::{LlamaModelParams, LlamaSplitMode};
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::logit_bias::LlamaLogitBias;
use llama_cpp_2::token::LlamaToken;

use super::gguf::{check_gguf, GgufHeader, MetaValue};
use super::placement::Device;
use super::{
    logprobs_from_logits, AdapterSet, Backend, BatchError, BatchRow, ModelInfo, Pooling,
    RuntimeError, SampleError, Sampled, SamplerSpec, SeqId, Token, Vocab,
};
use crate::config::{FlashAttention, GpuLayers, NativeRuntimeConfig, PlacementConfig, SplitMode};
use crate::sampling::{
    look_back, sampler_plan, BiasTarget, ChainStage, JsonBounds, LogitBias, OutputConstraint,
    SamplerPlan, SamplingError,
};

/// llama.cpp's process-wide backend; initialized once.
fn backend() -> Result<&'static LlamaBackend, RuntimeError> {
    static BACKEND: OnceLock<Result<LlamaBackend, String>> = OnceLock::new();
    BACKEND
        .get_or_init(|| {
            let backend = LlamaBackend::init().map_err(|e| e.to_string())?;
            // Before any model loads: llama.cpp reads the CPU backend's extra
            // buffer types when it places a model's weights.
            super::cpu_kernels::register();
            Ok(backend)
        })
        .as_ref()
        .map_err(|e| RuntimeError::Load {
            path: String::new(),
            message: format!("llama.cpp backend init failed: {e}"),
        })
}

/// Routes llama.cpp's own log lines to `tracing`, or silences them.
pub fn configure_llama_logs(enabled: bool) {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        llama_cpp_2::send_logs_to_tracing(
            llama_cpp_2::LogOptions::default().with_logs_enabled(enabled),
        );
    });
}

/// Architectures llama.cpp runs as encoders only (no generation).
const ENCODER_ONLY: &[&str] = &[
    "bert",
    "nomic-bert",
    "nomic-bert-moe",
    "jina-bert-v2",
    "jina-bert-v3",
    "neo-bert",
    "modern-bert",
    "eurobert",
    "t5encoder",
];

/// A loaded model: weights, vocabulary and metadata. Shared by every thread.
pub struct LlamaModelHandle {
    /// The multimodal projector (`mmproj`), when the model takes images.
    /// First: fields drop in order, and libmtmd tokenizes with the model's
    /// vocabulary, so the projector goes before the model.
    projector: Option<super::mtmd::Projector>,
    model: LlamaModel,
    info: ModelInfo,
    /// LoRA adapters loaded with the model, by id (llama.cpp frees them
    /// with the model).
    adapters: Vec<LoadedAdapter>,
}

/// A LoRA adapter llama.cpp loaded for this model.
struct LoadedAdapter(std::ptr::NonNull<llama_cpp_sys_2::llama_adapter_lora>);

// SAFETY: llama.cpp never changes a loaded adapter; contexts only read it.
unsafe impl Send for LoadedAdapter {}
// SAFETY: as above.
unsafe impl Sync for LoadedAdapter {}

/// The raw pointer of a model. `LlamaModel` is `repr(transparent)` over it.
fn model_ptr(model: &LlamaModel) -> *mut llama_cpp_sys_2::llama_model {
    // SAFETY: `LlamaModel` is one non-null pointer (repr(transparent), and the
    // size is asserted in `load_with_split`).
    unsafe {
        std::ptr::from_ref(model)
            .cast::<std::ptr::NonNull<llama_cpp_sys_2::llama_model>>()
            .read()
            .as_ptr()
    }
}

/// Loads the configured LoRA adapters for `model`, after checking each file
/// is a LoRA adapter for this architecture ([`super::lora::check_adapter`]).
fn load_adapters(
    model: &LlamaModel,
    arch: &str,
    config: &NativeRuntimeConfig,
) -> Result<Vec<LoadedAdapter>, RuntimeError> {
    let mut out = Vec::new();
    for (id, a) in config.lora.iter().enumerate() {
        let failed =
            |m: String| RuntimeError::Lora(format!("adapter {id} ({}): {m}", a.path.display()));
        super::lora::check_adapter(id, &a.path, arch)?;
        let cpath = std::ffi::CString::new(a.path.to_string_lossy().as_bytes())
            .map_err(|_| failed("path contains a NUL byte".into()))?;
        // SAFETY: a live model and a NUL-terminated path.
        let raw =
            unsafe { llama_cpp_sys_2::llama_adapter_lora_init(model_ptr(model), cpath.as_ptr()) };
        let raw = std::ptr::NonNull::new(raw).ok_or_else(|| {
            failed("llama.cpp refused it (its tensors do not match this model's)".into())
        })?;
        out.push(LoadedAdapter(raw));
    }
    Ok(out)
}

impl std::fmt::Debug for LlamaModelHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaModelHandle")
            .field("info", &self.info)
            .finish()
    }
}

/// Serializes model loads, llama.cpp's fitting and context creation: the
/// fitting swaps llama.cpp's process-wide logger for one pointing at its own
/// stack frame, so two at once (or a load logging meanwhile) could call
/// through a dangling pointer.
static LOAD_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn load_lock() -> std::sync::MutexGuard<'static, ()> {
    LOAD_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a context is shaped by, read before the model loads (for the
/// fitting) or from the loaded model (for the context itself).
struct ContextShape {
    n_ctx_train: u32,
    encoder_only: bool,
    pooling: Option<Pooling>,
}

fn header_pooling(header: &GgufHeader) -> Option<Pooling> {
    header
        .arch_value("pooling_type")
        .and_then(MetaValue::as_u64)
        .and_then(|p| match p {
            0 => Some(Pooling::None),
            1 => Some(Pooling::Mean),
            2 => Some(Pooling::Cls),
            3 => Some(Pooling::Last),
            4 => Some(Pooling::Rank),
            _ => None,
        })
}

fn header_encoder_only(header: &GgufHeader) -> bool {
    let architecture = header.architecture().unwrap_or("unknown");
    let causal = header
        .arch_value("attention.causal")
        .map(|v| !matches!(v, MetaValue::Bool(false)))
        .unwrap_or(true);
    ENCODER_ONLY.contains(&architecture) || !causal
}

fn header_u32(header: &GgufHeader, key: &str) -> u32 {
    header
        .arch_value(key)
        .and_then(MetaValue::as_u64)
        .and_then(|v| u32::try_from(v).ok())
        .unwrap_or(0)
}

/// A load decided: the checked header, the GPUs there are, and the model
/// parameters after the fitting (`params` is `None` for a tensor split,
/// which loads through [`load_with_split`]).
struct LoadPlan {
    header: GgufHeader,
    params: Option<LlamaModelParams>,
    gpus: Vec<Device>,
    layers: u32,
    total_layers: u32,
}

impl LoadPlan {
    /// RPC servers registered, the GPU choice checked against the devices
    /// there are, then llama.cpp's memory fitting for a context of
    /// `n_seq_max` sequences (unless `placement.fit` is off). Call with the
    /// load lock held.
    fn new(
        path: &Path,
        config: &NativeRuntimeConfig,
        n_seq_max: u32,
    ) -> Result<Self, RuntimeError> {
        let placement = &config.placement;
        let header = check_gguf(path)?;
        backend()?;
        super::rpc::register_servers(&placement.rpc)?;
        let gpus = super::placement::gpu_devices();
        check_gpu_choice(placement, &gpus)?;
        let total_layers = header_u32(&header, "block_count") + 1;
        // `None`: llama.cpp's default (every layer), left for the fitting to lower.
        let layers = match placement.gpu_layers {
            _ if gpus.is_empty() => Some(0),
            GpuLayers::Auto if placement.fit && placement.tensor_split.is_empty() => None,
            GpuLayers::Auto | GpuLayers::All => Some(u32::MAX),
            GpuLayers::Count(n) => Some(n),
        };
        if placement.kv_offload && layers != Some(0) && !header_encoder_only(&header) {
            check_kv_buffers(&header, config, &gpus)?;
        }
        if !placement.tensor_split.is_empty() {
            return Ok(Self {
                header,
                params: None,
                gpus,
                layers: layers.unwrap_or(u32::MAX).min(total_layers),
                total_layers,
            });
        }
        let mut params = LlamaModelParams::default()
            .with_use_mmap(placement.use_mmap)
            .with_use_mlock(placement.use_mlock)
            .with_main_gpu(placement.main_gpu as i32)
            .with_split_mode(split_mode(placement.split_mode));
        if let Some(n) = layers {
            params = params.with_n_gpu_layers(n);
        }
        if placement.fit {
            fit(path, &header, config, n_seq_max, &mut params, &gpus)?;
        }
        let layers = u32::try_from(params.n_gpu_layers()).unwrap_or(u32::MAX);
        Ok(Self {
            header,
            params: Some(params),
            gpus,
            layers: layers.min(total_layers),
            total_layers,
        })
    }

    fn placement(&self, placement: &PlacementConfig) -> super::placement::Placement {
        placed(placement, &self.gpus, self.layers, self.total_layers)
    }
}

/// Checks a placement without loading: the devices it names exist and, with
/// `placement.fit`, the model and a context of `n_seq_max` sequences fit
/// (llama.cpp's fitting reads the file's metadata only). Returns where the
/// layers would go. `sipp serve` runs this before it binds its port.
pub fn check_placement(
    path: &Path,
    config: &NativeRuntimeConfig,
    n_seq_max: u32,
) -> Result<super::placement::Placement, RuntimeError> {
    configure_llama_logs(config.observability.llama_logs);
    let _serial = load_lock();
    let plan = LoadPlan::new(path, config, n_seq_max)?;
    Ok(plan.placement(&config.placement))
}

/// Loads a GGUF model after checking it in Rust, placed as
/// `config.placement` says (see [`check_placement`]); a placement that
/// cannot work is [`RuntimeError::Placement`]. `progress` receives 0..=1.
pub fn load_model(
    path: &Path,
    config: &NativeRuntimeConfig,
    n_seq_max: u32,
    progress: Option<Box<dyn FnMut(f32) + Send>>,
) -> Result<Arc<LlamaModelHandle>, RuntimeError> {
    let _serial = load_lock();
    let plan = LoadPlan::new(path, config, n_seq_max)?;
    let placement = plan.placement(&config.placement);
    let model = match plan.params {
        Some(mut params) => {
            if let Some(mut cb) = progress {
                params = params.with_progress_callback(move |p| {
                    cb(p);
                    true
                });
            }
            LlamaModel::load_from_file(backend()?, path, &params).map_err(|e| {
                RuntimeError::Load {
                    path: path.display().to_string(),
                    message: e.to_string(),
                }
            })?
        }
        None => load_with_split(path, &config.placement, plan.layers, progress)?,
    };
    let mut info = model_info(path, &plan.header, &model);
    info.placement = placement;
    let adapters = load_adapters(&model, &info.architecture, config)?;
    tracing::info!(
        model = %path.display(),
        "placement: {}{}; weights {} MiB",
        info.placement.summary(),
        if info.placement.kv_offload { ", KV cache with them" } else { "" },
        info.size_bytes / (1 << 20)
    );
    if !adapters.is_empty() {
        tracing::info!(model = %path.display(), "{} LoRA adapters loaded", adapters.len());
    }
    let projector = match &config.mmproj {
        Some(p) => {
            let use_gpu = info.placement.offloaded_layers > 0;
            let proj = super::mtmd::Projector::load(
                p,
                model_ptr(&model),
                config.context.resolved_threads() as i32,
                use_gpu,
            )?;
            tracing::info!(model = %path.display(), "projector {} loaded: the model takes images", p.display());
            Some(proj)
        }
        None => None,
    };
    info.takes_images = projector.is_some();
    Ok(Arc::new(LlamaModelHandle {
        model,
        info,
        adapters,
        projector,
    }))
}

fn split_mode(mode: SplitMode) -> LlamaSplitMode {
    match mode {
        SplitMode::None => LlamaSplitMode::None,
        SplitMode::Layer => LlamaSplitMode::Layer,
        SplitMode::Row => LlamaSplitMode::Row,
    }
}

/// `main_gpu` and `tensor_split` name GPUs that exist (llama.cpp would abort
/// or index past its device list otherwise).
fn check_gpu_choice(placement: &PlacementConfig, gpus: &[Device]) -> Result<(), RuntimeError> {
    let seen = || {
        if gpus.is_empty() {
            format!(
                "this build sees no GPU device (built with: {})",
                super::placement::compiled_backends().join(", ")
            )
        } else {
            let names: Vec<String> = gpus.iter().map(Device::label).collect();
            format!("this machine has {}: {}", gpus.len(), names.join(", "))
        }
    };
    let uses_gpus = !matches!(placement.gpu_layers, GpuLayers::Count(0));
    if uses_gpus && placement.main_gpu as usize >= gpus.len().max(1) {
        return Err(RuntimeError::Placement(format!(
            "placement.main_gpu {} does not exist; {}",
            placement.main_gpu,
            seen()
        )));
    }
    if uses_gpus && placement.tensor_split.len() > gpus.len() {
        return Err(RuntimeError::Placement(format!(
            "placement.tensor_split names {} GPUs; {}",
            placement.tensor_split.len(),
            seen()
        )));
    }
    Ok(())
}

/// One layer's K cache is one tensor in one device buffer; a device whose
/// largest buffer is smaller (Vulkan's storage buffer range) makes ggml
/// abort, even inside the fitting's dry run, so this is checked first.
fn check_kv_buffers(
    header: &GgufHeader,
    config: &NativeRuntimeConfig,
    gpus: &[Device],
) -> Result<(), RuntimeError> {
    let n_head = header_u32(header, "attention.head_count").max(1);
    let n_head_kv = match header_u32(header, "attention.head_count_kv") {
        0 => n_head,
        n => n,
    };
    let head_dim = match header_u32(header, "attention.key_length") {
        0 => header_u32(header, "embedding_length") / n_head,
        d => d,
    };
    let n_ctx = config
        .context
        .resolved_n_ctx(header_u32(header, "context_length"));
    // f16 K cells, llama.cpp's default cache type.
    let layer_k = u64::from(n_ctx) * u64::from(n_head_kv) * u64::from(head_dim) * 2;
    if let Some(d) = holding_devices(&config.placement, gpus)
        .into_iter()
        .find(|d| layer_k > d.max_buffer)
    {
        return Err(RuntimeError::Placement(format!(
            "a context of {n_ctx} tokens needs {} MiB for each layer's K cache, which does not fit \
             in one buffer of {} (at most {} MiB); lower the context size or keep the KV cache \
             in host memory (placement.kv_offload = false, --no-kv-offload)",
            layer_k >> 20,
            d.label(),
            d.max_buffer >> 20
        )));
    }
    Ok(())
}

/// llama.cpp's own memory fitting (llama-server's `--fit`): projects the
/// weights, KV cache and compute buffers of this model and context on every
/// device (the host when there is no GPU) and, with `gpu_layers = "auto"`,
/// lowers the offloaded layers until they fit; anything else that does not
/// fit is a [`RuntimeError::Placement`].
fn fit(
    path: &Path,
    header: &GgufHeader,
    config: &NativeRuntimeConfig,
    n_seq_max: u32,
    params: &mut LlamaModelParams,
    gpus: &[Device],
) -> Result<(), RuntimeError> {
    let shape = ContextShape {
        n_ctx_train: header_u32(header, "context_length"),
        encoder_only: header_encoder_only(header),
        pooling: header_pooling(header),
    };
    let mut cparams = ContextPlan::new(config, &shape, n_seq_max).params;
    let cpath = std::ffi::CString::new(path.to_string_lossy().as_bytes()).map_err(|_| {
        RuntimeError::Load {
            path: path.display().to_string(),
            message: "path contains a NUL byte".into(),
        }
    })?;
    let margin = config.placement.fit_margin_mib as usize * (1 << 20);
    let mut margins = vec![margin; llama_cpp_2::max_devices().max(1)];
    let n_ctx = cparams.n_ctx().map_or(0, NonZeroU32::get);
    let fitted = std::pin::Pin::new(params).fit_params(
        &cpath,
        &mut cparams,
        &mut margins,
        n_ctx,
        llama_cpp_sys_2::GGML_LOG_LEVEL_ERROR,
    );
    match fitted {
        Ok(_) => Ok(()),
        Err(llama_cpp_2::model::params::FitError::Failure) => {
            let room = if gpus.is_empty() {
                "host memory".to_string()
            } else {
                gpus.iter()
                    .map(|d| format!("{} ({} MiB free)", d.label(), d.memory_free >> 20))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            Err(RuntimeError::Placement(format!(
                "{} ({} MiB of weights) with a context of {n_ctx} tokens (for {n_seq_max} \
                 sequence{}) does not fit in {room} leaving {} MiB free (llama.cpp's fitting); \
                 lower the context size or slots, offload fewer layers \
                 (placement.gpu_layers), or set placement.fit = false to try anyway",
                path.display(),
                std::fs::metadata(path).map_or(0, |m| m.len()) >> 20,
                if n_seq_max == 1 { "" } else { "s" },
                config.placement.fit_margin_mib
            )))
        }
        Err(e) => Err(RuntimeError::Load {
            path: path.display().to_string(),
            message: format!("llama.cpp's fitting failed: {e}"),
        }),
    }
}

/// The GPUs that take layers (and their KV): `main_gpu` alone with
/// `split_mode = "none"`, else every GPU with a share of the tensor split
/// (all of them without one).
fn holding_devices<'a>(placement: &PlacementConfig, gpus: &'a [Device]) -> Vec<&'a Device> {
    if placement.split_mode == SplitMode::None {
        gpus.get(placement.main_gpu as usize).into_iter().collect()
    } else if placement.tensor_split.is_empty() {
        gpus.iter().collect()
    } else {
        gpus.iter()
            .zip(&placement.tensor_split)
            .filter(|(_, share)| **share > 0.0)
            .map(|(d, _)| d)
            .collect()
    }
}

/// What the model got: the devices holding its offloaded layers.
fn placed(
    placement: &PlacementConfig,
    gpus: &[Device],
    layers: u32,
    total_layers: u32,
) -> super::placement::Placement {
    if layers == 0 || gpus.is_empty() {
        return super::placement::Placement::cpu(total_layers);
    }
    let holding = holding_devices(placement, gpus);
    let mut backends: Vec<&str> = holding.iter().map(|d| d.backend.as_str()).collect();
    backends.dedup();
    super::placement::Placement {
        backend: backends.join("+"),
        devices: holding.iter().map(|d| d.label()).collect(),
        offloaded_layers: layers,
        total_layers,
        kv_offload: placement.kv_offload,
    }
}

/// A load with a tensor split. llama-cpp-2's safe parameters have no setter
/// for it, so this fills llama.cpp's own `llama_model_params` and wraps the
/// result. (llama.cpp's fitting never runs with a split set by the user.)
fn load_with_split(
    path: &Path,
    placement: &PlacementConfig,
    layers: u32,
    progress: Option<Box<dyn FnMut(f32) + Send>>,
) -> Result<LlamaModel, RuntimeError> {
    type Progress = Box<dyn FnMut(f32) + Send>;
    unsafe extern "C" fn trampoline(p: f32, user: *mut std::ffi::c_void) -> bool {
        // SAFETY: `user` is the `Progress` boxed below, alive for the load.
        let cb = unsafe { &mut *user.cast::<Progress>() };
        cb(p);
        true
    }
    let failed = |message: String| RuntimeError::Load {
        path: path.display().to_string(),
        message,
    };
    let cpath = std::ffi::CString::new(path.to_string_lossy().as_bytes())
        .map_err(|_| failed("path contains a NUL byte".into()))?;
    let mut split = [0f32; 16];
    for (slot, share) in split.iter_mut().zip(&placement.tensor_split) {
        *slot = *share;
    }
    let mut progress: Option<Box<Progress>> = progress.map(Box::new);
    // SAFETY: plain C structs; every pointer set here (`split`, `progress`)
    // outlives the call, and llama.cpp copies what it keeps.
    let raw = unsafe {
        let mut p = llama_cpp_sys_2::llama_model_default_params();
        p.n_gpu_layers = i32::try_from(layers).unwrap_or(i32::MAX);
        p.main_gpu = placement.main_gpu as i32;
        p.split_mode = split_mode(placement.split_mode).into();
        p.tensor_split = split.as_ptr();
        p.load_mode = match (placement.use_mmap, placement.use_mlock) {
            (false, false) => llama_cpp_sys_2::LLAMA_LOAD_MODE_NONE,
            (true, false) => llama_cpp_sys_2::LLAMA_LOAD_MODE_MMAP,
            (false, true) => llama_cpp_sys_2::LLAMA_LOAD_MODE_MLOCK,
            (true, true) => llama_cpp_sys_2::LLAMA_LOAD_MODE_MMAP_MLOCK,
        };
        if let Some(cb) = progress.as_mut() {
            p.progress_callback = Some(trampoline);
            p.progress_callback_user_data = std::ptr::from_mut::<Progress>(cb).cast();
        }
        llama_cpp_sys_2::llama_model_load_from_file(cpath.as_ptr(), p)
    };
    let raw =
        std::ptr::NonNull::new(raw).ok_or_else(|| failed("llama.cpp returned no model".into()))?;
    const _: () = assert!(
        std::mem::size_of::<LlamaModel>()
            == std::mem::size_of::<std::ptr::NonNull<llama_cpp_sys_2::llama_model>>()
    );
    // SAFETY: `LlamaModel` is one non-null pointer to a `llama_model` it owns
    // and frees on drop (asserted to have that size above); this model was
    // loaded above and is owned by nothing else.
    Ok(unsafe {
        std::mem::transmute::<std::ptr::NonNull<llama_cpp_sys_2::llama_model>, LlamaModel>(raw)
    })
}

fn model_info(path: &Path, header: &GgufHeader, model: &LlamaModel) -> ModelInfo {
    let vocab = model.vocab();
    let architecture = header.architecture().unwrap_or("unknown").to_string();
    let opt_token = |t: LlamaToken| (t.0 >= 0).then_some(t.0);
    let encoder_only = header_encoder_only(header);
    let pooling = header_pooling(header);
    let quantization = header.quantization();
    let chat_template = header
        .metadata
        .get("tokenizer.chat_template")
        .and_then(MetaValue::as_str)
        .or_else(|| crate::chat::family_template(&architecture))
        .map(str::to_string);
    let sliding_window = header
        .metadata
        .get(&format!("{architecture}.attention.sliding_window"))
        .and_then(MetaValue::as_u64)
        .and_then(|w| u32::try_from(w).ok())
        .filter(|&w| w > 0);
    let n_params = model.n_params();
    let name = header
        .metadata
        .get("general.name")
        .and_then(MetaValue::as_str)
        .map(str::to_string);
    ModelInfo {
        path: path.display().to_string(),
        takes_images: false,
        description: format!(
            "{architecture} {:.0}M params {quantization}",
            n_params as f64 / 1e6
        ),
        architecture,
        name,
        n_params,
        size_bytes: model.size(),
        quantization,
        n_ctx_train: model.n_ctx_train(),
        n_vocab: usize::try_from(model.n_vocab()).unwrap_or(0),
        n_embd: usize::try_from(model.n_embd()).unwrap_or(0),
        n_layer: model.n_layer(),
        bos: opt_token(vocab.bos()),
        eos: opt_token(vocab.eos()),
        eot: opt_token(vocab.eot()),
        add_bos: vocab.should_add_bos(),
        has_decoder: !encoder_only,
        // SAFETY: a live model.
        has_encoder: encoder_only
            || unsafe { llama_cpp_sys_2::llama_model_has_encoder(model_ptr(model)) },
        // SAFETY: a live model; -1 when the GGUF names none.
        decoder_start: opt_token(LlamaToken(unsafe {
            llama_cpp_sys_2::llama_model_decoder_start_token(model_ptr(model))
        })),
        pooling,
        chat_template,
        sliding_window,
        fingerprint: header.fingerprint.clone(),
        placement: super::placement::Placement::default(),
        fim: super::FimTokens {
            pre: opt_token(vocab.fim_pre()),
            suf: opt_token(vocab.fim_suf()),
            mid: opt_token(vocab.fim_mid()),
            pad: opt_token(vocab.fim_pad()),
            rep: opt_token(vocab.fim_rep()),
            sep: opt_token(vocab.fim_sep()),
        },
    }
}

impl LlamaModelHandle {
    /// A token's bytes, special tokens written out or not; nothing for an
    /// id outside the vocabulary.
    fn piece(&self, token: Token, special: bool) -> Vec<u8> {
        if token < 0 || token as usize >= self.info.n_vocab {
            return Vec::new();
        }
        self.model
            .vocab()
            .token_to_piece(LlamaToken(token), special, None)
    }
}

impl Vocab for LlamaModelHandle {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn media(&self) -> Option<&dyn super::MediaTokenizer> {
        self.projector
            .as_ref()
            .map(|p| p as &dyn super::MediaTokenizer)
    }

    fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, RuntimeError> {
        Ok(self
            .model
            .vocab()
            .tokenize(text.as_bytes(), add_special, parse_special)
            .into_iter()
            .map(|t| t.0)
            .collect())
    }

    fn token_bytes(&self, token: Token) -> Vec<u8> {
        self.piece(token, false)
    }

    fn token_bytes_special(&self, token: Token) -> Vec<u8> {
        self.piece(token, true)
    }

    fn token_text(&self, token: Token) -> String {
        String::from_utf8_lossy(&self.piece(token, true)).into_owned()
    }

    fn is_eog(&self, token: Token) -> bool {
        token >= 0
            && (token as usize) < self.info.n_vocab
            && self.model.vocab().is_eog(LlamaToken(token))
    }

    fn check_constraint(
        &self,
        constraint: &OutputConstraint,
        bounds: &JsonBounds,
    ) -> Result<(), SamplingError> {
        build_grammar(&self.model, constraint, bounds).map(|_| ())
    }

    // As llama-server's format_prompt_rerank reads the model.
    fn rerank_format(&self) -> super::RerankFormat {
        let v = self.model.vocab();
        let real = |t: LlamaToken| (t.0 >= 0).then_some(t.0);
        let eos = real(v.eos()).or(real(v.sep()));
        super::RerankFormat {
            // Read as metadata: llama-cpp-2's `chat_template(Some(name))`
            // passes a pointer to a name it has already freed.
            template: self
                .model
                .meta_val_str("tokenizer.chat_template.rerank")
                .ok(),
            bos: real(v.bos()).filter(|_| v.should_add_bos()),
            eos: eos.filter(|_| v.should_add_eos()),
            sep: real(v.sep()).filter(|_| v.should_add_sep()),
        }
    }
}

/// A llama.cpp context with its batch: the engine thread's half of a model.
pub struct LlamaRuntime {
    // Field order is drop order: the batch and the context borrow the model, so
    // they go first and the `Arc` that keeps the model alive goes last.
    batch: LlamaBatch<'static>,
    ctx: LlamaContext<'static>,
    model: Arc<LlamaModelHandle>,
    n_ctx: u32,
    n_seq_max: u32,
    n_batch: u32,
    n_ubatch: u32,
    pooling: Option<Pooling>,
    /// Reused candidate buffer for grammar-constrained sampling.
    candidates: Vec<LlamaTokenData>,
    /// Which sequence each row of the last batch belonged to.
    last_rows: Vec<SeqId>,
    /// The context's raw pointer, for the calls llama-cpp-2 does not wrap
    /// (several LoRA adapters at once).
    raw_ctx: *mut llama_cpp_sys_2::llama_context,
    /// The LoRA adapters applied now.
    adapters: AdapterSet,
}

// SAFETY: `raw_ctx` is the pointer `ctx` owns; both move together and the
// engine thread alone uses them.
unsafe impl Send for LlamaRuntime {}

impl std::fmt::Debug for LlamaRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaRuntime")
            .field("n_ctx", &self.n_ctx)
            .field("n_seq_max", &self.n_seq_max)
            .finish()
    }
}

/// The raw pointer inside a `LlamaContext`, which llama-cpp-2 keeps
/// private: the struct is that pointer, a `Vec` of backend samplers (empty
/// here: sipp adds none, so its pointer is dangling and its lengths 0) and
/// zero-sized markers. The one word that can be a heap pointer is taken, and
/// accepted only when llama.cpp says that context belongs to `model`.
fn context_ptr(
    ctx: &LlamaContext<'_>,
    model: &LlamaModel,
) -> Result<*mut llama_cpp_sys_2::llama_context, RuntimeError> {
    const WORDS: usize =
        std::mem::size_of::<LlamaContext<'static>>() / std::mem::size_of::<usize>();
    const _: () = assert!(
        std::mem::size_of::<LlamaContext<'static>>() == 4 * std::mem::size_of::<usize>(),
        "llama-cpp-2 changed LlamaContext: revisit context_ptr"
    );
    // SAFETY: reads the struct's bytes as words (all its fields are
    // word-sized, no padding); nothing is dropped or dereferenced here.
    let words: [usize; WORDS] = unsafe { std::mem::transmute_copy(ctx) };
    let candidates: Vec<usize> = words.iter().copied().filter(|&w| w > 0xFFFF).collect();
    let found = match candidates.as_slice() {
        // SAFETY: the only word that can address memory in a context without
        // backend samplers: the context pointer.
        [w] if unsafe { llama_cpp_sys_2::llama_get_model(*w as *mut _) }.cast_mut()
            == model_ptr(model) =>
        {
            Some(*w as *mut llama_cpp_sys_2::llama_context)
        }
        _ => None,
    };
    found.ok_or_else(|| {
        RuntimeError::Context(
            "cannot find llama.cpp's context pointer (llama-cpp-2 layout changed)".into(),
        )
    })
}

/// A context's parameters and the sizes the runtime keeps from them; the
/// same for the fitting before a load and for the context itself.
struct ContextPlan {
    params: LlamaContextParams,
    n_ctx: u32,
    n_batch: u32,
    n_ubatch: u32,
    pooling: Option<Pooling>,
}

impl ContextPlan {
    fn new(config: &NativeRuntimeConfig, shape: &ContextShape, n_seq_max: u32) -> Self {
        let ctx_cfg = &config.context;
        let n_ctx = ctx_cfg.resolved_n_ctx(shape.n_ctx_train);
        let encoder_only = shape.encoder_only;
        let embeddings = ctx_cfg.embeddings || encoder_only;
        let pooling =
            embeddings.then(|| ctx_cfg.pooling.or(shape.pooling).unwrap_or(Pooling::Mean));
        // A non-causal encoder sees a whole input in one micro-batch.
        let (mut n_batch, mut n_ubatch) = if encoder_only {
            (ctx_cfg.n_batch, ctx_cfg.n_batch)
        } else {
            (ctx_cfg.n_batch, ctx_cfg.n_ubatch)
        };
        if embeddings {
            // llama.cpp reserves its pooled-embedding graph with n_ubatch split
            // evenly over the sequences, and aborts when it does not divide.
            n_ubatch -= n_ubatch % n_seq_max.max(1);
            n_ubatch = n_ubatch.max(n_seq_max);
            if encoder_only {
                n_batch = n_ubatch;
            }
        }
        let fa = match ctx_cfg.flash_attention {
            FlashAttention::Auto => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_AUTO,
            FlashAttention::On => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED,
            FlashAttention::Off => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED,
        };
        let mut params = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(n_ctx))
            .with_n_batch(n_batch)
            .with_n_ubatch(n_ubatch)
            .with_n_seq_max(n_seq_max)
            .with_n_threads(ctx_cfg.resolved_threads() as i32)
            .with_n_threads_batch(ctx_cfg.resolved_threads_batch() as i32)
            // One KV stream shared by every sequence (no per-slot division of the
            // context); encoders keep no KV and batch sequences as separate streams.
            .with_kv_unified(!encoder_only)
            .with_flash_attention_policy(fa)
            .with_offload_kqv(config.placement.kv_offload)
            .with_embeddings(embeddings);
        if let Some(p) = pooling {
            params = params.with_pooling_type(match p {
                Pooling::None => LlamaPoolingType::None,
                Pooling::Mean => LlamaPoolingType::Mean,
                Pooling::Cls => LlamaPoolingType::Cls,
                Pooling::Last => LlamaPoolingType::Last,
                Pooling::Rank => LlamaPoolingType::Rank,
            });
        }
        Self {
            params,
            n_ctx,
            n_batch,
            n_ubatch,
            pooling,
        }
    }
}

impl LlamaRuntime {
    /// Creates a context for the model with `n_seq_max` KV sequences on one
    /// unified KV cache.
    pub fn new(
        model: Arc<LlamaModelHandle>,
        config: &NativeRuntimeConfig,
        n_seq_max: u32,
    ) -> Result<Self, RuntimeError> {
        let backend = backend()?;
        let shape = ContextShape {
            n_ctx_train: model.info.n_ctx_train,
            encoder_only: model.info.has_encoder && !model.info.has_decoder,
            pooling: model.info.pooling,
        };
        let ContextPlan {
            params,
            n_ctx,
            n_batch,
            n_ubatch,
            pooling,
        } = ContextPlan::new(config, &shape, n_seq_max);
        let _serial = load_lock();
        // SAFETY: the context and batch only borrow the model; `model` (an Arc)
        // is stored in the same struct and dropped after both (field order).
        let model_ref: &'static LlamaModel = unsafe { &*std::ptr::from_ref(&model.model) };
        let ctx = model_ref.new_context(backend, params).map_err(|e| {
            RuntimeError::Context(format!("{e} (n_ctx {n_ctx}, n_seq_max {n_seq_max})"))
        })?;
        let m = &model.model;
        // K and V in f16 for every cell of every layer (llama.cpp's default types).
        let kv_bytes = u64::from(n_ctx)
            * u64::from(m.n_layer())
            * 2
            * u64::from(m.n_head_kv())
            * (m.n_embd().max(0) as u64 / u64::from(m.n_head().max(1)))
            * 2;
        tracing::info!(
            model = %model.info.path,
            "context: {n_ctx} tokens over {n_seq_max} sequences; KV cache about {} MiB {}",
            kv_bytes >> 20,
            if model.info.placement.kv_offload && model.info.placement.offloaded_layers > 0 {
                format!("on {}", model.info.placement.devices.join(", "))
            } else {
                "in host memory".to_string()
            }
        );
        let raw_ctx = context_ptr(&ctx, &model.model)?;
        let batch = LlamaBatch::new(n_batch as usize, 1);
        let rt = Self {
            batch,
            ctx,
            model,
            n_ctx,
            n_seq_max,
            n_batch,
            n_ubatch,
            pooling,
            candidates: Vec::new(),
            last_rows: Vec::new(),
            raw_ctx,
            adapters: AdapterSet::none(),
        };
        Ok(rt)
    }

    fn fill_batch(&mut self, rows: &[BatchRow]) -> Result<(), BatchError> {
        self.batch.clear();
        self.last_rows.clear();
        // An image placeholder is no token: llama.cpp would abort on it. The
        // scheduler never sends one; if it did, the batch fails instead (and
        // the executor's split narrows the failure to its request).
        if rows.iter().any(|r| crate::media::is_placeholder(r.token)) {
            return Err(BatchError::Failed(-101));
        }
        for r in rows {
            self.batch
                .add(LlamaToken(r.token), r.pos as i32, &[r.seq], r.output)
                .map_err(|_| BatchError::Failed(-100))?;
            self.last_rows.push(r.seq);
        }
        Ok(())
    }

    /// The banned tokens when the plan reduces to an argmax: greedy, no
    /// penalties, no constraint, and only biases that ban (-inf).
    fn greedy_bans(&self, plan: &SamplerPlan) -> Option<Vec<i32>> {
        let vocab = self.model.model.vocab();
        let mut banned = Vec::new();
        for b in plan.argmax_bans()? {
            match &b.target {
                BiasTarget::Token(t) => banned.push(*t),
                BiasTarget::Text(s) => banned.extend(
                    vocab
                        .tokenize(s.as_bytes(), false, false)
                        .iter()
                        .map(|t| t.0),
                ),
            }
        }
        banned.sort_unstable();
        banned.dedup();
        Some(banned)
    }

    fn build_chain(&self, plan: &SamplerPlan) -> Result<LlamaSampler, SamplingError> {
        chain_sampler(&self.model, self.n_ctx, &plan.chain)
    }
}

/// The llama.cpp chain for a planned chain ([`crate::sampling::sampler_chain`]):
/// each stage mapped by [`stage_sampler`], in order. `n_ctx` is the look-back
/// that -1 stands for.
pub fn chain_sampler(
    model: &LlamaModelHandle,
    n_ctx: u32,
    stages: &[ChainStage],
) -> Result<LlamaSampler, SamplingError> {
    let samplers = stages
        .iter()
        .map(|s| stage_sampler(model, n_ctx, s))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(LlamaSampler::chain(samplers, true))
}

/// The llama.cpp sampler for one planned stage. The model tokenizes text
/// biases and DRY's sequence breakers; `n_ctx` is the look-back that -1 stands
/// for ([`look_back`]).
pub fn stage_sampler(
    model: &LlamaModelHandle,
    n_ctx: u32,
    stage: &ChainStage,
) -> Result<LlamaSampler, SamplingError> {
    let n_vocab = model.info.n_vocab as i32;
    Ok(match stage {
        ChainStage::LogitBias(biases) => {
            LlamaSampler::logit_bias(n_vocab, &llama_biases(model, biases)?)
        }
        ChainStage::Penalties {
            last_n,
            repeat,
            frequency,
            presence,
        } => LlamaSampler::penalties(
            n_vocab,
            look_back(*last_n, n_ctx),
            *repeat,
            *frequency,
            *presence,
        ),
        ChainStage::Dry {
            multiplier,
            base,
            allowed_length,
            last_n,
            sequence_breakers,
        } => LlamaSampler::dry(
            &model.model,
            *multiplier,
            *base,
            *allowed_length,
            look_back(*last_n, n_ctx),
            sequence_breakers.iter().map(String::as_bytes),
        ),
        ChainStage::TopNSigma(n) => LlamaSampler::top_n_sigma(*n),
        ChainStage::TopK(k) => LlamaSampler::top_k(*k),
        ChainStage::Typical { p, min_keep } => LlamaSampler::typical(*p, *min_keep),
        ChainStage::TopP { p, min_keep } => LlamaSampler::top_p(*p, *min_keep),
        ChainStage::MinP { p, min_keep } => LlamaSampler::min_p(*p, *min_keep),
        ChainStage::Xtc {
            probability,
            threshold,
            min_keep,
            seed,
        } => LlamaSampler::xtc(*probability, *threshold, *min_keep, *seed),
        ChainStage::Temperature(t) => LlamaSampler::temp(*t),
        ChainStage::Mirostat { tau, eta, m, seed } => {
            LlamaSampler::mirostat(n_vocab, *seed, *tau, *eta, *m)
        }
        ChainStage::MirostatV2 { tau, eta, seed } => LlamaSampler::mirostat_v2(*seed, *tau, *eta),
        ChainStage::Greedy => LlamaSampler::greedy(),
        ChainStage::Dist { seed } => LlamaSampler::dist(*seed),
    })
}

/// Logit biases as llama.cpp takes them: token ids checked against the
/// vocabulary, texts tokenized (every token of the text gets the bias).
fn llama_biases(
    model: &LlamaModelHandle,
    biases: &[LogitBias],
) -> Result<Vec<LlamaLogitBias>, SamplingError> {
    let mut out = Vec::new();
    for b in biases {
        // The engine checked this already; an id outside the vocabulary must
        // never reach llama.cpp, so the same rule guards the call.
        b.validate(Some(model.info.n_vocab as usize))?;
        match &b.target {
            BiasTarget::Token(t) => {
                out.push(LlamaLogitBias::new(LlamaToken(*t), b.bias));
            }
            BiasTarget::Text(s) => {
                for t in model.model.vocab().tokenize(s.as_bytes(), false, false) {
                    out.push(LlamaLogitBias::new(t, b.bias));
                }
            }
        }
    }
    Ok(out)
}

/// Builds a grammar sampler for a constraint.
fn build_grammar(
    model: &LlamaModel,
    constraint: &OutputConstraint,
    bounds: &JsonBounds,
) -> Result<LlamaSampler, SamplingError> {
    let (gbnf, schema) = match constraint {
        OutputConstraint::Grammar(g) => (g.clone(), false),
        OutputConstraint::JsonObject => (bounds.json_object_grammar(), false),
        OutputConstraint::JsonSchema(s) => (schema_to_gbnf(s, bounds)?, true),
        OutputConstraint::Composed(c) => {
            let converted = c
                .schemas
                .iter()
                .map(|s| schema_to_gbnf(s, bounds))
                .collect::<Result<Vec<_>, _>>()?;
            let gbnf = c.assemble(&converted);
            if !c.triggers.is_empty() {
                return LlamaSampler::grammar_lazy_patterns(model, &gbnf, "root", &c.triggers, &[])
                    .map_err(|e| {
                        SamplingError::Schema(format!("the tool-call grammar was rejected: {e}"))
                    });
            }
            (gbnf, true)
        }
    };
    if gbnf.trim().is_empty() {
        return Err(SamplingError::Grammar("the grammar is empty".into()));
    }
    LlamaSampler::grammar(model, &gbnf, "root").map_err(|e| {
        if schema {
            SamplingError::Schema(format!("the converted grammar was rejected: {e}"))
        } else {
            SamplingError::Grammar(format!("llama.cpp could not parse it ({e})"))
        }
    })
}

/// Converts a JSON schema to GBNF with llama.cpp's converter, after writing
/// `bounds` into what the schema leaves open.
pub fn schema_to_gbnf(
    schema: &serde_json::Value,
    bounds: &JsonBounds,
) -> Result<String, SamplingError> {
    if !schema.is_object() && !schema.is_boolean() {
        return Err(SamplingError::Schema(
            "a schema must be a JSON object".into(),
        ));
    }
    crate::sampling::check_schema_supported(schema)?;
    let bounded = bounds.apply_to_schema(schema);
    let text = serde_json::to_string(&bounded).map_err(|e| SamplingError::Schema(e.to_string()))?;
    // llama-cpp-2 drops the converter's message; the checks above catch what
    // they can name, and anything else is reported as a refusal.
    let gbnf = llama_cpp_2::json_schema_to_grammar(&text).map_err(|e| {
        SamplingError::Schema(format!("llama.cpp's schema converter refused it ({e})"))
    })?;
    Ok(bounds.bound_converted_grammar(&gbnf))
}

/// Candidates the grammar is tried on before the whole vocabulary.
const GRAMMAR_SHORTLIST: usize = 512;

/// A request's sampler: the chain, and a grammar kept apart so it is consulted
/// only when the chain's pick breaks it (llama.cpp's grammar-rejection path).
pub struct LlamaSamplerState {
    chain: LlamaSampler,
    grammar: Option<LlamaSampler>,
    /// Greedy with nothing that rewrites logits but token bans (as
    /// `ignore_eos` adds): an argmax over the row, skipping the banned tokens
    /// (sorted), gives llama.cpp's greedy pick without building a candidate array.
    argmax_banning: Option<Vec<i32>>,
    /// The grammar refused a token it was made to accept (llama.cpp then
    /// holds no parse and would abort on its next use): the request fails
    /// at its next sample instead.
    grammar_broken: bool,
}

/// The first index of the largest value not banned (llama.cpp's greedy tie-break).
fn argmax(logits: &[f32], banned: &[i32]) -> i32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        // The ban check runs only on a new maximum, which is rare.
        if v > best_v && banned.binary_search(&(i as i32)).is_err() {
            best_v = v;
            best = i;
        }
    }
    best as i32
}

impl std::fmt::Debug for LlamaSamplerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaSamplerState")
            .field("grammar", &self.grammar.is_some())
            .finish()
    }
}

impl LlamaSamplerState {
    /// Resets the state for a new request with a new seed-free history.
    pub fn reset(&mut self) {
        self.chain.reset();
        if let Some(g) = &mut self.grammar {
            g.reset();
        }
    }
}

impl Backend for LlamaRuntime {
    type Sampler = LlamaSamplerState;

    fn vocab(&self) -> Arc<dyn Vocab> {
        self.model.clone()
    }

    fn n_ctx(&self) -> u32 {
        self.n_ctx
    }

    fn n_seq_max(&self) -> u32 {
        self.n_seq_max
    }

    fn n_batch(&self) -> u32 {
        self.n_batch
    }

    fn n_ubatch(&self) -> u32 {
        self.n_ubatch
    }

    fn embedding_pooling(&self) -> Option<Pooling> {
        self.pooling
    }

    fn warm_up(&mut self) {
        let encoder_only = self.model.info.has_encoder && !self.model.info.has_decoder;
        let token = self.model.info.bos.unwrap_or(0);
        let rows = [BatchRow {
            token,
            pos: 0,
            seq: 0,
            output: true,
        }];
        let ok = if encoder_only {
            self.encode(&rows).is_ok()
        } else if self.model.info.is_encoder_decoder() {
            // The decoder cross-attends to an encoder output: encode first,
            // as llama.cpp's own warm-up does.
            let start = self.model.info.decoder_start.unwrap_or(token);
            let first = [BatchRow {
                token: start,
                ..rows[0]
            }];
            self.encode(&rows).is_ok() && self.decode(&first).is_ok()
        } else {
            self.decode(&rows).is_ok()
        };
        if !ok {
            tracing::warn!("warm-up batch failed");
        }
        let _ = self.ctx.kv_cache_seq_rm(0, None, None);
    }

    fn set_adapters(&mut self, set: &AdapterSet) -> Result<(), RuntimeError> {
        if *set == self.adapters {
            return Ok(());
        }
        let loaded = &self.model.adapters;
        let mut ptrs = Vec::with_capacity(set.entries().len());
        let mut scales = Vec::with_capacity(set.entries().len());
        for &(id, scale) in set.entries() {
            let a = loaded.get(id).ok_or_else(|| {
                RuntimeError::Lora(format!("no adapter {id} (this model has {})", loaded.len()))
            })?;
            ptrs.push(a.0.as_ptr());
            scales.push(scale);
        }
        // SAFETY: the context is live; the adapters belong to its model and
        // the arrays hold `len` entries each.
        let code = unsafe {
            llama_cpp_sys_2::llama_set_adapters_lora(
                self.raw_ctx,
                if ptrs.is_empty() {
                    std::ptr::null_mut()
                } else {
                    ptrs.as_mut_ptr()
                },
                ptrs.len(),
                if scales.is_empty() {
                    std::ptr::null_mut()
                } else {
                    scales.as_mut_ptr()
                },
            )
        };
        if code != 0 {
            return Err(RuntimeError::Lora(format!(
                "llama.cpp refused the adapter set (code {code})"
            )));
        }
        self.adapters = set.clone();
        Ok(())
    }

    fn decode(&mut self, rows: &[BatchRow]) -> Result<(), BatchError> {
        self.fill_batch(rows)?;
        let result = self.ctx.decode(&mut self.batch).map_err(|e| match e {
            llama_cpp_2::DecodeError::NoKvCacheSlot => BatchError::NoKvSpace,
            llama_cpp_2::DecodeError::NTokensZero => BatchError::Failed(-1),
            llama_cpp_2::DecodeError::Unknown(c) => BatchError::Failed(c),
        });
        if result.is_err() {
            // llama.cpp only rolls back the micro-batch that failed; earlier ones
            // of the same batch stay. Remove them so the KV holds none of it.
            let mut first: std::collections::HashMap<SeqId, u32> = std::collections::HashMap::new();
            for r in rows {
                first
                    .entry(r.seq)
                    .and_modify(|p| *p = (*p).min(r.pos))
                    .or_insert(r.pos);
            }
            for (seq, pos) in first {
                let _ = self.ctx.kv_cache_seq_rm(seq, Some(pos), None);
            }
        }
        result
    }

    fn decode_media(
        &mut self,
        seq: SeqId,
        pos: u32,
        chunk: &super::MediaChunk,
    ) -> Result<(), BatchError> {
        let Some(proj) = self.model.projector.as_ref() else {
            return Err(BatchError::Failed(-1));
        };
        // The embedding batch replaces the logits of the last token batch.
        self.last_rows.clear();
        match proj.decode(self.raw_ctx, chunk, seq, pos, self.n_batch) {
            Ok(()) => Ok(()),
            Err(1) => Err(BatchError::NoKvSpace),
            Err(c) => Err(BatchError::Failed(c)),
        }
    }

    fn encode(&mut self, rows: &[BatchRow]) -> Result<(), BatchError> {
        self.fill_batch(rows)?;
        self.ctx.encode(&mut self.batch).map_err(|e| match e {
            llama_cpp_2::EncodeError::NoKvCacheSlot => BatchError::NoKvSpace,
            llama_cpp_2::EncodeError::NTokensZero => BatchError::Failed(-1),
            llama_cpp_2::EncodeError::Unknown(c) => BatchError::Failed(c),
        })
    }

    fn logits(&self, row: usize) -> &[f32] {
        self.ctx.get_logits_ith(row as i32)
    }

    fn embedding(&self, seq: SeqId, row: usize) -> Option<Vec<f32>> {
        match self.pooling? {
            Pooling::None => self
                .ctx
                .embeddings_ith(row as i32)
                .ok()
                .map(<[f32]>::to_vec),
            _ => self.ctx.embeddings_seq_ith(seq).ok().map(<[f32]>::to_vec),
        }
    }

    fn new_sampler(&self, spec: SamplerSpec<'_>) -> Result<Self::Sampler, SamplingError> {
        let plan = sampler_plan(spec.params, spec.constraint.is_some(), spec.seed);
        let chain = self.build_chain(&plan)?;
        // The grammar is kept outside the chain (GrammarPlacement::CheckThenResample).
        let grammar = spec
            .constraint
            .map(|c| build_grammar(&self.model.model, c, &spec.params.json_bounds))
            .transpose()?;
        Ok(LlamaSamplerState {
            chain,
            grammar,
            argmax_banning: self.greedy_bans(&plan),
            grammar_broken: false,
        })
    }

    fn reset_sampler(
        &self,
        sampler: &mut Self::Sampler,
        spec: SamplerSpec<'_>,
    ) -> Result<(), SamplingError> {
        // The chain is cheap to build and carries the seed; the grammar (the
        // expensive part) is only reset.
        let plan = sampler_plan(spec.params, spec.constraint.is_some(), spec.seed);
        sampler.chain = self.build_chain(&plan)?;
        sampler.argmax_banning = self.greedy_bans(&plan);
        if let Some(g) = &mut sampler.grammar {
            g.reset();
        }
        sampler.grammar_broken = false;
        Ok(())
    }

    fn sampler_accept_prompt(&self, sampler: &mut Self::Sampler, tokens: &[Token]) {
        // Only the chain sees the prompt: the grammar constrains generated text.
        for &t in tokens {
            sampler.chain.accept(LlamaToken(t));
        }
    }

    fn sample(
        &mut self,
        sampler: &mut Self::Sampler,
        row: usize,
        top_logprobs: Option<usize>,
    ) -> Result<Sampled, SampleError> {
        if sampler.grammar_broken {
            return Err(SampleError::GrammarExhausted);
        }
        let token = match &mut sampler.grammar {
            None if sampler.argmax_banning.is_some() => argmax(
                self.ctx.get_logits_ith(row as i32),
                sampler.argmax_banning.as_deref().unwrap_or_default(),
            ),
            None => sampler.chain.sample(&self.ctx, row as i32).0,
            Some(grammar) => {
                let logits = self.ctx.get_logits_ith(row as i32);
                let fill = |buf: &mut Vec<LlamaTokenData>| {
                    buf.clear();
                    buf.extend(
                        logits
                            .iter()
                            .enumerate()
                            .map(|(i, &l)| LlamaTokenData::new(LlamaToken(i as i32), l, 0.0)),
                    );
                };
                let mut buf = std::mem::take(&mut self.candidates);
                fill(&mut buf);
                let mut arr = LlamaTokenDataArray::new(buf, false);
                arr.apply_sampler(&mut sampler.chain);
                let first = arr.selected_token();
                // Cheap check first: does the grammar allow the chain's pick?
                let allowed = first.is_some_and(|tok| {
                    let mut single =
                        LlamaTokenDataArray::new(vec![LlamaTokenData::new(tok, 0.0, 0.0)], false);
                    single.apply_sampler(grammar);
                    single.data.first().is_some_and(|d| d.logit().is_finite())
                });
                let chosen = if allowed {
                    first
                } else {
                    // The grammar over the whole vocabulary costs milliseconds;
                    // the most likely few hundred candidates hold the pick in
                    // practice (exactly so for greedy), so try those first.
                    let mut buf = std::mem::take(&mut arr.data);
                    fill(&mut buf);
                    if buf.len() > GRAMMAR_SHORTLIST {
                        buf.select_nth_unstable_by(GRAMMAR_SHORTLIST - 1, |a, b| {
                            b.logit().total_cmp(&a.logit())
                        });
                        buf.truncate(GRAMMAR_SHORTLIST);
                    }
                    arr = LlamaTokenDataArray::new(buf, false);
                    arr.apply_sampler(grammar);
                    if arr.data.iter().all(|d| d.logit() == f32::NEG_INFINITY) {
                        let mut buf = std::mem::take(&mut arr.data);
                        fill(&mut buf);
                        arr = LlamaTokenDataArray::new(buf, false);
                        arr.apply_sampler(grammar);
                    }
                    if arr.data.iter().all(|d| d.logit() == f32::NEG_INFINITY) {
                        self.candidates = arr.data;
                        return Err(SampleError::GrammarExhausted);
                    }
                    arr.apply_sampler(&mut sampler.chain);
                    arr.selected_token()
                };
                self.candidates = arr.data;
                let tok = chosen.ok_or(SampleError::GrammarExhausted)?;
                // A lazy grammar lets any token through until its trigger
                // appears, then replays the trigger's text, which can fail.
                if grammar.try_accept(tok).is_err() {
                    sampler.grammar_broken = true;
                    return Err(SampleError::GrammarExhausted);
                }
                sampler.chain.accept(tok);
                tok.0
            }
        };
        let logprobs = top_logprobs
            .map(|n| logprobs_from_logits(self.ctx.get_logits_ith(row as i32), token, n));
        Ok(Sampled { token, logprobs })
    }

    fn accept_forced(
        &mut self,
        sampler: &mut Self::Sampler,
        row: usize,
        token: Token,
        top_logprobs: Option<usize>,
    ) -> Sampled {
        sampler.chain.accept(LlamaToken(token));
        if let Some(g) = &mut sampler.grammar {
            if g.try_accept(LlamaToken(token)).is_err() {
                sampler.grammar_broken = true;
            }
        }
        let logprobs = top_logprobs
            .map(|n| logprobs_from_logits(self.ctx.get_logits_ith(row as i32), token, n));
        Sampled { token, logprobs }
    }

    fn kv_truncate(&mut self, seq: SeqId, from: u32) {
        // Removing a tail of a sequence only fails on recurrent models; sipp
        // clears the whole sequence then, which always succeeds.
        if self.ctx.kv_cache_seq_rm(seq, Some(from), None).is_err() {
            let _ = self.ctx.kv_cache_seq_rm(seq, None, None);
        }
    }

    fn kv_share_prefix(&mut self, src: SeqId, dst: SeqId, len: u32) {
        let _ = self.ctx.kv_cache_seq_cp(src, dst, Some(0), Some(len));
    }

    fn kv_cells_used(&self) -> Option<u32> {
        None
    }

    fn kv_clear(&mut self) {
        // llama_memory_clear: also moves the cell search back to cell 0.
        self.ctx.clear_kv_cache();
    }

    fn kv_seq_positions(&self, seq: SeqId) -> Option<(u32, u32)> {
        // llama.cpp answers -1 for both when the sequence holds nothing.
        let min = self.ctx.kv_cache_seq_pos_min(seq);
        let max = self.ctx.kv_cache_seq_pos_max(seq);
        (min >= 0 && max >= 0).then_some((min as u32, max as u32))
    }

    fn seq_state_save(&mut self, seq: SeqId) -> Vec<u8> {
        let flags = LlamaStateSeqFlags::empty();
        let size = self.ctx.state_seq_get_size_ext(seq, flags);
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` has exactly the size llama.cpp asked for.
        let n = unsafe {
            self.ctx
                .state_seq_get_data_ext(buf.as_mut_ptr(), seq, flags)
        };
        buf.truncate(n);
        buf
    }

    fn seq_state_restore(&mut self, seq: SeqId, state: &[u8]) -> Result<(), RuntimeError> {
        // SAFETY: llama.cpp reads at most `state.len()` bytes from the slice.
        let ok = unsafe {
            self.ctx
                .state_seq_set_data_ext(state, seq, LlamaStateSeqFlags::empty())
        };
        if ok {
            Ok(())
        } else {
            let _ = self.ctx.kv_cache_seq_rm(seq, None, None);
            Err(RuntimeError::StateRestore(format!(
                "llama.cpp refused a {}-byte state for sequence {seq}",
                state.len()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converted_schemas_get_the_bounds_and_compact_whitespace() {
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "string"}}});
        let compact = JsonBounds {
            compact_whitespace: true,
            ..JsonBounds::default()
        };
        let gbnf = schema_to_gbnf(&schema, &compact).expect("converts");
        assert!(gbnf.lines().any(|l| l == r#"space ::= | " ""#), "{gbnf}");
        assert!(gbnf.contains("{0,64}"), "string bound: {gbnf}");
        let open = schema_to_gbnf(&schema, &JsonBounds::unbounded()).expect("converts");
        assert!(
            open.contains(r#""\n"{1,2}"#) && !open.contains("{0,64}"),
            "{open}"
        );
    }
}
