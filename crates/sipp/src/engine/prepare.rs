//! What the engine can do ([`EngineInfo`]) and the preparation of requests on
//! the caller's thread ([`RequestPreparer`]): each field checked by its rule in
//! [`validate`](super::validate), the prompt tokenized, defaults filled in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::chat::{ChatError, ChatMessage, ChatTemplate, RenderOptions, Role};
use crate::config::NativeRuntimeConfig;
use crate::runtime::{Backend, ModelInfo, Pooling, Token, Vocab};
use crate::sampling::OutputConstraint;
use crate::sampling::{BiasTarget, LogitBias, SamplingParams};
use crate::scheduler::RequestId;
use crate::tools::turn::ChatTurn;
use crate::tools::{format, grammar, OutputParser, ToolFormat};

use super::validate;
use super::{
    EmbedRequest, EngineError, EventSink, GenerateRequest, GenerateSpec, PreparedKind,
    PreparedRequest, PromptInput,
};

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
    /// Speculative decoding defaults.
    pub speculative: crate::config::SpeculativeConfig,
    /// A draft model is loaded next to the model.
    pub has_draft_model: bool,
    /// LoRA adapters loaded with the model, in id order.
    pub lora: Vec<crate::config::LoraAdapterConfig>,
    /// What one request may send in images.
    pub image_limits: crate::media::ImageLimits,
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
            speculative: config.speculative.clone(),
            has_draft_model: false,
            lora: config.lora.clone(),
            image_limits: config.images.limits(),
            model,
        }
    }
}

/// An encoder-decoder request's input (see [`PreparedRequest::encoder_input`]).
type EncoderInput = Option<Arc<[Token]>>;

/// Validates and tokenizes requests on the caller's thread.
#[derive(Clone)]
pub struct RequestPreparer {
    pub(super) vocab: Arc<dyn Vocab>,
    info: Arc<EngineInfo>,
    eog_tokens: Arc<Vec<Token>>,
    chat_template: Arc<Result<ChatTemplate, ChatError>>,
    caps: Option<TemplateCaps>,
    pub(super) lora: Arc<super::lora::LoraTable>,
}

/// What the model's chat template does with tools and reasoning, found once
/// when the engine starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemplateCaps {
    /// How its family writes calls.
    pub format: ToolFormat,
    /// It renders tools, calls and tool results itself; otherwise sipp's
    /// fallback ([`format::fallback_messages`]) rewrites the conversation.
    pub native_tools: bool,
    /// It renders a system message.
    pub system_role: bool,
    /// It knows `<think>` blocks.
    pub reasoning: bool,
}

impl TemplateCaps {
    /// The capabilities of a compiled template.
    pub fn of(t: &ChatTemplate) -> Self {
        let format = ToolFormat::detect(t.source());
        let native = t.renders_tools();
        Self {
            // A template that renders tools but writes no known marker gets
            // the fallback's format and instructions.
            native_tools: native && format != ToolFormat::Generic && format != ToolFormat::Pythonic,
            format,
            system_role: t.renders_system(),
            reasoning: t.source().contains("<think>"),
        }
    }
}

/// A chat answer ready to submit: its prompt, the constraint its tool calls
/// need, and the parser of its output.
#[derive(Debug, Clone)]
pub struct PreparedTurn {
    /// The rendered and tokenized conversation.
    pub prompt: PromptInput,
    /// The grammar of calls (lazy under `auto`), if the model may call.
    pub constraint: Option<OutputConstraint>,
    /// A parser for one answer (clone it per choice).
    pub parser: OutputParser,
    /// How the model writes calls.
    pub format: ToolFormat,
    /// The prompt ends inside an open `<think>` block.
    pub starts_inside: bool,
}

