//! The engine: one model, one OS thread running the step loop, and a handle
//! that is `Send + Sync` for submitting requests from async code or threads.
//!
//! Each request gets its own event stream: text deltas, then exactly one final
//! event. Dropping a [`RequestHandle`] cancels its request.

mod core;
mod drafter;
mod executor;
mod lora;
mod metrics;
mod prepare;
mod request;
mod slots;
pub mod validate;

pub use self::core::EngineCore;
pub use executor::Executor;
pub use lora::{LoraAdapterState, LoraTable};
pub use metrics::{EngineMetrics, MetricsSnapshot, SlotView};
pub use prepare::{EngineInfo, PreparedTurn, RequestPreparer, TemplateCaps};
pub use request::{
    Completion, EmbedRequest, EmbeddingOutput, EngineError, EventSink, GenerateRequest,
    GenerateSpec, LoraScale, MediaPrompt, PreparedKind, PreparedRequest, PromptInput, QueuePlace,
    ReasoningBudget, ReasoningBudgetRequest, RequestEvent, RequestStats, Speculation,
    SpeculativeRequest, TextDelta, TokenLogprobs, Usage,
};
pub use slots::{KvErased, KvHolder, KvRestored, KvSaved, SlotActionError};
pub use validate::{MAX_STOP_STRINGS, MAX_TOP_LOGPROBS};

#[cfg(feature = "llama")]
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::chat::ChatMessage;
use crate::config::NativeRuntimeConfig;
use crate::runtime::{Backend, Token, Vocab};
use crate::scheduler::RequestId;

enum Command {
    Submit(PreparedRequest, QueuePlace),
    Cancel(RequestId),
    CancelAll,
    /// Save, restore or erase a slot's KV (see [`slots`]).
    Slot(slots::SlotAction),
    Shutdown,
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
    /// Charged with the tokens of every request submitted through this
    /// clone (see [`Engine::metered`]).
    meter: Option<Arc<dyn UsageMeter>>,
    /// The LoRA adapters of requests submitted through this clone that
    /// choose none (see [`Engine::with_adapter`]).
    lora: Option<Arc<[LoraScale]>>,
}

