//! Prefix reuse on the real default model: greedy output with reuse equals the
//! output with the cache off (up to batching near-ties, see DESIGN.md).

mod common;

use common::{assert_same_up_to_near_tie, default_model, engine_with, greedy, run};
use sipp::config::CacheMode;
use sipp::engine::{Engine, GenerateRequest};

const NEAR_TIE: f32 = 1.0;

fn system_prompt() -> String {
    let rules = [
        "Answer in one short sentence.",
        "Be polite and precise.",
        "Never invent facts; say you do not know instead.",
        "Prefer simple words over technical jargon.",
        "Use metric units.",
        "Do not use lists or tables.",
    ];
    let mut s = String::from("You are the help desk assistant of a small public library. ");
    for i in 0..12 {
        for r in rules {
            s.push_str(&format!("Rule {}: {r} ", i * rules.len() + 1));
        }
    }
    s
}

#[test]
fn repeated_prompt_reuses_and_matches_cache_off() {
    let on = engine_with(2, |_| {});
    let off = engine_with(2, |c| c.cache.mode = CacheMode::Off);
    let prompt = format!(
        "{}Question: when does the library open?\nAnswer:",
        system_prompt()
    );
    let reference = run(&off, &prompt, 24);
    let first = run(&on, &prompt, 24);
    let second = run(&on, &prompt, 24);
    assert_eq!(first.usage.cached_tokens, 0);
    assert_eq!(
        second.usage.cached_tokens,
        second.usage.prompt_tokens - 1,
        "all but the last prompt token reused"
    );
    assert_same_up_to_near_tie(&reference, &first, NEAR_TIE, "first");
    assert_same_up_to_near_tie(&reference, &second, NEAR_TIE, "repeat");
}

#[test]
fn conversation_turn_by_turn_reuses_history() {
    let on = engine_with(2, |_| {});
    let off = engine_with(2, |c| c.cache.mode = CacheMode::Off);
    let questions = [
        "Can I borrow books?",
        "How many at once?",
        "And for how long?",
        "What if I am late?",
    ];
    let mut history = system_prompt();
    for (turn, q) in questions.iter().enumerate() {
        history.push_str(&format!("\nUser: {q}\nAssistant:"));
        let reference = run(&off, &history, 20);
        let c = run(&on, &history, 20);
        assert_same_up_to_near_tie(&reference, &c, NEAR_TIE, &format!("turn {turn}"));
        if turn > 0 {
            // Everything up to the previous answer was resident.
            assert!(
                c.usage.cached_tokens + 30 >= c.usage.prompt_tokens,
                "turn {turn}: cached {} of {}",
                c.usage.cached_tokens,
                c.usage.prompt_tokens
            );
        }
        // Continue with the model's own answer (cache-on text, as a user would).
        history.push_str(&c.text);
    }
}

#[test]
fn eight_concurrent_share_a_long_system_prompt() {
    let on = engine_with(8, |_| {});
    let off = engine_with(8, |c| c.cache.mode = CacheMode::Off);
    let sys = system_prompt();
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("{sys}\nUser: question number {i}, what is {i} plus {i}?\nAssistant:"))
        .collect();
    let reference: Vec<_> = prompts.iter().map(|p| run(&off, p, 16)).collect();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| on.generate(greedy(p, 16)).expect("submit"))
        .collect();
    let shared: Vec<_> = handles
        .into_iter()
        .map(|h| h.blocking_completion().expect("ok"))
        .collect();
    let sys_tokens = on
        .vocab()
        .tokenize(&sys, true, true)
        .expect("tokenize")
        .len();
    let cached: usize = shared.iter().map(|c| c.usage.cached_tokens).sum();
    assert!(
        cached >= 7 * (sys_tokens - 2),
        "the system prompt ({sys_tokens} tokens) is computed once: cached {cached}"
    );
    for (i, (r, s)) in reference.iter().zip(&shared).enumerate() {
        assert_same_up_to_near_tie(r, s, NEAR_TIE, &format!("request {i}"));
    }
    let m = on.metrics();
    assert!(m.prefix_reused_tokens as usize >= cached);
}

