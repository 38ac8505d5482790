//! Integration tests on the real default model (SmolLM2-135M-Instruct Q4_1).

mod common;

use common::{assert_same_up_to_near_tie, engine_with, greedy};
use sipp::config::CacheMode;
use sipp::engine::{EngineError, GenerateRequest, RequestEvent};
use sipp::sampling::OutputConstraint;
use sipp::text::FinishReason;

/// The largest top-2 logit gap at which batched numerics may flip a greedy pick.
/// DESIGN.md measured gaps up to 0.8 between batchings on this model.
const NEAR_TIE: f32 = 1.0;

#[test]
fn tokenize_detokenize_round_trips() {
    let e = engine_with(1, |_| {});
    let v = e.vocab();
    for text in [
        "Hello, world! 123",
        "Café crème, naïve façade, São Paulo, Ærøskøbing",
        "北京欢迎你，东京と大阪。서울",
        "Emoji: 🦀🚀👍🏽 and 👨‍👩‍👧 family",
        "  leading spaces and\ttabs\nnewlines  ",
    ] {
        let tokens = v.tokenize(text, false, false).expect("tokenizes");
        assert!(!tokens.is_empty());
        assert_eq!(v.detokenize(&tokens), text, "round trip of {text:?}");
    }
}

#[test]
fn greedy_is_deterministic() {
    let e = engine_with(1, |c| c.cache.mode = CacheMode::Off);
    let a = e
        .generate(greedy("Once upon a time", 32))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    let b = e
        .generate(greedy("Once upon a time", 32))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    assert_eq!(a.text, b.text);
    assert!(!a.text.is_empty());
}

/// The one fact about the model that other tests lean on ("Paris" in a short
/// greedy completion of this prompt): its first token is " Paris", 2.5 nats
/// ahead of the next (measured with native and with generic x86-64 kernels),
/// where batching and kernels move logits by well under 1.
#[test]
fn the_capital_of_france() {
    let e = engine_with(1, |_| {});
    let c = e
        .generate(greedy("The capital of France is", 16))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    let first = &c.logprobs[0].logprobs;
    let text = |t: i32| String::from_utf8_lossy(&e.vocab().token_bytes(t)).into_owned();
    assert_eq!(text(first.top[0].token), " Paris", "{:?}", c.text);
    let margin = first.top[0].logprob - first.top[1].logprob;
    eprintln!(
        "first token {:?}, margin {margin:.3} over {:?}",
        text(first.top[0].token),
        text(first.top[1].token)
    );
    assert!(
        margin > 2.0 * NEAR_TIE,
        "margin {margin} over {:?}",
        text(first.top[1].token)
    );
    assert!(c.text.contains("Paris"), "{:?}", c.text);
}

const PROMPTS: [&str; 8] = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "A recipe for pancakes needs",
    "In 1969, astronauts",
    "The best way to learn a language is",
    "Photosynthesis is the process by which",
    "My favourite animal is the cat because",
];

#[test]
fn eight_concurrent_match_each_alone() {
    let e = engine_with(8, |c| c.cache.mode = CacheMode::Off);
    let alone: Vec<_> = PROMPTS
        .iter()
        .map(|p| {
            e.generate(greedy(p, 24))
                .expect("submit")
                .blocking_completion()
                .expect("ok")
        })
        .collect();
    let handles: Vec<_> = PROMPTS
        .iter()
        .map(|p| e.generate(greedy(p, 24)).expect("submit"))
        .collect();
    let together: Vec<_> = handles
        .into_iter()
        .map(|h| h.blocking_completion().expect("ok"))
        .collect();
    // Batch composition depends on arrival timing, and llama.cpp's kernels sum
    // in a different order for 8 rows than for 1: a greedy pick can flip where
    // the two best tokens are nearly tied. Observed here: divergence after
    // 8-20 identical tokens at top-2 gaps of 0.003-0.09 (e.g. "311 million" vs
    // "321 million"). A divergence anywhere else would mean sequences leak into
    // each other, which `assert_same_up_to_near_tie` rejects.
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        match assert_same_up_to_near_tie(a, b, NEAR_TIE, PROMPTS[i]) {
            None => {}
            Some(gap) => {
                let at = a
                    .tokens
                    .iter()
                    .zip(&b.tokens)
                    .take_while(|(x, y)| x == y)
                    .count();
                eprintln!(
                    "prompt {i} diverged at token {at} at a near-tie (gap {gap:.3}): {:?} | {:?}",
                    a.text, b.text
                )
            }
        }
    }
}