impl PreparedTurn {
    /// A cap of `max_tokens` on the answer's `<think>` block (`None` for a
    /// negative count: no cap, as llama-server's `-1`).
    pub fn reasoning_budget(&self, max_tokens: i64) -> Option<super::ReasoningBudgetRequest> {
        u32::try_from(max_tokens)
            .ok()
            .map(|max_tokens| super::ReasoningBudgetRequest {
                max_tokens,
                close: "\n</think>\n\n".into(),
                starts_inside: self.starts_inside,
            })
    }
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
        let caps = chat_template.as_ref().ok().map(TemplateCaps::of);
        let lora = Arc::new(super::lora::LoraTable::new(&info.lora));
        Self {
            lora,
            vocab,
            info: Arc::new(info),
            eog_tokens: Arc::new(eog_tokens),
            chat_template: Arc::new(chat_template),
            caps,
        }
    }

    /// What the model's template does with tools, if it has a template.
    pub fn template_caps(&self) -> Option<TemplateCaps> {
        self.caps
    }

    /// Renders and tokenizes a chat answer with tools: the conversation as the
    /// template (or the fallback) shows it, the grammar its calls need, and a
    /// parser for its output. Tools, the choice and the call history are
    /// checked first; errors name the field.
    pub fn prepare_turn(&self, turn: &ChatTurn<'_>) -> Result<PreparedTurn, EngineError> {
        let (text, turn_out) = self.render_turn(turn)?;
        Ok(PreparedTurn {
            prompt: self.chat_text_tokens(&text, turn.messages)?,
            ..turn_out
        })
    }

    /// [`Self::prepare_turn`] without tokenizing: the rendered prompt text, and
    /// the turn with an empty prompt.
    pub fn render_turn(&self, turn: &ChatTurn<'_>) -> Result<(String, PreparedTurn), EngineError> {
        let template = self.chat_template.as_ref().as_ref().map_err(Clone::clone)?;
        let caps = self.caps.unwrap_or(TemplateCaps {
            format: ToolFormat::Generic,
            native_tools: false,
            system_role: true,
            reasoning: false,
        });
        turn.tools.validate()?;
        format::check_history(turn.messages)?;
        if turn.continue_final && turn.messages.last().map(|m| m.role) != Some(Role::Assistant) {
            return Err(EngineError::InvalidRequest {
                field: "continue_final_message",
                message: "the last message must be an assistant message to continue".into(),
            });
        }
        let shown: &[crate::tools::Tool] = if turn.tools.may_call() {
            &turn.tools.tools
        } else {
            &[]
        };
        let text = if caps.native_tools {
            template.render_with(
                turn.messages,
                &RenderOptions {
                    add_generation_prompt: !turn.continue_final,
                    tools: (!shown.is_empty()).then_some(shown),
                    kwargs: turn.kwargs,
                },
            )?
        } else {
            let messages = format::fallback_messages(
                turn.messages,
                shown,
                caps.format,
                turn.tools.parallel,
                caps.system_role,
            )?;
            template.render_with(
                &messages,
                &RenderOptions {
                    add_generation_prompt: !turn.continue_final,
                    tools: None,
                    kwargs: turn.kwargs,
                },
            )?
        };
        let text = if turn.continue_final {
            continued(text, turn.messages)?
        } else {
            text
        };
        let starts_inside = caps.reasoning && text.trim_end().ends_with("<think>");
        // Splitting is on by default even for templates that never say
        // <think>: it costs nothing when the model does not think.
        let reasoning = turn.reasoning;
        let prepared = PreparedTurn {
            prompt: PromptInput::Tokens(Vec::new()),
            constraint: grammar::call_grammar(caps.format, turn.tools)
                .map(OutputConstraint::Composed),
            parser: OutputParser::new(caps.format, turn.tools.may_call(), reasoning, starts_inside),
            format: caps.format,
            starts_inside,
        };
        Ok((text, prepared))
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
        self.chat_tokens(messages, true)
    }

    /// [`Self::chat_prompt`], with or without the generation prompt.
    pub fn chat_tokens(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<PromptInput, EngineError> {
        let text = self.render_chat(messages, add_generation_prompt)?;
        self.chat_text_tokens(&text, messages)
    }

    /// The tokens of a rendered conversation; with images in `messages`,
    /// the projector's tokens and the images' places.
    fn chat_text_tokens(
        &self,
        text: &str,
        messages: &[ChatMessage],
    ) -> Result<PromptInput, EngineError> {
        let urls: Vec<&str> = messages.iter().flat_map(ChatMessage::image_urls).collect();
        if !urls.is_empty() {
            return self.media_prompt(text, messages, &urls);
        }
        let mut tokens = self
            .vocab
            .tokenize(text, false, true)
            .map_err(|e| EngineError::Tokenize(e.to_string()))?;
        if let Some(bos) = self.info.model.bos {
            if self.info.model.add_bos && tokens.first() != Some(&bos) {
                tokens.insert(0, bos);
            }
        }
        Ok(PromptInput::Tokens(tokens))
    }

    /// A rendered conversation with images: the images read and decoded,
    /// the text split at their markers by the projector, each image given
    /// its placeholders. Errors name `messages`.
    fn media_prompt(
        &self,
        text: &str,
        messages: &[ChatMessage],
        urls: &[&str],
    ) -> Result<PromptInput, EngineError> {
        let bad = |message: String| EngineError::InvalidRequest {
            field: "messages",
            message,
        };
        let Some(projector) = self.vocab.media() else {
            return Err(bad(format!(
                "{} takes no images: it has no multimodal projector (load one with \
                 --mmproj, or `mmproj` in the model's config)",
                self.info.model.name.as_deref().unwrap_or("this model")
            )));
        };
        if messages.iter().any(ChatMessage::has_marker_text) {
            return Err(bad(format!(
                "a message's text contains `{}`, which stands for an image here",
                crate::media::IMAGE_MARKER
            )));
        }
        let images = crate::media::load_images(urls, &self.info.image_limits)
            .map_err(|e| bad(e.to_string()))?;
        let pieces = projector
            .tokenize(text, &images)
            .map_err(|e| bad(e.to_string()))?;
        let mut tokens = Vec::new();
        let mut media = Vec::new();
        if let Some(bos) = self.info.model.bos.filter(|_| self.info.model.add_bos) {
            let starts_with_bos = match pieces.first() {
                Some(crate::runtime::MediaPiece::Text(t)) => t.first() == Some(&bos),
                _ => false,
            };
            if !starts_with_bos {
                tokens.push(bos);
            }
        }
        for piece in pieces {
            match piece {
                crate::runtime::MediaPiece::Text(t) => tokens.extend(t),
                crate::runtime::MediaPiece::Image(chunk) => {
                    let start = tokens.len();
                    tokens.extend(crate::media::placeholder_tokens(chunk.hash, chunk.n_tokens));
                    media.push(crate::runtime::MediaSpan { start, chunk });
                }
            }
        }
        // The last prompt row gives the first token's logits: it must be text.
        if media.last().is_some_and(|m| m.end() == tokens.len()) {
            return Err(bad("the prompt cannot end with an image".into()));
        }
        Ok(PromptInput::Media(super::request::MediaPrompt {
            tokens,
            media,
        }))
    }

    /// What the engine can do.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The tokens of a prompt given in `field`: text tokenized (empty text
    /// stays empty, for the length rule to refuse), token ids checked against
    /// the vocabulary.
    fn tokens_of(
        &self,
        field: &'static str,
        input: &PromptInput,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, EngineError> {
        match input {
            PromptInput::Text(s) if s.is_empty() => Ok(Vec::new()),
            PromptInput::Text(s) => self
                .vocab
                .tokenize(s, add_special, parse_special)
                .map_err(|e| EngineError::Tokenize(e.to_string())),
            PromptInput::Tokens(t) => t
                .iter()
                .map(|&x| validate::token_id(field, x.into(), self.info.model.n_vocab))
                .collect(),
            PromptInput::Media(m) => Ok(m.tokens.clone()),
        }
    }

    /// The tokens a generation request's prompt becomes, exactly as
    /// [`Self::prepare_generate`] computes them (BOS when the model wants it
    /// and `add_special` asks; token ids checked).
    pub fn prompt_tokens(
        &self,
        prompt: &PromptInput,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, EngineError> {
        self.tokens_of(
            "prompt",
            prompt,
            add_special && self.info.model.add_bos,
            parse_special,
        )
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
        validate::sampling(&sampling, info.model.n_vocab)?;
        if let Some(c) = &req.constraint {
            validate::constraint(c, self.vocab.as_ref(), &sampling.json_bounds)?;
        }
        if let Some(n) = req.logprobs {
            validate::logprobs(n)?;
        }
        validate::stop(&req.stop)?;
        if let Some(n) = req.max_tokens {
            validate::max_tokens(n, info.max_tokens_limit)?;
        }
        let (prompt, encoder_input) = if info.model.is_encoder_decoder() {
            self.encoder_decoder_prompt(&req.prompt, req.parse_special)?
        } else {
            let p = self.prompt_tokens(&req.prompt, req.add_special, req.parse_special)?;
            (p, None)
        };
        let media: Arc<[crate::runtime::MediaSpan]> = match &req.prompt {
            PromptInput::Media(m) => m.media.clone().into(),
            _ => Arc::from(Vec::new()),
        };
        validate::prompt_length(prompt.len(), info.n_ctx)?;
        let max_tokens = match req.max_tokens {
            Some(n) => n as usize,
            None if info.default_max_tokens > 0 => info.default_max_tokens as usize,
            // Until the context is full.
            None => info.n_ctx as usize - prompt.len(),
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
        let reasoning_budget = match &req.reasoning_budget {
            Some(b) => Some(super::ReasoningBudget {
                max_tokens: b.max_tokens as usize,
                close: self
                    .vocab
                    .tokenize(&b.close, false, true)
                    .map_err(|e| EngineError::Tokenize(e.to_string()))?,
                starts_inside: b.starts_inside,
            }),
            None => None,
        };
        // A repeatable request speculates only when it asks to: which drafts
        // a step verifies follows measured timings, and a step's shape can
        // move logits at near-ties.
        let asked = req.speculative.as_ref().is_some_and(|s| s.mode.is_some());
        let mut speculative = self.speculation(req.speculative)?;
        if req.repeatable && !asked {
            speculative.mode = crate::config::SpeculativeMode::Off;
        }
        if !media.is_empty() || encoder_input.is_some() {
            // Drafts come from the context (n-gram) or a draft model that
            // sees tokens; image placeholders are neither.
            speculative.mode = crate::config::SpeculativeMode::Off;
        }
        let adapters = self.lora.resolve(req.lora.as_deref())?;
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
                reasoning_budget,
                speculative,
                skip_special_tokens: req.skip_special_tokens,
                include_stop: req.include_stop,
            }),
            prompt,
            media,
            // The decoder's KV depends on the encoder's output: never reused.
            cache_prompt: req.cache_prompt && encoder_input.is_none(),
            encoder_input,
            context_key: req.context_key,
            adapters,
            repeatable: req.repeatable,
            submitted_at: Instant::now(),
            sink,
        })
    }

    /// An encoder-decoder model's prompt: the input tokenized with its
    /// special tokens (T5 appends EOS), to be encoded in one pass, and the
    /// decoder's start token as the prompt the slot decodes from.
    fn encoder_decoder_prompt(
        &self,
        prompt: &PromptInput,
        parse_special: bool,
    ) -> Result<(Vec<Token>, EncoderInput), EngineError> {
        let info = &self.info;
        if matches!(prompt, PromptInput::Media(_)) {
            return Err(EngineError::Unsupported(
                "this encoder-decoder model takes no images".into(),
            ));
        }
        let input = self.tokens_of("prompt", prompt, true, parse_special)?;
        if input.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        // llama.cpp encodes a whole input in one micro-batch.
        validate::embedding_input_length(input.len(), info.max_embedding_tokens)?;
        let start = info.model.decoder_start.or(info.model.bos).ok_or_else(|| {
            EngineError::Unsupported("the model names no decoder start token".into())
        })?;
        Ok((vec![start], Some(Arc::from(input))))
    }

    /// The speculative decoding a request gets: its own mode and `n_max`
    /// where it gives them, the engine's otherwise.
    fn speculation(
        &self,
        req: Option<super::SpeculativeRequest>,
    ) -> Result<super::Speculation, EngineError> {
        let cfg = &self.info.speculative;
        let req = req.unwrap_or_default();
        let n_max = req.n_max.unwrap_or(cfg.n_max);
        validate::draft_tokens(n_max)?;
        let mode = req.mode.unwrap_or(cfg.mode);
        if mode == crate::config::SpeculativeMode::Draft && !self.info.has_draft_model {
            return Err(EngineError::InvalidRequest {
                field: "speculative.mode",
                message: "`draft` needs a draft model, and this model has none \
                          (speculative.draft_model in its runtime config)"
                    .into(),
            });
        }
        Ok(super::Speculation {
            mode,
            n_max: n_max as usize,
            ngram_min: cfg.ngram_min as usize,
            ngram_max: cfg.ngram_max as usize,
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
        if matches!(req.input, PromptInput::Media(_)) {
            return Err(EngineError::InvalidRequest {
                field: "input",
                message: "images are not embedded; send text".into(),
            });
        }
        let prompt = self.tokens_of("input", &req.input, true, false)?;
        validate::embedding_input_length(prompt.len(), self.info.max_embedding_tokens)?;
        Ok(embedding_request(id, prompt, req.normalize, sink))
    }
}

/// A request that reads the pooled embedding (or rank score) of `prompt`.
fn embedding_request(
    id: RequestId,
    prompt: Vec<Token>,
    normalize: bool,
    sink: EventSink,
) -> PreparedRequest {
    PreparedRequest {
        id,
        kind: PreparedKind::Embed { normalize },
        prompt,
        media: Arc::from(Vec::new()),
        encoder_input: None,
        context_key: None,
        adapters: crate::runtime::AdapterSet::none(),
        cache_prompt: false,
        repeatable: false,
        submitted_at: Instant::now(),
        sink,
    }
}

impl RequestPreparer {
    /// Validates a rerank request: one (query, document) pair, tokenized as
    /// llama-server does ([`crate::runtime::RerankFormat`]), read out as the
    /// raw rank-pooled scores.
    pub fn prepare_rerank(
        &self,
        id: RequestId,
        query: &str,
        document: &str,
        sink: EventSink,
    ) -> Result<PreparedRequest, EngineError> {
        if self.info.embedding_pooling != Some(Pooling::Rank) {
            return Err(EngineError::InvalidRequest {
                field: "model",
                message: format!(
                    "this model does not rerank: it needs rank pooling (a cross-encoder with a \
                     classification head, loaded with context.pooling = \"rank\"); its pooling \
                     is {}",
                    self.info
                        .embedding_pooling
                        .map_or("none (a generation context)", Pooling::as_str)
                ),
            });
        }
        let prompt = self
            .vocab
            .rerank_format()
            .pair_tokens(self.vocab.as_ref(), query, document)
            .map_err(|e| EngineError::Tokenize(e.to_string()))?;
        validate::embedding_input_length(prompt.len(), self.info.max_embedding_tokens)?;
        Ok(embedding_request(id, prompt, false, sink))
    }
}

/// A conversation rendered without a generation prompt, cut right after the
/// text of its last (assistant) message, so the model continues that text
/// instead of closing the turn. As transformers does: the last place the
/// message's text appears, or its trimmed text when the template trims.
fn continued(text: String, messages: &[ChatMessage]) -> Result<String, EngineError> {
    let last = messages.last().map(ChatMessage::text).unwrap_or_default();
    let found = [last.as_str(), last.trim()]
        .into_iter()
        .filter(|t| !t.is_empty())
        .find_map(|t| text.rfind(t).map(|at| at + t.len()));
    match found {
        Some(end) => Ok(text[..end].to_string()),
        None if last.trim().is_empty() => Err(EngineError::InvalidRequest {
            field: "continue_final_message",
            message: "the last assistant message has no text to continue".into(),
        }),
        None => Err(EngineError::InvalidRequest {
            field: "continue_final_message",
            message:
                "the chat template does not show the last message's text; it cannot be continued"
                    .into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::fake::{FakeBackend, FakeConfig, N_VOCAB};

    fn preparer(max_tokens_limit: u32) -> RequestPreparer {
        let mut config = NativeRuntimeConfig::default();
        config.scheduler.max_tokens_limit = max_tokens_limit;
        let backend = FakeBackend::new(FakeConfig {
            n_ctx: 64,
            ..FakeConfig::default()
        });
        RequestPreparer::new(backend.vocab(), EngineInfo::new(&backend, &config))
    }

    /// Prepares the request; on refusal, the field it names.
    fn prepare(p: &RequestPreparer, req: GenerateRequest) -> Result<(), String> {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        match p.prepare_generate(1, req, tx) {
            Ok(_) => Ok(()),
            Err(EngineError::InvalidRequest { field, .. }) => Err(field.to_string()),
            Err(EngineError::Sampling(crate::sampling::SamplingError::Invalid {
                field, ..
            })) => Err(field.to_string()),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn each_field_is_checked_by_its_rule() {
        let p = preparer(10);
        let req = || GenerateRequest::new("ab");
        // max_tokens: 1 to the endpoint's limit.
        assert_eq!(prepare(&p, req().max_tokens(10)), Ok(()));
        assert_eq!(prepare(&p, req().max_tokens(11)), Err("max_tokens".into()));
        assert_eq!(prepare(&p, req().max_tokens(0)), Err("max_tokens".into()));
        // logprobs: up to MAX_TOP_LOGPROBS.
        let logprobs = |n| GenerateRequest {
            logprobs: Some(n),
            ..req()
        };
        assert_eq!(prepare(&p, logprobs(validate::MAX_TOP_LOGPROBS)), Ok(()));
        assert_eq!(
            prepare(&p, logprobs(validate::MAX_TOP_LOGPROBS + 1)),
            Err("logprobs".into())
        );
        // stop: up to MAX_STOP_STRINGS.
        let stop = |n: usize| GenerateRequest {
            stop: (0..n).map(|i| format!("s{i}")).collect(),
            ..req()
        };
        assert_eq!(prepare(&p, stop(validate::MAX_STOP_STRINGS)), Ok(()));
        assert_eq!(
            prepare(&p, stop(validate::MAX_STOP_STRINGS + 1)),
            Err("stop".into())
        );
        // logit_bias and prompt token ids: inside the vocabulary.
        let bias = |t: usize| {
            req().sampling(SamplingParams {
                logit_bias: vec![LogitBias {
                    target: BiasTarget::Token(t as Token),
                    bias: 1.0,
                }],
                ..SamplingParams::default()
            })
        };
        assert_eq!(prepare(&p, bias(N_VOCAB - 1)), Ok(()));
        assert_eq!(prepare(&p, bias(N_VOCAB)), Err("logit_bias".into()));
        let tokens = |t: usize| GenerateRequest::new(PromptInput::Tokens(vec![1, t as Token]));
        assert_eq!(prepare(&p, tokens(N_VOCAB - 1)), Ok(()));
        assert_eq!(prepare(&p, tokens(N_VOCAB)), Err("prompt".into()));
    }

    #[test]
    fn no_endpoint_limit_leaves_max_tokens_open() {
        let p = preparer(0);
        assert_eq!(
            prepare(&p, GenerateRequest::new("ab").max_tokens(u32::MAX)),
            Ok(())
        );
    }

    #[test]
    fn rerank_pairs_are_formatted_as_llama_server_does_and_need_rank_pooling() {
        use crate::runtime::fake::{BOS, EOS};
        use crate::runtime::RerankFormat;
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        // A context that pools by mean does not rerank.
        match preparer(0).prepare_rerank(1, "q", "d", tx.clone()) {
            Err(EngineError::InvalidRequest { field, message }) => {
                assert_eq!(field, "model");
                assert!(
                    message.contains("rank pooling") && message.contains("none"),
                    "{message}"
                );
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        let backend = FakeBackend::new(FakeConfig {
            n_ctx: 64,
            encoder_only: true,
            embeddings: Some(Pooling::Rank),
            ..FakeConfig::default()
        });
        let config = NativeRuntimeConfig::default();
        let p = RequestPreparer::new(backend.vocab(), EngineInfo::new(&backend, &config));
        let prepared = p.prepare_rerank(1, "ab", "c", tx).expect("prepared");
        assert_eq!(prepared.prompt, vec![BOS, 97, 98, 99]);
        assert!(matches!(
            prepared.kind,
            PreparedKind::Embed { normalize: false }
        ));

        let v = backend.vocab();
        // BERT: [CLS] query [SEP] document.
        let bert = RerankFormat {
            bos: Some(BOS),
            sep: Some(7),
            ..RerankFormat::default()
        };
        assert_eq!(
            bert.pair_tokens(v.as_ref(), "ab", "c").expect("tokens"),
            vec![BOS, 97, 98, 7, 99]
        );
        // EOS after both texts, SEP between; special text in them stays text.
        let full = RerankFormat {
            eos: Some(EOS),
            ..bert.clone()
        };
        assert_eq!(
            full.pair_tokens(v.as_ref(), "</s>", "").expect("tokens"),
            vec![BOS, 60, 47, 115, 62, EOS, 7, EOS]
        );
        // A template: special text is parsed, nothing is added.
        let templated = RerankFormat {
            template: Some("<s>{query}</s>{document}".into()),
            ..full
        };
        assert_eq!(
            templated.pair_tokens(v.as_ref(), "a", "b").expect("tokens"),
            vec![BOS, 97, EOS, 98]
        );
    }
}
