//! Bounds that keep constrained JSON finite.
//!
//! A grammar only says what may come next; it cannot make a small model close a
//! string. Under JSON mode or a schema without `maxLength` / `maxItems`, a small
//! model at a moderate temperature often writes a string or a list of keys that
//! grows until `max_tokens` cuts it, leaving invalid JSON. These bounds put a
//! ceiling on what the schema left open, so every constrained output has a
//! finite longest form. Each bound narrows what a schema allows only where the
//! schema itself set nothing; 0 turns a bound off, and `JsonBounds::unbounded()`
//! (`"json_bounds": false` on a request) turns them all off.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Limits applied to JSON mode and to JSON schemas where the schema is silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JsonBounds {
    /// Longest string (value or key), in characters, where the schema sets no
    /// `maxLength`, `pattern`, `format`, `enum` or `const`. 0: unbounded.
    /// Default 64.
    pub max_string_chars: u32,
    /// Most items in an array where the schema sets no `maxItems`. 0: unbounded.
    /// Default 8.
    pub max_array_items: u32,
    /// JSON mode: most members in one object. 0: unbounded. Default 16.
    pub max_object_members: u32,
    /// JSON mode: deepest nesting of objects and arrays (the top object is
    /// depth 1). 0: unbounded. Default 4.
    pub max_depth: u32,
    /// Whitespace between JSON tokens is at most one space: no newlines or
    /// indentation (the JSON means the same). Default false: llama.cpp's
    /// bounded blanks, a newline and up to 20 spaces or tabs.
    pub compact_whitespace: bool,
}

impl Default for JsonBounds {
    fn default() -> Self {
        Self {
            max_string_chars: 64,
            max_array_items: 8,
            max_object_members: 16,
            max_depth: 4,
            compact_whitespace: false,
        }
    }
}

/// llama.cpp's grammar parser expands `x{0,N}` into N nested rules; past this
/// a grammar gets slow to build for no practical gain.
pub const MAX_BOUND: u32 = 4096;

impl JsonBounds {
    /// No bounds at all: JSON mode and schemas exactly as written.
    pub const fn unbounded() -> Self {
        Self {
            max_string_chars: 0,
            max_array_items: 0,
            max_object_members: 0,
            max_depth: 0,
            compact_whitespace: false,
        }
    }

