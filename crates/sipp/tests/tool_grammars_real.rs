//! Every family's call grammar on the real model and llama.cpp's grammar
//! engine: forced calls (`required`, a named function, parallel or not) in
//! each format parse back, with that family's parser, into calls whose
//! arguments validate against the function's schema, however the model is
//! sampled; lazy (`auto`) grammars compile with their trigger patterns and
//! never produce a malformed call.

mod common;

use sipp::engine::{Completion, Engine, GenerateRequest};
use sipp::sampling::{OutputConstraint, SamplingParams};
use sipp::tools::grammar::call_grammar;
use sipp::tools::turn::ReasoningFormat;
use sipp::tools::{OutputParser, Tool, ToolChoice, ToolFormat, ToolSpec, TurnOutput};

const FORMATS: [ToolFormat; 5] = [
    ToolFormat::Hermes,
    ToolFormat::Llama3,
    ToolFormat::Mistral,
    ToolFormat::Pythonic,
    ToolFormat::Generic,
];

fn tools() -> Vec<Tool> {
    vec![
        Tool::function(
            "get_weather",
            "Current weather in a city",
            serde_json::json!({
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7}
                },
                "required": ["city"],
                "additionalProperties": false
            }),
        ),
        Tool::function(
            "search",
            "Search the web",
            serde_json::json!({
                "type": "object",
                "properties": {"query": {"type": "string"}, "exact": {"type": "boolean"}},
                "required": ["query", "exact"]
            }),
        ),
    ]
}

fn sampled(seed: u32) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

fn run(
    e: &Engine,
    prompt: &str,
    constraint: OutputConstraint,
    seed: u32,
    max_tokens: u32,
) -> Completion {
    e.generate(GenerateRequest {
        max_tokens: Some(max_tokens),
        constraint: Some(constraint),
        sampling: Some(sampled(seed)),
        ..GenerateRequest::new(prompt)
    })
    .expect("submit")
    .blocking_completion()
    .expect("completes")
}

fn parse(format: ToolFormat, text: &str) -> TurnOutput {
    OutputParser::new(format, true, ReasoningFormat::None, false).parse_all(text)
}

fn assert_valid_calls(format: ToolFormat, out: &TurnOutput, only: Option<&str>, what: &str) {
    let tools = tools();
    for c in &out.calls {
        let tool = tools
            .iter()
            .find(|t| t.function.name == c.function.name)
            .unwrap_or_else(|| panic!("{what}: unknown function {:?}", c.function.name));
        if let Some(name) = only {
            assert_eq!(c.function.name, name, "{what}");
        }
        let args: serde_json::Value = serde_json::from_str(&c.function.arguments)
            .unwrap_or_else(|e| panic!("{what} ({format:?}): arguments not JSON: {e}: {c:?}"));
        let schema = tool.parameters();
        let v = jsonschema::validator_for(&schema).expect("schema compiles");
        assert!(
            v.is_valid(&args),
            "{what} ({format:?}): {args} does not match {schema}"
        );
    }
}

#[test]
fn forced_calls_in_every_format_parse_into_schema_valid_calls() {
    let e = common::engine_with(4, |_| {});
    let prompt = "<|im_start|>user\nWhat is the weather in Paris, and find news about it.<|im_end|>\n<|im_start|>assistant\n";
    for format in FORMATS {
        for (choice, parallel, only) in [
            (ToolChoice::Required, true, None),
            (ToolChoice::Function("search".into()), false, Some("search")),
        ] {
            let spec = ToolSpec {
                tools: tools(),
                choice,
                parallel,
            };
            let g = call_grammar(format, &spec).expect("a grammar");
            assert!(
                g.triggers.is_empty(),
                "forced calls apply from the first token"
            );
            for seed in 0..2 {
                // One call fits easily; up to 8 parallel ones may not.
                let limit = if parallel { 300 } else { 200 };
                let c = run(
                    &e,
                    prompt,
                    OutputConstraint::Composed(g.clone()),
                    seed,
                    limit,
                );
                let what = format!("{format:?} {only:?} seed {seed}: {:?}", c.text);
                let mut out = parse(format, &c.text);
                let cut = match c.finish_reason {
                    // The grammar ended the answer: every call is complete.
                    sipp::text::FinishReason::Eos => false,
                    // Up to 8 parallel calls may not fit in max_tokens: the
                    // last one may be cut (a format's parser may then keep
                    // its markup as text), the ones before it are whole.
                    sipp::text::FinishReason::Length if parallel => {
                        out.calls.pop();
                        true
                    }
                    other => panic!("{what}: ended by {other:?}"),
                };
                assert!(!out.calls.is_empty(), "{what}: no call parsed");
                if !parallel {
                    assert_eq!(out.calls.len(), 1, "{what}");
                }
                if !cut {
                    assert!(
                        out.content.trim().is_empty(),
                        "{what}: text outside the call: {:?}",
                        out.content
                    );
                }
                assert_valid_calls(format, &out, only, &what);
            }
        }
    }
}

