//! LoRA adapter sets on the fake backend, whose KV cells remember the set
//! they were computed under and whose predictions depend on it (as KV
//! computed under other weights would): requests of different sets run
//! concurrently and each gets what it gets alone, and KV is never reused
//! across sets, even for the same prompt.

use sipp::config::{CacheMode, LoraAdapterConfig, MixedAdapters, NativeRuntimeConfig};
use sipp::engine::{Engine, EngineError, GenerateRequest, LoraScale};
use sipp::runtime::fake::{FakeBackend, FakeConfig};

fn engine() -> Engine {
    engine_with(MixedAdapters::PerSet)
}

fn engine_with(mixed: MixedAdapters) -> Engine {
    let mut cfg = NativeRuntimeConfig::default();
    cfg.scheduler.mixed_adapters = mixed;
    cfg.context.n_parallel = 8;
    cfg.context.n_batch = 64;
    cfg.context.n_ubatch = 64;
    cfg.cache.mode = CacheMode::SharedPrefix;
    cfg.cache.idle_sequences = 4;
    cfg.cache.min_prefix_tokens = 4;
    // The fake loads nothing: any id it is given is an adapter.
    cfg.lora = ["a", "b"]
        .iter()
        .map(|n| {
            let mut l = LoraAdapterConfig::new(format!("/adapters/{n}.gguf").into(), 1.0);
            l.apply = false;
            l
        })
        .collect();
    let fake = FakeConfig {
        n_seq_max: 12,
        n_batch: 64,
        n_ubatch: 64,
        ..FakeConfig::default()
    };
    Engine::start(FakeBackend::new(fake), cfg)
}

fn request(prompt: &str, lora: Option<Vec<LoraScale>>) -> GenerateRequest {
    GenerateRequest {
        max_tokens: Some(12),
        ignore_eos: true,
        lora,
        ..GenerateRequest::new(prompt).greedy()
    }
}

fn sets() -> Vec<Option<Vec<LoraScale>>> {
    let s = |id, scale| LoraScale { id, scale };
    vec![
        None,
        Some(vec![s(0, 1.0)]),
        Some(vec![s(1, 1.0)]),
        Some(vec![s(0, 1.0), s(1, 0.5)]),
    ]
}

const PROMPT: &str = "A shared system prompt that every request starts with. Question: ";

fn alone(prompt: &str, lora: Option<Vec<LoraScale>>) -> String {
    engine()
        .generate(request(prompt, lora))
        .expect("submit")
        .blocking_completion()
        .expect("completes")
        .text
}

#[test]
fn mixed_sets_run_together_and_each_gets_its_own_output() {
    let want: Vec<String> = sets().into_iter().map(|l| alone(PROMPT, l)).collect();
    for i in 0..want.len() {
        for j in i + 1..want.len() {
            assert_ne!(want[i], want[j], "sets {i} and {j} should differ");
        }
    }
    let mut steps = Vec::new();
    for mixed in [MixedAdapters::PerSet, MixedAdapters::Rotate] {
        let e = engine_with(mixed);
        // Eight at once, interleaving the sets, all with the same prompt: a
        // prefix shared across sets would change the text.
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let set = sets()[i % 4].clone();
                (i % 4, e.generate(request(PROMPT, set)).expect("submit"))
            })
            .collect();
        for (k, h) in handles {
            let got = h.blocking_completion().expect("completes").text;
            assert_eq!(got, want[k], "set {k} under concurrency, {mixed:?}");
        }
        // Adapters 0 and 1: counted per request that ran with them.
        assert_eq!(e.lora_request_counts(), vec![4, 4]);
        steps.push(e.metrics().steps);
    }
    // Rotating, a step runs one set: the same work takes more steps.
    assert!(steps[0] < steps[1], "steps per set / rotating: {steps:?}");
}

#[test]
fn kv_is_reused_within_a_set_and_never_across_sets() {
    let e = engine();
    let a = Some(vec![LoraScale { id: 0, scale: 1.0 }]);
    let first = e
        .generate(request(PROMPT, a.clone()))
        .expect("submit")
        .blocking_completion()
        .expect("completes");
    let longer = format!("{PROMPT}{}", first.text);
    // The base model on a prompt the set-A sequence holds: computed afresh.
    let base = e
        .generate(request(&longer, None))
        .expect("submit")
        .blocking_completion()
        .expect("completes");
    assert_eq!(base.usage.cached_tokens, 0);
    assert_eq!(base.text, alone(&longer, None));
    // The same set reuses its own KV, and the text is the same as alone.
    let again = e
        .generate(request(&longer, a.clone()))
        .expect("submit")
        .blocking_completion()
        .expect("completes");
    assert!(
        again.usage.cached_tokens >= PROMPT.len(),
        "{:?}",
        again.usage
    );
    assert_eq!(again.text, alone(&longer, a));
}

#[test]
fn named_adapters_global_scales_and_bad_ids() {
    let e = engine();
    let b = Some(vec![LoraScale { id: 1, scale: 1.0 }]);
    // `TARGET:b` selects adapter b for requests that choose none.
    let named = e.with_adapter("b").expect("adapter b");
    assert!(e.with_adapter("c").is_none());
    let by_name = named
        .generate(request(PROMPT, None))
        .expect("submit")
        .blocking_completion()
        .expect("completes")
        .text;
    assert_eq!(by_name, alone(PROMPT, b.clone()));
    // Global scales: requests that choose none get them (an empty list too).
    e.set_lora_scales(&[LoraScale { id: 1, scale: 1.0 }])
        .expect("set");
    for lora in [None, Some(Vec::new())] {
        let got = e
            .generate(request(PROMPT, lora))
            .expect("submit")
            .blocking_completion()
            .expect("completes")
            .text;
        assert_eq!(got, by_name);
    }
    assert_eq!(e.lora_adapters()[1].global_scale, 1.0);
    assert_eq!(e.lora_adapters()[0].global_scale, 0.0);
    for bad in [
        vec![LoraScale { id: 2, scale: 1.0 }],
        vec![LoraScale {
            id: 0,
            scale: f32::INFINITY,
        }],
    ] {
        match e.generate(request(PROMPT, Some(bad.clone()))) {
            Err(EngineError::InvalidRequest { field: "lora", .. }) => {}
            other => panic!("{bad:?}: {:?}", other.map(|_| ())),
        }
        assert!(e.set_lora_scales(&bad).is_err());
    }
}

#[test]
fn embeddings_run_with_the_global_scales() {
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_parallel = 2;
    cfg.context.embeddings = true;
    cfg.lora = vec![LoraAdapterConfig::new("/adapters/a.gguf".into(), 1.0)];
    let fake = FakeConfig {
        n_seq_max: 4,
        embeddings: Some(sipp::runtime::Pooling::Mean),
        ..FakeConfig::default()
    };
    let e = Engine::start(FakeBackend::new(fake), cfg);
    let embed = |e: &Engine| {
        e.embed(sipp::engine::EmbedRequest::new("some text"))
            .expect("submit")
            .blocking_embedding()
            .expect("embeds")
            .values
    };
    let adapted = embed(&e);
    e.set_lora_scales(&[]).expect("off");
    let base = embed(&e);
    assert_ne!(adapted, base);
    // `TARGET:NAME` selects the adapter for embeddings too.
    let named = e.with_adapter("a").expect("adapter a");
    assert_eq!(embed(&named), adapted);
    assert_eq!(e.lora_request_counts(), vec![2]);
}