    /// The whitespace rule's body: one optional space when compact, else
    /// llama.cpp's bounded blanks (a newline and up to 20 spaces or tabs).
    fn ws_rule(&self) -> &'static str {
        if self.compact_whitespace {
            r#"| " ""#
        } else {
            r#"| " " | "\n" [ \t]{0,20}"#
        }
    }

    /// llama.cpp's converted schema grammar with this whitespace rule in place
    /// of the converter's own `space` rule.
    pub fn bound_converted_grammar(&self, gbnf: &str) -> String {
        if !self.compact_whitespace {
            return gbnf.to_string();
        }
        gbnf.lines()
            .map(|line| {
                if line.starts_with("space ::=") {
                    format!("space ::= {}", self.ws_rule())
                } else {
                    line.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), crate::sampling::SamplingError> {
        for (name, v) in [
            ("max_string_chars", self.max_string_chars),
            ("max_array_items", self.max_array_items),
            ("max_object_members", self.max_object_members),
            ("max_depth", self.max_depth),
        ] {
            if v > MAX_BOUND {
                return Err(crate::sampling::SamplingError::Invalid {
                    field: "json_bounds",
                    message: format!(
                        "`{name}` must be at most {MAX_BOUND} (0 turns it off), got {v}"
                    ),
                });
            }
        }
        Ok(())
    }

    /// The GBNF for one JSON object (OpenAI's `json_object` mode), in the shape
    /// of llama.cpp's `grammars/json.gbnf`, within these bounds. Whitespace is
    /// always bounded, as llama.cpp's schema converter bounds it.
    pub fn json_object_grammar(&self) -> String {
        let chars = repeat("char", 0, self.max_string_chars);
        let depth = self.max_depth;
        let mut g = String::new();
        g.push_str("root ::= object1\n");
        // One object/array/value rule per depth when depth is bounded; one
        // recursive set otherwise.
        let levels = if depth == 0 { 1 } else { depth };
        for d in 1..=levels {
            let next = if depth == 0 { d } else { d + 1 };
            let containers = if depth == 0 || d < depth {
                format!("object{next} | array{next} | ")
            } else {
                String::new()
            };
            let members = list(&format!("member{d}"), self.max_object_members);
            let items = list(&format!("value{d}"), self.max_array_items);
            g.push_str(&format!(
                "object{d} ::= \"{{\" ws {members} \"}}\" ws\n\
                 member{d} ::= string \":\" ws value{d}\n\
                 array{d} ::= \"[\" ws {items} \"]\" ws\n\
                 value{d} ::= {containers}string | number | (\"true\" | \"false\" | \"null\") ws\n"
            ));
        }
        g.push_str(&format!(
            "string ::= \"\\\"\" {chars} \"\\\"\" ws\n\
             char ::= [^\"\\\\\\x7F\\x00-\\x1F] | \"\\\\\" ([\"\\\\bfnrt] | \"u\" [0-9a-fA-F]{{4}})\n\
             number ::= (\"-\"? ([0-9] | [1-9] [0-9]{{0,15}})) (\".\" [0-9]{{1,16}})? ([eE] [-+]? [0-9] [0-9]{{0,15}})? ws\n\
             ws ::= {}\n",
            self.ws_rule()
        ));
        g
    }

    /// The longest output JSON mode can produce under these bounds, in bytes
    /// (`None` when any bound is off). Every token is at least one byte, so a
    /// JSON-mode request with `max_tokens` at least this always ends by itself
    /// with a complete object.
    pub fn json_object_max_bytes(&self) -> Option<u64> {
        let (s, m, n, d) = (
            u64::from(self.max_string_chars),
            u64::from(self.max_object_members),
            u64::from(self.max_array_items),
            self.max_depth,
        );
        if s == 0 || m == 0 || n == 0 || d == 0 {
            return None;
        }
        // The longest form of each rule of `json_object_grammar`: blanks are
        // one space, or "\n" and 20 tabs; a character is at most a 6-byte
        // `\uXXXX` escape.
        let ws = if self.compact_whitespace { 1 } else { 21 };
        let string = 2 + 6 * s + ws;
        let number = 17 + 17 + 18 + ws;
        let scalar = string.max(number).max(5 + ws);
        let container =
            |count: u64, item: u64| 1 + ws + count * item + (count - 1) * (1 + ws) + 1 + ws;
        // From the deepest level up: value(d) may hold object(d+1) / array(d+1).
        let mut value = scalar;
        let mut object = 0;
        for _ in 0..d {
            object = container(m, string + 1 + ws + value);
            let array = container(n, value);
            value = scalar.max(object).max(array);
        }
        Some(object)
    }

    /// The schema with these bounds written into every node that leaves them
    /// open, ready for llama.cpp's converter. Bounds the schema sets itself are
    /// kept, and never tightened below a minimum the schema asks for.
    pub fn apply_to_schema(&self, schema: &Value) -> Value {
        let mut out = schema.clone();
        self.bound_node(&mut out);
        out
    }

    fn bound_node(&self, node: &mut Value) {
        let Value::Object(obj) = node else {
            return;
        };
        let (is_string, is_array) = {
            let types = type_names(obj);
            (types.contains(&"string"), types.contains(&"array"))
        };
        if self.max_string_chars > 0
            && is_string
            && !["maxLength", "pattern", "format", "enum", "const"]
                .iter()
                .any(|k| obj.contains_key(*k))
        {
            let min = obj.get("minLength").and_then(Value::as_u64).unwrap_or(0);
            let max = u64::from(self.max_string_chars).max(min);
            obj.insert("maxLength".into(), max.into());
        }
        if self.max_array_items > 0
            && is_array
            && !obj.contains_key("maxItems")
            && !obj.contains_key("enum")
            && !obj.contains_key("const")
        {
            let min = obj.get("minItems").and_then(Value::as_u64).unwrap_or(0);
            let fixed = obj
                .get("prefixItems")
                .and_then(Value::as_array)
                .map_or(0, Vec::len) as u64;
            let max = u64::from(self.max_array_items).max(min).max(fixed);
            obj.insert("maxItems".into(), max.into());
        }
        for key in ["properties", "$defs", "definitions"] {
            if let Some(Value::Object(children)) = obj.get_mut(key) {
                children.values_mut().for_each(|c| self.bound_node(c));
            }
        }
        for key in ["items", "additionalProperties"] {
            if let Some(child) = obj.get_mut(key) {
                self.bound_node(child);
            }
        }
        for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
            if let Some(Value::Array(children)) = obj.get_mut(key) {
                children.iter_mut().for_each(|c| self.bound_node(c));
            }
        }
    }
}

fn type_names(obj: &Map<String, Value>) -> Vec<&str> {
    match obj.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

/// `rule` repeated `min..=max` times (`max` 0: unbounded), as GBNF.
fn repeat(rule: &str, min: u32, max: u32) -> String {
    match (min, max) {
        (0, 0) => format!("{rule}*"),
        (m, 0) => format!("{rule}{{{m},}}"),
        (m, n) => format!("{rule}{{{m},{n}}}"),
    }
}

/// An optional comma-separated list of at most `max` `rule`s (0: unbounded).
fn list(rule: &str, max: u32) -> String {
    let more = if max == 0 {
        format!("(\",\" ws {rule})*")
    } else {
        format!("(\",\" ws {rule}){{0,{}}}", max - 1)
    };
    format!("( {rule} {more} )?")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schema_bounds_fill_only_what_the_schema_left_open() {
        let b = JsonBounds {
            max_string_chars: 50,
            max_array_items: 4,
            ..JsonBounds::default()
        };
        let s = json!({
            "type": "object",
            "properties": {
                "free": {"type": "string"},
                "short": {"type": "string", "maxLength": 8},
                "long_min": {"type": "string", "minLength": 80},
                "code": {"type": "string", "pattern": "^[A-Z]+$"},
                "day": {"type": "string", "format": "date"},
                "maybe": {"type": ["string", "null"]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "few": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                "many": {"type": "array", "minItems": 9},
                "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "string"}, {}, {}, {}, {}]},
                "nested": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/x"}]}
            },
            "additionalProperties": {"type": "string"},
            "$defs": {"x": {"type": "object", "properties": {"y": {"type": "string"}}}}
        });
        let out = b.apply_to_schema(&s);
        let p = &out["properties"];
        assert_eq!(p["free"]["maxLength"], 50);
        assert_eq!(p["short"]["maxLength"], 8);
        assert_eq!(p["long_min"]["maxLength"], 80);
        assert!(p["code"].get("maxLength").is_none());
        assert!(p["day"].get("maxLength").is_none());
        assert_eq!(p["maybe"]["maxLength"], 50);
        assert_eq!(p["tags"]["maxItems"], 4);
        assert_eq!(p["tags"]["items"]["maxLength"], 50);
        assert_eq!(p["few"]["maxItems"], 2);
        assert_eq!(p["many"]["maxItems"], 9);
        assert_eq!(p["pair"]["maxItems"], 6);
        assert_eq!(p["pair"]["prefixItems"][0]["maxLength"], 50);
        assert_eq!(p["nested"]["anyOf"][0]["maxLength"], 50);
        assert_eq!(out["additionalProperties"]["maxLength"], 50);
        assert_eq!(out["$defs"]["x"]["properties"]["y"]["maxLength"], 50);
        // Unbounded leaves the schema as it was.
        assert_eq!(JsonBounds::unbounded().apply_to_schema(&s), s);
    }

    #[test]
    fn json_object_grammar_follows_the_bounds() {
        let g = JsonBounds::default().json_object_grammar();
        assert!(g.contains("char{0,64}"), "{g}");
        assert!(g.contains("(\",\" ws member1){0,15}"), "{g}");
        assert!(g.contains("(\",\" ws value1){0,7}"), "{g}");
        assert!(
            g.contains("value4 ::= string"),
            "deepest level is scalars: {g}"
        );
        assert!(g.contains("value3 ::= object4 | array4 | string"), "{g}");
        assert!(!g.contains("object5"), "{g}");
        let open = JsonBounds::unbounded().json_object_grammar();
        assert!(open.contains("char*"), "{open}");
        assert!(
            open.contains("value1 ::= object1 | array1 | string"),
            "{open}"
        );
        assert!(open.contains("(\",\" ws member1)*"), "{open}");
    }

    #[test]
    fn the_longest_json_mode_output_is_counted_from_the_grammar() {
        let flat = JsonBounds {
            max_string_chars: 1,
            max_object_members: 1,
            max_array_items: 1,
            max_depth: 1,
            compact_whitespace: false,
        };
        // `{` ws `"` \uXXXX `"` ws `:` ws number `}` ws.
        let longest = format!(
            "{{{ws}\"\\u00e9\"{ws}:{ws}-1234567890123456.1234567890123456e-1234567890123456{ws}}}{ws}",
            ws = format!("\n{}", "\t".repeat(20))
        );
        assert_eq!(flat.json_object_max_bytes(), Some(longest.len() as u64));
        let deeper = JsonBounds {
            max_depth: 2,
            ..flat
        };
        assert!(deeper.json_object_max_bytes() > flat.json_object_max_bytes());
        let compact = JsonBounds {
            compact_whitespace: true,
            ..flat
        };
        let longest = longest.replace(&format!("\n{}", "\t".repeat(20)), " ");
        assert_eq!(compact.json_object_max_bytes(), Some(longest.len() as u64));
        assert_eq!(
            JsonBounds::default().json_object_max_bytes().map(|b| b > 0),
            Some(true)
        );
        assert_eq!(JsonBounds::unbounded().json_object_max_bytes(), None);
    }

    #[test]
    fn compact_whitespace_replaces_the_converters_space_rule_only() {
        // The shape llama.cpp's converter emits.
        let gbnf = "root ::= \"{\" space \"}\" space\nspace ::= | \" \" | \"\\n\"{1,2} [ \\t]{0,20}\nstring ::= \"x\" space";
        let compact = JsonBounds {
            compact_whitespace: true,
            ..JsonBounds::default()
        };
        let out = compact.bound_converted_grammar(gbnf);
        assert_eq!(
            out,
            "root ::= \"{\" space \"}\" space\nspace ::= | \" \"\nstring ::= \"x\" space"
        );
        assert_eq!(JsonBounds::unbounded().bound_converted_grammar(gbnf), gbnf);
        assert!(compact.json_object_grammar().contains("ws ::= | \" \"\n"));
        assert!(JsonBounds::default()
            .json_object_grammar()
            .contains("[ \\t]{0,20}"));
        assert_eq!(JsonBounds::default().bound_converted_grammar(gbnf), gbnf);
    }

    #[test]
    fn bounds_past_the_limit_are_refused_by_name() {
        let b = JsonBounds {
            max_array_items: MAX_BOUND + 1,
            ..JsonBounds::default()
        };
        let msg = b.validate().expect_err("too large").to_string();
        assert!(
            msg.contains("json_bounds") && msg.contains("max_array_items"),
            "{msg}"
        );
        JsonBounds::default()
            .validate()
            .expect("defaults are valid");
        JsonBounds::unbounded()
            .validate()
            .expect("unbounded is valid");
    }
}
