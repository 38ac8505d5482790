//! Slot save, erase and restore on the fake backend, through the public
//! threaded API: the file round-trips, a restored slot's KV is reused by the
//! next prompt that extends it, an erased one by nothing, a slot's KV follows
//! the request that last used it, sessions go by `context_key`, and files of
//! other models are refused. The mirror stays equal to the backend throughout
//! (the idle invariant check).

mod common;

use std::time::{Duration, Instant};

use common::fake_engine as engine;
use sipp::config::NativeRuntimeConfig;
use sipp::engine::{Engine, GenerateRequest, KvHolder, SlotActionError};
use sipp::runtime::fake::{FakeBackend, FakeConfig};
use sipp::session::{read_slot_file, write_slot_file, SlotFileError};

fn run(e: &Engine, prompt: &str, key: Option<&str>) -> sipp::engine::Completion {
    e.generate(GenerateRequest {
        max_tokens: Some(8),
        ignore_eos: true,
        context_key: key.map(str::to_string),
        ..GenerateRequest::new(prompt).greedy()
    })
    .expect("submit")
    .blocking_completion()
    .expect("completes")
}

/// A new temporary folder, removed when the handle drops.
fn dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("sipp-slots-fake-{tag}-"))
        .tempdir()
        .expect("dir")
}

/// Waits for the engine's next idle check and asserts it found nothing.
fn assert_idle_invariants(e: &Engine) {
    let before = e.metrics().idle_checks;
    // Any command wakes the engine, which checks again once idle.
    let _ = e.erase_kv(&KvHolder::Session("-".into()));
    let start = Instant::now();
    while e.metrics().idle_checks == before && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(e.metrics().invariant_violations, 0);
}

const PROMPT: &str =
    "You are a careful assistant. Answer in one short sentence. Question: why is the sky blue?";

