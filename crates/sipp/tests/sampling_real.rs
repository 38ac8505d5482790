//! Sampling and structured output on the real default model.

mod common;

use common::engine_with;
use serde_json::json;
use sipp::chat::ChatMessage;
use sipp::engine::{Completion, Engine, GenerateRequest, RequestEvent};
use sipp::sampling::{BiasTarget, JsonBounds, LogitBias, OutputConstraint, SamplingParams};
use sipp::text::is_json_prefix;
use sipp::text::FinishReason;

fn run(e: &Engine, req: GenerateRequest) -> Completion {
    e.generate(req)
        .expect("submit")
        .blocking_completion()
        .expect("completes")
}

fn schemas() -> Vec<(&'static str, serde_json::Value)> {
    vec![
        (
            "Describe a person as JSON.",
            json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": false}),
        ),
        (
            "Give a list of three fruits as a JSON array.",
            json!({"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 3, "maxItems": 3}),
        ),
        (
            "Is the sky blue? Answer as JSON.",
            json!({"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"], "additionalProperties": false}),
        ),
        ("Pick a colour.", json!({"enum": ["red", "green", "blue"]})),
        (
            "Rate the movie from 1 to 5.",
            json!({"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["stars"], "additionalProperties": false}),
        ),
        (
            "Temperature in Celsius between -40 and 50.",
            json!({"type": "integer", "minimum": -40, "maximum": 50}),
        ),
        (
            "A date of birth.",
            json!({"type": "object", "properties": {"born": {"type": "string", "format": "date"}}, "required": ["born"], "additionalProperties": false}),
        ),
        (
            "An identifier.",
            json!({"type": "string", "format": "uuid"}),
        ),
        (
            "A meeting time.",
            json!({"type": "object", "properties": {"at": {"type": "string", "format": "time"}}, "required": ["at"], "additionalProperties": false}),
        ),
        (
            "An event timestamp.",
            json!({"type": "string", "format": "date-time"}),
        ),
        (
            "A country code.",
            json!({"type": "string", "pattern": "^[A-Z]{2}$"}),
        ),
        (
            "A short nickname.",
            json!({"type": "string", "minLength": 2, "maxLength": 8}),
        ),
        (
            "An address as JSON.",
            json!({"type": "object", "properties": {"street": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"], "additionalProperties": false}),
        ),
        (
            "An order with items.",
            json!({"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 10}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"], "additionalProperties": false}, "minItems": 1, "maxItems": 3}}, "required": ["id", "items"], "additionalProperties": false}),
        ),
        (
            "A book with an optional subtitle.",
            json!({"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}, "subtitle": {"type": "string", "maxLength": 30}}, "required": ["title"], "additionalProperties": false}),
        ),
        (
            "Either a number or nothing.",
            json!({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}),
        ),
        (
            "A status.",
            json!({"type": "object", "properties": {"status": {"enum": ["open", "closed", "pending"]}, "code": {"const": 7}}, "required": ["status", "code"], "additionalProperties": false}),
        ),
        (
            "A point as a pair.",
            json!({"type": "array", "prefixItems": [{"type": "integer", "minimum": -9, "maximum": 9}, {"type": "integer", "minimum": -9, "maximum": 9}], "minItems": 2}),
        ),
        (
            "A nested configuration.",
            json!({"type": "object", "properties": {"server": {"type": "object", "properties": {"host": {"type": "string", "maxLength": 20}, "port": {"type": "integer", "minimum": 1, "maximum": 65535}}, "required": ["host", "port"], "additionalProperties": false}, "debug": {"type": "boolean"}}, "required": ["server", "debug"], "additionalProperties": false}),
        ),
        (
            "A measurement.",
            json!({"type": "object", "properties": {"value": {"type": "number"}, "unit": {"enum": ["cm", "kg", "s"]}}, "required": ["value", "unit"], "additionalProperties": false}),
        ),
        (
            "Tags for a photo.",
            json!({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}, "required": ["tags"], "additionalProperties": false}),
        ),
        (
            "A reference to a definition.",
            json!({"$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string", "maxLength": 12}}, "required": ["kind", "name"], "additionalProperties": false}}, "type": "object", "properties": {"pet": {"$ref": "#/$defs/pet"}}, "required": ["pet"], "additionalProperties": false}),
        ),
    ]
}

