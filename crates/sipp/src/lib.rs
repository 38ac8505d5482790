//! sipp: a continuous-batching inference runtime for GGUF models on llama.cpp.
//!
//! Layers, top to bottom: [`engine`] (one model, a step-loop thread, request
//! handles), [`scheduler`] (slots and the batch plan), [`session`] (KV leases,
//! prefix reuse, snapshots), [`sampling`] (settings and constraints), [`text`]
//! (UTF-8 carry, stop strings) and [`runtime`] (the only code that touches
//! llama.cpp, behind a trait with a fake implementation for tests).
//!
//! One engine step, as data: [`scheduler::Scheduler::schedule`] turns the
//! slots, the queue and a copy of the KV mirror into a
//! [`scheduler::StepPlan`] (admissions with their reuse, prefix waits,
//! preemptions, resumes, the [`session::KvOp`]s they need, and every slot's
//! batch rows) without changing anything; the engine's
//! [`engine::Executor`] carries it out on the backend and returns a
//! [`scheduler::StepOutput`] (sampled tokens, embeddings, per-span failures,
//! or a batch refused for KV room, after which the step is replanned); and
//! [`scheduler::Scheduler::update`] applies it and returns the events to send.
//!
//! Around them: [`client`] (one API over local engines, sipp gateways and
//! providers), [`chat`] (messages and templates), [`tools`] (tool calls and
//! reasoning: formats, grammars, parsers), [`protocol`] (wire types), and
//! [`models`] (named models and fetching).

#![warn(missing_docs)]

pub mod chat;
pub mod client;
pub mod config;
pub mod engine;
pub mod media;
pub mod models;
pub mod protocol;
pub mod runtime;
pub mod sampling;
pub mod scheduler;
pub mod session;
pub mod text;
pub mod tools;

pub use config::NativeRuntimeConfig;
pub use engine::{
    Completion, EmbedRequest, EmbeddingOutput, Engine, EngineError, GenerateRequest, PromptInput,
    RequestEvent, RequestHandle,
};