#[test]
fn a_slot_is_saved_erased_and_restored_into_another_slot() {
    let tmp = dir("slot");
    let d = tmp.path();
    let e = engine(2);
    let first = run(&e, PROMPT, None);
    let file = d.join("a.bin");
    let saved = e.save_kv(&KvHolder::Slot(0), &file).expect("save");
    assert_eq!(saved.n_saved, first.usage.prompt_tokens + 7);
    assert_eq!(
        saved.n_written,
        std::fs::metadata(&file).expect("file").len()
    );
    let read = read_slot_file(&file, &e.info().model.fingerprint, e.info().model.n_vocab)
        .expect("read back");
    assert_eq!(read.tokens.len(), saved.n_saved);
    // Slot 1 served nothing: it holds nothing to save.
    assert!(matches!(
        e.save_kv(&KvHolder::Slot(1), &d.join("b.bin")),
        Err(SlotActionError::Empty(_))
    ));
    assert_eq!(
        e.erase_kv(&KvHolder::Slot(0)).expect("erase").n_erased,
        saved.n_saved
    );
    assert_eq!(e.erase_kv(&KvHolder::Slot(0)).expect("erase").n_erased, 0);

    // Restored into slot 1, the next prompt extending the tokens reuses them.
    let continued = format!("{PROMPT}{} And why is it red at sunset?", first.text);
    let reference = run(&engine(2), &continued, None);
    let restored = e.restore_kv(&KvHolder::Slot(1), &file).expect("restore");
    assert_eq!(
        (restored.n_restored, restored.n_read),
        (saved.n_saved, saved.n_written)
    );
    let second = run(&e, &continued, None);
    assert!(
        second.usage.cached_tokens >= first.usage.prompt_tokens,
        "{:?}",
        second.usage
    );
    assert_eq!(second.text, reference.text);
    // The request that reused the sequence took it: slot 1 holds nothing now.
    assert_eq!(e.erase_kv(&KvHolder::Slot(1)).expect("erase").n_erased, 0);
    assert!(e.erase_kv(&KvHolder::Slot(0)).expect("erase").n_erased > 0);
    let cold = run(&e, &continued, None);
    assert_eq!(cold.usage.cached_tokens, 0, "erased KV was reused");
    assert_eq!(cold.text, reference.text);

    // Out of range, another model's file, a damaged one, a missing one.
    assert!(matches!(
        e.erase_kv(&KvHolder::Slot(2)),
        Err(SlotActionError::NoSuchSlot { id: 2, slots: 2 })
    ));
    write_slot_file(
        &d.join("other.bin"),
        "another-model",
        &read.tokens,
        &read.state,
    )
    .expect("write");
    let err = e
        .restore_kv(&KvHolder::Slot(0), &d.join("other.bin"))
        .expect_err("another model's file is refused");
    assert!(
        matches!(err, SlotActionError::File(SlotFileError::OtherModel { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("another model"), "{err}");
    let bytes = std::fs::read(&file).expect("read");
    std::fs::write(d.join("short.bin"), &bytes[..bytes.len() - 1]).expect("write");
    assert!(matches!(
        e.restore_kv(&KvHolder::Slot(0), &d.join("short.bin")),
        Err(SlotActionError::File(SlotFileError::Invalid { .. }))
    ));
    assert!(matches!(
        e.restore_kv(&KvHolder::Slot(0), &d.join("missing.bin")),
        Err(SlotActionError::File(SlotFileError::NotFound(_)))
    ));
    assert_idle_invariants(&e);
}

#[test]
fn a_session_is_saved_and_restored_by_context_key() {
    let tmp = dir("session");
    let d = tmp.path();
    let e = engine(2);
    let first = run(&e, PROMPT, Some("alice"));
    let key = KvHolder::Session("alice".into());
    let file = d.join("alice.bin");
    let saved = e.save_kv(&key, &file).expect("save");
    assert_eq!(saved.n_saved, first.usage.prompt_tokens + 7);
    assert!(matches!(
        e.save_kv(&KvHolder::Session("bob".into()), &d.join("bob.bin")),
        Err(SlotActionError::Empty(_))
    ));
    assert_eq!(e.erase_kv(&key).expect("erase").n_erased, saved.n_saved);
    // Another conversation fills the cache meanwhile.
    run(
        &e,
        "Something else entirely, with a prompt long enough to matter.",
        Some("bob"),
    );
    let restored = e.restore_kv(&key, &file).expect("restore");
    assert_eq!(restored.n_restored, saved.n_saved);
    let continued = format!("{PROMPT}{} Tell me more.", first.text);
    let second = run(&e, &continued, Some("alice"));
    assert!(
        second.usage.cached_tokens >= first.usage.prompt_tokens,
        "{:?}",
        second.usage
    );
    assert_eq!(second.text, run(&engine(2), &continued, None).text);
    // Restoring again replaces what the session held.
    assert_eq!(
        e.restore_kv(&key, &file).expect("restore").n_restored,
        saved.n_saved
    );
    assert_eq!(e.erase_kv(&key).expect("erase").n_erased, saved.n_saved);
    assert_idle_invariants(&e);
}

#[test]
fn kv_computed_under_lora_adapters_is_not_saved() {
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_parallel = 2;
    cfg.context.n_batch = 64;
    cfg.context.n_ubatch = 64;
    cfg.lora = vec![sipp::config::LoraAdapterConfig::new(
        "/adapters/a.gguf".into(),
        1.0,
    )];
    let fake = FakeConfig {
        n_seq_max: 4,
        n_batch: 64,
        n_ubatch: 64,
        ..FakeConfig::default()
    };
    let e = Engine::start(FakeBackend::new(fake), cfg);
    // The adapter applies to requests that choose none (its global scale).
    run(&e, "A conversation under the adapter", Some("lora"));
    let tmp = dir("lora");
    let d = tmp.path();
    let err = e
        .save_kv(&KvHolder::Session("lora".into()), &d.join("s.bin"))
        .expect_err("refused");
    assert!(matches!(err, SlotActionError::Adapters(_)), "{err}");
    assert!(!d.join("s.bin").exists());
    // With the adapter off, the same conversation saves.
    e.set_lora_scales(&[]).expect("off");
    run(&e, "A conversation on the base model", Some("base"));
    e.save_kv(&KvHolder::Session("base".into()), &d.join("b.bin"))
        .expect("saved");
}

/// A prompt of `n` one-byte tokens starting with `tag`.
fn passage(tag: char, n: usize) -> String {
    let mut p = String::new();
    let mut i = 0;
    while p.len() < n {
        p.push_str(&format!("{tag}{i} words of a passage. "));
        i += 1;
    }
    p
}

#[test]
fn a_slot_whose_prefix_was_parked_is_saved_and_erased_from_the_store() {
    let tmp = dir("parked");
    let d = tmp.path();
    // Slot 0 serves a short request while slot 1 decodes a long one, so
    // slot 0's KV is parked in the snapshot store before the save. Steps of
    // 5 ms keep the short one running until the long one arrives (without
    // them it could finish first, and the long one took slot 0).
    let run_pair = |e: &Engine| {
        let submit = |tag, n| {
            e.generate(GenerateRequest {
                max_tokens: Some(n),
                ignore_eos: true,
                ..GenerateRequest::new(passage(tag, 300)).greedy()
            })
            .expect("submit")
        };
        let a = submit('A', 4);
        let b = submit('B', 160);
        let a = a.blocking_completion().expect("a");
        b.blocking_completion().expect("b");
        a
    };
    let pace = Duration::from_millis(5);
    let e = common::fake_engine_paced(2, pace, |_| {});
    let a = run_pair(&e);
    assert!(e.metrics().idle_parks >= 1, "{:?}", e.metrics());
    let file = d.join("parked.bin");
    let saved = e.save_kv(&KvHolder::Slot(0), &file).expect("save");
    assert_eq!(saved.n_saved, a.usage.prompt_tokens + 3);
    let fingerprint = &e.info().model.fingerprint;
    let n_vocab = e.info().model.n_vocab;
    let parked = read_slot_file(&file, fingerprint, n_vocab).expect("read back");

    // The same pair on an engine that keeps idle prefixes live saves the
    // same tokens and state.
    let live = common::fake_engine_paced(2, pace, |c| c.cache.park_idle = false);
    run_pair(&live);
    assert_eq!(live.metrics().idle_parks, 0);
    let live_file = d.join("live.bin");
    live.save_kv(&KvHolder::Slot(0), &live_file).expect("save");
    let kept = read_slot_file(&live_file, fingerprint, n_vocab).expect("read back");
    assert_eq!((&parked.tokens, &parked.state), (&kept.tokens, &kept.state));

    // Erasing the parked slot drops its snapshot: nothing reuses it after.
    assert_eq!(
        e.erase_kv(&KvHolder::Slot(0)).expect("erase").n_erased,
        saved.n_saved
    );
    assert_eq!(e.erase_kv(&KvHolder::Slot(0)).expect("erase").n_erased, 0);
    let again = run(&e, &passage('A', 300), None);
    assert_eq!(again.usage.cached_tokens, 0, "erased KV was reused");
    assert_idle_invariants(&e);
}
