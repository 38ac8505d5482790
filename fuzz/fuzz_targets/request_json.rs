//! Request JSON decoding and validation, as the server does it: decode each
//! request shape, map it onto a generation request, validate sampling and
//! output constraints. Nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sipp::engine::PromptInput;
use sipp::protocol::native::{ChatBody, EmbedBody, QueryBody};
use sipp::protocol::openai::{ChatCompletionRequest, CompletionRequest, EmbeddingRequest};
use sipp::protocol::{request_from_openai, request_from_text_options};
use sipp::sampling::SamplingParams;

fn check(r: Result<sipp::engine::GenerateRequest, sipp::engine::EngineError>) {
    if let Ok(req) = r {
        if let Some(s) = &req.sampling {
            let _ = s.validate();
        }
        if let Some(c) = &req.constraint {
            let _ = c.validate();
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let defaults = SamplingParams::default();
    if let Ok(r) = serde_json::from_slice::<CompletionRequest>(data) {
        check(request_from_openai(&r.sampling, r.max_tokens, r.logprobs, None, &defaults, PromptInput::Text(String::new())));
    }
    if let Ok(r) = serde_json::from_slice::<ChatCompletionRequest>(data) {
        check(request_from_openai(&r.sampling, r.max_tokens, None, r.response_format.as_ref(), &defaults, PromptInput::Text(String::new())));
    }
    if let Ok(r) = serde_json::from_slice::<QueryBody>(data) {
        check(request_from_text_options(&r.options, &defaults, PromptInput::Text(r.prompt)));
    }
    if let Ok(r) = serde_json::from_slice::<ChatBody>(data) {
        check(request_from_text_options(&r.options, &defaults, PromptInput::Text(String::new())));
    }
    let _ = serde_json::from_slice::<EmbeddingRequest>(data);
    let _ = serde_json::from_slice::<EmbedBody>(data);
    if let Ok(s) = serde_json::from_slice::<SamplingParams>(data) {
        let _ = s.validate();
    }
});
