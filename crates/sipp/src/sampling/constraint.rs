//! Output constraints: what the generated text must match.

use serde::{Deserialize, Serialize};

/// A constraint on generated text, enforced by a grammar sampler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum OutputConstraint {
    /// A GBNF grammar with a `root` rule.
    Grammar(String),
    /// Any JSON object (OpenAI's `{"type": "json_object"}`).
    JsonObject,
    /// A JSON document valid against this JSON schema.
    JsonSchema(serde_json::Value),
    /// A grammar built around JSON schemas (tool calls), optionally lazy.
    Composed(ComposedGrammar),
}

/// GBNF whose rules use converted JSON schemas: schema `k` is converted with
/// llama.cpp's converter (under the request's JSON bounds), every one of its
/// rules is renamed with the prefix `s{k}-` (see [`prefix_rules`]), and `gbnf`
/// refers to its root as `s{k}-root`. With `triggers`, the grammar is lazy:
/// text is free until one of these regular expressions matches what was
/// generated (llama.cpp's lazy grammar: `^...$` matches the whole text, any
/// other pattern is searched for), and the grammar applies from the first
/// capture group's start (or the match's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ComposedGrammar {
    /// The grammar, with a `root` rule.
    pub gbnf: String,
    /// The schemas it refers to.
    pub schemas: Vec<serde_json::Value>,
    /// Lazy-grammar trigger patterns; empty: the grammar applies from the
    /// first token.
    pub triggers: Vec<String>,
}

impl ComposedGrammar {
    /// The whole grammar, given each schema converted to GBNF (in order).
    pub fn assemble(&self, converted: &[String]) -> String {
        let mut out = self.gbnf.trim_end().to_string();
        out.push('\n');
        for (k, g) in converted.iter().enumerate() {
            out.push_str(&prefix_rules(g, &format!("s{k}-")));
            out.push('\n');
        }
        out
    }
}

/// Renames every rule of a GBNF grammar (definitions and references) by
/// putting `prefix` before its name, so that several converted grammars can
/// live in one. String literals, character classes and comments are left
/// as they are.
pub fn prefix_rules(gbnf: &str, prefix: &str) -> String {
    let mut out = String::with_capacity(gbnf.len() * 2);
    let mut chars = gbnf.chars().peekable();
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    while let Some(c) = chars.next() {
        match c {
            '"' | '[' => {
                let close = if c == '"' { '"' } else { ']' };
                out.push(c);
                while let Some(d) = chars.next() {
                    out.push(d);
                    if d == '\\' {
                        if let Some(e) = chars.next() {
                            out.push(e);
                        }
                    } else if d == close {
                        break;
                    }
                }
            }
            '#' => {
                out.push(c);
                for d in chars.by_ref() {
                    out.push(d);
                    if d == '\n' {
                        break;
                    }
                }
            }
            '<' => {
                // A token reference such as <[123]> or <think>: not a rule.
                out.push(c);
                for d in chars.by_ref() {
                    out.push(d);
                    if d == '>' {
                        break;
                    }
                }
            }
            c if is_name(c) && !c.is_ascii_digit() => {
                out.push_str(prefix);
                out.push(c);
                while let Some(&d) = chars.peek() {
                    if !is_name(d) {
                        break;
                    }
                    out.push(d);
                    chars.next();
                }
            }
            c if c.is_ascii_digit() => {
                // Repetition counts ({0,20}) stay numbers.
                out.push(c);
                while let Some(&d) = chars.peek() {
                    if !d.is_ascii_digit() {
                        break;
                    }
                    out.push(d);
                    chars.next();
                }
            }
            c => out.push(c),
        }
    }
    out
}

/// Keywords that only annotate a schema; they constrain nothing.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "$defs",
    "definitions",
    "readOnly",
    "writeOnly",
    "deprecated",
    "$anchor",
];

/// Keywords llama.cpp's schema converter enforces.
const SUPPORTED: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "pattern",
    "minLength",
    "maxLength",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
];

/// String formats the converter turns into grammar.
const FORMATS: &[&str] = &[
    "date",
    "time",
    "date-time",
    "uuid",
    "uuid1",
    "uuid2",
    "uuid3",
    "uuid4",
    "uuid5",
];

fn unsupported(path: &str, message: String) -> crate::sampling::SamplingError {
    crate::sampling::SamplingError::Schema(format!("at {path}: {message}"))
}

/// Rejects schema features the grammar converter would silently ignore, so a
/// request never gets output that looks constrained but is not. The error
/// names the keyword and where it is.
pub fn check_schema_supported(
    schema: &serde_json::Value,
) -> Result<(), crate::sampling::SamplingError> {
    check_node(schema, schema, "#")
}

/// Resolves a local `$ref` ("#/..."), as the converter does.
fn resolve_ref<'a>(root: &'a serde_json::Value, r: &str) -> Option<&'a serde_json::Value> {
    let pointer = r.strip_prefix('#')?;
    if pointer.is_empty() {
        return Some(root);
    }
    root.pointer(pointer)
}

