//! One answer of a chat with tools: the parser that turns the generated text
//! into content, reasoning and calls as it streams, and what it collected.

use super::parse::{CallEvent, CallParser};
use super::reasoning::{Piece, ReasoningSplitter};
use super::{new_call_id, ToolCall, ToolFormat};

/// Whether `<think>` blocks are split from the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReasoningFormat {
    /// Left in the content as the model wrote it.
    None,
    /// Split off into `reasoning_content` (the default).
    #[default]
    Split,
}

/// A chat answer to prepare: the conversation, its tools, and how to render
/// and read it.
#[derive(Debug, Clone, Copy)]
pub struct ChatTurn<'a> {
    /// The conversation.
    pub messages: &'a [crate::chat::ChatMessage],
    /// The tools and how they may be used.
    pub tools: &'a super::ToolSpec,
    /// Whether `<think>` blocks are split off.
    pub reasoning: ReasoningFormat,
    /// Extra template variables (`chat_template_kwargs`).
    pub kwargs: Option<&'a serde_json::Map<String, serde_json::Value>>,
    /// The last message is an unfinished assistant answer to continue: the
    /// prompt ends with its text, with no end-of-turn and no new generation
    /// prompt (transformers' and vLLM's `continue_final_message`).
    pub continue_final: bool,
}

impl<'a> ChatTurn<'a> {
    /// A turn with these messages and tools, reasoning split, no kwargs.
    pub fn new(messages: &'a [crate::chat::ChatMessage], tools: &'a super::ToolSpec) -> Self {
        Self {
            messages,
            tools,
            reasoning: ReasoningFormat::Split,
            kwargs: None,
            continue_final: false,
        }
    }
}

/// What streams out of an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnEvent {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// Call `index` started.
    CallStart {
        /// Which call (0, 1, ...).
        index: usize,
        /// Its id.
        id: String,
        /// The function's name.
        name: String,
    },
    /// More of call `index`'s arguments (JSON text).
    CallArguments {
        /// Which call.
        index: usize,
        /// The next piece.
        fragment: String,
    },
    /// Call `index` is complete.
    CallEnd {
        /// Which call.
        index: usize,
    },
}

/// Everything an answer said, collected.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TurnOutput {
    /// The answer text.
    pub content: String,
    /// The reasoning, when the model reasoned.
    pub reasoning: Option<String>,
    /// The calls it made.
    pub calls: Vec<ToolCall>,
}

/// True when a call's arguments are a whole JSON object: every call the
/// grammar let through is, except one that `max_tokens` cut.
pub fn is_complete(call: &ToolCall) -> bool {
    serde_json::from_str::<serde_json::Value>(&call.function.arguments).is_ok_and(|v| v.is_object())
}

impl TurnOutput {
    /// The calls that are whole (leaving out one that `max_tokens` cut).
    pub fn complete_calls(&self) -> impl Iterator<Item = &ToolCall> {
        self.calls.iter().filter(|c| is_complete(c))
    }

    /// Adds an event.
    pub fn apply(&mut self, e: &TurnEvent) {
        match e {
            TurnEvent::Content(s) => self.content.push_str(s),
            TurnEvent::Reasoning(s) => self.reasoning.get_or_insert_with(String::new).push_str(s),
            TurnEvent::CallStart { id, name, .. } => {
                self.calls.push(ToolCall::new(id.clone(), name.clone(), ""))
            }
            TurnEvent::CallArguments { index, fragment } => {
                if let Some(c) = self.calls.get_mut(*index) {
                    c.function.arguments.push_str(fragment);
                }
            }
            TurnEvent::CallEnd { .. } => {}
        }
    }
}

/// Parses one answer as it streams: reasoning first (when split), then calls
/// in the family's format (when the model may call).
#[derive(Debug, Clone)]
pub struct OutputParser {
    reasoning: Option<ReasoningSplitter>,
    calls: Option<CallParser>,
    format: ToolFormat,
    ids: Vec<String>,
    output: TurnOutput,
}

impl OutputParser {
    /// A parser. `calls`: the model may call (parse its format); `reasoning`:
    /// split `<think>` blocks, `starts_inside` when the prompt opened one.
    pub fn new(
        format: ToolFormat,
        calls: bool,
        reasoning: ReasoningFormat,
        starts_inside: bool,
    ) -> Self {
        Self {
            reasoning: (reasoning == ReasoningFormat::Split)
                .then(|| ReasoningSplitter::new(starts_inside)),
            calls: calls.then(|| CallParser::new(format)),
            format,
            ids: Vec::new(),
            output: TurnOutput::default(),
        }
    }

    /// A parser that passes text through as content.
    pub fn plain() -> Self {
        Self::new(ToolFormat::Generic, false, ReasoningFormat::None, false)
    }

    /// The events of the next piece of text.
    pub fn push(&mut self, text: &str) -> Vec<TurnEvent> {
        let pieces = match &mut self.reasoning {
            Some(r) => r.push(text),
            None => vec![Piece::Content(text.to_string())],
        };
        self.route(pieces, false)
    }

