//! How often constrained JSON finishes within a token budget, with the JSON
//! bounds off and on, side by side on the same engine (issue: JSON mode and
//! schemas must not run away).
//!
//!     cargo run --release --example json_finish -- [SEEDS] [MAX_TOKENS] [TEMPERATURE] [off|default]
//!
//! Runs every case of `tests/fixtures/open_schemas.json` (open schemas as users
//! write them, and JSON-mode prompts) once per seed and per setting, the two
//! settings interleaved seed by seed, and prints the share that ended by
//! themselves (not cut by `max_tokens`), the share of those that parse, and
//! the mean tokens generated.

use std::time::Instant;

use sipp::chat::ChatMessage;
use sipp::engine::{Engine, GenerateRequest};
use sipp::sampling::{JsonBounds, OutputConstraint, SamplingParams};
use sipp::text::FinishReason;
use sipp::NativeRuntimeConfig;

#[derive(Default)]
struct Tally {
    runs: u32,
    finished: u32,
    parsed: u32,
    tokens: u64,
    cut: Vec<String>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let seeds: u32 = args.next().map_or(Ok(5), |s| s.parse())?;
    let max_tokens: u32 = args.next().map_or(Ok(200), |s| s.parse())?;
    let temperature: f32 = args.next().map_or(Ok(0.7), |s| s.parse())?;
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/open_schemas.json");
    let cases: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(fixture)?)?;

    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_ctx = 16384;
    cfg.context.n_parallel = 16;
    let engine = Engine::load(&sipp::models::resolve_or_fetch("default")?, cfg)?;
    let settings = [
        ("off", JsonBounds::unbounded()),
        ("default", JsonBounds::default()),
    ];
    // A fourth argument names one setting to run alone.
    let only = args.next();
    let settings: Vec<_> = settings
        .into_iter()
        .filter(|(name, _)| only.as_deref().is_none_or(|o| o == *name))
        .collect();
    let mut tallies: Vec<Tally> = settings.iter().map(|_| Tally::default()).collect();
    let started = Instant::now();
    for seed in 1..=seeds {
        for ((name, bounds), tally) in settings.iter().zip(tallies.iter_mut()) {
            let mut handles = Vec::new();
            for case in &cases {
                let prompt = case["prompt"].as_str().unwrap_or_default();
                let constraint = match &case["schema"] {
                    serde_json::Value::Null => OutputConstraint::JsonObject,
                    s => OutputConstraint::JsonSchema(s.clone()),
                };
                let req = GenerateRequest {
                    max_tokens: Some(max_tokens),
                    sampling: Some(SamplingParams {
                        temperature,
                        seed: Some(seed),
                        json_bounds: *bounds,
                        ..SamplingParams::default()
                    }),
                    constraint: Some(constraint),
                    ..GenerateRequest::new(engine.chat_prompt(&[ChatMessage::user(prompt)])?)
                };
                handles.push((prompt, engine.generate(req)?));
            }
            for (prompt, h) in handles {
                let c = h.blocking_completion()?;
                tally.runs += 1;
                tally.tokens += c.usage.completion_tokens as u64;
                if c.finish_reason == FinishReason::Length {
                    let head: String = c.text.chars().take(160).collect();
                    tally.cut.push(format!("seed {seed} {prompt} {head:?}"));
                } else {
                    tally.finished += 1;
                    match serde_json::from_str::<serde_json::Value>(c.text.trim()) {
                        Ok(_) => tally.parsed += 1,
                        Err(e) => tally.cut.push(format!(
                            "ENDED BUT DOES NOT PARSE ({e}): seed {seed} {prompt} {:?}",
                            c.text
                        )),
                    }
                }
            }
            eprintln!(
                "seed {seed} {name}: done at {:.0}s",
                started.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "{} cases x {seeds} seeds, temperature {temperature}, max_tokens {max_tokens}",
        cases.len()
    );
    for ((name, bounds), t) in settings.iter().zip(&tallies) {
        println!(
            "bounds {name:8} {bounds:?}\n  finished {}/{} ({:.1}%), of those parse {}/{}, mean tokens {:.1}",
            t.finished,
            t.runs,
            100.0 * f64::from(t.finished) / f64::from(t.runs.max(1)),
            t.parsed,
            t.finished,
            t.tokens as f64 / f64::from(t.runs.max(1)),
        );
        for c in &t.cut {
            println!("  cut by max_tokens: {c}");
        }
    }
    Ok(())
}
