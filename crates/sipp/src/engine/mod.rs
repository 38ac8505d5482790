//! The engine: one model, one OS thread running the step loop, and a handle
//! that is `Send + Sync` for submitting requests from async code or threads.
//!
//! Each request gets its own event stream: text deltas, then exactly one final
//! event. Dropping a [`RequestHandle`] cancels its request.

mod core;
mod metrics;
mod request;

pub use self::core::{
    EngineCore, EventSink, GenerateSpec, PreparedKind, PreparedRequest, SlotWork,
};
pub use metrics::{EngineMetrics, MetricsSnapshot};
pub use request::{
    Completion, EmbedRequest, EmbeddingOutput, EngineError, GenerateRequest, PromptInput,
    RequestEvent, RequestStats, TextDelta, TokenLogprobs, Usage,
};

#[cfg(feature = "llama")]
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::chat::{ChatError, ChatMessage, ChatTemplate};
use crate::config::NativeRuntimeConfig;
use crate::runtime::{Backend, ModelInfo, Pooling, Token, Vocab};
use crate::sampling::{BiasTarget, LogitBias, SamplingParams};
use crate::scheduler::RequestId;

/// Largest `logprobs` (top alternatives) a request may ask for.
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;

enum Command {
    Submit(PreparedRequest),
    Cancel(RequestId),
    CancelAll,
    Shutdown,
}

/// What the engine can do, fixed at start.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// The model.
    pub model: ModelInfo,
    /// KV cache size in tokens.
    pub n_ctx: u32,
    /// Slots.
    pub slots: usize,
    /// Largest embedding input.
    pub max_embedding_tokens: usize,
    /// Pooling when the context computes embeddings.
    pub embedding_pooling: Option<Pooling>,
    /// Whether the context can generate text.
    pub can_generate: bool,
    /// Default sampling settings.
    pub sampling: SamplingParams,
    /// Queue limit.
    pub max_queued: usize,
    /// Default max_tokens (0: until the context is full).
    pub default_max_tokens: u32,
    /// Upper bound on max_tokens (0: none).
    pub max_tokens_limit: u32,
}

impl EngineInfo {
    /// What an engine on this backend with this config can do.
    pub fn new<B: Backend>(backend: &B, config: &NativeRuntimeConfig) -> Self {
        let model = backend.vocab().info().clone();
        let pooling = backend.embedding_pooling();
        let encoder_only = model.has_encoder && !model.has_decoder;
        let budget = (config.step_budget() as usize).min(backend.n_batch() as usize);
        EngineInfo {
            n_ctx: backend.n_ctx(),
            slots: config.slots() as usize,
            max_embedding_tokens: budget.min(backend.n_ubatch() as usize),
            embedding_pooling: pooling,
            // A decoder context computing pooled embeddings yields no logits.
            can_generate: !encoder_only && pooling.is_none_or(|p| p == Pooling::None),
            sampling: config.sampling.clone(),
            max_queued: config.scheduler.max_queued_requests as usize,
            default_max_tokens: config.scheduler.default_max_tokens,
            max_tokens_limit: config.scheduler.max_tokens_limit,
            model,
        }
    }
}

/// Validates and tokenizes requests on the caller's thread.
#[derive(Clone)]
pub struct RequestPreparer {
    vocab: Arc<dyn Vocab>,
    info: Arc<EngineInfo>,
    eog_tokens: Arc<Vec<Token>>,
    chat_template: Arc<Result<ChatTemplate, ChatError>>,
}

impl std::fmt::Debug for RequestPreparer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestPreparer")
            .field("info", &self.info)
            .finish()
    }
}

fn random_seed() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as u32
}

impl RequestPreparer {
    /// A preparer for an engine with this vocabulary and info.
    pub fn new(vocab: Arc<dyn Vocab>, info: EngineInfo) -> Self {
        let eog_tokens = (0..info.model.n_vocab as Token)
            .filter(|&t| vocab.is_eog(t))
            .collect();
        let token_text = |t: Option<Token>| t.map(|t| vocab.token_text(t)).unwrap_or_default();
        let chat_template = match &info.model.chat_template {
            Some(source) => ChatTemplate::new(
                source,
                &token_text(info.model.bos),
                &token_text(info.model.eos),
            ),
            None => Err(ChatError::NoTemplate),
        };
        Self {
            vocab,
            info: Arc::new(info),
            eog_tokens: Arc::new(eog_tokens),
            chat_template: Arc::new(chat_template),
        }
    }

