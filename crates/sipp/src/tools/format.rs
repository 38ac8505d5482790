//! How a model family writes tool calls, detected from its chat template, and
//! the fallback for templates that do not render tools.
//!
//! | format | a call as the model writes it | detected by |
//! |---|---|---|
//! | [`ToolFormat::Hermes`] | `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>` | `<tool_call>` in the template (Qwen 2.5, Qwen 3, Hermes) |
//! | [`ToolFormat::Llama3`] | `{"name": "f", "parameters": {...}}` (optionally after `<\|python_tag\|>`) | `<\|python_tag\|>` or the `ipython` role (Llama 3.1 to 3.3) |
//! | [`ToolFormat::Mistral`] | `[TOOL_CALLS][{"name": "f", "arguments": {...}}]` | `[TOOL_CALLS]` (Mistral v0.3, Nemo) |
//! | [`ToolFormat::Pythonic`] | `[f(city="Paris"), g(n=1)]` | `<start_of_turn>` (Gemma, whose templates have no tools) |
//! | [`ToolFormat::Generic`] | `{"tool_calls": [{"name": "f", "arguments": {...}}]}` | any other template |
//!
//! A template that renders tools (its output shows a probe tool's name) gets
//! the tools, the calls in history and the `tool` messages as they are. Any
//! other gets the fallback of [`fallback_messages`]: the tool descriptions and
//! how to call them go into the system message (or the first user message
//! when the template refuses a system role), earlier calls become the text of
//! their assistant message, written in the family's format, and tool results
//! become user messages that say which call they answer.

use serde_json::Value;

use super::{Tool, ToolCall, ToolError};
use crate::chat::{ChatMessage, MessageContent, Role};

/// How a family writes calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolFormat {
    /// `<tool_call>{json}</tool_call>`, one block per call.
    Hermes,
    /// A bare JSON object with `name` and `parameters`.
    Llama3,
    /// `[TOOL_CALLS]` and a JSON array of calls.
    Mistral,
    /// A Python-style list of calls, `[f(a=1)]`.
    Pythonic,
    /// sipp's fallback: `{"tool_calls": [...]}`.
    Generic,
}

