//! Grammars of tool calls: with `tool_choice` `required` or a named function
//! the grammar applies from the first token, so the answer is one call (or
//! several, when parallel calls are on) whose arguments match the function's
//! schema; with `auto` it is lazy, switched on by the family's call marker, so
//! free text stays free and every call that starts is schema-valid.
//!
//! Arguments go through llama.cpp's JSON-schema converter (one schema per
//! function, or per parameter for the Python-style format), under the
//! request's JSON bounds, so a small model's strings and lists end.

use serde_json::{json, Map, Value};

use super::{Tool, ToolChoice, ToolFormat, ToolSpec};
use crate::sampling::ComposedGrammar;

/// Most calls in one answer when parallel calls are on, as JSON bounds cap an
/// open array: a sampled model cannot list calls until `max_tokens`.
pub const MAX_PARALLEL_CALLS: usize = 8;

/// Optional blanks between JSON tokens the grammar writes itself.
const WS: &str = "ws ::= [ \\t\\n]{0,4}";

/// The grammar of calls under `spec`, or none when the model may not call.
pub fn call_grammar(format: ToolFormat, spec: &ToolSpec) -> Option<ComposedGrammar> {
    if !spec.may_call() {
        return None;
    }
    let tools = spec.callable();
    let lazy = spec.choice == ToolChoice::Auto;
    let (gbnf, schemas) = match format {
        ToolFormat::Pythonic => pythonic(&tools, spec.parallel),
        _ => json_calls(format, &tools, spec.parallel),
    };
    let triggers = if lazy {
        vec![trigger(format, &tools)]
    } else {
        Vec::new()
    };
    Some(ComposedGrammar {
        gbnf,
        schemas,
        triggers,
    })
}

/// The regular expression that switches a lazy grammar on.
fn trigger(format: ToolFormat, tools: &[&Tool]) -> String {
    match format {
        ToolFormat::Hermes => regex_escape("<tool_call>"),
        ToolFormat::Mistral => regex_escape("[TOOL_CALLS]"),
        ToolFormat::Llama3 => r#"^\s*(<\|python_tag\|>|\{\s*"name")[\s\S]*$"#.into(),
        ToolFormat::Generic => r#"^\s*(\{\s*"tool_calls")[\s\S]*$"#.into(),
        ToolFormat::Pythonic => {
            let names: Vec<String> = tools
                .iter()
                .map(|t| regex_escape(&t.function.name))
                .collect();
            format!(r"^\s*(\[\s*({})\()[\s\S]*$", names.join("|"))
        }
    }
}

fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        if "\\^$.|?*+()[]{}".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A GBNF string literal.
fn lit(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A schema's `$defs` and `definitions` moved up to the root of the schema
/// that embeds it, so its local references still resolve.
fn hoist_defs(params: &Value, into: &mut Map<String, Value>) -> Value {
    let mut params = params.clone();
    if let Some(o) = params.as_object_mut() {
        for key in ["$defs", "definitions"] {
            if let Some(defs) = o.remove(key) {
                into.insert(key.into(), defs);
            }
        }
    }
    params
}

/// One function's call as a JSON object: its name, then its arguments (under
/// `parameters` for Llama 3, `arguments` otherwise).
fn call_schema(format: ToolFormat, tool: &Tool) -> Value {
    let key = if format == ToolFormat::Llama3 {
        "parameters"
    } else {
        "arguments"
    };
    let mut root = Map::new();
    let params = hoist_defs(&tool.parameters(), &mut root);
    root.insert("type".into(), "object".into());
    let mut props = Map::new();
    props.insert("name".into(), json!({ "const": tool.function.name }));
    props.insert(key.into(), params);
    root.insert("properties".into(), Value::Object(props));
    root.insert("required".into(), json!(["name", key]));
    root.insert("additionalProperties".into(), false.into());
    Value::Object(root)
}

/// Formats whose calls are JSON objects.
fn json_calls(format: ToolFormat, tools: &[&Tool], parallel: bool) -> (String, Vec<Value>) {
    let schemas: Vec<Value> = tools.iter().map(|t| call_schema(format, t)).collect();
    let call = (0..schemas.len())
        .map(|k| format!("s{k}-root"))
        .collect::<Vec<_>>()
        .join(" | ");
    let (first, more) = match format {
        // Whitespace around the call as the parser takes it: a lazy grammar
        // replays the rest of the token that completed its trigger, which
        // may be `>\n\n` or `>{` as well as `>\n`.
        ToolFormat::Hermes => (
            r#"block ::= "<tool_call>" ws call ws "</tool_call>""#.to_string(),
            r#"root ::= block (ws block){0,MORE}"#,
        ),
        ToolFormat::Llama3 => (
            r#"block ::= "<|python_tag|>"? call"#.to_string(),
            r#"root ::= block"#,
        ),
        ToolFormat::Mistral => (
            r#"block ::= call"#.to_string(),
            r#"root ::= "[TOOL_CALLS]" "[" ws block ("," ws block){0,MORE} ws "]""#,
        ),
        _ => (
            r#"block ::= call"#.to_string(),
            r#"root ::= "{" ws "\"tool_calls\"" ws ":" ws "[" ws block ("," ws block){0,MORE} ws "]" ws "}""#,
        ),
    };
    let root = if parallel {
        more.replace("MORE", &(MAX_PARALLEL_CALLS - 1).to_string())
    } else {
        // One call: the repetition goes.
        more.replace(r#" (ws block){0,MORE}"#, "")
            .replace(r#" ("," ws block){0,MORE}"#, "")
    };
    let gbnf = format!("{root}\n{first}\ncall ::= {call}\n{WS}\n");
    (gbnf, schemas)
}

/// `[f(a=1, b="x"), g()]`: each parameter's value is JSON of its schema, the
/// required parameters first in the order the schema lists them, then the
/// optional ones, each optional.
fn pythonic(tools: &[&Tool], parallel: bool) -> (String, Vec<Value>) {
    let mut schemas = Vec::new();
    let mut rules = Vec::new();
    let mut calls = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let params = tool.parameters();
        let required: Vec<&str> = params["required"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let props: Vec<(String, Value)> = params["properties"]
            .as_object()
            .map(|o| o.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        let mut parts_req = Vec::new();
        let mut parts_opt = Vec::new();
        for (name, schema) in props {
            let mut root = Map::new();
            if let Some(o) = params.as_object() {
                for key in ["$defs", "definitions"] {
                    if let Some(d) = o.get(key) {
                        root.insert(key.into(), d.clone());
                    }
                }
            }
            let mut s = schema.as_object().cloned().unwrap_or_default();
            s.extend(root);
            let k = schemas.len();
            schemas.push(Value::Object(s));
            let arg = format!("{} s{k}-root", lit(&format!("{name}=")));
            if required.contains(&name.as_str()) {
                parts_req.push(arg);
            } else {
                parts_opt.push(arg);
            }
        }
        // Required ones in order, then each optional one or not.
        let mut body = parts_req.join(r#" "," ws "#);
        for opt in parts_opt {
            body = if body.is_empty() {
                format!("({opt})?")
            } else {
                format!(r#"{body} ("," ws {opt})?"#)
            };
        }
        let rule = format!("call{i}");
        rules.push(format!(
            "{rule} ::= {} {body} \")\"",
            lit(&format!("{}(", tool.function.name))
        ));
        calls.push(rule);
    }
    let root = if parallel {
        format!(
            r#"root ::= "[" ws call ("," ws call){{0,{}}} ws "]""#,
            MAX_PARALLEL_CALLS - 1
        )
    } else {
        r#"root ::= "[" ws call ws "]""#.to_string()
    };
    let gbnf = format!(
        "{root}\ncall ::= {}\n{}\n{WS}\n",
        calls.join(" | "),
        rules.join("\n")
    );
    (gbnf, schemas)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        vec![
            Tool::function(
                "get_weather",
                "Weather",
                json!({"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}),
            ),
            Tool::function(
                "search",
                "Search",
                json!({"type": "object", "properties": {"q": {"$ref": "#/$defs/q"}}, "$defs": {"q": {"type": "string"}}}),
            ),
        ]
    }

    #[test]
    fn no_grammar_when_calls_are_off() {
        let spec = ToolSpec {
            choice: ToolChoice::None,
            ..ToolSpec::auto(tools())
        };
        assert!(call_grammar(ToolFormat::Hermes, &spec).is_none());
        assert!(call_grammar(ToolFormat::Hermes, &ToolSpec::auto(Vec::new())).is_none());
    }

    #[test]
    fn auto_is_lazy_and_required_is_not() {
        let g = call_grammar(ToolFormat::Hermes, &ToolSpec::auto(tools())).expect("grammar");
        assert_eq!(g.triggers, vec!["<tool_call>".to_string()]);
        assert_eq!(g.schemas.len(), 2);
        assert!(g.gbnf.contains("call ::= s0-root | s1-root"));
        let spec = ToolSpec {
            choice: ToolChoice::Required,
            ..ToolSpec::auto(tools())
        };
        assert!(call_grammar(ToolFormat::Generic, &spec)
            .expect("grammar")
            .triggers
            .is_empty());
    }

    #[test]
    fn a_named_function_is_the_only_one_callable() {
        let spec = ToolSpec {
            choice: ToolChoice::Function("search".into()),
            parallel: false,
            ..ToolSpec::auto(tools())
        };
        let g = call_grammar(ToolFormat::Mistral, &spec).expect("grammar");
        assert_eq!(g.schemas.len(), 1);
        assert_eq!(g.schemas[0]["properties"]["name"]["const"], "search");
        // The function's $defs moved to the root, where its $ref points.
        assert_eq!(g.schemas[0]["$defs"]["q"]["type"], "string");
        assert!(
            g.gbnf
                .contains(r#"root ::= "[TOOL_CALLS]" "[" ws block ws "]""#),
            "{}",
            g.gbnf
        );
        crate::sampling::check_schema_supported(&g.schemas[0]).expect("supported");
    }

    #[test]
    fn pythonic_lists_required_parameters_first() {
        let g = call_grammar(ToolFormat::Pythonic, &ToolSpec::auto(tools())).expect("grammar");
        assert!(
            g.gbnf.contains(
                r#"call0 ::= "get_weather(" "city=" s0-root ("," ws "unit=" s1-root)? ")""#
            ),
            "{}",
            g.gbnf
        );
        assert!(g.triggers[0].contains("get_weather|search"));
        assert_eq!(g.schemas[2]["$defs"]["q"]["type"], "string");
    }
}