/// Runs a request, checking at every delta that the text so far is the start
/// of a JSON document (what a constrained stream guarantees, even when cut).
fn run_checking_json_prefix(e: &Engine, req: GenerateRequest, what: &str) -> Completion {
    let mut h = e.generate(req).expect("submit");
    let mut text = String::new();
    while let Some(ev) = h.blocking_next_event() {
        match ev {
            RequestEvent::Delta(d) => {
                text.push_str(&d.text);
                assert!(is_json_prefix(&text), "{what}: not a JSON prefix: {text:?}");
            }
            RequestEvent::Finished(c) => {
                assert_eq!(c.text, text, "{what}: the deltas add up to the text");
                return c;
            }
            RequestEvent::Failed(err) => panic!("{what}: {err}"),
            _ => {}
        }
    }
    panic!("{what}: no final event")
}

/// Asserts the guarantee of schema-constrained output: a JSON prefix always,
/// and, when the model ended it (not `max_tokens`), valid against the schema.
fn assert_schema_guarantee(what: &str, schema: &serde_json::Value, c: &Completion) {
    assert!(
        is_json_prefix(&c.text),
        "{what}: not a JSON prefix: {:?}",
        c.text
    );
    if c.finish_reason == FinishReason::Length {
        return;
    }
    let value: serde_json::Value = serde_json::from_str(c.text.trim()).unwrap_or_else(|err| {
        panic!(
            "{what}: ended by itself but is not JSON ({err}): {:?}",
            c.text
        )
    });
    let validator = jsonschema::validator_for(schema).expect("schema compiles");
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| e.to_string())
        .collect();
    assert!(
        errors.is_empty(),
        "{what}: {value} violates its schema: {errors:?}"
    );
}

#[test]
fn json_schema_outputs_validate() {
    let e = engine_with(4, |_| {});
    let cases = schemas();
    assert!(cases.len() >= 20);
    // Submitted together: constrained requests share batches like any other.
    let handles: Vec<_> = cases
        .iter()
        .map(|(prompt, schema)| {
            let req = GenerateRequest {
                max_tokens: Some(400),
                constraint: Some(OutputConstraint::JsonSchema(schema.clone())),
                ..GenerateRequest::new(format!("{prompt}\nJSON:")).greedy()
            };
            e.generate(req).expect("submit")
        })
        .collect();
    for ((prompt, schema), h) in cases.iter().zip(handles) {
        let c = h.blocking_completion().expect("completes");
        assert_schema_guarantee(prompt, schema, &c);
    }
}

/// Open schemas as users write them (no maxLength, no maxItems) and JSON-mode
/// prompts, sampled: under the default JSON bounds every stream is a JSON
/// prefix and every output the model ended is valid against the schema.
#[test]
fn open_schemas_stream_json_prefixes_and_validate_when_finished() {
    let e = engine_with(4, |_| {});
    let fixture = common::manifest_dir().join("tests/fixtures/open_schemas.json");
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixture).expect("fixture")).expect("json");
    assert!(cases.len() >= 20);
    for (i, case) in cases.iter().enumerate() {
        let prompt = case["prompt"].as_str().expect("prompt");
        let (constraint, schema) = match &case["schema"] {
            serde_json::Value::Null => (OutputConstraint::JsonObject, json!({"type": "object"})),
            s => (OutputConstraint::JsonSchema(s.clone()), s.clone()),
        };
        let req = GenerateRequest {
            max_tokens: Some(160),
            constraint: Some(constraint),
            sampling: Some(SamplingParams {
                temperature: 0.7,
                seed: Some(i as u32),
                ..SamplingParams::default()
            }),
            ..GenerateRequest::new(
                e.chat_prompt(&[ChatMessage::user(prompt)])
                    .expect("template"),
            )
        };
        let c = run_checking_json_prefix(&e, req, prompt);
        assert_schema_guarantee(prompt, &schema, &c);
    }
}

/// JSON mode under bounds has a longest possible output; with `max_tokens` at
/// that length every request ends by itself with an object within the bounds,
/// on any machine, whatever the model says.
#[test]
fn bounded_json_mode_always_ends_with_an_object_within_the_bounds() {
    let e = engine_with(4, |c| c.context.n_ctx = 8192);
    let bounds = JsonBounds {
        max_string_chars: 16,
        max_object_members: 4,
        max_array_items: 4,
        max_depth: 2,
        compact_whitespace: false,
    };
    let longest = bounds.json_object_max_bytes().expect("bounded");
    assert!(longest < 6000, "{longest}");
    let prompts = [
        "Describe a cat in JSON.",
        "Give me a recipe as JSON.",
        "A user profile as JSON.",
    ];
    for (i, prompt) in prompts.iter().enumerate() {
        for seed in 0..2u32 {
            let req = GenerateRequest {
                max_tokens: Some(longest as u32),
                constraint: Some(OutputConstraint::JsonObject),
                sampling: Some(SamplingParams {
                    temperature: 0.7,
                    seed: Some(seed + 10 * i as u32),
                    json_bounds: bounds,
                    ..SamplingParams::default()
                }),
                ..GenerateRequest::new(
                    e.chat_prompt(&[ChatMessage::user(*prompt)])
                        .expect("template"),
                )
            };
            let c = run_checking_json_prefix(&e, req, prompt);
            assert_eq!(c.finish_reason, FinishReason::Eos, "{prompt}: {:?}", c.text);
            let v: serde_json::Value = serde_json::from_str(c.text.trim()).expect("complete JSON");
            assert!(v.is_object(), "{v}");
            assert_within_bounds(&v, &bounds, 1);
        }
    }
}