impl ToolFormat {
    /// Its name in logs and `/v1/models`.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Mistral => "mistral",
            ToolFormat::Pythonic => "pythonic",
            ToolFormat::Generic => "generic",
        }
    }

    /// The family of a template source.
    pub fn detect(template_source: &str) -> Self {
        if template_source.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if template_source.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if template_source.contains("<|python_tag|>") || template_source.contains("ipython")
        {
            ToolFormat::Llama3
        } else if template_source.contains("<start_of_turn>") {
            ToolFormat::Pythonic
        } else {
            ToolFormat::Generic
        }
    }

    /// Calls written as the family writes them (how the fallback shows earlier
    /// calls to the model).
    pub fn write_calls(self, calls: &[(String, Value)]) -> String {
        let obj = |name: &str, key: &str, args: &Value| {
            let mut o = serde_json::Map::new();
            o.insert("name".into(), name.into());
            o.insert(key.into(), args.clone());
            Value::Object(o)
        };
        match self {
            ToolFormat::Hermes => calls
                .iter()
                .map(|(n, a)| format!("<tool_call>\n{}\n</tool_call>", obj(n, "arguments", a)))
                .collect::<Vec<_>>()
                .join("\n"),
            ToolFormat::Llama3 => calls
                .iter()
                .map(|(n, a)| obj(n, "parameters", a).to_string())
                .collect::<Vec<_>>()
                .join("; "),
            ToolFormat::Mistral => format!(
                "[TOOL_CALLS]{}",
                Value::Array(calls.iter().map(|(n, a)| obj(n, "arguments", a)).collect())
            ),
            ToolFormat::Pythonic => format!(
                "[{}]",
                calls
                    .iter()
                    .map(|(n, a)| {
                        let args = a
                            .as_object()
                            .map(|o| {
                                o.iter()
                                    .map(|(k, v)| format!("{k}={v}"))
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            })
                            .unwrap_or_default();
                        format!("{n}({args})")
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            ToolFormat::Generic => {
                let list: Vec<Value> = calls.iter().map(|(n, a)| obj(n, "arguments", a)).collect();
                serde_json::json!({ "tool_calls": list }).to_string()
            }
        }
    }

    /// How the fallback tells the model to call (after the tool list).
    fn instructions(self, parallel: bool) -> String {
        let example = self.write_calls(&[(
            "function_name".into(),
            serde_json::json!({"argument": "value"}),
        )]);
        let more = if parallel {
            " To call several functions at once, list them all in that form."
        } else {
            " Call at most one function at a time."
        };
        format!(
            "To call a function, answer with only this, and nothing else:\n{example}\nwith the function's name and an arguments object that matches its parameters.{more} Otherwise, answer normally."
        )
    }
}

/// The system text the fallback adds: the tools and how to call them.
pub fn fallback_tool_text(format: ToolFormat, tools: &[Tool], parallel: bool) -> String {
    let mut s = String::from("You can call these functions, described as JSON schemas:\n");
    for t in tools {
        s.push_str(&serde_json::to_string(t).unwrap_or_default());
        s.push('\n');
    }
    s.push_str(&format.instructions(parallel));
    s
}

/// The conversation rewritten for a template that does not render tools (see
/// the module notes). `tools` is empty when the request has none (or calls are
/// off): then only history is rewritten. `system_role` says whether the
/// template renders a system message.
pub fn fallback_messages(
    messages: &[ChatMessage],
    tools: &[Tool],
    format: ToolFormat,
    parallel: bool,
    system_role: bool,
) -> Result<Vec<ChatMessage>, ToolError> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    // Whether each message of `out` holds a tool result.
    let mut from_tool: Vec<bool> = Vec::with_capacity(messages.len());
    let names = call_names(messages);
    for (i, m) in messages.iter().enumerate() {
        let converted = match m.role {
            Role::Assistant if m.tool_calls.as_ref().is_some_and(|c| !c.is_empty()) => {
                let calls = m.tool_calls.as_deref().unwrap_or_default();
                let parsed = parsed_calls(calls, i)?;
                let mut text = m.text();
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&format.write_calls(&parsed));
                ChatMessage::assistant(text)
            }
            Role::Tool => {
                let name = m.name.clone().or_else(|| {
                    m.tool_call_id
                        .as_ref()
                        .and_then(|id| names.get(id).cloned())
                });
                let head = match (name, &m.tool_call_id) {
                    (Some(n), Some(id)) => format!("Result of {n} (call {id}):"),
                    (Some(n), None) => format!("Result of {n}:"),
                    (None, Some(id)) => format!("Result of call {id}:"),
                    (None, None) => "Tool result:".to_string(),
                };
                ChatMessage::user(format!("{head}\n{}", m.text()))
            }
            _ => ChatMessage {
                tool_calls: None,
                ..m.clone()
            },
        };
        // Tool results are user turns: join them with the user turns around
        // them, for templates that insist on alternating roles (user turns
        // the request itself put side by side stay as they are).
        let is_tool = m.role == Role::Tool;
        match out.last_mut() {
            Some(prev)
                if prev.role == Role::User
                    && converted.role == Role::User
                    && (is_tool || from_tool.last() == Some(&true)) =>
            {
                let joined = format!("{}\n\n{}", prev.text(), converted.text());
                prev.content = Some(MessageContent::Text(joined));
                if let Some(f) = from_tool.last_mut() {
                    *f = true;
                }
            }
            _ => {
                out.push(converted);
                from_tool.push(is_tool);
            }
        }
    }
    if !tools.is_empty() {
        let text = fallback_tool_text(format, tools, parallel);
        match out.first_mut() {
            Some(first) if first.role == Role::System => {
                let joined = format!("{}\n\n{text}", first.text());
                first.content = Some(MessageContent::Text(joined));
            }
            _ if system_role => out.insert(0, ChatMessage::system(text)),
            _ => match out.iter_mut().find(|m| m.role == Role::User) {
                Some(user) => {
                    let joined = format!("{text}\n\n{}", user.text());
                    user.content = Some(MessageContent::Text(joined));
                }
                None => out.insert(0, ChatMessage::user(text)),
            },
        }
    }
    Ok(out)
}