#[test]
fn snapshot_restored_after_eviction() {
    // One slot and no idle sequences: a different prompt evicts the first.
    let on = engine_with(1, |c| c.cache.idle_sequences = 0);
    let off = engine_with(1, |c| c.cache.mode = CacheMode::Off);
    let a = format!(
        "{}Question: can I print documents?\nAnswer:",
        system_prompt()
    );
    let b = "An unrelated prompt about the weather in Lisbon, long enough to be cached as well.";
    let reference = run(&off, &a, 20);
    run(&on, &a, 20);
    run(&on, b, 8);
    let again = run(&on, &a, 20);
    let m = on.metrics();
    assert!(m.snapshot_saves >= 1, "{m:?}");
    assert!(m.snapshot_restores >= 1, "{m:?}");
    assert!(m.snapshot_bytes_restored > 0);
    assert_eq!(again.usage.cached_tokens, again.usage.prompt_tokens - 1);
    assert_same_up_to_near_tie(&reference, &again, NEAR_TIE, "restored");
}

/// A copy of the default model with one metadata string changed: loadable,
/// but a different model identity (its GGUF header differs).
fn other_model(dir: &std::path::Path) -> std::path::PathBuf {
    let src = default_model();
    let dst = dir.join("other-model.gguf");
    let mut bytes = std::fs::read(&src).expect("read model");
    let needle = b"Smollm2 135M";
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("general.name present");
    bytes[at..at + needle.len()].copy_from_slice(b"Otherm2 135M");
    std::fs::write(&dst, bytes).expect("write copy");
    dst
}

#[test]
fn snapshot_file_from_another_model_is_refused() {
    let tmp = tempfile::Builder::new()
        .prefix("sipp-spill-test-")
        .tempdir()
        .expect("dir");
    let dir = tmp.path().join("spill");
    let spill = |c: &mut sipp::NativeRuntimeConfig| {
        c.cache.snapshot_dir = Some(dir.clone());
        c.cache.idle_sequences = 0;
        // No room in memory: every snapshot goes to the directory.
        c.cache.max_snapshot_bytes = 1;
    };
    let a = format!("{}Question: is there wifi?\nAnswer:", system_prompt());
    {
        let writer = engine_with(1, spill);
        run(&writer, &a, 8);
        run(
            &writer,
            "Something different to force an eviction of the first prompt.",
            4,
        );
        assert!(writer.metrics().snapshot_saves >= 1);
    }
    let files = std::fs::read_dir(&dir).expect("spill dir").count();
    assert!(files >= 1, "a snapshot was spilled");

    // The same model finds and uses the file.
    let same = engine_with(1, spill);
    let c = run(&same, &a, 8);
    assert_eq!(c.usage.cached_tokens, c.usage.prompt_tokens - 1);
    assert_eq!(same.metrics().snapshot_files_rejected, 0);
    drop(same);

    // Another model refuses it and computes from scratch, with the output the
    // cache-off run of that model gives.
    let mut cfg = sipp::NativeRuntimeConfig::default();
    cfg.context.n_ctx = 4096;
    cfg.context.n_parallel = 1;
    spill(&mut cfg);
    let other_path = other_model(tmp.path());
    let other = Engine::load(&other_path, cfg.clone()).expect("loads");
    let c = run(&other, &a, 8);
    assert_eq!(
        c.usage.cached_tokens, 0,
        "nothing may be reused from another model's file"
    );
    assert!(
        other.metrics().snapshot_files_rejected >= 1,
        "{:?}",
        other.metrics()
    );
    cfg.cache.mode = CacheMode::Off;
    cfg.cache.snapshot_dir = None;
    let other_off = Engine::load(&other_path, cfg).expect("loads");
    let reference = run(&other_off, &a, 8);
    assert_eq!(reference.text, c.text);
}

