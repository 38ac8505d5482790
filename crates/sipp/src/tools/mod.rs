//! Tool calling and reasoning: the tool and call types every surface shares
//! (OpenAI chat, Responses, Anthropic Messages, providers, [`crate::client`]),
//! and what turns a conversation with tools into a prompt, a constraint and a
//! parsed answer:
//!
//! - [`format`](mod@format): how a model's template family writes calls, detected from
//!   the template, and the documented fallback for templates without tools;
//! - [`grammar`]: grammars that make every emitted call schema-valid, from
//!   the first token (`required`, a named function) or lazily from the
//!   family's call marker (`auto`);
//! - [`parse`]: pure, incremental parsers from generated text to content and
//!   calls (one per family), and [`reasoning`]: `<think>` blocks split off;
//! - [`turn`]: the two put together for one answer.

pub mod format;
pub mod grammar;
pub mod parse;
pub mod reasoning;
pub mod turn;

use serde::{Deserialize, Serialize};

pub use format::ToolFormat;
pub use turn::{OutputParser, TurnEvent, TurnOutput};

/// A tool the model may call (OpenAI's `{"type": "function", "function": ...}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    /// Always "function".
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// The function.
    pub function: FunctionDef,
}

fn function_kind() -> String {
    "function".into()
}

impl Tool {
    /// A function tool.
    pub fn function(
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: serde_json::Value,
    ) -> Self {
        Self {
            kind: function_kind(),
            function: FunctionDef {
                name: name.into(),
                description: Some(description.into()),
                parameters: Some(parameters),
                strict: None,
            },
        }
    }

    /// The parameters' schema (an empty object schema when none was given).
    pub fn parameters(&self) -> serde_json::Value {
        self.function
            .parameters
            .clone()
            .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}))
    }
}

/// A function's definition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionDef {
    /// Its name.
    pub name: String,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema of its arguments (an object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    /// OpenAI's strict flag (arguments are always schema-valid here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Its id (a `tool` message answers it by this id).
    pub id: String,
    /// Always "function".
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// The function and its arguments.
    pub function: FunctionCall,
}

impl ToolCall {
    /// A function call with these arguments (JSON text).
    pub fn new(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: impl Into<String>,
    ) -> Self {
        Self {
            id: id.into(),
            kind: function_kind(),
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }
}

/// A called function.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments as JSON text (OpenAI's shape).
    pub arguments: String,
}

/// Whether and which tool the model must call.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// Never call.
    None,
    /// Text or calls, as the model chooses.
    #[default]
    Auto,
    /// At least one call.
    Required,
    /// A call of this function.
    Function(String),
}

impl Serialize for ToolChoice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ToolChoice::None => s.serialize_str("none"),
            ToolChoice::Auto => s.serialize_str("auto"),
            ToolChoice::Required => s.serialize_str("required"),
            ToolChoice::Function(name) => serde_json::json!({
                "type": "function", "function": {"name": name}
            })
            .serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let v = serde_json::Value::deserialize(d)?;
        match &v {
            serde_json::Value::String(s) => match s.as_str() {
                "none" => Ok(ToolChoice::None),
                "auto" => Ok(ToolChoice::Auto),
                "required" => Ok(ToolChoice::Required),
                other => Err(D::Error::custom(format!(
                    "tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {other:?}"
                ))),
            },
            serde_json::Value::Object(o) => o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(|n| n.as_str())
                .map(|n| ToolChoice::Function(n.to_string()))
                .ok_or_else(|| {
                    D::Error::custom("a named tool_choice needs `function.name`")
                }),
            _ => Err(D::Error::custom(
                "tool_choice must be a string or an object",
            )),
        }
    }
}

/// The tools of one request and how they may be used.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolSpec {
    /// The tools.
    pub tools: Vec<Tool>,
    /// Whether and which one must be called.
    pub choice: ToolChoice,
    /// More than one call in one answer (OpenAI's default: true).
    pub parallel: bool,
}

impl ToolSpec {
    /// Tools the model may call or not, several at once.
    pub fn auto(tools: Vec<Tool>) -> Self {
        Self {
            tools,
            choice: ToolChoice::Auto,
            parallel: true,
        }
    }

    /// True when the model may call something.
    pub fn may_call(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }

    /// The tools a call may use under the choice.
    pub fn callable(&self) -> Vec<&Tool> {
        match &self.choice {
            ToolChoice::None => Vec::new(),
            ToolChoice::Function(name) => self
                .tools
                .iter()
                .filter(|t| &t.function.name == name)
                .collect(),
            _ => self.tools.iter().collect(),
        }
    }