/// Text the grammar forces, so the test does not depend on what the model
/// would say; how it is cut into tokens is still the model's choice.
const FORCED: &str = " Paris is the capital and largest city of France, on the Seine.";

#[test]
fn stop_string_split_across_tokens_never_leaks() {
    let e = engine_with(1, |c| c.cache.mode = CacheMode::Off);
    let forced = |stop: Vec<String>| GenerateRequest {
        stop,
        constraint: Some(OutputConstraint::Grammar(format!("root ::= {FORCED:?}"))),
        ..greedy("The capital of France is", 64)
    };
    let base = e
        .generate(forced(Vec::new()))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    assert_eq!(base.text, FORCED);
    // Pick a stop that spans a token boundary: the last two characters of one
    // word piece and the first two of the next, occurring nowhere earlier.
    let v = e.vocab();
    let pieces: Vec<String> = base
        .tokens
        .iter()
        .map(|&t| String::from_utf8_lossy(&v.token_bytes(t)).into_owned())
        .collect();
    let chars = |s: &str| s.chars().collect::<Vec<char>>();
    let (stop, expected) = (1..pieces.len())
        .filter_map(|k| {
            let (l, r) = (chars(&pieces[k - 1]), chars(&pieces[k]));
            if l.len() < 2
                || r.len() < 2
                || l.iter()
                    .chain(&r)
                    .any(|c| !c.is_alphanumeric() && *c != ' ')
            {
                return None;
            }
            let stop: String = l[l.len() - 2..].iter().chain(&r[..2]).collect();
            let at: usize = pieces[..k].iter().map(String::len).sum::<usize>()
                - l[l.len() - 2..].iter().map(|c| c.len_utf8()).sum::<usize>();
            (base.text.find(&stop) == Some(at)).then(|| (stop, base.text[..at].to_string()))
        })
        .next()
        .unwrap_or_else(|| panic!("no two adjacent word pieces in {pieces:?}"));
    let mut h = e.generate(forced(vec![stop.clone()])).expect("submit");
    let mut streamed = String::new();
    let completion = loop {
        match h.blocking_next_event().expect("event") {
            RequestEvent::Delta(d) => streamed.push_str(&d.text),
            RequestEvent::Finished(c) => break c,
            RequestEvent::Failed(e) => panic!("{e}"),
            _ => {}
        }
    };
    assert_eq!(completion.finish_reason, FinishReason::Stop);
    assert!(
        !streamed.contains(&stop),
        "stop {stop:?} leaked into {streamed:?}"
    );
    assert_eq!(streamed, expected);
    assert_eq!(completion.text, expected);
}

