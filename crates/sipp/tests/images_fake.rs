//! Images through the scheduler on the fake backend: an image is a span of
//! its own (one per step, after the token rows), the same image at the same
//! place is reused from the KV cache, a failing image fails its request
//! alone, and decoding slots keep advancing while images are computed.

mod common;

use std::sync::Arc;

use common::fake_engine as engine;
use sipp::engine::{GenerateRequest, MediaPrompt, PromptInput, RequestEvent};
use sipp::media::placeholder_tokens;
use sipp::runtime::fake::POISON_IMAGE;
use sipp::runtime::{MediaChunk, MediaSpan};

const IMAGE_TOKENS: usize = 24;

/// "before" + image + "after", as the chat preparation builds it.
fn image_prompt(hash: u64, before: &str, after: &str) -> PromptInput {
    let mut tokens: Vec<i32> = before.bytes().map(i32::from).collect();
    let start = tokens.len();
    tokens.extend(placeholder_tokens(hash, IMAGE_TOKENS));
    tokens.extend(after.bytes().map(i32::from));
    PromptInput::Media(MediaPrompt {
        tokens,
        media: vec![MediaSpan {
            start,
            chunk: MediaChunk {
                hash,
                n_tokens: IMAGE_TOKENS,
                handle: Arc::new(()),
            },
        }],
    })
}

fn greedy(prompt: PromptInput, n: u32) -> GenerateRequest {
    GenerateRequest {
        max_tokens: Some(n),
        ignore_eos: true,
        ..GenerateRequest::new(prompt).greedy()
    }
}

#[test]
fn an_image_prompt_completes_and_counts_its_image_tokens() {
    let e = engine(2);
    let c = e
        .generate(greedy(
            image_prompt(7, "User: look ", " What is it?\nAI:"),
            6,
        ))
        .expect("submit")
        .blocking_completion()
        .expect("completes");
    assert_eq!(c.usage.completion_tokens, 6);
    assert_eq!(c.usage.prompt_tokens, 11 + IMAGE_TOKENS + 16);
    assert_eq!(e.metrics().images, 1);
}

#[test]
fn different_images_give_different_text_and_the_same_image_the_same() {
    let e = engine(2);
    let run = |hash| {
        e.generate(greedy(image_prompt(hash, "Describe ", " now:"), 12))
            .expect("submit")
            .blocking_completion()
            .expect("completes")
    };
    let (a, b, a2) = (run(1), run(2), run(1));
    assert_eq!(a.text, a2.text);
    assert_ne!(
        a.text, b.text,
        "the fake's text depends on the image's placeholders"
    );
    // The second request with image 1 reuses its prefix, image included.
    assert!(
        a2.usage.cached_tokens >= 9 + IMAGE_TOKENS,
        "cached {}",
        a2.usage.cached_tokens
    );
    assert_eq!(e.metrics().images, 2, "image 1 is computed once");
}

#[test]
fn a_failing_image_fails_its_request_alone() {
    let e = engine(3);
    let bad = e
        .generate(greedy(image_prompt(POISON_IMAGE, "Bad ", " image"), 4))
        .expect("submit");
    let good = e
        .generate(greedy(image_prompt(5, "Good ", " image"), 4))
        .expect("submit");
    let text = e
        .generate(greedy(PromptInput::Text("plain text".into()), 4))
        .expect("submit");
    let err = bad
        .blocking_completion()
        .expect_err("the poisoned image fails");
    assert!(err.to_string().contains("image"), "{err}");
    assert_eq!(
        good.blocking_completion()
            .expect("completes")
            .usage
            .completion_tokens,
        4
    );
    assert_eq!(
        text.blocking_completion()
            .expect("completes")
            .usage
            .completion_tokens,
        4
    );
}

#[test]
fn a_decoding_stream_advances_every_step_while_images_are_computed() {
    let e = engine(9);
    let mut stream = e
        .generate(greedy(PromptInput::Text("Once upon a time".into()), 40))
        .expect("submit");
    // Wait for the stream's first token, so it decodes while images arrive.
    loop {
        match stream.blocking_next_event().expect("events") {
            RequestEvent::Delta(d) if !d.tokens.is_empty() => break,
            _ => {}
        }
    }
    let before = e.metrics();
    let images: Vec<_> = (0..8)
        .map(|i| {
            e.generate(greedy(image_prompt(100 + i, "Picture ", " caption:"), 4))
                .expect("submit")
        })
        .collect();
    for h in images {
        h.blocking_completion()
            .expect("every image request completes");
    }
    let done = stream.blocking_completion().expect("the stream completes");
    assert_eq!(done.usage.completion_tokens, 40);
    let after = e.metrics();
    assert_eq!(after.images - before.images, 8);
    // One image per step (the packing unit tests check the stream's row is
    // in each of those steps).
    assert!(after.steps - before.steps >= 8);
}