    /// Renders a conversation with the model's chat template.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        match self.chat_template.as_ref() {
            Ok(t) => t.render(messages, add_generation_prompt),
            Err(e) => Err(e.clone()),
        }
    }

    /// The token ids of a rendered conversation: special-token text parsed,
    /// BOS added only when the model wants one and the template did not write it.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<PromptInput, EngineError> {
        let text = self.render_chat(messages, true)?;
        let mut tokens = self
            .vocab
            .tokenize(&text, false, true)
            .map_err(|e| EngineError::Tokenize(e.to_string()))?;
        if let Some(bos) = self.info.model.bos {
            if self.info.model.add_bos && tokens.first() != Some(&bos) {
                tokens.insert(0, bos);
            }
        }
        Ok(PromptInput::Tokens(tokens))
    }

    /// What the engine can do.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn tokens_of(
        &self,
        input: &PromptInput,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, EngineError> {
        let tokens = match input {
            PromptInput::Text(s) => {
                if s.is_empty() {
                    return Err(EngineError::EmptyPrompt);
                }
                self.vocab
                    .tokenize(s, add_special, parse_special)
                    .map_err(|e| EngineError::Tokenize(e.to_string()))?
            }
            PromptInput::Tokens(t) => {
                let n_vocab = self.info.model.n_vocab as Token;
                if let Some(bad) = t.iter().find(|&&x| x < 0 || x >= n_vocab) {
                    return Err(EngineError::InvalidRequest {
                        field: "prompt",
                        message: format!("token id {bad} is outside the vocabulary (0..{n_vocab})"),
                    });
                }
                t.clone()
            }
        };
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        Ok(tokens)
    }

    /// Validates a generation request.
    pub fn prepare_generate(
        &self,
        id: RequestId,
        req: GenerateRequest,
        sink: EventSink,
    ) -> Result<PreparedRequest, EngineError> {
        let info = &self.info;
        if !info.model.can_generate() {
            return Err(EngineError::Unsupported(format!(
                "{} is an encoder-only ({}) model; it computes embeddings and cannot generate text",
                info.model.name.as_deref().unwrap_or("this model"),
                info.model.architecture
            )));
        }
        if !info.can_generate {
            return Err(EngineError::Unsupported(
                "this endpoint's context is configured for embeddings only".into(),
            ));
        }
        let mut sampling = req.sampling.unwrap_or_else(|| info.sampling.clone());
        sampling.validate()?;
        let n_vocab = info.model.n_vocab as i32;
        for b in &sampling.logit_bias {
            if let crate::sampling::BiasTarget::Token(t) = b.target {
                if t >= n_vocab {
                    return Err(EngineError::InvalidRequest {
                        field: "logit_bias",
                        message: format!("token id {t} is outside the vocabulary (0..{n_vocab})"),
                    });
                }
            }
        }
        if let Some(c) = &req.constraint {
            c.validate()?;
            self.vocab.check_constraint(c, &sampling.json_bounds)?;
        }
        if let Some(n) = req.logprobs {
            if n > MAX_TOP_LOGPROBS {
                return Err(EngineError::InvalidRequest {
                    field: "logprobs",
                    message: format!("at most {MAX_TOP_LOGPROBS} alternatives, got {n}"),
                });
            }
        }
        if req.stop.len() > MAX_STOP_STRINGS {
            return Err(EngineError::InvalidRequest {
                field: "stop",
                message: format!(
                    "at most {MAX_STOP_STRINGS} stop strings, got {}",
                    req.stop.len()
                ),
            });
        }
        let add_special = req.add_special && info.model.add_bos;
        let prompt = self.tokens_of(&req.prompt, add_special, req.parse_special)?;
        if prompt.len() >= info.n_ctx as usize {
            return Err(EngineError::PromptTooLong {
                prompt_tokens: prompt.len(),
                n_ctx: info.n_ctx,
            });
        }
        let room = info.n_ctx as usize - prompt.len();
        let max_tokens = match req.max_tokens {
            Some(0) => {
                return Err(EngineError::InvalidRequest {
                    field: "max_tokens",
                    message: "must be at least 1".into(),
                })
            }
            Some(n) if info.max_tokens_limit > 0 && n > info.max_tokens_limit => {
                return Err(EngineError::InvalidRequest {
                    field: "max_tokens",
                    message: format!(
                        "at most {} on this endpoint, got {n}",
                        info.max_tokens_limit
                    ),
                })
            }
            Some(n) => n as usize,
            None if info.default_max_tokens > 0 => info.default_max_tokens as usize,
            None => room,
        };
        if req.ignore_eos {
            // Ban end-of-generation tokens so the model keeps writing, as
            // llama-server does.
            sampling
                .logit_bias
                .extend(self.eog_tokens.iter().map(|&t| LogitBias {
                    target: BiasTarget::Token(t),
                    bias: f32::NEG_INFINITY,
                }));
        }
        let seed = sampling.seed.unwrap_or_else(random_seed);
        Ok(PreparedRequest {
            id,
            kind: PreparedKind::Generate(GenerateSpec {
                max_tokens,
                stop: req.stop,
                ignore_eos: req.ignore_eos,
                sampling,
                seed,
                constraint: req.constraint,
                logprobs: req.logprobs.map(|n| n as usize),
            }),
            prompt,
            context_key: req.context_key,
            cache_prompt: req.cache_prompt,
            repeatable: req.repeatable,
            submitted_at: Instant::now(),
            sink,
        })
    }

    /// Validates an embedding request.
    pub fn prepare_embed(
        &self,
        id: RequestId,
        req: EmbedRequest,
        sink: EventSink,
    ) -> Result<PreparedRequest, EngineError> {
        if self.info.embedding_pooling.is_none() {
            return Err(EngineError::Unsupported(format!(
                "this context does not compute embeddings ({} is a generation model; load it with \
                 context.embeddings = true, or use an embedding model)",
                self.info.model.architecture
            )));
        }
        let prompt = self.tokens_of(&req.input, true, false)?;
        if prompt.len() > self.info.max_embedding_tokens {
            return Err(EngineError::InputTooLong {
                tokens: prompt.len(),
                max: self.info.max_embedding_tokens,
            });
        }
        Ok(PreparedRequest {
            id,
            kind: PreparedKind::Embed {
                normalize: req.normalize,
            },
            prompt,
            context_key: None,
            cache_prompt: false,
            repeatable: false,
            submitted_at: Instant::now(),
            sink,
        })
    }
}