#[test]
fn chinese_and_emoji_stream_whole_characters() {
    let e = engine_with(2, |_| {});
    // The grammar makes the output multibyte whatever the model prefers; the
    // model still picks the tokens, byte-level pieces of a character included.
    let grammar = OutputConstraint::Grammar(
        r#"root ::= ("春" | "天" | "的" | "诗" | "花" | "🎉" | "🐱" | "🌟" | "👍🏽" | "👨‍👩‍👧" | "é" | " ")+"#.into(),
    );
    for prompt in [
        "请用中文写一句关于春天的诗：",
        "Reply with emoji only: 🎉🐱🌟 ->",
    ] {
        let mut h = e
            .generate(GenerateRequest {
                ignore_eos: true,
                constraint: Some(grammar.clone()),
                ..greedy(prompt, 40)
            })
            .expect("submit");
        let mut text = String::new();
        loop {
            match h.blocking_next_event().expect("event") {
                RequestEvent::Delta(d) => text.push_str(&d.text),
                RequestEvent::Finished(c) => {
                    assert_eq!(c.text, text);
                    // Streaming never splits a character: the streamed text is
                    // exactly the decoding of all generated bytes at once (a
                    // split would add U+FFFD where whole decoding has none; the
                    // model itself may emit invalid bytes, which both show alike).
                    let bytes: Vec<u8> = c
                        .tokens
                        .iter()
                        .flat_map(|&t| e.vocab().token_bytes(t))
                        .collect();
                    assert_eq!(text, String::from_utf8_lossy(&bytes), "{prompt}");
                    break;
                }
                RequestEvent::Failed(e) => panic!("{e}"),
                _ => {}
            }
        }
        assert!(
            text.chars().any(|c| !c.is_ascii()),
            "{prompt}: expected non-ASCII output, got {text:?}"
        );
    }
}

#[test]
fn cancel_mid_stream_frees_the_slot_for_the_next_request() {
    let e = engine_with(1, |_| {});
    let mut h = e
        .generate(GenerateRequest {
            ignore_eos: true,
            ..greedy("Write a very long essay about rivers.", 2000)
        })
        .expect("submit");
    let mut n = 0;
    loop {
        match h.blocking_next_event().expect("event") {
            RequestEvent::Delta(_) => {
                n += 1;
                if n == 5 {
                    h.cancel();
                }
            }
            RequestEvent::Finished(c) => {
                assert_eq!(c.finish_reason, FinishReason::Cancelled);
                assert!(c.usage.completion_tokens < 50);
                break;
            }
            RequestEvent::Started => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    // The final event is sent as the slot is freed, in the same step.
    let start = std::time::Instant::now();
    while e.metrics().busy_slots != 0 && start.elapsed() < std::time::Duration::from_secs(2) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(e.metrics().busy_slots, 0);
    let next = e
        .generate(greedy("The capital of France is", 8))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    assert_eq!(
        next.usage.completion_tokens.min(8),
        next.usage.completion_tokens
    );
    assert!(!next.text.is_empty());
}

#[test]
fn context_full_finishes_with_length() {
    let e = engine_with(1, |c| c.context.n_ctx = 64);
    let c = e
        .generate(GenerateRequest {
            ignore_eos: true,
            ..GenerateRequest::new("Count: 1, 2, 3,").greedy()
        })
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    assert_eq!(c.finish_reason, FinishReason::Length);
    assert_eq!(c.usage.prompt_tokens + c.usage.completion_tokens, 64);
}

#[test]
fn prompt_longer_than_context_is_rejected_with_numbers() {
    let e = engine_with(1, |c| c.context.n_ctx = 64);
    let err = e
        .generate(GenerateRequest::new("word ".repeat(100)))
        .unwrap_err();
    match err {
        EngineError::PromptTooLong {
            prompt_tokens,
            n_ctx,
        } => {
            assert!(prompt_tokens >= 100);
            assert_eq!(n_ctx, 64);
        }
        other => panic!("{other}"),
    }
}

#[test]
fn chat_renders_chatml_and_adds_no_second_bos() {
    use sipp::chat::ChatMessage;
    let e = engine_with(1, |_| {});
    let messages = [
        ChatMessage::system("You are terse."),
        ChatMessage::user("Name a colour."),
    ];
    let text = e.render_chat(&messages, true).expect("renders");
    assert_eq!(
        text,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    );
    let c = e
        .chat(&messages, greedy("", 16))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    // The prompt is the template's special tokens parsed, once.
    let expected = e.vocab().tokenize(&text, false, true).expect("tokens");
    assert_eq!(c.usage.prompt_tokens, expected.len());
    assert!(
        !c.text.contains("<|im_end|>") && !c.text.is_empty(),
        "{:?}",
        c.text
    );
    let err = e.chat(&[], greedy("", 4)).unwrap_err();
    assert!(err.to_string().contains("messages"), "{err}");
}