/// Call id to function name, over every assistant message's calls.
fn call_names(messages: &[ChatMessage]) -> std::collections::HashMap<String, String> {
    messages
        .iter()
        .flat_map(|m| m.tool_calls.iter().flatten())
        .map(|c| (c.id.clone(), c.function.name.clone()))
        .collect()
}

fn parsed_calls(calls: &[ToolCall], index: usize) -> Result<Vec<(String, Value)>, ToolError> {
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            serde_json::from_str(&c.function.arguments)
                .map(|a| (c.function.name.clone(), a))
                .map_err(|e| {
                    ToolError::new(
                        format!("messages[{index}].tool_calls[{j}].function.arguments"),
                        format!("is not JSON: {e}"),
                    )
                })
        })
        .collect()
}

/// Checks a conversation's messages and tool history: every message has
/// content except an assistant message that makes calls, every call's
/// arguments are a JSON object, and every `tool` message answers a call made
/// before it (by `tool_call_id`).
pub fn check_history(messages: &[ChatMessage]) -> Result<(), ToolError> {
    let mut made = std::collections::HashSet::new();
    for (i, m) in messages.iter().enumerate() {
        let calls = m.tool_calls.as_ref().is_some_and(|c| !c.is_empty());
        if m.content.is_none() && !(m.role == Role::Assistant && calls) {
            return Err(ToolError::new(
                format!("messages[{i}].content"),
                "is required (only an assistant message with `tool_calls` may leave it out)",
            ));
        }
        if let Some(calls) = &m.tool_calls {
            if m.role != Role::Assistant {
                return Err(ToolError::new(
                    format!("messages[{i}].tool_calls"),
                    "only assistant messages make calls",
                ));
            }
            for (j, (_, args)) in parsed_calls(calls, i)?.iter().enumerate() {
                if !args.is_object() {
                    return Err(ToolError::new(
                        format!("messages[{i}].tool_calls[{j}].function.arguments"),
                        "must be a JSON object",
                    ));
                }
            }
            made.extend(calls.iter().map(|c| c.id.as_str()));
        }
        if m.role == Role::Tool {
            match &m.tool_call_id {
                None => {
                    return Err(ToolError::new(
                        format!("messages[{i}].tool_call_id"),
                        "a tool message must say which call it answers",
                    ))
                }
                Some(id) if !made.contains(id.as_str()) => {
                    return Err(ToolError::new(
                        format!("messages[{i}].tool_call_id"),
                        format!("no earlier assistant message made a call with id {id:?}"),
                    ))
                }
                Some(_) => {}
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Tool {
        Tool::function(
            "get_weather",
            "Weather in a city",
            serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        )
    }

    fn history() -> Vec<ChatMessage> {
        vec![
            ChatMessage::user("Weather in Paris?"),
            ChatMessage::tool_calls(
                None,
                vec![ToolCall::new(
                    "call_1",
                    "get_weather",
                    r#"{"city": "Paris"}"#,
                )],
            ),
            ChatMessage::tool_result("call_1", "18 C, sunny"),
            ChatMessage::user("Thanks. And tomorrow?"),
        ]
    }

    #[test]
    fn families_are_told_apart_by_their_markers() {
        assert_eq!(
            ToolFormat::detect("{{ '<tool_call>' }}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::detect("[TOOL_CALLS] <tool_call>"),
            ToolFormat::Mistral
        );
        assert_eq!(ToolFormat::detect("<|python_tag|>"), ToolFormat::Llama3);
        assert_eq!(ToolFormat::detect("<start_of_turn>"), ToolFormat::Pythonic);
        assert_eq!(ToolFormat::detect("<|im_start|>"), ToolFormat::Generic);
    }

    #[test]
    fn fallback_puts_tools_in_the_system_message_and_results_in_user_turns() {
        let out = fallback_messages(&history(), &[weather()], ToolFormat::Generic, true, true)
            .expect("converts");
        assert_eq!(out[0].role, Role::System);
        assert!(out[0].text().contains("\"get_weather\""));
        assert!(
            out[0].text().contains("{\"tool_calls\":["),
            "{}",
            out[0].text()
        );
        assert_eq!(out[2].role, Role::Assistant);
        assert_eq!(
            out[2].text(),
            r#"{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}"#
        );
        // The result and the next user turn are one user turn.
        assert_eq!(out.len(), 4);
        assert_eq!(out[3].role, Role::User);
        assert!(out[3]
            .text()
            .starts_with("Result of get_weather (call call_1):\n18 C, sunny\n\nThanks."));
        // Without a system role, the tools go into the first user turn.
        let out = fallback_messages(&history(), &[weather()], ToolFormat::Pythonic, false, false)
            .expect("converts");
        assert_eq!(out[0].role, Role::User);
        assert!(out[0]
            .text()
            .contains("[function_name(argument=\"value\")]"));
        assert!(out[0].text().ends_with("Weather in Paris?"));
        assert_eq!(out[1].text(), r#"[get_weather(city="Paris")]"#);
    }

    #[test]
    fn user_turns_the_request_put_side_by_side_are_not_joined() {
        let msgs = vec![ChatMessage::user("a"), ChatMessage::user("b")];
        let out = fallback_messages(&msgs, &[], ToolFormat::Generic, true, true).expect("ok");
        assert_eq!(out, msgs);
    }

    #[test]
    fn history_checks_name_the_field() {
        assert!(check_history(&history()).is_ok());
        let mut h = history();
        h[2].tool_call_id = Some("call_9".into());
        assert_eq!(
            check_history(&h).expect_err("refused").field,
            "messages[2].tool_call_id"
        );
        let mut h = history();
        h[1].tool_calls = Some(vec![ToolCall::new("call_1", "get_weather", "{city")]);
        assert_eq!(
            check_history(&h).expect_err("refused").field,
            "messages[1].tool_calls[0].function.arguments"
        );
        let mut h = history();
        h[1].tool_calls = Some(vec![ToolCall::new("call_1", "get_weather", "[1]")]);
        assert!(check_history(&h)
            .expect_err("refused")
            .message
            .contains("object"));
        let mut h = history();
        h[2].tool_call_id = None;
        assert!(check_history(&h).is_err());
        let mut h = history();
        h[0].content = None;
        assert_eq!(
            check_history(&h).expect_err("refused").field,
            "messages[0].content"
        );
    }

    #[test]
    fn calls_are_written_as_each_family_writes_them() {
        let calls = vec![("f".to_string(), serde_json::json!({"a": 1}))];
        assert_eq!(
            ToolFormat::Hermes.write_calls(&calls),
            "<tool_call>\n{\"name\":\"f\",\"arguments\":{\"a\":1}}\n</tool_call>"
        );
        assert_eq!(
            ToolFormat::Llama3.write_calls(&calls),
            "{\"name\":\"f\",\"parameters\":{\"a\":1}}"
        );
        assert_eq!(
            ToolFormat::Mistral.write_calls(&calls),
            "[TOOL_CALLS][{\"name\":\"f\",\"arguments\":{\"a\":1}}]"
        );
        assert_eq!(ToolFormat::Pythonic.write_calls(&calls), "[f(a=1)]");
    }
}