fn assert_within_bounds(v: &serde_json::Value, b: &JsonBounds, depth: u32) {
    match v {
        serde_json::Value::String(s) => {
            assert!(s.chars().count() <= b.max_string_chars as usize, "{s:?}");
        }
        serde_json::Value::Array(items) => {
            assert!(
                depth <= b.max_depth && items.len() <= b.max_array_items as usize,
                "{v}"
            );
            items
                .iter()
                .for_each(|x| assert_within_bounds(x, b, depth + 1));
        }
        serde_json::Value::Object(members) => {
            assert!(
                depth <= b.max_depth && members.len() <= b.max_object_members as usize,
                "{v}"
            );
            for (k, x) in members {
                assert!(k.chars().count() <= b.max_string_chars as usize, "{k:?}");
                assert_within_bounds(x, b, depth + 1);
            }
        }
        _ => {}
    }
}

#[test]
fn yes_no_grammar_only_yields_yes_or_no() {
    let e = engine_with(4, |_| {});
    let grammar = OutputConstraint::Grammar("root ::= \"yes\" | \"no\"".into());
    for (i, q) in [
        "Is water wet?",
        "Is fire cold?",
        "Do cats bark?",
        "Is the earth round?",
        "Can fish fly?",
    ]
    .iter()
    .enumerate()
    {
        for seed in 0..4u32 {
            let req = GenerateRequest {
                max_tokens: Some(8),
                constraint: Some(grammar.clone()),
                sampling: Some(SamplingParams {
                    temperature: 1.0,
                    seed: Some(seed + i as u32 * 10),
                    ..SamplingParams::default()
                }),
                ..GenerateRequest::new(format!("Question: {q} Answer yes or no.\nAnswer:"))
            };
            let c = run(&e, req);
            assert!(c.text == "yes" || c.text == "no", "{q}: {:?}", c.text);
        }
    }
}

fn sampled(e: &Engine, prompt: &str, seed: u32) -> String {
    let req = GenerateRequest {
        max_tokens: Some(32),
        ignore_eos: true,
        sampling: Some(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: Some(seed),
            ..SamplingParams::default()
        }),
        ..GenerateRequest::new(prompt)
    };
    run(e, req).text
}

#[test]
fn seeds_reproduce_and_differ() {
    let e = engine_with(2, |c| c.cache.mode = sipp::config::CacheMode::Off);
    let prompt = "Once upon a time, in a small village,";
    let a = sampled(&e, prompt, 42);
    let b = sampled(&e, prompt, 42);
    let c = sampled(&e, prompt, 43);
    assert_eq!(a, b, "same seed, same settings, same text");
    assert_ne!(
        a, c,
        "a different seed at temperature 1 gives different text"
    );
}

#[test]
fn banned_token_never_appears() {
    let e = engine_with(1, |_| {});
    let base = run(
        &e,
        GenerateRequest::new("The capital of France is")
            .greedy()
            .max_tokens(16),
    );
    let banned = base.tokens[0];
    let text = String::from_utf8_lossy(&e.vocab().token_bytes(banned)).into_owned();
    let by_id = GenerateRequest {
        sampling: Some(SamplingParams {
            logit_bias: vec![LogitBias {
                target: BiasTarget::Token(banned),
                bias: f32::NEG_INFINITY,
            }],
            ..SamplingParams::greedy()
        }),
        ..GenerateRequest::new("The capital of France is").max_tokens(32)
    };
    let c = run(&e, by_id);
    assert!(
        !c.tokens.contains(&banned),
        "token {banned} ({text:?}) appeared: {:?}",
        c.text
    );
    // At temperature 1 too, over several seeds.
    for seed in 0..5 {
        let req = GenerateRequest {
            max_tokens: Some(32),
            sampling: Some(SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                logit_bias: vec![LogitBias {
                    target: BiasTarget::Text(text.clone()),
                    bias: -100.0,
                }],
                ..SamplingParams::default()
            }),
            ..GenerateRequest::new("The capital of France is")
        };
        assert!(!run(&e, req).tokens.contains(&banned));
    }
}

