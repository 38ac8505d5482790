//! Incremental parsers from generated text to content and tool calls, one per
//! family (see the table in [`super::format`]).
//!
//! The parser reads one character at a time, and what it emits depends only
//! on the text, never on how it was cut into pieces: pushing a text in any
//! split gives the same events once adjacent texts (and adjacent argument
//! fragments of one call) are joined. It holds back only what it cannot
//! decide yet: a suffix that may still become a call marker, and call markup
//! (marker, JSON before the function's name) that may still turn out not to
//! be a call, in which case it comes back as text, unchanged.
//!
//! - Hermes: `<tool_call>` blocks anywhere in the text, each a JSON object
//!   with `name` and `arguments` (either order; `arguments` may also be a
//!   string holding JSON, as Qwen models sometimes write it), the closing
//!   `</tool_call>` optional.
//! - Llama 3: the whole answer (after whitespace and an optional
//!   `<|python_tag|>`) is `{"name": ..., "parameters": ...}`, several calls
//!   separated by `;`; else it is all text.
//! - Mistral: `[TOOL_CALLS]` and a JSON array of call objects.
//! - Pythonic: an answer that starts with `[name(`, or a ```` ```tool_code ````
//!   fence anywhere, holding `[f(a=1), g()]` (or bare calls); keyword values
//!   are Python literals or JSON, and come out as a JSON object.
//! - Generic: the whole answer is `{"tool_calls": [...]}`; else it is all
//!   text.
//!
//! Arguments stream as the model writes them (the raw JSON text of the value,
//! or the decoded text of a string value), except for the Python-style
//! format, whose arguments come as one fragment when the call's `)` arrives.
//! Whitespace between calls and after the last one is dropped; text between
//! calls is kept. An answer cut inside a started call ends it (its arguments
//! are then incomplete).

mod json_scan;
mod pyargs;

use json_scan::{JsonScan, Step, StrDecoder, StrStep};

use super::ToolFormat;

/// What a parser found in the text pushed so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallEvent {
    /// Text that is not part of a call.
    Text(String),
    /// Call `index` (0, 1, ... in order) started; its name is known.
    Start {
        /// Which call.
        index: usize,
        /// The function's name.
        name: String,
    },
    /// More of call `index`'s arguments, as JSON text.
    Arguments {
        /// Which call.
        index: usize,
        /// The next piece of the arguments' JSON text.
        fragment: String,
    },
    /// Call `index` is complete.
    End {
        /// Which call.
        index: usize,
    },
}

/// Events with adjacent texts joined, and adjacent argument fragments of one
/// call joined; empty ones dropped. Two event streams of the same text cut
/// differently are equal once merged.
pub fn merge_events(events: impl IntoIterator<Item = CallEvent>) -> Vec<CallEvent> {
    let mut out = Vec::new();
    for e in events {
        push_merged(&mut out, e);
    }
    out
}