#[test]
fn lazy_grammars_compile_and_any_call_they_let_through_is_valid() {
    let e = common::engine_with(4, |_| {});
    let prompt = "<|im_start|>user\nCall get_weather for Paris.<|im_end|>\n<|im_start|>assistant\n";
    for format in FORMATS {
        let g = call_grammar(format, &ToolSpec::auto(tools())).expect("a grammar");
        assert_eq!(g.triggers.len(), 1, "auto is lazy");
        for seed in 0..2 {
            let c = run(&e, prompt, OutputConstraint::Composed(g.clone()), seed, 200);
            let what = format!("{format:?} auto seed {seed}: {:?}", c.text);
            let out = parse(format, &c.text);
            if c.finish_reason == sipp::text::FinishReason::Eos {
                assert_valid_calls(format, &out, None, &what);
            }
        }
    }
}

#[test]
fn a_schema_the_converter_refuses_is_a_clear_error_at_submission() {
    let e = common::engine_with(1, |_| {});
    let mut spec = ToolSpec::auto(tools());
    spec.tools[0].function.parameters = Some(serde_json::json!({
        "type": "object", "properties": {"a": {"type": "string", "format": "email"}}
    }));
    let g = call_grammar(ToolFormat::Hermes, &spec).expect("a grammar");
    let err = e
        .generate(GenerateRequest {
            constraint: Some(OutputConstraint::Composed(g)),
            ..GenerateRequest::new("x")
        })
        .expect_err("refused");
    assert!(err.to_string().contains("email"), "{err}");
}

/// A lazy grammar can break on its own trigger: the trigger "th" is found
/// inside the token " the" (forced here by a bias), and the token's tail "e"
/// replays into a grammar that wants "x" after "th". llama.cpp's grammar then
/// holds no parse (and would abort on its next use): the request fails with
/// a grammar error, alone, and the engine serves the next one.
#[test]
fn a_lazy_grammar_broken_by_its_trigger_token_fails_its_request_alone() {
    use sipp::engine::EngineError;
    use sipp::sampling::{BiasTarget, ComposedGrammar, LogitBias};
    let e = common::engine_with(2, |_| {});
    let constraint = OutputConstraint::Composed(ComposedGrammar {
        gbnf: r#"root ::= "th" "x""#.into(),
        schemas: Vec::new(),
        triggers: vec!["th".into()],
    });
    let sampling = SamplingParams {
        logit_bias: vec![LogitBias {
            target: BiasTarget::Text(" the".into()),
            bias: 100.0,
        }],
        ..SamplingParams::greedy()
    };
    let got = e
        .generate(GenerateRequest {
            max_tokens: Some(8),
            constraint: Some(constraint),
            sampling: Some(sampling),
            ..GenerateRequest::new("Say something.")
        })
        .expect("submit")
        .blocking_completion();
    match got {
        Err(EngineError::GrammarExhausted { .. }) => {}
        other => panic!("expected a grammar error, got {other:?}"),
    }
    let next = common::run(&e, "Hello", 4);
    assert!(!next.tokens.is_empty());
}