#[test]
fn logprobs_are_finite_sorted_and_contain_the_choice() {
    let e = engine_with(1, |_| {});
    let req = GenerateRequest {
        logprobs: Some(5),
        ..GenerateRequest::new("The capital of France is")
            .greedy()
            .max_tokens(12)
    };
    let c = run(&e, req);
    assert_eq!(c.logprobs.len(), c.tokens.len());
    for (lp, &tok) in c.logprobs.iter().zip(&c.tokens) {
        assert_eq!(lp.token, tok);
        assert_eq!(lp.logprobs.top.len(), 5);
        assert!(lp.logprobs.chosen.logprob.is_finite() && lp.logprobs.chosen.logprob <= 0.0);
        assert!(lp
            .logprobs
            .top
            .iter()
            .all(|t| t.logprob.is_finite() && t.logprob <= 0.0));
        assert!(
            lp.logprobs
                .top
                .windows(2)
                .all(|w| w[0].logprob >= w[1].logprob),
            "sorted"
        );
        assert!(
            lp.logprobs.top.iter().any(|t| t.token == tok),
            "the chosen token is among the top"
        );
    }
}

#[test]
fn penalties_mirostat_dry_xtc_and_custom_order_run() {
    let e = engine_with(1, |_| {});
    let variants = [
        SamplingParams {
            repeat_penalty: 1.3,
            frequency_penalty: 0.5,
            presence_penalty: 0.5,
            seed: Some(1),
            ..SamplingParams::default()
        },
        SamplingParams {
            mirostat: 1,
            seed: Some(1),
            ..SamplingParams::default()
        },
        SamplingParams {
            mirostat: 2,
            seed: Some(1),
            ..SamplingParams::default()
        },
        SamplingParams {
            dry_multiplier: 0.8,
            seed: Some(1),
            ..SamplingParams::default()
        },
        SamplingParams {
            xtc_probability: 0.5,
            xtc_threshold: 0.1,
            seed: Some(1),
            ..SamplingParams::default()
        },
        SamplingParams {
            typical_p: 0.9,
            top_n_sigma: 1.0,
            seed: Some(1),
            ..SamplingParams::default()
        },
        SamplingParams {
            samplers: Some(
                SamplingParams::parse_order(&["min_p", "temperature", "top_k"]).expect("known"),
            ),
            seed: Some(1),
            ..SamplingParams::default()
        },
    ];
    for p in variants {
        let c = run(
            &e,
            GenerateRequest {
                sampling: Some(p.clone()),
                ..GenerateRequest::new("List some animals:").max_tokens(24)
            },
        );
        assert!(c.usage.completion_tokens > 0, "{p:?}");
    }
    // A repetition penalty changes greedy output on a repetitive prompt.
    let prompt = "one one one one one one one one";
    let plain = run(&e, GenerateRequest::new(prompt).greedy().max_tokens(16));
    let penalized = run(
        &e,
        GenerateRequest {
            sampling: Some(SamplingParams {
                repeat_penalty: 1.8,
                ..SamplingParams::greedy()
            }),
            ..GenerateRequest::new(prompt).max_tokens(16)
        },
    );
    assert_ne!(plain.text, penalized.text);
}

#[test]
fn invalid_grammar_and_schema_are_rejected_at_submission() {
    let e = engine_with(1, |_| {});
    let bad = GenerateRequest {
        constraint: Some(OutputConstraint::Grammar("root ::= (\"a\"".into())),
        ..GenerateRequest::new("x")
    };
    let msg = e.generate(bad).unwrap_err().to_string();
    assert!(msg.contains("`grammar`"), "{msg}");
    let bad = GenerateRequest {
        constraint: Some(OutputConstraint::JsonSchema(
            json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
        )),
        ..GenerateRequest::new("x")
    };
    let msg = e.generate(bad).unwrap_err().to_string();
    assert!(msg.contains("`json_schema`"), "{msg}");
    let bad = GenerateRequest {
        constraint: Some(OutputConstraint::JsonSchema(
            json!({"type": "number", "multipleOf": 2}),
        )),
        ..GenerateRequest::new("x")
    };
    let msg = e.generate(bad).unwrap_err().to_string();
    assert!(msg.contains("multipleOf"), "{msg}");
    assert_eq!(e.metrics().busy_slots, 0);
    assert_eq!(
        e.metrics().requests_failed,
        0,
        "rejected before taking a slot"
    );
}