fn push_merged(out: &mut Vec<CallEvent>, e: CallEvent) {
    match (out.last_mut(), e) {
        (_, CallEvent::Text(s)) if s.is_empty() => {}
        (_, CallEvent::Arguments { fragment, .. }) if fragment.is_empty() => {}
        (Some(CallEvent::Text(prev)), CallEvent::Text(s)) => prev.push_str(&s),
        (
            Some(CallEvent::Arguments {
                index: i,
                fragment: prev,
            }),
            CallEvent::Arguments { index, fragment },
        ) if *i == index => prev.push_str(&fragment),
        (_, e) => out.push(e),
    }
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_MARK: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";
const FENCE_OPEN: &str = "```tool_code";
const FENCE_CLOSE: &str = "```";

/// Where the parser is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    /// Free text (watching for the family's marker).
    Text,
    /// Llama 3 at the start: this many characters of `<|python_tag|>` read.
    PyTag(usize),
    /// Whitespace, then a call object's `{`.
    ExpectObj,
    /// Inside a call object.
    Obj(ObjSt),
    /// After a call object (what may follow depends on the context).
    AfterObj,
    /// Reading a closing word (`</tool_call>`, a fence's backticks): this
    /// many characters matched.
    Close(&'static str, usize),
    /// Llama 3 after `;`: whitespace, then the next call object.
    LlamaSep,
    /// Mistral after `[TOOL_CALLS]`: whitespace, then `[` (or one object).
    ArrOpen,
    /// After the `[` of a list of call objects: whitespace, then `{`.
    ArrFirst,
    /// Generic: the outer object up to its `"tool_calls": [`.
    GenHead(GenSt),
    /// Generic after the list: whitespace, then `}`.
    GenClose,
    /// Python-style after ```` ```tool_code ````: whitespace, then `[` or a
    /// call.
    PyFence,
    /// Python-style, before a call's name: whitespace, then the name.
    PyBeforeName,
    /// Python-style, reading a call's name (up to its `(`).
    PyName,
    /// Python-style, inside a call's parentheses.
    PyArgs,
    /// Python-style, after a call's `)`.
    PyAfter,
    /// Python-style, after the list's `]` inside a fence: whitespace, then
    /// the closing backticks.
    PyFenceEnd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ObjSt {
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After `,`: a key.
    Key,
    /// Inside a key.
    InKey,
    /// After a key.
    Colon,
    /// After `:`: whitespace, then the value.
    ValueStart,
    /// Inside a value.
    Value(Val),
    /// After a value: `,` or `}`.
    Next,
}

/// Which value is being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Val {
    /// The function's name (a string).
    Name,
    /// The arguments, written as JSON.
    ArgsJson,
    /// The arguments, written as a string that holds JSON.
    ArgsString,
    /// Any other key's value.
    Skip,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GenSt {
    BeforeKey,
    InKey,
    Colon,
    BeforeList,
}

/// What holds the call objects being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ctx {
    /// A `<tool_call>` block.
    Hermes,
    /// Llama 3's bare objects.
    Llama,
    /// Mistral's list.
    MistralList,
    /// Mistral's `[TOOL_CALLS]` and a single object.
    MistralOne,
    /// Generic's `tool_calls` list.
    GenericList,
    /// Python-style calls: inside a fence or not, in a `[...]` list or bare.
    Py { fenced: bool, list: bool },
}

/// The call object being read.
#[derive(Debug, Clone, Default)]
struct Obj {
    key: String,
    dec: StrDecoder,
    scan: JsonScan,
    name: Option<String>,
    name_buf: String,
    args_seen: bool,
    /// Arguments read before the call could start (the name comes later).
    args_buf: String,
}

/// Splits generated text into text and calls, as it arrives.
#[derive(Debug, Clone)]
pub struct CallParser {
    format: ToolFormat,
    st: St,
    ctx: Ctx,
    /// Markup read since the last call (or since the text): it goes back out
    /// as text if it turns out not to be a call. Not kept inside a started
    /// call.
    raw: String,
    /// Inside a started call (its Start emitted, its End not yet).
    in_call: bool,
    /// Right after a call: `raw` holds only what separates calls.
    between: bool,
    /// Nothing but whitespace yet.
    at_start: bool,
    /// Holding leading whitespace (at the start, or after a call).
    lead: bool,
    /// The held leading whitespace follows a call (dropped at the end).
    after_call: bool,
    ws_hold: String,
    /// A suffix of the text that may still become a marker.
    partial: String,
    obj: Obj,
    py_name: String,
    py_args: String,
    py_depth: usize,
    py_quote: Option<char>,
    py_escape: bool,
    next_index: usize,
    out: Vec<CallEvent>,
}

impl CallParser {
    /// A parser for this family's calls.
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            st: St::Text,
            ctx: Ctx::Hermes,
            raw: String::new(),
            in_call: false,
            between: false,
            at_start: true,
            lead: true,
            after_call: false,
            ws_hold: String::new(),
            partial: String::new(),
            obj: Obj::default(),
            py_name: String::new(),
            py_args: String::new(),
            py_depth: 0,
            py_quote: None,
            py_escape: false,
            next_index: 0,
            out: Vec::new(),
        }
    }

    /// The events of a whole text at once, merged.
    pub fn parse_all(format: ToolFormat, text: &str) -> Vec<CallEvent> {
        let mut p = Self::new(format);
        let mut events = p.push(text);
        events.extend(p.finish());
        merge_events(events)
    }

    /// The events the new text completes.
    pub fn push(&mut self, text: &str) -> Vec<CallEvent> {
        for c in text.chars() {
            self.feed(c);
        }
        std::mem::take(&mut self.out)
    }

    /// The events left at the end of the text.
    pub fn finish(&mut self) -> Vec<CallEvent> {
        match self.st {
            St::Text => {
                if !self.partial.is_empty() {
                    let p = std::mem::take(&mut self.partial);
                    self.emit_text(&p);
                } else if !self.after_call {
                    let ws = std::mem::take(&mut self.ws_hold);
                    self.emit_text(&ws);
                }
            }
            _ if self.in_call => self.end_call(),
            St::PyArgs if looks_like_kwargs(&self.py_args) => {
                // Cut inside the arguments: the call, without them.
                let name = std::mem::take(&mut self.py_name);
                self.start_call(name);
                self.end_call();
            }
            _ if self.between => {}
            _ => {
                let raw = std::mem::take(&mut self.raw);
                self.emit_text(&raw);
            }
        }
        self.raw.clear();
        self.ws_hold.clear();
        self.partial.clear();
        self.st = St::Text;
        self.lead = false;
        self.at_start = false;
        std::mem::take(&mut self.out)
    }

    fn markers(&self) -> &'static [&'static str] {
        match self.format {
            ToolFormat::Hermes => &[HERMES_OPEN],
            ToolFormat::Mistral => &[MISTRAL_MARK],
            ToolFormat::Pythonic => &[FENCE_OPEN],
            ToolFormat::Llama3 | ToolFormat::Generic => &[],
        }
    }

    fn feed(&mut self, c: char) {
        if self.st == St::Text {
            self.text_char(c);
            return;
        }
        let kept = !self.in_call;
        if kept {
            self.raw.push(c);
        }
        if let Err(replay) = self.step(c) {
            if kept {
                self.raw.pop();
            }
            self.fail(replay, c);
        }
    }

    /// Not a call after all: a started call ends, the markup read goes out
    /// as text except its last `replay` bytes, which are read again as text
    /// (with `c`), as they may start a marker.
    fn fail(&mut self, replay: usize, c: char) {
        if self.in_call {
            self.end_call();
        }
        let tail = self.raw.split_off(self.raw.len().saturating_sub(replay));
        let text = std::mem::take(&mut self.raw);
        self.st = St::Text;
        self.at_start = false;
        if self.between && text.chars().all(char::is_whitespace) {
            // Only whitespace after a call: dropped if a marker follows.
            self.lead = true;
            self.after_call = true;
            self.ws_hold = text;
        } else {
            self.lead = false;
            self.emit_text(&text);
        }
        self.between = false;
        for t in tail.chars() {
            self.feed(t);
        }
        self.feed(c);
    }

    fn text_char(&mut self, c: char) {
        if self.lead {
            if c.is_whitespace() {
                self.ws_hold.push(c);
                return;
            }
            self.lead = false;
            if std::mem::take(&mut self.at_start) && self.anchored(c) {
                return;
            }
        }
        self.partial.push(c);
        let markers = self.markers();
        loop {
            if let Some(m) = markers.iter().find(|m| **m == self.partial) {
                self.raw = std::mem::take(&mut self.ws_hold);
                self.raw.push_str(m);
                self.partial.clear();
                self.after_marker(m);
                return;
            }
            if markers.iter().any(|m| m.starts_with(self.partial.as_str())) {
                return;
            }
            let mut rest = self.partial.chars();
            let first = rest.next().map(String::from).unwrap_or_default();
            self.partial = rest.collect();
            self.emit_text(&first);
            if self.partial.is_empty() {
                return;
            }
        }
    }

    /// The first character of the answer, for families whose calls are the
    /// whole answer: true when it starts one.
    fn anchored(&mut self, c: char) -> bool {
        let next = match (self.format, c) {
            (ToolFormat::Llama3, '{') => {
                self.ctx = Ctx::Llama;
                self.begin_obj();
                St::Obj(ObjSt::KeyOrClose)
            }
            (ToolFormat::Llama3, '<') => St::PyTag(1),
            (ToolFormat::Generic, '{') => St::GenHead(GenSt::BeforeKey),
            (ToolFormat::Pythonic, '[') => {
                self.ctx = Ctx::Py {
                    fenced: false,
                    list: true,
                };
                St::PyBeforeName
            }
            _ => return false,
        };
        self.raw = std::mem::take(&mut self.ws_hold);
        self.raw.push(c);
        self.st = next;
        true
    }

    fn after_marker(&mut self, marker: &str) {
        self.between = false;
        self.st = match marker {
            HERMES_OPEN => {
                self.ctx = Ctx::Hermes;
                St::ExpectObj
            }
            MISTRAL_MARK => St::ArrOpen,
            _ => St::PyFence,
        };
    }

    /// Back to free text after calls.
    fn commit_to_text(&mut self) {
        self.raw.clear();
        self.between = false;
        self.st = St::Text;
        self.lead = true;
        self.after_call = true;
    }

    fn begin_obj(&mut self) {
        self.obj = Obj::default();
        self.between = false;
    }

    fn emit(&mut self, e: CallEvent) {
        push_merged(&mut self.out, e);
    }

    fn emit_text(&mut self, s: &str) {
        if !self.ws_hold.is_empty() {
            let ws = std::mem::take(&mut self.ws_hold);
            self.emit(CallEvent::Text(ws));
        }
        self.emit(CallEvent::Text(s.to_string()));
    }

    fn emit_args(&mut self, s: &str) {
        if self.in_call {
            let index = self.next_index - 1;
            self.emit(CallEvent::Arguments {
                index,
                fragment: s.to_string(),
            });
        } else {
            self.obj.args_buf.push_str(s);
        }
    }

    fn start_call(&mut self, name: String) {
        let index = self.next_index;
        self.next_index += 1;
        self.emit(CallEvent::Start { index, name });
        self.in_call = true;
        self.raw.clear();
    }

    fn end_call(&mut self) {
        self.emit(CallEvent::End {
            index: self.next_index - 1,
        });
        self.in_call = false;
        self.between = true;
    }

    /// Starts the call once its name is known (and, for Llama 3, whose
    /// calls have no marker, once its arguments begin too).
    fn maybe_start(&mut self) {
        if self.in_call || (self.format == ToolFormat::Llama3 && !self.obj.args_seen) {
            return;
        }
        if let Some(name) = self.obj.name.clone() {
            self.start_call(name);
            let buf = std::mem::take(&mut self.obj.args_buf);
            self.emit_args(&buf);
        }
    }

    /// One character of markup; `Err(n)` when it is not a call after all
    /// (the last `n` bytes of the markup are read again as text).
    fn step(&mut self, c: char) -> Result<(), usize> {
        let ws = c.is_whitespace();
        match self.st {
            St::Text => unreachable!("text is read by text_char"),
            St::PyTag(n) => {
                if !PYTHON_TAG[n..].starts_with(c) {
                    return Err(0);
                }
                self.st = if n + 1 == PYTHON_TAG.len() {
                    self.ctx = Ctx::Llama;
                    St::ExpectObj
                } else {
                    St::PyTag(n + 1)
                };
            }
            St::ExpectObj | St::ArrFirst | St::LlamaSep => match c {
                _ if ws => {}
                '{' => {
                    self.begin_obj();
                    self.st = St::Obj(ObjSt::KeyOrClose);
                }
                _ => return Err(0),
            },
            St::Obj(o) => return self.obj_char(o, c),
            St::AfterObj => match (self.ctx, c) {
                (_, _) if ws => {}
                (Ctx::Hermes, '<') => self.st = St::Close(HERMES_CLOSE, 1),
                (Ctx::Llama, ';') => self.st = St::LlamaSep,
                (Ctx::Llama, '{') => {
                    self.begin_obj();
                    self.st = St::Obj(ObjSt::KeyOrClose);
                }
                (Ctx::MistralList | Ctx::GenericList, ',') => self.st = St::ExpectObj,
                (Ctx::MistralList, ']') => self.commit_to_text(),
                (Ctx::GenericList, ']') => self.st = St::GenClose,
                _ => return Err(0),
            },
            St::Close(word, n) => {
                if !word[n..].starts_with(c) {
                    return Err(n);
                }
                if n + 1 == word.len() {
                    self.commit_to_text();
                } else {
                    self.st = St::Close(word, n + 1);
                }
            }
            St::ArrOpen => match c {
                _ if ws => {}
                '[' => {
                    self.ctx = Ctx::MistralList;
                    self.st = St::ArrFirst;
                }
                '{' => {
                    self.ctx = Ctx::MistralOne;
                    self.begin_obj();
                    self.st = St::Obj(ObjSt::KeyOrClose);
                }
                _ => return Err(0),
            },
            St::GenHead(g) => self.gen_head(g, c)?,
            St::GenClose => match c {
                _ if ws => {}
                '}' => self.commit_to_text(),
                _ => return Err(0),
            },
            St::PyFence => match c {
                _ if ws => {}
                '[' => {
                    self.ctx = Ctx::Py {
                        fenced: true,
                        list: true,
                    };
                    self.st = St::PyBeforeName;
                }
                c if is_name_start(c) => {
                    self.ctx = Ctx::Py {
                        fenced: true,
                        list: false,
                    };
                    self.py_begin(c);
                }
                _ => return Err(0),
            },
            St::PyBeforeName => match c {
                _ if ws => {}
                c if is_name_start(c) => self.py_begin(c),
                _ => return Err(0),
            },
            St::PyName => match c {
                '(' => {
                    self.py_args.clear();
                    self.py_depth = 0;
                    self.py_quote = None;
                    self.py_escape = false;
                    self.st = St::PyArgs;
                }
                c if pyargs::is_name_char(c) => self.py_name.push(c),
                _ => return Err(0),
            },
            St::PyArgs => return self.py_args_char(c),
            St::PyAfter => {
                let Ctx::Py { fenced, list } = self.ctx else {
                    return Err(0);
                };
                match c {
                    _ if ws => {}
                    ',' => self.st = St::PyBeforeName,
                    ']' if list && fenced => self.st = St::PyFenceEnd,
                    ']' if list => self.commit_to_text(),
                    '`' if !list => self.st = St::Close(FENCE_CLOSE, 1),
                    c if !list && is_name_start(c) => self.py_begin(c),
                    _ => return Err(0),
                }
            }
            St::PyFenceEnd => match c {
                _ if ws => {}
                '`' => self.st = St::Close(FENCE_CLOSE, 1),
                _ => return Err(0),
            },
        }
        Ok(())
    }

    fn gen_head(&mut self, g: GenSt, c: char) -> Result<(), usize> {
        let ws = c.is_whitespace();
        let next = match (g, c) {
            (GenSt::InKey, c) => match self.obj.dec.feed(c, &mut self.obj.key) {
                StrStep::More => GenSt::InKey,
                StrStep::Done if self.obj.key == "tool_calls" => GenSt::Colon,
                _ => return Err(0),
            },
            (_, _) if ws => g,
            (GenSt::BeforeKey, '"') => {
                self.begin_obj();
                GenSt::InKey
            }
            (GenSt::Colon, ':') => GenSt::BeforeList,
            (GenSt::BeforeList, '[') => {
                self.ctx = Ctx::GenericList;
                self.st = St::ArrFirst;
                return Ok(());
            }
            _ => return Err(0),
        };
        self.st = St::GenHead(next);
        Ok(())
    }

    fn obj_char(&mut self, o: ObjSt, c: char) -> Result<(), usize> {
        let ws = c.is_whitespace();
        let next = match o {
            ObjSt::KeyOrClose | ObjSt::Key => match c {
                _ if ws => o,
                '}' if o == ObjSt::KeyOrClose => return self.close_obj(),
                '"' => {
                    self.obj.key.clear();
                    self.obj.dec = StrDecoder::default();
                    ObjSt::InKey
                }
                _ => return Err(0),
            },
            ObjSt::InKey => match self.obj.dec.feed(c, &mut self.obj.key) {
                StrStep::More => o,
                StrStep::Done => ObjSt::Colon,
                StrStep::Invalid => return Err(0),
            },
            ObjSt::Colon => match c {
                _ if ws => o,
                ':' => ObjSt::ValueStart,
                _ => return Err(0),
            },
            ObjSt::ValueStart => {
                if ws {
                    return Ok(());
                }
                let key = self.obj.key.as_str();
                let val = if key == "name" && self.obj.name.is_none() && c == '"' {
                    self.obj.name_buf.clear();
                    self.obj.dec = StrDecoder::default();
                    self.st = St::Obj(ObjSt::Value(Val::Name));
                    return Ok(());
                } else if (key == "arguments" || key == "parameters") && !self.obj.args_seen {
                    self.obj.args_seen = true;
                    self.maybe_start();
                    if c == '"' {
                        self.obj.dec = StrDecoder::default();
                        self.st = St::Obj(ObjSt::Value(Val::ArgsString));
                        return Ok(());
                    }
                    Val::ArgsJson
                } else {
                    Val::Skip
                };
                self.obj.scan = JsonScan::default();
                return self.scan_char(val, c);
            }
            ObjSt::Value(Val::Name) => {
                let mut name = std::mem::take(&mut self.obj.name_buf);
                let step = self.obj.dec.feed(c, &mut name);
                match step {
                    StrStep::More => self.obj.name_buf = name,
                    StrStep::Done => {
                        self.obj.name = Some(name);
                        self.maybe_start();
                        self.st = St::Obj(ObjSt::Next);
                    }
                    StrStep::Invalid => return Err(0),
                }
                return Ok(());
            }
            ObjSt::Value(Val::ArgsString) => {
                let mut piece = String::new();
                match self.obj.dec.feed(c, &mut piece) {
                    StrStep::More => {
                        if !piece.is_empty() {
                            self.emit_args(&piece);
                        }
                        o
                    }
                    StrStep::Done => ObjSt::Next,
                    StrStep::Invalid => return Err(0),
                }
            }
            ObjSt::Value(val) => return self.scan_char(val, c),
            ObjSt::Next => match c {
                _ if ws => o,
                ',' => ObjSt::Key,
                '}' => return self.close_obj(),
                _ => return Err(0),
            },
        };
        self.st = St::Obj(next);
        Ok(())
    }

    /// A character of a value read by the JSON scanner (the arguments, or a
    /// value skipped).
    fn scan_char(&mut self, val: Val, c: char) -> Result<(), usize> {
        let step = self.obj.scan.feed(c);
        if val == Val::ArgsJson && matches!(step, Step::More | Step::Done) {
            let mut b = [0u8; 4];
            self.emit_args(c.encode_utf8(&mut b));
        }
        match step {
            Step::More => self.st = St::Obj(ObjSt::Value(val)),
            Step::Done => self.st = St::Obj(ObjSt::Next),
            Step::Before => return self.obj_char(ObjSt::Next, c),
            Step::Invalid => return Err(0),
        }
        Ok(())
    }

    fn close_obj(&mut self) -> Result<(), usize> {
        // A call starts as soon as its name is known (for Llama 3, and its
        // arguments begin): an object that has not started is no call.
        if !self.in_call {
            return Err(0);
        }
        if !self.obj.args_seen {
            self.emit_args("{}");
        }
        self.end_call();
        if self.ctx == Ctx::MistralOne {
            self.commit_to_text();
        } else {
            self.st = St::AfterObj;
        }
        Ok(())
    }

    fn py_begin(&mut self, c: char) {
        self.between = false;
        self.py_name.clear();
        self.py_name.push(c);
        self.st = St::PyName;
    }

    fn py_args_char(&mut self, c: char) -> Result<(), usize> {
        if let Some(q) = self.py_quote {
            if self.py_escape {
                self.py_escape = false;
            } else if c == '\\' {
                self.py_escape = true;
            } else if c == q {
                self.py_quote = None;
            }
            self.py_args.push(c);
            return Ok(());
        }
        match c {
            '"' | '\'' => self.py_quote = Some(c),
            '(' | '[' | '{' => self.py_depth += 1,
            ')' if self.py_depth == 0 => {
                let json = pyargs::kwargs_to_json(&self.py_args).ok_or(0usize)?;
                let name = std::mem::take(&mut self.py_name);
                self.start_call(name);
                self.emit_args(&json);
                self.end_call();
                self.st = St::PyAfter;
                return Ok(());
            }
            ')' | ']' | '}' => {
                if self.py_depth == 0 {
                    return Err(0);
                }
                self.py_depth -= 1;
            }
            _ => {}
        }
        self.py_args.push(c);
        Ok(())
    }
}

fn is_name_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

/// Arguments cut short that began as keyword arguments (or are empty).
fn looks_like_kwargs(args: &str) -> bool {
    let s = args.trim_start();
    let name_len = s.len() - s.trim_start_matches(pyargs::is_name_char).len();
    s.is_empty()
        || (name_len > 0 && {
            let rest = s[name_len..].trim_start();
            rest.is_empty() || rest.starts_with('=')
        })
}

#[cfg(test)]
mod tests;
