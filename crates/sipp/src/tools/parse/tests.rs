use super::*;
use proptest::prelude::*;
use serde_json::{json, Value};

const ALL: [ToolFormat; 5] = [
    ToolFormat::Hermes,
    ToolFormat::Llama3,
    ToolFormat::Mistral,
    ToolFormat::Pythonic,
    ToolFormat::Generic,
];

/// The merged events of these chunks.
fn run(format: ToolFormat, chunks: &[&str]) -> Vec<CallEvent> {
    let mut p = CallParser::new(format);
    let mut all = Vec::new();
    for c in chunks {
        all.extend(p.push(c));
    }
    all.extend(p.finish());
    merge_events(all)
}

/// The text and the calls (name, arguments) of merged events, checking that
/// calls are numbered in order and each starts once, ends once.
fn collect(events: &[CallEvent]) -> (String, Vec<(String, String)>) {
    let mut text = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut open: Option<usize> = None;
    for e in events {
        match e {
            CallEvent::Text(s) => {
                assert_eq!(open, None, "text inside a call: {events:?}");
                text.push_str(s);
            }
            CallEvent::Start { index, name } => {
                assert_eq!(open, None, "{events:?}");
                assert_eq!(*index, calls.len(), "{events:?}");
                calls.push((name.clone(), String::new()));
                open = Some(*index);
            }
            CallEvent::Arguments { index, fragment } => {
                assert_eq!(open, Some(*index), "{events:?}");
                calls[*index].1.push_str(fragment);
            }
            CallEvent::End { index } => {
                assert_eq!(open, Some(*index), "{events:?}");
                open = None;
            }
        }
    }
    assert_eq!(open, None, "a call never ended: {events:?}");
    (text, calls)
}

fn parse(format: ToolFormat, text: &str) -> (String, Vec<(String, String)>) {
    collect(&CallParser::parse_all(format, text))
}

fn call(name: &str, args: &str) -> (String, String) {
    (name.to_string(), args.to_string())
}

fn text(s: &str) -> CallEvent {
    CallEvent::Text(s.into())
}

fn start(index: usize, name: &str) -> CallEvent {
    CallEvent::Start {
        index,
        name: name.into(),
    }
}

fn args(index: usize, fragment: &str) -> CallEvent {
    CallEvent::Arguments {
        index,
        fragment: fragment.into(),
    }
}

fn end(index: usize) -> CallEvent {
    CallEvent::End { index }
}

/// Every character on its own, as a token-by-token stream might bring it.
fn char_by_char(format: ToolFormat, s: &str) -> Vec<CallEvent> {
    let chars: Vec<String> = s.chars().map(String::from).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    run(format, &refs)
}

#[test]
fn qwen_hermes_call_after_text() {
    let out = "I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let expected = vec![
        text("I'll check.\n"),
        start(0, "get_weather"),
        args(0, r#"{"city": "Paris"}"#),
        end(0),
    ];
    assert_eq!(run(ToolFormat::Hermes, &[out]), expected);
    assert_eq!(char_by_char(ToolFormat::Hermes, out), expected);
}