#[test]
fn context_key_keeps_a_conversation_resident_under_pressure() {
    // One slot plus one idle sequence and no snapshots: three conversations
    // compete for two sequences. Least-recently-used eviction would drop Ana's
    // history; her context key keeps it.
    let e = engine_with(1, |c| {
        c.cache.idle_sequences = 1;
        c.cache.max_snapshot_bytes = 0;
    });
    let base = system_prompt();
    let with_key = |p: &str, k: Option<&str>| GenerateRequest {
        context_key: k.map(String::from),
        ..greedy(p, 8)
    };
    let a1 = format!("{base}\nUser: I am Ana.\nAssistant:");
    let ca = e
        .generate(with_key(&a1, Some("ana")))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    for other in ["Tell me about trains.", "Tell me about boats, please."] {
        e.generate(with_key(other, None))
            .expect("submit")
            .blocking_completion()
            .expect("ok");
    }
    let a2 = format!("{a1}{}\nUser: What is my name?\nAssistant:", ca.text);
    let c = e
        .generate(with_key(&a2, Some("ana")))
        .expect("submit")
        .blocking_completion()
        .expect("ok");
    let a1_tokens = e.vocab().tokenize(&a1, true, true).expect("tok").len();
    assert!(
        c.usage.cached_tokens >= a1_tokens,
        "cached {} < {a1_tokens}",
        c.usage.cached_tokens
    );
    assert_eq!(e.metrics().snapshot_restores, 0);
}

/// A repeatable seeded request returns the same text however other requests
/// ran before and around it: concurrent long and constrained requests, a
/// prefix of its own prompt left in the cache, and a KV cache filled past 512
/// cells (where llama.cpp's CPU flash attention changes how it reduces a lone
/// sequence's attention). Without `repeatable`, that history moves logits by a
/// few hundredths and a temperature-1 sample may flip (see the README).
#[test]
fn a_repeatable_seeded_request_repeats_across_interleaved_traffic() {
    let e = engine_with(4, |c| c.context.n_ctx = 4096);
    let story = || GenerateRequest {
        max_tokens: Some(24),
        repeatable: true,
        sampling: Some(sipp::sampling::SamplingParams {
            temperature: 1.0,
            seed: Some(42),
            ..Default::default()
        }),
        ..GenerateRequest::new(
            e.chat_prompt(&[sipp::chat::ChatMessage::user("Tell me a story.")])
                .expect("template"),
        )
    };
    let complete = |r: GenerateRequest| {
        e.generate(r)
            .expect("submit")
            .blocking_completion()
            .expect("ok")
    };
    let first = complete(story());
    assert_eq!(first.usage.cached_tokens, 0);
    // The same prompt without `repeatable` leaves its prefix in the cache.
    complete(GenerateRequest {
        repeatable: false,
        ..story()
    });
    // Traffic around it: a long request filling the KV past 512 cells, a
    // JSON-schema request, and the repeatable request submitted among them.
    let long = e
        .generate(GenerateRequest {
            max_tokens: Some(600),
            ignore_eos: true,
            ..GenerateRequest::new("Write a long essay about rivers.").greedy()
        })
        .expect("submit");
    let json = e
        .generate(GenerateRequest {
            max_tokens: Some(200),
            constraint: Some(sipp::sampling::OutputConstraint::JsonSchema(serde_json::json!({
                "type": "object",
                "properties": {"items": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}
            }))),
            sampling: Some(sipp::sampling::SamplingParams {
                temperature: 0.7,
                seed: Some(7),
                ..Default::default()
            }),
            ..GenerateRequest::new("List three things to pack, as JSON:")
        })
        .expect("submit");
    let during = e.generate(story()).expect("submit");
    let after_json = e
        .generate(GenerateRequest {
            repeatable: false,
            ..story()
        })
        .expect("submit");
    let during = during.blocking_completion().expect("ok");
    for h in [long, json, after_json] {
        h.blocking_completion().expect("ok");
    }
    assert!(
        e.metrics().kv_cells_used > 0,
        "other requests left prefixes cached"
    );
    let after = complete(story());
    for (what, c) in [("during other requests", &during), ("after them", &after)] {
        assert_eq!(c.usage.cached_tokens, 0, "{what}");
        assert_eq!(
            c.tokens, first.tokens,
            "{what}: {:?} vs {:?}",
            c.text, first.text
        );
    }
}
