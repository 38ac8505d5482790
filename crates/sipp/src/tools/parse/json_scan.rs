//! Character-at-a-time JSON scanning for the call parsers: where a value ends
//! (strict syntax, so text that is not JSON is told apart as soon as it goes
//! wrong), and JSON strings decoded as they arrive.

/// What a scanner made of one more character.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Consumed; the value goes on.
    More,
    /// Consumed; it was the value's last character.
    Done,
    /// Not consumed: the value (a number) ended just before it.
    Before,
    /// Not JSON.
    Invalid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    /// A value starts here.
    Value,
    /// After `[`: a value or `]`.
    ArrFirst,
    /// After `{`: a key or `}`.
    ObjFirst,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value inside a container: `,` or the close.
    Comma,
    /// Inside a string (a key when `key`).
    Str { key: bool, esc: Esc },
    /// Inside `true`, `false` or `null`, `at` letters matched.
    Lit { word: &'static str, at: usize },
    /// Inside a number.
    Num(Num),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Esc {
    No,
    Backslash,
    /// `\u` and this many hex digits.
    Hex(u8),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

impl Num {
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::ExpDigits)
    }

    /// The state after `c`, or none when `c` does not continue the number.
    fn next(self, c: char) -> Option<Num> {
        let digit = c.is_ascii_digit();
        Some(match (self, c) {
            (Num::Minus, '0') => Num::Zero,
            (Num::Minus, _) if digit => Num::Int,
            (Num::Int, _) if digit => Num::Int,
            (Num::Zero | Num::Int, '.') => Num::Dot,
            (Num::Zero | Num::Int | Num::Frac, 'e' | 'E') => Num::Exp,
            (Num::Dot | Num::Frac, _) if digit => Num::Frac,
            (Num::Exp, '+' | '-') => Num::ExpSign,
            (Num::Exp | Num::ExpSign | Num::ExpDigits, _) if digit => Num::ExpDigits,
            _ => return None,
        })
    }
}

/// Finds the end of one JSON value, fed from its first character (no leading
/// whitespace), validating as it goes.
#[derive(Debug, Clone)]
pub(crate) struct JsonScan {
    stack: Vec<u8>,
    st: St,
}

impl Default for JsonScan {
    fn default() -> Self {
        Self {
            stack: Vec::new(),
            st: St::Value,
        }
    }
}

impl JsonScan {
    /// The next character of the value.
    pub(crate) fn feed(&mut self, c: char) -> Step {
        match self.st {
            St::Value | St::ArrFirst => {
                if c.is_ascii_whitespace() && !self.stack.is_empty() {
                    return Step::More;
                }
                if c == ']' && self.st == St::ArrFirst {
                    return self.close();
                }
                self.value_start(c)
            }
            St::ObjFirst | St::Key => {
                if c.is_ascii_whitespace() {
                    Step::More
                } else if c == '}' && self.st == St::ObjFirst {
                    self.close()
                } else if c == '"' {
                    self.st = St::Str {
                        key: true,
                        esc: Esc::No,
                    };
                    Step::More
                } else {
                    Step::Invalid
                }
            }
            St::Colon => match c {
                ':' => {
                    self.st = St::Value;
                    Step::More
                }
                c if c.is_ascii_whitespace() => Step::More,
                _ => Step::Invalid,
            },
            St::Comma => match (c, self.stack.last()) {
                (c, _) if c.is_ascii_whitespace() => Step::More,
                (',', Some(b'{')) => {
                    self.st = St::Key;
                    Step::More
                }
                (',', Some(_)) => {
                    self.st = St::Value;
                    Step::More
                }
                ('}', Some(b'{')) | (']', Some(b'[')) => self.close(),
                _ => Step::Invalid,
            },
            St::Str { key, esc } => {
                let esc = match (esc, c) {
                    (Esc::No, '"') => {
                        if key {
                            self.st = St::Colon;
                            return Step::More;
                        }
                        return self.after_value();
                    }
                    (Esc::No, '\\') => Esc::Backslash,
                    (Esc::No, c) if (c as u32) < 0x20 => return Step::Invalid,
                    (Esc::No, _) => Esc::No,
                    (Esc::Backslash, '"' | '\\' | '/' | 'b' | 'f' | 'n' | 'r' | 't') => Esc::No,
                    (Esc::Backslash, 'u') => Esc::Hex(0),
                    (Esc::Hex(n), c) if c.is_ascii_hexdigit() => {
                        if n == 3 {
                            Esc::No
                        } else {
                            Esc::Hex(n + 1)
                        }
                    }
                    _ => return Step::Invalid,
                };
                self.st = St::Str { key, esc };
                Step::More
            }
            St::Lit { word, at } => {
                if word[at..].starts_with(c) {
                    if at + 1 == word.len() {
                        return self.after_value();
                    }
                    self.st = St::Lit { word, at: at + 1 };
                    Step::More
                } else {
                    Step::Invalid
                }
            }
            St::Num(n) => match n.next(c) {
                Some(n) => {
                    self.st = St::Num(n);
                    Step::More
                }
                None if !n.complete() => Step::Invalid,
                None if self.stack.is_empty() => Step::Before,
                None => {
                    // The number ended; `c` belongs to its container.
                    self.st = St::Comma;
                    self.feed(c)
                }
            },
        }
    }