    /// Checks the tools and the choice; errors name the field as OpenAI's
    /// request does (`tools[1].function.name`, `tool_choice`).
    pub fn validate(&self) -> Result<(), ToolError> {
        let mut seen = std::collections::HashSet::new();
        for (i, t) in self.tools.iter().enumerate() {
            if t.kind != "function" {
                return Err(ToolError::new(
                    format!("tools[{i}].type"),
                    format!("only \"function\" tools are supported, got {:?}", t.kind),
                ));
            }
            let name = &t.function.name;
            let name_ok = !name.is_empty()
                && name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
            if !name_ok {
                return Err(ToolError::new(
                    format!("tools[{i}].function.name"),
                    format!("must be 1 to 64 of a-z, A-Z, 0-9, `_`, `-`, `.`, got {name:?}"),
                ));
            }
            if !seen.insert(name.as_str()) {
                return Err(ToolError::new(
                    format!("tools[{i}].function.name"),
                    format!("{name:?} is defined twice"),
                ));
            }
            if let Some(p) = &t.function.parameters {
                let field = format!("tools[{i}].function.parameters");
                if p.get("type").and_then(|t| t.as_str()) != Some("object") {
                    return Err(ToolError::new(
                        field,
                        "must be a JSON schema of `\"type\": \"object\"`",
                    ));
                }
                crate::sampling::check_schema_supported(p)
                    .map_err(|e| ToolError::new(field.clone(), e.to_string()))?;
                if let Err(e) = jsonschema::validator_for(p) {
                    return Err(ToolError::new(
                        field,
                        format!("not a valid JSON schema: {e}"),
                    ));
                }
            }
        }
        match &self.choice {
            ToolChoice::Function(name) if !seen.contains(name.as_str()) => Err(ToolError::new(
                "tool_choice",
                format!("names the function {name:?}, which is not in `tools`"),
            )),
            ToolChoice::Required if self.tools.is_empty() => Err(ToolError::new(
                "tool_choice",
                "is \"required\" but `tools` is empty",
            )),
            _ => Ok(()),
        }
    }
}

/// A tool definition, choice or history entry that cannot be used, naming the
/// field as the request wrote it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid `{field}`: {message}")]
pub struct ToolError {
    /// The field (`tools[0].function.parameters`, `messages[2].tool_call_id`).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl ToolError {
    /// An error about `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A fresh call id: `call_` and 24 letters and digits, or 9 for Mistral's
/// templates, which refuse any other length.
pub fn new_call_id(format: ToolFormat) -> String {
    let pick = |n: usize| -> String { (0..n).map(|_| fastrand::alphanumeric()).collect() };
    match format {
        ToolFormat::Mistral => pick(9),
        _ => format!("call_{}", pick(24)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Tool {
        Tool::function(
            "get_weather",
            "Weather in a city",
            serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        )
    }

    #[test]
    fn tool_choice_reads_every_openai_shape() {
        let read = |v: serde_json::Value| serde_json::from_value::<ToolChoice>(v);
        assert_eq!(
            read(serde_json::json!("none")).expect("ok"),
            ToolChoice::None
        );
        assert_eq!(
            read(serde_json::json!("auto")).expect("ok"),
            ToolChoice::Auto
        );
        assert_eq!(
            read(serde_json::json!("required")).expect("ok"),
            ToolChoice::Required
        );
        let named = read(serde_json::json!({"type": "function", "function": {"name": "f"}}));
        assert_eq!(named.expect("ok"), ToolChoice::Function("f".into()));
        assert!(read(serde_json::json!("sometimes")).is_err());
        assert!(read(serde_json::json!({"type": "function"})).is_err());
        let back = serde_json::to_value(ToolChoice::Function("f".into())).expect("ok");
        assert_eq!(back["function"]["name"], "f");
    }

    #[test]
    fn bad_tools_name_the_field() {
        let mut spec = ToolSpec::auto(vec![weather(), weather()]);
        let e = spec.validate().expect_err("refused");
        assert_eq!(e.field, "tools[1].function.name");
        spec.tools.pop();
        spec.choice = ToolChoice::Function("nope".into());
        assert_eq!(spec.validate().expect_err("refused").field, "tool_choice");
        spec.choice = ToolChoice::Auto;
        spec.tools[0].function.parameters = Some(serde_json::json!({"type": "string"}));
        assert_eq!(
            spec.validate().expect_err("refused").field,
            "tools[0].function.parameters"
        );
        spec.tools[0].function.parameters =
            Some(serde_json::json!({"type": "object", "properties": {"a": {"type": "strin"}}}));
        assert!(spec.validate().is_err());
        spec.tools[0].function.parameters = Some(
            serde_json::json!({"type": "object", "properties": {"a": {"if": {"type": "string"}}}}),
        );
        let e = spec.validate().expect_err("refused");
        assert!(e.message.contains("`if`"), "{e}");
        spec.tools[0].function.name = "has space".into();
        assert_eq!(
            spec.validate().expect_err("refused").field,
            "tools[0].function.name"
        );
        assert!(ToolSpec::auto(vec![weather()]).validate().is_ok());
        let req = ToolSpec {
            choice: ToolChoice::Required,
            ..ToolSpec::default()
        };
        assert_eq!(req.validate().expect_err("refused").field, "tool_choice");
    }

    #[test]
    fn call_ids_fit_their_family() {
        let id = new_call_id(ToolFormat::Mistral);
        assert_eq!(id.len(), 9);
        assert!(id.chars().all(|c| c.is_ascii_alphanumeric()));
        let id = new_call_id(ToolFormat::Hermes);
        assert!(id.starts_with("call_") && id.len() == 29);
    }
}
