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
}

/// GBNF for one JSON object, in the shape of llama.cpp's `grammars/json.gbnf`.
/// Whitespace is bounded so a small model cannot loop on blanks forever.
pub fn json_object_grammar() -> &'static str {
    r#"root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
"#
}