struct Inner {
    commands: mpsc::Sender<Command>,
    preparer: RequestPreparer,
    metrics: Arc<EngineMetrics>,
    queued: Arc<AtomicUsize>,
    next_id: AtomicU64,
    alive: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Ok(mut t) = self.thread.lock() {
            if let Some(t) = t.take() {
                let _ = t.join();
            }
        }
    }
}

/// A running engine. Cloning is cheap; the engine stops when the last clone drops.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.info().model.path)
            .finish()
    }
}

/// Errors starting an engine.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Loading the model or creating the context failed.
    #[error(transparent)]
    Runtime(#[from] crate::runtime::RuntimeError),
}

impl Engine {
    /// Loads a GGUF model and starts its engine.
    #[cfg(feature = "llama")]
    pub fn load(path: &Path, config: NativeRuntimeConfig) -> Result<Engine, StartError> {
        Self::load_with_progress(path, config, None)
    }

    /// Loads a model, reporting load progress (0..=1), and starts its engine.
    #[cfg(feature = "llama")]
    pub fn load_with_progress(
        path: &Path,
        config: NativeRuntimeConfig,
        progress: Option<Box<dyn FnMut(f32) + Send>>,
    ) -> Result<Engine, StartError> {
        config.validate()?;
        crate::runtime::llama::configure_llama_logs(config.observability.llama_logs);
        let model = crate::runtime::llama::load_model(path, &config.placement, progress)?;
        let n_seq = config.slots() + config.cache.idle_sequences;
        let runtime = crate::runtime::llama::LlamaRuntime::new(model, &config, n_seq)?;
        Ok(Self::start(runtime, config))
    }