fn check_node(
    root: &serde_json::Value,
    node: &serde_json::Value,
    path: &str,
) -> Result<(), crate::sampling::SamplingError> {
    let obj = match node {
        serde_json::Value::Bool(_) => return Ok(()),
        serde_json::Value::Object(o) => o,
        _ => {
            return Err(unsupported(
                path,
                "a schema must be an object or a boolean".into(),
            ))
        }
    };
    for key in obj.keys() {
        if !SUPPORTED.contains(&key.as_str()) && !ANNOTATIONS.contains(&key.as_str()) {
            return Err(unsupported(
                path,
                format!("the keyword `{key}` is not supported"),
            ));
        }
    }
    let types: Vec<&str> = match obj.get("type") {
        Some(serde_json::Value::String(t)) => vec![t.as_str()],
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|v| v.as_str()).collect(),
        _ => Vec::new(),
    };
    let has_bounds = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]
        .iter()
        .find(|k| obj.contains_key(**k));
    if let Some(k) = has_bounds {
        if !types.contains(&"integer") || types.len() > 1 {
            return Err(unsupported(
                path,
                format!("`{k}` is only supported on \"type\": \"integer\""),
            ));
        }
    }
    if let Some(f) = obj.get("format") {
        let f = f.as_str().unwrap_or_default();
        if !FORMATS.contains(&f) {
            return Err(unsupported(
                path,
                format!(
                    "the string format `{f}` is not supported (supported: {})",
                    FORMATS.join(", ")
                ),
            ));
        }
    }
    for key in ["properties", "$defs", "definitions"] {
        if let Some(serde_json::Value::Object(props)) = obj.get(key) {
            for (name, sub) in props {
                check_node(root, sub, &format!("{path}/{key}/{name}"))?;
            }
        }
    }
    if let Some(r) = obj.get("$ref") {
        let r = r.as_str().unwrap_or_default();
        if resolve_ref(root, r).is_none() {
            return Err(unsupported(
                path,
                format!("`$ref` {r:?} does not resolve to a local definition"),
            ));
        }
    }
    if obj.get("items").is_some_and(serde_json::Value::is_boolean) {
        return Err(unsupported(
            path,
            "`items` must be a schema object, not a boolean".into(),
        ));
    }
    for key in ["items", "additionalProperties"] {
        if let Some(sub) = obj.get(key) {
            if sub.is_object() {
                check_node(root, sub, &format!("{path}/{key}"))?;
            }
        }
    }
    for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
        if let Some(serde_json::Value::Array(subs)) = obj.get(key) {
            for (i, sub) in subs.iter().enumerate() {
                check_node(root, sub, &format!("{path}/{key}/{i}"))?;
            }
        }
    }
    Ok(())
}

impl OutputConstraint {
    /// Checks what can be checked without a model: the schema's features.
    pub fn validate(&self) -> Result<(), crate::sampling::SamplingError> {
        match self {
            OutputConstraint::Grammar(g) if g.trim().is_empty() => Err(
                crate::sampling::SamplingError::Grammar("the grammar is empty".into()),
            ),
            OutputConstraint::JsonSchema(s) => check_schema_supported(s),
            OutputConstraint::Composed(c) => c.schemas.iter().try_for_each(check_schema_supported),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule_prefixes_leave_literals_classes_and_counts_alone() {
        let g = "root ::= \"a b\" item{0,20} # note root\nitem ::= [a-z\\]] | \"\\\"x\" space\nspace ::= | \" \"";
        let p = prefix_rules(g, "s0-");
        assert_eq!(
            p,
            "s0-root ::= \"a b\" s0-item{0,20} # note root\ns0-item ::= [a-z\\]] | \"\\\"x\" s0-space\ns0-space ::= | \" \""
        );
    }
    use serde_json::json;

    #[test]
    fn supported_schemas_pass() {
        let s = json!({
            "type": "object",
            "title": "Person",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "born": {"type": "string", "format": "date"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
            },
            "required": ["name"],
            "additionalProperties": false
        });
        OutputConstraint::JsonSchema(s)
            .validate()
            .expect("supported");
    }

    #[test]
    fn ignored_features_are_rejected_with_their_place() {
        let cases = [
            (
                json!({"type": "number", "multipleOf": 3}),
                "`multipleOf`",
                "#",
            ),
            (
                json!({"type": "object", "properties": {"x": {"type": "number", "minimum": 1.5}}}),
                "`minimum`",
                "#/properties/x",
            ),
            (json!({"type": "string", "format": "email"}), "`email`", "#"),
            (
                json!({"type": "array", "items": {"type": "string"}, "uniqueItems": true}),
                "`uniqueItems`",
                "#",
            ),
            (
                json!({"anyOf": [{"not": {"type": "null"}}]}),
                "`not`",
                "#/anyOf/0",
            ),
            (json!(3), "object or a boolean", "#"),
            (
                json!({"properties": {"a": {"$ref": "#/$defs/missing"}}}),
                "`$ref`",
                "#/properties/a",
            ),
            (json!({"type": "array", "items": false}), "`items`", "#"),
        ];
        for (schema, what, path) in cases {
            let msg = OutputConstraint::JsonSchema(schema)
                .validate()
                .expect_err("rejected")
                .to_string();
            assert!(
                msg.contains("json_schema") && msg.contains(what) && msg.contains(path),
                "{msg}"
            );
        }
        let msg = OutputConstraint::Grammar("  ".into())
            .validate()
            .expect_err("empty")
            .to_string();
        assert!(msg.contains("`grammar`"), "{msg}");
    }
}