#[test]
fn hermes_blocks_in_a_row_and_text_between() {
    let out = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>";
    assert_eq!(
        parse(ToolFormat::Hermes, out),
        (
            String::new(),
            vec![
                call("get_weather", r#"{"city": "Paris"}"#),
                call("get_time", r#"{"tz": "CET"}"#)
            ]
        )
    );
    let out = "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\nThen:\n<tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>\n";
    assert_eq!(
        parse(ToolFormat::Hermes, out),
        (
            "\nThen:\n".to_string(),
            vec![call("a", "{}"), call("b", "{}")]
        )
    );
}

#[test]
fn hermes_variants_models_write() {
    // Arguments first: the call comes out whole once the name is known.
    assert_eq!(
        run(
            ToolFormat::Hermes,
            &[
                "<tool_call>{\"arguments\": {\"q\": [1, {\"x\": \"}\"}]}, ",
                "\"name\": \"search\"}</tool_call>"
            ]
        ),
        vec![
            start(0, "search"),
            args(0, r#"{"q": [1, {"x": "}"}]}"#),
            end(0)
        ]
    );
    // Qwen's arguments as a string holding JSON.
    assert_eq!(
        parse(
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"city\\\": \\\"Par\\u00eds\\\"}\"}\n</tool_call>"
        ),
        (String::new(), vec![call("f", "{\"city\": \"París\"}")])
    );
    // No closing tag at the end, or before the next block.
    assert_eq!(
        parse(
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n<tool_call>\n{\"name\": \"g\", \"arguments\": {\"a\": 1}}"
        ),
        (String::new(), vec![call("f", "{}"), call("g", r#"{"a": 1}"#)])
    );
    // Extra keys, no arguments at all.
    assert_eq!(
        parse(
            ToolFormat::Hermes,
            "<tool_call>{\"id\": 7, \"name\": \"now\"}</tool_call>"
        ),
        (String::new(), vec![call("now", "{}")])
    );
    // Numbers and literals as the last thing in the arguments.
    assert_eq!(
        parse(
            ToolFormat::Hermes,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"n\": -1.5e3, \"b\": true}}</tool_call>"
        ),
        (
            String::new(),
            vec![call("f", r#"{"n": -1.5e3, "b": true}"#)]
        )
    );
}

#[test]
fn hermes_arguments_stream_as_they_arrive() {
    let mut p = CallParser::new(ToolFormat::Hermes);
    assert_eq!(p.push("Sure. <tool_"), vec![text("Sure. ")]);
    assert_eq!(p.push("call>\n{\"name\": \"get_wea"), vec![]);
    assert_eq!(
        p.push("ther\", \"arguments\": {\"ci"),
        vec![start(0, "get_weather"), args(0, "{\"ci")]
    );
    assert_eq!(
        p.push("ty\": \"Paris\"}"),
        vec![args(0, "ty\": \"Paris\"}")]
    );
    assert_eq!(p.push("}"), vec![end(0)]);
    assert_eq!(p.push("\n</tool_call>"), vec![]);
    assert_eq!(p.finish(), vec![]);
}

#[test]
fn hermes_text_that_is_not_a_call_is_kept() {
    for plain in [
        "a < b, and <tool> or <tool_cal",
        "<tool_call>not json</tool_call>",
        "<tool_call>\n{\"foo\": 1}\n</tool_call>",
        "<tool_call>{\"name\": 3}</tool_call>",
        "Cut: <tool_call>\n{\"na",
        "x<<tool_cal<tool_ca",
        "",
        "   ",
        "{\"name\": \"f\", \"arguments\": {}}",
    ] {
        assert_eq!(
            parse(ToolFormat::Hermes, plain),
            (plain.to_string(), vec![]),
            "{plain}"
        );
        assert_eq!(collect(&char_by_char(ToolFormat::Hermes, plain)).0, plain);
    }
    // A partial marker is held only until it cannot be one.
    let mut p = CallParser::new(ToolFormat::Hermes);
    assert_eq!(p.push("Hi <tool_"), vec![text("Hi ")]);
    assert_eq!(p.push("x"), vec![text("<tool_x")]);
    // A broken block, then a good one.
    assert_eq!(
        parse(
            ToolFormat::Hermes,
            "<tool_call><tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"
        ),
        ("<tool_call>".to_string(), vec![call("f", "{}")])
    );
}

#[test]
fn an_answer_cut_inside_a_call_ends_it() {
    assert_eq!(
        run(
            ToolFormat::Hermes,
            &["<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Pa"]
        ),
        vec![start(0, "f"), args(0, "{\"city\": \"Pa"), end(0)]
    );
    assert_eq!(
        run(ToolFormat::Mistral, &["[TOOL_CALLS][{\"name\": \"f\""]),
        vec![start(0, "f"), end(0)]
    );
    assert_eq!(
        run(ToolFormat::Pythonic, &["[get_weather(city=\"Pa"]),
        vec![start(0, "get_weather"), end(0)]
    );
    assert_eq!(
        run(
            ToolFormat::Llama3,
            &["{\"name\": \"f\", \"parameters\": {}"]
        ),
        vec![start(0, "f"), args(0, "{}"), end(0)]
    );
    // Broken JSON after the name ends the call; the rest is text.
    assert_eq!(
        parse(
            ToolFormat::Hermes,
            "<tool_call>{\"name\": \"f\" \"arguments\": {}}"
        ),
        ("\"arguments\": {}}".to_string(), vec![call("f", "")])
    );
    // Whitespace after the last call, or a partial closing tag, is dropped.
    assert_eq!(
        parse(
            ToolFormat::Hermes,
            "<tool_call>{\"name\": \"f\", \"arguments\": {}}\n</tool_"
        ),
        (String::new(), vec![call("f", "{}")])
    );
}

#[test]
fn llama3_calls() {
    let out = r#"{"name": "get_weather", "parameters": {"city": "Paris"}}"#;
    let expected = vec![
        start(0, "get_weather"),
        args(0, r#"{"city": "Paris"}"#),
        end(0),
    ];
    assert_eq!(run(ToolFormat::Llama3, &[out]), expected);
    assert_eq!(char_by_char(ToolFormat::Llama3, out), expected);
    let tagged = format!("<|python_tag|>{out}");
    assert_eq!(run(ToolFormat::Llama3, &[&tagged]), expected);
    assert_eq!(
        parse(
            ToolFormat::Llama3,
            "\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}\n"
        ),
        (String::new(), vec![call("a", r#"{"x": 1}"#), call("b", "{}")])
    );
    // Parameters first.
    assert_eq!(
        parse(
            ToolFormat::Llama3,
            r#"{"parameters": {"q": "x"}, "name": "search"}"#
        ),
        (String::new(), vec![call("search", r#"{"q": "x"}"#)])
    );
}

#[test]
fn llama3_text_is_text() {
    for plain in [
        "The weather in Paris is sunny.",
        "  Sure {\"name\": \"f\", \"parameters\": {}}",
        "{\"answer\": 42}",
        "{\"name\": \"Bob\", \"age\": 3}",
        "{not json at all}",
        "<|python_tag|>brave_search.call(query=\"x\")",
        "<b>bold</b>",
        "{",
    ] {
        assert_eq!(
            parse(ToolFormat::Llama3, plain),
            (plain.to_string(), vec![]),
            "{plain}"
        );
    }
    // After a call, text that is not one is text.
    assert_eq!(
        parse(
            ToolFormat::Llama3,
            "{\"name\": \"f\", \"parameters\": {}}\nDone: {\"name\": \"g\"}"
        ),
        (
            "\nDone: {\"name\": \"g\"}".to_string(),
            vec![call("f", "{}")]
        )
    );
}

#[test]
fn mistral_calls() {
    let out = r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123DEF"}]"#;
    let expected = vec![
        start(0, "get_weather"),
        args(0, r#"{"city": "Paris"}"#),
        end(0),
    ];
    assert_eq!(run(ToolFormat::Mistral, &[out]), expected);
    assert_eq!(char_by_char(ToolFormat::Mistral, out), expected);
    assert_eq!(
        parse(
            ToolFormat::Mistral,
            "Let me look.[TOOL_CALLS] [ {\"name\": \"a\", \"arguments\": {}} ,\n {\"id\": \"x\", \"arguments\": {\"k\": [1]}, \"name\": \"b\"} ]"
        ),
        ("Let me look.".to_string(), vec![call("a", "{}"), call("b", r#"{"k": [1]}"#)])
    );
    for plain in [
        "[1, 2, 3] is a list",
        "[TOOL_CALLS] nothing",
        "[TOOL_CALLS][]",
        "[TOOL_CALLS][{\"arguments\": {}}]",
        "[TOOL",
    ] {
        assert_eq!(
            parse(ToolFormat::Mistral, plain),
            (plain.to_string(), vec![]),
            "{plain}"
        );
    }
}

#[test]
fn pythonic_calls() {
    let out = r#"[get_weather(city="Paris", days=3)]"#;
    let expected = vec![
        start(0, "get_weather"),
        args(0, r#"{"city": "Paris", "days": 3}"#),
        end(0),
    ];
    assert_eq!(run(ToolFormat::Pythonic, &[out]), expected);
    assert_eq!(char_by_char(ToolFormat::Pythonic, out), expected);
    assert_eq!(
        parse(ToolFormat::Pythonic, "  [get_time(), search(q='it\\'s (ok)', opts={'n': 2, 'x': None}, tags=[\"a\", True])]\n"),
        (
            String::new(),
            vec![
                call("get_time", "{}"),
                call("search", r#"{"q": "it's (ok)", "opts": {"n": 2, "x": null}, "tags": ["a", true]}"#)
            ]
        )
    );
    // Gemma's fences, with a list or bare calls, after text.
    assert_eq!(
        parse(
            ToolFormat::Pythonic,
            "```tool_code\n[get_weather(city=\"Paris\")]\n```"
        ),
        (
            String::new(),
            vec![call("get_weather", r#"{"city": "Paris"}"#)]
        )
    );
    assert_eq!(
        parse(ToolFormat::Pythonic, "I'll check.\n```tool_code\nget_weather(city=\"Paris\")\nget_time(tz=\"CET\")\n```\nOne moment."),
        (
            "I'll check.\n\nOne moment.".to_string(),
            vec![call("get_weather", r#"{"city": "Paris"}"#), call("get_time", r#"{"tz": "CET"}"#)]
        )
    );
    for plain in [
        "[1] See the notes.",
        "[link](https://example.com)",
        "[f(1, 2)]",
        "[f(a=g(1))]",
        "Call [f(a=1)] later",
        "```python\nprint(1)\n```",
        "```tool_code\nprint(x)\n```",
        "[see(this)",
        "[]",
    ] {
        assert_eq!(
            parse(ToolFormat::Pythonic, plain),
            (plain.to_string(), vec![]),
            "{plain}"
        );
    }
}

#[test]
fn generic_calls() {
    let out = r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}"#;
    let expected = vec![
        start(0, "get_weather"),
        args(0, r#"{"city": "Paris"}"#),
        end(0),
    ];
    assert_eq!(run(ToolFormat::Generic, &[out]), expected);
    assert_eq!(char_by_char(ToolFormat::Generic, out), expected);
    assert_eq!(
        parse(
            ToolFormat::Generic,
            "{ \"tool_calls\" : [ {\"name\": \"a\", \"arguments\": {}},{\"name\": \"b\", \"arguments\": {\"x\": null}} ] }"
        ),
        (String::new(), vec![call("a", "{}"), call("b", r#"{"x": null}"#)])
    );
    for plain in [
        "Paris is sunny.",
        "{\"answer\": \"Paris\"}",
        "{\"tool_calls\": []}",
        "{\"tool_calls\": 3}",
        "{\"tool_",
        "Here: {\"tool_calls\": [{\"name\": \"a\", \"arguments\": {}}]}",
    ] {
        assert_eq!(
            parse(ToolFormat::Generic, plain),
            (plain.to_string(), vec![]),
            "{plain}"
        );
    }
}

// ---- properties ----

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        (-1e6f64..1e6).prop_map(|f| json!(f)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "[a-z \"'\\\\(){}\\[\\],:=<>/\n\té😀\u{1}]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("[a-z\"(){} ]{0,4}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

fn calls_strategy() -> impl Strategy<Value = Vec<(String, Value)>> {
    let args = prop::collection::vec(("[a-z_][a-z0-9_]{0,5}", json_value()), 0..4)
        .prop_map(|kv| Value::Object(kv.into_iter().collect()));
    prop::collection::vec(("[a-z_][a-z0-9_.]{0,8}", args), 1..4)
}

fn same_calls(format: ToolFormat, text: &str, got: &[(String, String)], want: &[(String, Value)]) {
    assert_eq!(got.len(), want.len(), "{format:?}: {text}\n{got:?}");
    for ((gn, ga), (wn, wa)) in got.iter().zip(want) {
        assert_eq!(gn, wn, "{format:?}: {text}");
        let ga: Value = serde_json::from_str(ga)
            .unwrap_or_else(|e| panic!("{format:?}: arguments {ga:?} of {text}: {e}"));
        assert_eq!(&ga, wa, "{format:?}: {text}");
    }
}

/// Calls as a family writes them, in the ways models and grammars vary:
/// whitespace, pretty-printing, key order, optional markers.
fn variants(format: ToolFormat, calls: &[(String, Value)]) -> Vec<String> {
    let obj = |n: &str, a: &Value, key: &str, args_first: bool, pretty: bool| {
        let a = if pretty {
            serde_json::to_string_pretty(a).unwrap_or_default()
        } else {
            a.to_string()
        };
        let n = Value::from(n).to_string();
        if args_first {
            format!("{{\"{key}\": {a}, \"name\": {n}}}")
        } else {
            format!("{{ \"name\" : {n},\n  \"{key}\":{a} }}")
        }
    };
    let mut out = vec![format.write_calls(calls)];
    let join = |f: &dyn Fn(&String, &Value) -> String, sep: &str| -> String {
        calls
            .iter()
            .map(|(n, a)| f(n, a))
            .collect::<Vec<_>>()
            .join(sep)
    };
    match format {
        ToolFormat::Hermes => {
            out.push(join(
                &|n, a| {
                    format!(
                        "<tool_call>{}</tool_call>",
                        obj(n, a, "arguments", true, true)
                    )
                },
                "\n\n",
            ));
            out.push(join(
                &|n, a| {
                    format!(
                        "<tool_call>\n{}\n</tool_call>",
                        obj(n, a, "arguments", false, false)
                    )
                },
                "",
            ));
            // Arguments as a string holding JSON.
            out.push(join(
                &|n, a| {
                    let s = Value::from(a.to_string()).to_string();
                    format!(
                        "<tool_call>\n{{\"name\": {}, \"arguments\": {s}}}\n</tool_call>",
                        Value::from(n.as_str())
                    )
                },
                "\n",
            ));
        }
        ToolFormat::Llama3 => {
            out.push(format!(
                "<|python_tag|>{}",
                join(&|n, a| obj(n, a, "parameters", false, true), ";")
            ));
            out.push(format!(
                " \n{}\n",
                join(&|n, a| obj(n, a, "parameters", true, false), " ;\n")
            ));
        }
        ToolFormat::Mistral => {
            out.push(format!(
                "[TOOL_CALLS] [\n{}\n]",
                join(&|n, a| obj(n, a, "arguments", false, true), " ,\n")
            ));
            out.push(format!(
                "Calling.[TOOL_CALLS][{}]",
                join(&|n, a| obj(n, a, "arguments", true, false), ",")
            ));
        }
        ToolFormat::Generic => {
            out.push(format!(
                "\n{{\n  \"tool_calls\": [\n{}\n  ]\n}}\n",
                join(&|n, a| obj(n, a, "arguments", false, true), ",\n")
            ));
            out.push(format!(
                "{{\"tool_calls\":[{}]}}",
                join(&|n, a| obj(n, a, "arguments", true, false), ",")
            ));
        }
        ToolFormat::Pythonic => {
            let py = |n: &String, a: &Value, sep: &str| {
                let args = a
                    .as_object()
                    .map(|o| {
                        o.iter()
                            .map(|(k, v)| {
                                format!(
                                    "{k}={}",
                                    serde_json::to_string_pretty(v).unwrap_or_default()
                                )
                            })
                            .collect::<Vec<_>>()
                            .join(sep)
                    })
                    .unwrap_or_default();
                format!("{n}({args})")
            };
            out.push(format!(
                "[\n  {}\n]",
                join(&|n, a| py(n, a, ",\n  "), ",\n  ")
            ));
            out.push(format!(
                "```tool_code\n[{}]\n```",
                join(&|n, a| py(n, a, ", "), ", ")
            ));
            out.push(format!(
                "Checking.\n```tool_code\n{}\n```",
                join(&|n, a| py(n, a, ","), "\n")
            ));
        }
    }
    out
}

fn atoms() -> impl Strategy<Value = String> {
    let atom = prop_oneof![
        Just("<tool_call>"),
        Just("</tool_call>"),
        Just("<tool_"),
        Just("[TOOL_CALLS]"),
        Just("[TOOL"),
        Just("<|python_tag|>"),
        Just("```tool_code"),
        Just("```"),
        Just("{"),
        Just("}"),
        Just("["),
        Just("]"),
        Just("("),
        Just(")"),
        Just("\"name\": \"f\""),
        Just("\"arguments\": "),
        Just("\"parameters\":"),
        Just("\"tool_calls\":"),
        Just("{\"a\": [1, \"x\"]}"),
        Just(":"),
        Just(","),
        Just(";"),
        Just("="),
        Just("\""),
        Just("'"),
        Just("\\"),
        Just(" "),
        Just("\n"),
        Just("get_weather("),
        Just("city="),
        Just("12"),
        Just("true"),
        Just("é"),
        Just("😀"),
        Just("x"),
        Just("<"),
        Just("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>"),
        Just("{\"arguments\": \"{\\\"a\\\": 1}\", \"name\": \"g\"}"),
        Just("[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]"),
        Just("{\"name\": \"f\", \"parameters\": {\"a\": \"x\"}}"),
        Just("{\"tool_calls\": [{\"name\": \"f\", \"arguments\": {}}]}"),
        Just("[f(a=1), g()]"),
        Just("f(a='x)')"),
    ];
    prop::collection::vec(atom, 0..16).prop_map(|v| v.concat())
}

fn cut<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let bounds: Vec<usize> = (0..=text.len())
        .filter(|i| text.is_char_boundary(*i))
        .collect();
    let mut at: Vec<usize> = cuts.iter().map(|c| bounds[c % bounds.len()]).collect();
    at.push(0);
    at.push(text.len());
    at.sort_unstable();
    at.dedup();
    at.windows(2).map(|w| &text[w[0]..w[1]]).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_split_gives_the_same_events(
        text in atoms(),
        cuts in prop::collection::vec(0usize..10_000, 0..10),
    ) {
        for format in ALL {
            let whole = run(format, &[&text]);
            prop_assert_eq!(&run(format, &cut(&text, &cuts)), &whole, "{:?} {:?}", format, text);
            prop_assert_eq!(&char_by_char(format, &text), &whole, "{:?} {:?}", format, text);
            let (got, calls) = collect(&whole);
            // Without calls nothing is lost.
            if calls.is_empty() {
                prop_assert_eq!(&got, &text, "{:?}", format);
            }
        }
    }

    #[test]
    fn written_calls_parse_back(
        calls in calls_strategy(),
        cuts in prop::collection::vec(0usize..10_000, 0..10),
    ) {
        for format in ALL {
            for text in variants(format, &calls) {
                let whole = run(format, &[&text]);
                let (_, got) = collect(&whole);
                same_calls(format, &text, &got, &calls);
                prop_assert_eq!(&run(format, &cut(&text, &cuts)), &whole, "{:?} {:?}", format, text);
            }
        }
    }

    #[test]
    fn text_around_calls_survives(
        before in "[a-zA-Z .!?\n]{0,20}",
        calls in calls_strategy(),
    ) {
        // Families whose calls may follow text.
        for format in [ToolFormat::Hermes, ToolFormat::Mistral] {
            let text = format!("{before}{}", format.write_calls(&calls));
            let (t, got) = parse(format, &text);
            same_calls(format, &text, &got, &calls);
            // Whitespace alone before the first call is dropped.
            let kept = if before.trim().is_empty() { "" } else { before.as_str() };
            prop_assert_eq!(t, kept);
        }
    }
}