    /// Starts an engine on any backend (the fake one in tests).
    pub fn start<B: Backend + Send + 'static>(backend: B, config: NativeRuntimeConfig) -> Engine {
        let vocab = backend.vocab();
        let info = EngineInfo::new(&backend, &config);
        let preparer = RequestPreparer::new(vocab, info);
        let metrics = Arc::new(EngineMetrics::default());
        let queued = Arc::new(AtomicUsize::new(0));
        let alive = Arc::new(AtomicBool::new(true));
        let (tx, rx) = mpsc::channel();
        let (metrics_t, queued_t, alive_t) = (metrics.clone(), queued.clone(), alive.clone());
        // The core (and every sampler it builds) lives on the engine thread only.
        let thread = std::thread::Builder::new()
            .name("sipp-engine".into())
            .spawn(move || {
                let mut backend = backend;
                backend.warm_up();
                run_engine(
                    EngineCore::new(backend, &config, metrics_t, queued_t),
                    rx,
                    alive_t,
                )
            })
            .expect("spawning the engine thread");
        Engine {
            inner: Arc::new(Inner {
                commands: tx,
                preparer,
                metrics,
                queued,
                next_id: AtomicU64::new(1),
                alive,
                thread: Mutex::new(Some(thread)),
            }),
        }
    }

    /// What the engine can do.
    pub fn info(&self) -> &EngineInfo {
        self.inner.preparer.info()
    }

    /// The model's vocabulary (tokenize, detokenize).
    pub fn vocab(&self) -> &Arc<dyn Vocab> {
        &self.inner.preparer.vocab
    }

    /// Live metrics.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.inner.metrics.snapshot()
    }

    /// Whether the engine thread is running.
    pub fn is_alive(&self) -> bool {
        self.inner.alive.load(Ordering::Relaxed)
    }

    fn reserve_queue_place(&self) -> Result<(), EngineError> {
        let max = self.info().max_queued;
        self.inner
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < max).then_some(q + 1)
            })
            .map(|_| ())
            .map_err(|_| EngineError::QueueFull { max_queued: max })
    }

    fn submit(
        &self,
        prepared: PreparedRequest,
        rx: UnboundedReceiver<RequestEvent>,
    ) -> Result<RequestHandle, EngineError> {
        if !self.is_alive() {
            return Err(EngineError::EngineStopped);
        }
        self.reserve_queue_place()?;
        let id = prepared.id;
        if self.inner.commands.send(Command::Submit(prepared)).is_err() {
            self.inner.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(EngineError::EngineStopped);
        }
        Ok(RequestHandle {
            id,
            events: rx,
            commands: self.inner.commands.clone(),
            done: false,
        })
    }

    /// Cancels every queued and running request (used at shutdown, after the
    /// grace period).
    pub fn cancel_all(&self) {
        let _ = self.inner.commands.send(Command::CancelAll);
    }

    /// Submits a generation request. Errors in the request are returned here,
    /// before it takes a slot.
    pub fn generate(&self, req: GenerateRequest) -> Result<RequestHandle, EngineError> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let prepared = self.inner.preparer.prepare_generate(id, req, tx)?;
        self.submit(prepared, rx)
    }

    /// The prompt tokens of a conversation, rendered with the model's template.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<PromptInput, EngineError> {
        self.inner.preparer.chat_prompt(messages)
    }

    /// Submits a chat: the conversation is rendered with the model's chat
    /// template and replaces `req.prompt`.
    pub fn chat(
        &self,
        messages: &[ChatMessage],
        req: GenerateRequest,
    ) -> Result<RequestHandle, EngineError> {
        let prompt = self.inner.preparer.chat_prompt(messages)?;
        self.generate(GenerateRequest { prompt, ..req })
    }

    /// Renders a conversation with the model's chat template.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        Ok(self
            .inner
            .preparer
            .render_chat(messages, add_generation_prompt)?)
    }

    /// Submits an embedding request.
    pub fn embed(&self, req: EmbedRequest) -> Result<RequestHandle, EngineError> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let prepared = self.inner.preparer.prepare_embed(id, req, tx)?;
        self.submit(prepared, rx)
    }
}

fn run_engine<B: Backend>(
    mut core: EngineCore<B>,
    rx: mpsc::Receiver<Command>,
    alive: Arc<AtomicBool>,
) {
    // Returns false on shutdown.
    fn handle<B: Backend>(core: &mut EngineCore<B>, cmd: Command) -> bool {
        match cmd {
            Command::Submit(r) => core.enqueue(r),
            Command::Cancel(id) => core.cancel(id),
            Command::CancelAll => core.cancel_all(),
            Command::Shutdown => return false,
        }
        true
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        'outer: loop {
            if !core.has_work() {
                // Going idle: a good moment to check nothing leaked.
                core.check_idle_invariants();
                match rx.recv() {
                    Ok(cmd) => {
                        if !handle(&mut core, cmd) {
                            break 'outer;
                        }
                    }
                    Err(_) => break 'outer,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        if !handle(&mut core, cmd) {
                            break 'outer;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        if !core.has_work() {
                            break 'outer;
                        }
                        break;
                    }
                }
            }
            core.step();
        }
        core.shutdown();
    }));
    alive.store(false, Ordering::Relaxed);
    if result.is_err() {
        tracing::error!("the engine thread panicked; every request in it has failed");
    }
}