    /// True when the text fed so far is a whole value (a number at the end of
    /// the text is one).
    pub(crate) fn complete_at_end(&self) -> bool {
        matches!(self.st, St::Num(n) if n.complete() && self.stack.is_empty())
    }

    fn value_start(&mut self, c: char) -> Step {
        match c {
            '{' => {
                self.stack.push(b'{');
                self.st = St::ObjFirst;
                Step::More
            }
            '[' => {
                self.stack.push(b'[');
                self.st = St::ArrFirst;
                Step::More
            }
            '"' => {
                self.st = St::Str {
                    key: false,
                    esc: Esc::No,
                };
                Step::More
            }
            't' | 'f' | 'n' => {
                let word = match c {
                    't' => "true",
                    'f' => "false",
                    _ => "null",
                };
                self.st = St::Lit { word, at: 1 };
                Step::More
            }
            '-' => {
                self.st = St::Num(Num::Minus);
                Step::More
            }
            '0' => {
                self.st = St::Num(Num::Zero);
                Step::More
            }
            c if c.is_ascii_digit() => {
                self.st = St::Num(Num::Int);
                Step::More
            }
            _ => Step::Invalid,
        }
    }

    fn close(&mut self) -> Step {
        self.stack.pop();
        self.after_value()
    }

    fn after_value(&mut self) -> Step {
        if self.stack.is_empty() {
            self.st = St::Value;
            Step::Done
        } else {
            self.st = St::Comma;
            Step::More
        }
    }
}

/// What a string decoder made of one more character.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StrStep {
    /// Consumed, the string goes on.
    More,
    /// The closing quote.
    Done,
    /// A bad escape or a raw control character.
    Invalid,
}

