//! Measures the two JSON-schema engines llama-cpp-2 offers on the same model and
//! schemas: llama.cpp's converter plus its GBNF sampler, and llguidance. For each
//! it reports how many schemas it accepts, grammar build time, sampler time per
//! token and whether every output parses. Greedy decoding, one sequence.
//!
//! ```sh
//! cargo run --release -p sipp-rs --features llguidance --example grammar_engines -- MODEL.gguf
//! ```
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

const MAX_TOKENS: usize = 96;

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 3, "maxItems": 3}),
        json!({"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["stars"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"born": {"type": "string", "format": "date"}}, "required": ["born"], "additionalProperties": false}),
        json!({"type": "string", "pattern": "^[A-Z]{2}$"}),
        json!({"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 10}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"], "additionalProperties": false}, "minItems": 1, "maxItems": 3}}, "required": ["id", "items"], "additionalProperties": false}),
        json!({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}),
        json!({"type": "object", "properties": {"status": {"enum": ["open", "closed", "pending"]}, "code": {"const": 7}}, "required": ["status", "code"], "additionalProperties": false}),
        json!({"$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string", "maxLength": 12}}, "required": ["kind", "name"], "additionalProperties": false}}, "type": "object", "properties": {"pet": {"$ref": "#/$defs/pet"}}, "required": ["pet"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}, "required": ["tags"], "additionalProperties": false}),
        // Features one engine or the other may refuse.
        json!({"type": "number", "multipleOf": 2}),
        json!({"type": "array", "items": {"type": "integer"}, "uniqueItems": true, "maxItems": 3}),
        json!({"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "maxProperties": 2}),
        json!({"oneOf": [{"type": "string", "maxLength": 5}, {"type": "boolean"}]}),
    ]
}

#[derive(Default)]
struct Tally {
    accepted: usize,
    build: Duration,
    sample: Duration,
    tokens: usize,
    parsed: usize,
    runs: usize,
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .expect("usage: grammar_engines MODEL.gguf");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as i32;
    let backend = LlamaBackend::init().expect("backend");
    let model =
        LlamaModel::load_from_file(&backend, &path, &LlamaModelParams::default()).expect("model");
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(1024))
        .with_n_threads(threads)
        .with_n_threads_batch(threads);
    let mut ctx = model.new_context(&backend, params).expect("context");
    let t = Instant::now();
    let env = LlamaSampler::llguidance_tok_env(&model);
    let mut factory = ParserFactory::new_simple(&env).expect("llguidance factory");
    factory.quiet();
    println!(
        "llguidance tokenizer environment: {:.1} ms (once per model)",
        t.elapsed().as_secs_f64() * 1e3
    );
    let prompt = model
        .vocab()
        .tokenize(b"Here is the answer as JSON:\n", true, true);
    let mut tallies = [Tally::default(), Tally::default()];
    for schema in schemas() {
        let text = schema.to_string();
        let mut row = Vec::new();
        for (engine, tally) in tallies.iter_mut().enumerate() {
            let t = Instant::now();
            let constraint = if engine == 0 {
                llama_cpp_2::json_schema_to_grammar(&text)
                    .ok()
                    .and_then(|g| LlamaSampler::grammar(&model, &g, "root").ok())
            } else {
                factory
                    .create_parser(TopLevelGrammar::from_json_schema(schema.clone()))
                    .ok()
                    .map(|p| LlamaSampler::from(Matcher::new(Ok(p))))
            };
            let Some(constraint) = constraint else {
                row.push("refused".to_string());
                continue;
            };
            tally.build += t.elapsed();
            tally.accepted += 1;
            let mut sampler = LlamaSampler::chain_simple([constraint, LlamaSampler::greedy()]);
            ctx.clear_kv_cache();
            let mut batch = LlamaBatch::new(512, 1);
            for (i, tok) in prompt.iter().enumerate() {
                batch
                    .add(*tok, i as i32, &[0], i + 1 == prompt.len())
                    .expect("batch");
            }
            ctx.decode(&mut batch).expect("decode");
            let mut pos = prompt.len() as i32;
            let mut out = Vec::new();
            for _ in 0..MAX_TOKENS {
                let t = Instant::now();
                let tok = sampler.sample(&ctx, batch.n_tokens() - 1);
                tally.sample += t.elapsed();
                tally.tokens += 1;
                if model.vocab().is_eog(tok) {
                    break;
                }
                out.extend(model.vocab().token_to_piece(tok, false, None));
                batch.clear();
                batch.add(tok, pos, &[0], true).expect("batch");
                pos += 1;
                ctx.decode(&mut batch).expect("decode");
            }
            let out = String::from_utf8_lossy(&out).to_string();
            tally.runs += 1;
            let ok = serde_json::from_str::<Value>(out.trim()).is_ok();
            tally.parsed += usize::from(ok);
            row.push(format!(
                "{}{}",
                if ok { "" } else { "UNPARSED " },
                out.trim()
            ));
        }
        println!("{text}\n  llama.cpp:  {}\n  llguidance: {}", row[0], row[1]);
    }
    println!(
        "\n{:<12} {:>9} {:>14} {:>18} {:>8} {:>14}",
        "engine", "accepted", "build ms/each", "sampler us/token", "tokens", "outputs parse"
    );
    for (name, t) in ["llama.cpp", "llguidance"].iter().zip(&tallies) {
        println!(
            "{:<12} {:>6}/{:<2} {:>14.2} {:>18.1} {:>8} {:>11}/{}",
            name,
            t.accepted,
            schemas().len(),
            t.build.as_secs_f64() * 1e3 / t.accepted.max(1) as f64,
            t.sample.as_secs_f64() * 1e6 / t.tokens.max(1) as f64,
            t.tokens,
            t.parsed,
            t.runs
        );
    }
}