/// Charges a request's tokens to whoever sent it: a server's token-rate
/// limits. The engine calls it, never decides with it.
pub trait UsageMeter: Send + Sync {
    /// Called once a request is prepared, before it is queued, with its
    /// prompt tokens; an error refuses the request (nothing is queued).
    fn admit(&self, prompt_tokens: usize) -> Result<(), EngineError>;
    /// Called as tokens are generated (each delta's, and at the end what no
    /// delta carried, e.g. a stop string's).
    fn generated(&self, tokens: usize);
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
        let n_seq = config.slots() + config.cache.idle_sequences;
        let model = crate::runtime::llama::load_model(path, &config, n_seq, progress)?;
        let runtime = crate::runtime::llama::LlamaRuntime::new(model, &config, n_seq)?;
        let draft = match &config.speculative.draft_model {
            Some(p) => Some(Self::load_draft(p, &config, &runtime)?),
            None => None,
        };
        Ok(Self::start_with_draft(runtime, draft, config))
    }

    /// The draft model: its own context (one sequence per slot, the draft
    /// context size or the target's), checked to share the target's
    /// vocabulary.
    #[cfg(feature = "llama")]
    fn load_draft(
        path: &Path,
        config: &NativeRuntimeConfig,
        target: &crate::runtime::llama::LlamaRuntime,
    ) -> Result<crate::runtime::llama::LlamaRuntime, StartError> {
        let mut cfg = config.clone();
        // The adapters are the target's.
        cfg.lora.clear();
        if config.speculative.draft_n_ctx > 0 {
            cfg.context.n_ctx = config.speculative.draft_n_ctx;
        } else {
            cfg.context.n_ctx = target.n_ctx();
        }
        let model = crate::runtime::llama::load_model(path, &cfg, config.slots(), None)?;
        let draft = crate::runtime::llama::LlamaRuntime::new(model, &cfg, config.slots())?;
        let (t, d) = (target.vocab(), draft.vocab());
        let same = t.info().n_vocab == d.info().n_vocab
            && (0..t.info().n_vocab as Token)
                .step_by(97)
                .all(|tok| t.token_bytes(tok) == d.token_bytes(tok));
        if !same {
            return Err(StartError::Config(crate::config::ConfigError::Invalid {
                field: "speculative.draft_model",
                message: format!(
                    "{} does not share the model's vocabulary ({} tokens against {})",
                    path.display(),
                    d.info().n_vocab,
                    t.info().n_vocab
                ),
            }));
        }
        Ok(draft)
    }

    /// Starts an engine on any backend (the fake one in tests).
    pub fn start<B: Backend + Send + 'static>(backend: B, config: NativeRuntimeConfig) -> Engine {
        Self::start_with_draft(backend, None, config)
    }

    /// Starts an engine with a draft model for `draft` speculation (a
    /// backend on a model sharing the target's vocabulary).
    pub fn start_with_draft<B: Backend + Send + 'static>(
        backend: B,
        draft: Option<B>,
        config: NativeRuntimeConfig,
    ) -> Engine {
        let vocab = backend.vocab();
        let mut info = EngineInfo::new(&backend, &config);
        info.has_draft_model = draft.is_some();
        let preparer = RequestPreparer::new(vocab, info);
        let metrics = Arc::new(EngineMetrics::default());
        // Idle slots are visible as soon as the engine exists.
        metrics.publish_idle_slots(config.slots() as usize);
        let queued = Arc::new(AtomicUsize::new(0));
        let alive = Arc::new(AtomicBool::new(true));
        let (tx, rx) = mpsc::channel();
        let (metrics_t, alive_t) = (metrics.clone(), alive.clone());
        // The core (and every sampler it builds) lives on the engine thread only.
        let thread = std::thread::Builder::new()
            .name("sipp-engine".into())
            .spawn(move || {
                let mut backend = backend;
                backend.warm_up();
                let mut core = EngineCore::new(backend, &config, metrics_t);
                if let Some(mut d) = draft {
                    d.warm_up();
                    core = core.with_drafter(d);
                }
                run_engine(core, rx, alive_t)
            })
            .expect("spawning the engine thread");
        Engine {
            meter: None,
            lora: None,
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

    /// Every slot as of the last step: its phase and its request's counts.
    pub fn slot_views(&self) -> Vec<SlotView> {
        self.inner.metrics.slot_views()
    }

    /// This engine, charging every request submitted through the returned
    /// clone to `meter` (prompt tokens at submission, which it may refuse,
    /// then generated tokens as they arrive).
    pub fn metered(&self, meter: Arc<dyn UsageMeter>) -> Engine {
        Engine {
            inner: self.inner.clone(),
            meter: Some(meter),
            lora: self.lora.clone(),
        }
    }

    /// This engine with the LoRA adapter named `name` (alone, at its
    /// configured scale) for every request submitted through the returned
    /// clone that chooses no adapters itself: how `model: "TARGET:NAME"`
    /// selects one. `None` when the model has no adapter of that name.
    pub fn with_adapter(&self, name: &str) -> Option<Engine> {
        let choice = self.inner.preparer.lora.by_name(name)?;
        Some(Engine {
            inner: self.inner.clone(),
            meter: self.meter.clone(),
            lora: Some(choice.into()),
        })
    }

    /// The model's LoRA adapters with their global scales.
    pub fn lora_adapters(&self) -> Vec<LoraAdapterState> {
        self.inner.preparer.lora.states()
    }

    /// Sets the adapters' global scales (llama-server's `POST
    /// /lora-adapters`): the listed ones at their scales, the others at 0.
    /// Requests already submitted keep the scales they were given.
    pub fn set_lora_scales(&self, scales: &[LoraScale]) -> Result<(), EngineError> {
        self.inner.preparer.lora.set_global(scales)
    }

    /// Requests that ran with each adapter, by id.
    pub fn lora_request_counts(&self) -> Vec<u64> {
        self.inner.preparer.lora.request_counts()
    }

    /// Whether the engine thread is running.
    pub fn is_alive(&self) -> bool {
        self.inner.alive.load(Ordering::Relaxed)
    }

    fn submit(
        &self,
        prepared: PreparedRequest,
        rx: UnboundedReceiver<RequestEvent>,
    ) -> Result<RequestHandle, EngineError> {
        if !self.is_alive() {
            return Err(EngineError::EngineStopped);
        }
        if let Some(m) = &self.meter {
            m.admit(prepared.prompt.len())?;
        }
        let max = self.info().max_queued;
        let place = QueuePlace::reserve(&self.inner.queued, max)
            .ok_or(EngineError::QueueFull { max_queued: max })?;
        let id = prepared.id;
        // On a failed send the command, and with it the place, is dropped.
        if self
            .inner
            .commands
            .send(Command::Submit(prepared, place))
            .is_err()
        {
            return Err(EngineError::EngineStopped);
        }
        Ok(RequestHandle {
            id,
            events: rx,
            commands: self.inner.commands.clone(),
            done: false,
            meter: self.meter.clone().map(|m| (m, 0)),
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
        let mut req = req;
        if req.lora.is_none() {
            req.lora = self.lora.as_deref().map(<[LoraScale]>::to_vec);
        }
        let prepared = self.inner.preparer.prepare_generate(id, req, tx)?;
        let adapters = prepared.adapters.clone();
        let handle = self.submit(prepared, rx)?;
        self.inner.preparer.lora.count(&adapters);
        Ok(handle)
    }

    /// The prompt tokens of a conversation, rendered with the model's template.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<PromptInput, EngineError> {
        self.inner.preparer.chat_prompt(messages)
    }

    /// Renders and tokenizes a chat answer with tools and reasoning: the
    /// prompt, the grammar its calls need and the parser of its output.
    pub fn prepare_turn(
        &self,
        turn: &crate::tools::turn::ChatTurn<'_>,
    ) -> Result<PreparedTurn, EngineError> {
        self.inner.preparer.prepare_turn(turn)
    }

    /// [`Self::prepare_turn`] without tokenizing: the rendered prompt text and
    /// the turn (with an empty prompt).
    pub fn render_turn(
        &self,
        turn: &crate::tools::turn::ChatTurn<'_>,
    ) -> Result<(String, PreparedTurn), EngineError> {
        self.inner.preparer.render_turn(turn)
    }

    /// What the model's chat template does with tools, if it has one.
    pub fn template_caps(&self) -> Option<TemplateCaps> {
        self.inner.preparer.template_caps()
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

    /// The tokens a generation request's prompt becomes, as
    /// [`Engine::generate`] computes them (routers' render endpoints use it).
    pub fn prompt_tokens(
        &self,
        prompt: &PromptInput,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<crate::runtime::Token>, EngineError> {
        self.inner
            .preparer
            .prompt_tokens(prompt, add_special, parse_special)
    }

    /// The token ids of a conversation rendered with the model's chat
    /// template, as [`Engine::chat`] computes them.
    pub fn chat_tokens(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<crate::runtime::Token>, EngineError> {
        match self
            .inner
            .preparer
            .chat_tokens(messages, add_generation_prompt)?
        {
            PromptInput::Tokens(t) => Ok(t),
            PromptInput::Media(m) => Ok(m.tokens),
            PromptInput::Text(_) => unreachable!("chat prompts are tokenized"),
        }
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
        self.submit_embedding(prepared, rx)
    }

    /// Submits one (query, document) pair to a reranker (a model with rank
    /// pooling); the embedding's values are its raw scores (`n_cls_out` of
    /// them, the relevance score first). The documents of one request go in
    /// as separate pairs and are batched together by the scheduler.
    pub fn rerank(&self, query: &str, document: &str) -> Result<RequestHandle, EngineError> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let prepared = self
            .inner
            .preparer
            .prepare_rerank(id, query, document, tx)?;
        self.submit_embedding(prepared, rx)
    }

    /// Submits an embedding or rerank request with the adapters this clone
    /// selects, else every adapter at its global scale (as llama-server
    /// computes embeddings with its global LoRA scales).
    fn submit_embedding(
        &self,
        mut prepared: PreparedRequest,
        rx: UnboundedReceiver<RequestEvent>,
    ) -> Result<RequestHandle, EngineError> {
        let lora = &self.inner.preparer.lora;
        prepared.adapters = lora.resolve(self.lora.as_deref())?;
        let adapters = prepared.adapters.clone();
        let handle = self.submit(prepared, rx)?;
        lora.count(&adapters);
        Ok(handle)
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
            Command::Submit(r, place) => core.enqueue(r, Some(place)),
            Command::Cancel(id) => core.cancel(id),
            Command::CancelAll => core.cancel_all(),
            Command::Slot(a) => core.slot_action(a),
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
pub struct RequestHandle {
    id: RequestId,
    events: UnboundedReceiver<RequestEvent>,
    commands: mpsc::Sender<Command>,
    done: bool,
    /// The meter and the generated tokens charged to it so far.
    meter: Option<(Arc<dyn UsageMeter>, usize)>,
}

impl std::fmt::Debug for RequestHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestHandle")
            .field("id", &self.id)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Submit(r, _) => write!(f, "Submit({})", r.id),
            Command::Cancel(id) => write!(f, "Cancel({id})"),
            Command::CancelAll => write!(f, "CancelAll"),
            Command::Slot(a) => write!(f, "Slot({a:?})"),
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
                if let Some((meter, charged)) = &mut self.meter {
                    let n = match &ev {
                        RequestEvent::Delta(d) => d.tokens.len(),
                        RequestEvent::Finished(c) => {
                            c.usage.completion_tokens.saturating_sub(*charged)
                        }
                        _ => 0,
                    };
                    if n > 0 {
                        *charged += n;
                        meter.generated(n);
                    }
                }
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