    /// The events left at the end of the answer.
    pub fn finish(&mut self) -> Vec<TurnEvent> {
        let pieces = match &mut self.reasoning {
            Some(r) => r.finish(),
            None => Vec::new(),
        };
        self.route(pieces, true)
    }

    /// Everything seen so far.
    pub fn output(&self) -> &TurnOutput {
        &self.output
    }

    /// Parses a whole answer at once.
    pub fn parse_all(mut self, text: &str) -> TurnOutput {
        self.push(text);
        self.finish();
        self.output
    }

    fn route(&mut self, pieces: Vec<Piece>, end: bool) -> Vec<TurnEvent> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Reasoning(s) if !s.is_empty() => out.push(TurnEvent::Reasoning(s)),
                Piece::Reasoning(_) => {}
                Piece::Content(s) => match &mut self.calls {
                    Some(c) => {
                        let events = c.push(&s);
                        self.calls_to_turn(events, &mut out);
                    }
                    None if !s.is_empty() => out.push(TurnEvent::Content(s)),
                    None => {}
                },
            }
        }
        if end {
            if let Some(c) = &mut self.calls {
                let events = c.finish();
                self.calls_to_turn(events, &mut out);
            }
        }
        for e in &out {
            self.output.apply(e);
        }
        out
    }

    fn calls_to_turn(&mut self, events: Vec<CallEvent>, out: &mut Vec<TurnEvent>) {
        for e in events {
            out.push(match e {
                CallEvent::Text(s) if s.is_empty() => continue,
                CallEvent::Text(s) => TurnEvent::Content(s),
                CallEvent::Start { index, name } => {
                    while self.ids.len() <= index {
                        self.ids.push(new_call_id(self.format));
                    }
                    TurnEvent::CallStart {
                        index,
                        id: self.ids[index].clone(),
                        name,
                    }
                }
                CallEvent::Arguments { index, fragment } => {
                    TurnEvent::CallArguments { index, fragment }
                }
                CallEvent::End { index } => TurnEvent::CallEnd { index },
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3: &str = "<think>\nThe user wants Paris.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

    #[test]
    fn reasoning_content_and_calls_come_apart() {
        let out = OutputParser::new(ToolFormat::Hermes, true, ReasoningFormat::Split, false)
            .parse_all(QWEN3);
        assert_eq!(
            out.reasoning.as_deref().map(str::trim),
            Some("The user wants Paris.")
        );
        assert_eq!(out.content, "Let me check.\n");
        assert_eq!(out.calls.len(), 1);
        assert_eq!(out.calls[0].function.name, "get_weather");
        let args: serde_json::Value =
            serde_json::from_str(&out.calls[0].function.arguments).expect("json");
        assert_eq!(args, serde_json::json!({"city": "Paris"}));
        assert!(out.calls[0].id.starts_with("call_"));
    }

    #[test]
    fn streamed_pieces_add_up_to_the_whole_answer() {
        let whole = OutputParser::new(ToolFormat::Hermes, true, ReasoningFormat::Split, false)
            .parse_all(QWEN3);
        let mut p = OutputParser::new(ToolFormat::Hermes, true, ReasoningFormat::Split, false);
        let mut events = Vec::new();
        let chars: Vec<char> = QWEN3.chars().collect();
        for piece in chars.chunks(3) {
            events.extend(p.push(&piece.iter().collect::<String>()));
        }
        events.extend(p.finish());
        let mut out = TurnOutput::default();
        events.iter().for_each(|e| out.apply(e));
        // Ids are drawn per parser; the rest is the same.
        assert_eq!(out.calls[0].function, whole.calls[0].function);
        assert_eq!(
            (out.content, out.reasoning),
            (whole.content, whole.reasoning)
        );
        assert!(
            matches!(events.iter().find(|e| matches!(e, TurnEvent::CallStart { .. })),
            Some(TurnEvent::CallStart { index: 0, name, .. }) if name == "get_weather")
        );
    }

    #[test]
    fn without_calls_or_splitting_text_is_untouched() {
        let out = OutputParser::plain().parse_all(QWEN3);
        assert_eq!(out.content, QWEN3);
        assert!(out.calls.is_empty() && out.reasoning.is_none());
        // Calls off (tool_choice none): the call markup stays text.
        let out = OutputParser::new(ToolFormat::Hermes, false, ReasoningFormat::Split, false)
            .parse_all(QWEN3);
        assert!(out.calls.is_empty());
        assert!(out.content.contains("<tool_call>"));
    }

    #[test]
    fn a_prompt_that_opened_the_block_starts_inside_it() {
        let out = OutputParser::new(ToolFormat::Hermes, true, ReasoningFormat::Split, true)
            .parse_all("thinking...</think>answer");
        assert_eq!(out.reasoning.as_deref(), Some("thinking..."));
        assert_eq!(out.content, "answer");
    }
}