/// Cancels one request; cheap to clone and usable from any thread.
#[derive(Debug, Clone)]
pub struct Canceller {
    id: RequestId,
    commands: mpsc::Sender<Command>,
}

impl Canceller {
    /// Cancels the request (no effect once it has finished).
    pub fn cancel(&self) {
        let _ = self.commands.send(Command::Cancel(self.id));
    }
}

/// A submitted request: its events, and cancellation. Dropping it cancels the
/// request if it has not finished.
#[derive(Debug)]
pub struct RequestHandle {
    id: RequestId,
    events: UnboundedReceiver<RequestEvent>,
    commands: mpsc::Sender<Command>,
    done: bool,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Submit(r) => write!(f, "Submit({})", r.id),
            Command::Cancel(id) => write!(f, "Cancel({id})"),
            Command::CancelAll => write!(f, "CancelAll"),
            Command::Shutdown => write!(f, "Shutdown"),
        }
    }
}

impl RequestHandle {
    /// The request id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    fn on_event(&mut self, ev: Option<RequestEvent>) -> Option<RequestEvent> {
        if self.done {
            return None;
        }
        match ev {
            Some(ev) => {
                self.done = ev.is_final();
                Some(ev)
            }
            None => {
                self.done = true;
                Some(RequestEvent::Failed(EngineError::EngineStopped))
            }
        }
    }

    /// The next event; `None` after the final one.
    pub async fn next_event(&mut self) -> Option<RequestEvent> {
        if self.done {
            return None;
        }
        let ev = self.events.recv().await;
        self.on_event(ev)
    }

    /// The next event, blocking the thread (not for use inside an async runtime).
    pub fn blocking_next_event(&mut self) -> Option<RequestEvent> {
        if self.done {
            return None;
        }
        let ev = self.events.blocking_recv();
        self.on_event(ev)
    }

    /// Cancels the request; its final event reports `cancelled`.
    pub fn cancel(&self) {
        let _ = self.commands.send(Command::Cancel(self.id));
    }

    /// A handle that can cancel this request from another thread.
    pub fn canceller(&self) -> Canceller {
        Canceller {
            id: self.id,
            commands: self.commands.clone(),
        }
    }

    /// Waits for the final completion, discarding deltas.
    pub async fn completion(mut self) -> Result<Completion, EngineError> {
        while let Some(ev) = self.next_event().await {
            if let Some(r) = final_completion(ev) {
                return r;
            }
        }
        Err(EngineError::EngineStopped)
    }

    /// Blocking form of [`Self::completion`].
    pub fn blocking_completion(mut self) -> Result<Completion, EngineError> {
        while let Some(ev) = self.blocking_next_event() {
            if let Some(r) = final_completion(ev) {
                return r;
            }
        }
        Err(EngineError::EngineStopped)
    }

    /// Waits for an embedding.
    pub async fn embedding(mut self) -> Result<EmbeddingOutput, EngineError> {
        while let Some(ev) = self.next_event().await {
            if let Some(r) = final_embedding(ev) {
                return r;
            }
        }
        Err(EngineError::EngineStopped)
    }

    /// Blocking form of [`Self::embedding`].
    pub fn blocking_embedding(mut self) -> Result<EmbeddingOutput, EngineError> {
        while let Some(ev) = self.blocking_next_event() {
            if let Some(r) = final_embedding(ev) {
                return r;
            }
        }
        Err(EngineError::EngineStopped)
    }
}

fn final_completion(ev: RequestEvent) -> Option<Result<Completion, EngineError>> {
    match ev {
        RequestEvent::Finished(c) => Some(Ok(c)),
        RequestEvent::Failed(e) => Some(Err(e)),
        RequestEvent::Embedding(_) => Some(Err(EngineError::Unsupported(
            "expected a completion, got an embedding".into(),
        ))),
        _ => None,
    }
}

fn final_embedding(ev: RequestEvent) -> Option<Result<EmbeddingOutput, EngineError>> {
    match ev {
        RequestEvent::Embedding(e) => Some(Ok(e)),
        RequestEvent::Failed(e) => Some(Err(e)),
        RequestEvent::Finished(c) if c.finish_reason == crate::text::FinishReason::Cancelled => {
            Some(Err(EngineError::Unsupported(
                "the embedding was cancelled".into(),
            )))
        }
        RequestEvent::Finished(_) => Some(Err(EngineError::Unsupported(
            "expected an embedding, got a completion".into(),
        ))),
        _ => None,
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        if !self.done {
            self.cancel();
        }
    }
}