/// Decodes a JSON string's body (after its opening quote) as it arrives; a
/// `\u` escape comes out once its four digits are in (a high surrogate once
/// its low half is), a lone surrogate as U+FFFD.
#[derive(Debug, Clone, Default)]
pub(crate) struct StrDecoder {
    esc: Esc2,
    high: Option<u16>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Esc2 {
    #[default]
    No,
    Backslash,
    Hex(u8, u16),
}

impl StrDecoder {
    /// The next character; what it decodes to goes to `out`.
    pub(crate) fn feed(&mut self, c: char, out: &mut String) -> StrStep {
        match self.esc {
            Esc2::No => match c {
                '"' => {
                    self.flush_high(out);
                    *self = Self::default();
                    StrStep::Done
                }
                '\\' => {
                    self.esc = Esc2::Backslash;
                    StrStep::More
                }
                c if (c as u32) < 0x20 => StrStep::Invalid,
                c => {
                    self.put(c, out);
                    StrStep::More
                }
            },
            Esc2::Backslash => {
                let plain = match c {
                    '"' => '"',
                    '\\' => '\\',
                    '/' => '/',
                    'b' => '\u{8}',
                    'f' => '\u{c}',
                    'n' => '\n',
                    'r' => '\r',
                    't' => '\t',
                    'u' => {
                        self.esc = Esc2::Hex(0, 0);
                        return StrStep::More;
                    }
                    _ => return StrStep::Invalid,
                };
                self.esc = Esc2::No;
                self.put(plain, out);
                StrStep::More
            }
            Esc2::Hex(n, v) => {
                let Some(d) = c.to_digit(16) else {
                    return StrStep::Invalid;
                };
                let v = (v << 4) | d as u16;
                if n < 3 {
                    self.esc = Esc2::Hex(n + 1, v);
                    return StrStep::More;
                }
                self.esc = Esc2::No;
                match v {
                    0xD800..=0xDBFF => {
                        self.flush_high(out);
                        self.high = Some(v);
                    }
                    0xDC00..=0xDFFF => match self.high.take() {
                        Some(h) => {
                            let code =
                                0x10000 + (((h as u32) - 0xD800) << 10) + (v as u32 - 0xDC00);
                            out.push(char::from_u32(code).unwrap_or('\u{FFFD}'));
                        }
                        None => out.push('\u{FFFD}'),
                    },
                    v => self.put(char::from_u32(v as u32).unwrap_or('\u{FFFD}'), out),
                }
                StrStep::More
            }
        }
    }

    fn put(&mut self, c: char, out: &mut String) {
        self.flush_high(out);
        out.push(c);
    }

    fn flush_high(&mut self, out: &mut String) {
        if self.high.take().is_some() {
            out.push('\u{FFFD}');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(s: &str) -> (Vec<Step>, bool) {
        let mut j = JsonScan::default();
        let steps: Vec<Step> = s.chars().map(|c| j.feed(c)).collect();
        (steps, j.complete_at_end())
    }

    #[test]
    fn values_end_where_json_says() {
        for doc in [
            r#"{"a": [1, -2.5e+3, true, null, {"b": "x\"y\u00e9"}], "c": {}, "d": []}"#,
            r#""a \\ b""#,
            "[ ]",
            "{ }",
            "true",
            r#"["}", "]", {"k": "{"}]"#,
        ] {
            let (steps, _) = scan(doc);
            assert_eq!(steps.last(), Some(&Step::Done), "{doc}");
            assert!(
                steps[..steps.len() - 1].iter().all(|s| *s == Step::More),
                "{doc}"
            );
        }
        let (steps, end) = scan("12.5");
        assert!(steps.iter().all(|s| *s == Step::More) && end);
        let (steps, _) = scan("12,");
        assert_eq!(steps, vec![Step::More, Step::More, Step::Before]);
        let (steps, _) = scan("[12]");
        assert_eq!(steps.last(), Some(&Step::Done));
    }

    #[test]
    fn broken_json_is_invalid() {
        for bad in [
            "{a",
            "[1,,2]",
            "{\"a\" 1}",
            "tru e",
            "01",
            "-",
            "\"\\x\"",
            "[1}",
            "1.e5",
            "{\"a\":1,}",
        ] {
            let (steps, end) = scan(bad);
            assert!(
                steps.contains(&Step::Invalid)
                    || steps.contains(&Step::Before)
                    || (!end && steps.last() != Some(&Step::Done)),
                "{bad}: {steps:?}"
            );
        }
    }

    #[test]
    fn strings_decode_as_they_arrive() {
        let mut d = StrDecoder::default();
        let mut out = String::new();
        let body = r#"a\"b\\c\/\n\u00e9\ud83d\ude00\ud800x""#;
        let steps: Vec<StrStep> = body.chars().map(|c| d.feed(c, &mut out)).collect();
        assert_eq!(steps.last(), Some(&StrStep::Done));
        assert_eq!(out, "a\"b\\c/\né😀\u{FFFD}x");
        let mut d = StrDecoder::default();
        assert_eq!(d.feed('\u{1}', &mut out), StrStep::Invalid);
    }
}
