//! How often a seeded or greedy request changes its text when other requests
//! ran before it, with and without `repeatable` (issue: seeds and the prefix
//! cache).
//!
//!     cargo run --release --example repeatability -- [PROMPTS] [TOKENS]
//!
//! For each chat prompt, greedy and seeded (temperature 1): a reference run on
//! an idle engine, then, after a long request has filled the KV cache past 512
//! cells (where llama.cpp's CPU flash attention splits a single sequence's
//! attention across threads), the same request again with the prefix cache,
//! with `cache_prompt: false`, and with `repeatable: true`. Prints how many
//! texts differ from the reference in each case.

use sipp::chat::ChatMessage;
use sipp::engine::{Engine, GenerateRequest};
use sipp::sampling::SamplingParams;
use sipp::NativeRuntimeConfig;

const PROMPTS: [&str; 16] = [
    "Tell me a story.",
    "Write a poem about the sea.",
    "Explain photosynthesis.",
    "Describe your ideal weekend.",
    "Give me advice for a job interview.",
    "What makes a good friend?",
    "Describe a city at night.",
    "Why do cats purr?",
    "Write a letter to a future self.",
    "Describe the taste of coffee.",
    "Invent a new holiday.",
    "What is the best way to learn?",
    "Tell me about the moon.",
    "Write a recipe for a sandwich.",
    "Describe a forest in autumn.",
    "Plan a trip to the mountains.",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n_prompts: usize = args.next().map_or(Ok(PROMPTS.len()), |s| s.parse())?;
    let tokens: u32 = args.next().map_or(Ok(24), |s| s.parse())?;
    let mut cfg = NativeRuntimeConfig::default();
    cfg.context.n_ctx = 8192;
    let engine = Engine::load(&sipp::models::resolve_or_fetch("default")?, cfg)?;
    let request =
        |prompt: &str, seeded: bool| -> Result<GenerateRequest, Box<dyn std::error::Error>> {
            let sampling = if seeded {
                SamplingParams {
                    temperature: 1.0,
                    seed: Some(42),
                    ..SamplingParams::default()
                }
            } else {
                SamplingParams::greedy()
            };
            Ok(GenerateRequest {
                max_tokens: Some(tokens),
                sampling: Some(sampling),
                ..GenerateRequest::new(engine.chat_prompt(&[ChatMessage::user(prompt)])?)
            })
        };
    let run = |req: GenerateRequest| -> Result<String, Box<dyn std::error::Error>> {
        Ok(engine.generate(req)?.blocking_completion()?.text)
    };
    let filler = |salt: usize| GenerateRequest {
        max_tokens: Some(600),
        ignore_eos: true,
        ..GenerateRequest::new(format!("Write a long essay about rivers, part {salt}.")).greedy()
    };
    // [mode][case]: changed texts.
    let cases = ["prefix cache", "cache_prompt false", "repeatable"];
    let mut changed = [[0u32; 3]; 2];
    for (i, prompt) in PROMPTS.iter().take(n_prompts).enumerate() {
        for (m, seeded) in [false, true].into_iter().enumerate() {
            let reference = run(GenerateRequest {
                repeatable: true,
                ..request(prompt, seeded)?
            })?;
            // Cache the prompt's prefix, then fill the KV past 512 cells.
            run(request(prompt, seeded)?)?;
            run(filler(i))?;
            let cached = run(request(prompt, seeded)?)?;
            let fresh = run(GenerateRequest {
                cache_prompt: false,
                ..request(prompt, seeded)?
            })?;
            let repeatable = run(GenerateRequest {
                repeatable: true,
                ..request(prompt, seeded)?
            })?;
            for (c, text) in [cached, fresh, repeatable].iter().enumerate() {
                if *text != reference {
                    changed[m][c] += 1;
                }
            }
        }
        eprintln!("prompt {} of {n_prompts} done", i + 1);
    }
    println!("{n_prompts} chat prompts, {tokens} tokens, texts that differ from an idle engine's:");
    for (m, mode) in ["greedy", "seeded (temperature 1)"].iter().enumerate() {
        for (c, case) in cases.iter().enumerate() {
            println!("  {mode:24} {case:20} {}/{n_prompts}", changed[m][c]);
        }
    }
    Ok(())
}
