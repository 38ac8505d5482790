//! Local endpoints: an engine in this process.

use crate::client::{
    ChatRequest, ClientError, EmbedRequest, Embedding, Embeddings, QueryRequest, RequestOptions,
    Response, Run, RunEvent,
};
use crate::engine::{Engine, GenerateRequest, PromptInput, RequestEvent, RequestHandle};
use crate::protocol::request_from_text_options;
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
        Ok(spawn_run(self.engine.generate(r)?, req.options.stream))
    }

    pub(super) fn chat(&self, req: ChatRequest) -> Result<Run, ClientError> {
        let prompt = self.engine.chat_prompt(&req.messages)?;
        let r = self.request(&req.options, prompt)?;
        Ok(spawn_run(self.engine.generate(r)?, req.options.stream))
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

/// Forwards an engine request's events to a run, and the run's cancel to it.
fn spawn_run(mut handle: RequestHandle, stream: bool) -> Run {
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
            let out = match ev {
                RequestEvent::Delta(d) if stream && !d.text.is_empty() => RunEvent::Delta(d.text),
                RequestEvent::Finished(c) => RunEvent::Done(Response {
                    text: c.text,
                    finish_reason: c.finish_reason.as_str().to_string(),
                    usage: c.usage,
                    stats: Some(c.stats),
                    logprobs: c.logprobs,
                }),
                RequestEvent::Failed(e) => RunEvent::Error(e.into()),
                _ => continue,
            };
            let last = !matches!(out, RunEvent::Delta(_));
            if tx.send(out).is_err() && !cancelled {
                // Nobody is listening any more.
                handle.cancel();
            }
            if last {
                break;
            }
        }
    });
    run
}
