//! Local endpoints: an engine in this process.

use crate::client::{
    ChatRequest, ClientError, EmbedRequest, Embedding, Embeddings, QueryRequest, RequestOptions,
    Response, Run, RunEvent,
};
use crate::engine::{Engine, GenerateRequest, PromptInput, RequestEvent, RequestHandle};
use crate::protocol::request_from_text_options;
use crate::text::FinishReason;
use crate::tools::turn::ChatTurn;
use crate::tools::{OutputParser, TurnEvent, TurnOutput};
use crate::NativeRuntimeConfig;

pub(super) struct LocalEndpoint {
    engine: Engine,
}

impl LocalEndpoint {
    #[cfg(not(feature = "llama"))]
    pub(super) async fn start(
        _model: String,
        _config: NativeRuntimeConfig,
    ) -> Result<Self, ClientError> {
        Err(ClientError::Load(
            "this build of sipp has no llama.cpp runtime (feature `llama`)".into(),
        ))
    }

    #[cfg(feature = "llama")]
    pub(super) async fn start(
        model: String,
        config: NativeRuntimeConfig,
    ) -> Result<Self, ClientError> {
        let engine = tokio::task::spawn_blocking(move || {
            let path = crate::models::resolve_or_fetch(&model)
                .map_err(|e| ClientError::Load(e.to_string()))?;
            Engine::load(&path, config).map_err(|e| ClientError::Load(e.to_string()))
        })
        .await
        .map_err(|e| ClientError::Load(e.to_string()))??;
        Ok(Self { engine })
    }

    fn request(
        &self,
        options: &RequestOptions,
        prompt: PromptInput,
    ) -> Result<GenerateRequest, ClientError> {
        let wire = options.native_options();
        Ok(request_from_text_options(
            &wire,
            &self.engine.info().sampling,
            prompt,
        )?)
    }

    pub(super) fn query(&self, req: QueryRequest) -> Result<Run, ClientError> {
        let r = self.request(&req.options, PromptInput::Text(req.prompt))?;
        Ok(spawn_run(
            self.engine.generate(r)?,
            req.options.stream,
            None,
        ))
    }

    /// A chat as the server's chat route runs it: the conversation and its
    /// tools rendered by [`Engine::prepare_turn`], the calls' grammar as the
    /// constraint, and the output parsed into answer, reasoning and calls.
    pub(super) fn chat(&self, req: ChatRequest) -> Result<Run, ClientError> {
        let spec = req.tool_spec();
        let turn = self
            .engine
            .prepare_turn(&ChatTurn::new(&req.messages, &spec))?;
        let mut r = self.request(&req.options, turn.prompt)?;
        if turn.constraint.is_some() {
            r.constraint = turn.constraint;
        }
        Ok(spawn_run(
            self.engine.generate(r)?,
            req.options.stream,
            Some(turn.parser),
        ))
    }

    pub(super) async fn embed(&self, req: EmbedRequest) -> Result<Embeddings, ClientError> {
        let normalize = req.normalize.unwrap_or(true);
        let handles = req
            .inputs
            .into_iter()
            .map(|t| {
                self.engine.embed(crate::engine::EmbedRequest {
                    input: PromptInput::Text(t),
                    normalize,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut data = Vec::with_capacity(handles.len());
        let mut prompt_tokens = 0;
        for h in handles {
            let e = h.embedding().await?;
            prompt_tokens += e.prompt_tokens;
            data.push(Embedding {
                values: e.values,
                pooling: Some(e.pooling),
                normalized: Some(e.normalized),
            });
        }
        Ok(Embeddings {
            data,
            prompt_tokens,
        })
    }
}

/// The run event of an answer's event (a call's end has none).
pub(super) fn turn_event(e: TurnEvent) -> Option<RunEvent> {
    Some(match e {
        TurnEvent::Content(s) => RunEvent::Delta(s),
        TurnEvent::Reasoning(s) => RunEvent::Reasoning(s),
        TurnEvent::CallStart { index, id, name } => RunEvent::ToolCallStart { index, id, name },
        TurnEvent::CallArguments { index, fragment } => {
            RunEvent::ToolCallArguments { index, fragment }
        }
        TurnEvent::CallEnd { .. } => return None,
    })
}

/// A chat's finish reason: `tool_calls` when it called and ended by itself.
fn chat_finish_reason(reason: FinishReason, output: &TurnOutput) -> String {
    match reason {
        FinishReason::Stop | FinishReason::Eos if !output.calls.is_empty() => "tool_calls".into(),
        r => r.as_str().to_string(),
    }
}

/// Forwards an engine request's events to a run, and the run's cancel to it.
/// With a parser (a chat), the text is split into answer, reasoning and calls.
fn spawn_run(mut handle: RequestHandle, stream: bool, mut parser: Option<OutputParser>) -> Run {
    let (tx, cancel, run) = Run::channel();
    tokio::spawn(async move {
        let mut cancelled = false;
        loop {
            let ev = tokio::select! {
                ev = handle.next_event() => ev,
                () = cancel.cancelled(), if !cancelled => {
                    cancelled = true;
                    handle.cancel();
                    continue;
                }
            };
            let Some(ev) = ev else { break };
            let (pieces, last) = match ev {
                RequestEvent::Delta(d) if stream && !d.text.is_empty() => match &mut parser {
                    Some(p) => (
                        p.push(&d.text).into_iter().filter_map(turn_event).collect(),
                        false,
                    ),
                    None => (vec![RunEvent::Delta(d.text)], false),
                },
                RequestEvent::Finished(c) => {
                    let mut out = Vec::new();
                    let done = match parser.take() {
                        None => Response {
                            text: c.text,
                            finish_reason: c.finish_reason.as_str().to_string(),
                            usage: c.usage,
                            stats: Some(c.stats),
                            logprobs: c.logprobs,
                            ..Response::default()
                        },
                        Some(mut p) => {
                            // Streamed, the parser has seen every delta;
                            // otherwise it reads the whole text now.
                            let output = if stream {
                                out.extend(p.finish().into_iter().filter_map(turn_event));
                                p.output().clone()
                            } else {
                                p.parse_all(&c.text)
                            };
                            Response {
                                finish_reason: chat_finish_reason(c.finish_reason, &output),
                                text: output.content,
                                tool_calls: output.calls,
                                reasoning: output.reasoning,
                                usage: c.usage,
                                stats: Some(c.stats),
                                logprobs: c.logprobs,
                            }
                        }
                    };
                    out.push(RunEvent::Done(done));
                    (out, true)
                }
                RequestEvent::Failed(e) => (vec![RunEvent::Error(e.into())], true),
                _ => continue,
            };
            for out in pieces {
                if tx.send(out).is_err() && !cancelled {
                    // Nobody is listening any more.
                    cancelled = true;
                    handle.cancel();
                }
            }
            if last {
                break;
            }
        }
    });
    run
}
