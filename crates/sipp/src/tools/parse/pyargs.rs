//! Python-style keyword arguments (`city="Paris", days=3`) to a JSON object's
//! text: values are Python literals or JSON (strings in either quotes,
//! numbers, `True`/`False`/`None` and `true`/`false`/`null`, lists, tuples and
//! dicts).

use super::json_scan::{JsonScan, Step};

/// The arguments between a call's parentheses as a JSON object's text
/// (`{"city": "Paris", "days": 3}`), or none when they are not keyword
/// arguments with literal values.
pub(crate) fn kwargs_to_json(src: &str) -> Option<String> {
    let mut p = Py {
        s: src.chars().collect(),
        i: 0,
    };
    let mut out = String::from("{");
    let mut first = true;
    loop {
        p.ws();
        if p.at_end() {
            break;
        }
        let key = p.key()?;
        p.ws();
        p.eat('=')?;
        p.ws();
        if !first {
            out.push_str(", ");
        }
        first = false;
        out.push_str(&json_string(&key));
        out.push_str(": ");
        p.value(&mut out, 0)?;
        p.ws();
        if p.at_end() {
            break;
        }
        p.eat(',')?;
    }
    out.push('}');
    Some(out)
}

/// A character that may be part of a keyword (parameters are named as their
/// schema names them).
pub(crate) fn is_name_char(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '$' | '@')
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// Nesting deeper than this is refused (no stack overflow on hostile text).
const MAX_DEPTH: usize = 64;

struct Py {
    s: Vec<char>,
    i: usize,
}

impl Py {
    fn at_end(&self) -> bool {
        self.i >= self.s.len()
    }

    fn peek(&self) -> Option<char> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: char) -> Option<()> {
        (self.peek() == Some(c)).then(|| self.i += 1)
    }

    fn key(&mut self) -> Option<String> {
        let start = self.i;
        while self.peek().is_some_and(is_name_char) {
            self.i += 1;
        }
        (self.i > start).then(|| self.s[start..self.i].iter().collect())
    }

    fn value(&mut self, out: &mut String, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            '"' | '\'' => {
                let s = self.string()?;
                out.push_str(&json_string(&s));
            }
            '[' => self.seq(']', out, depth)?,
            '(' => self.seq(')', out, depth)?,
            '{' => self.dict(out, depth)?,
            c if c.is_ascii_digit() || matches!(c, '-' | '+' | '.') => self.number(out)?,
            c if c.is_alphabetic() || c == '_' => {
                let start = self.i;
                while self.peek().is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    self.i += 1;
                }
                let word: String = self.s[start..self.i].iter().collect();
                out.push_str(match word.as_str() {
                    "True" | "true" => "true",
                    "False" | "false" => "false",
                    "None" | "null" => "null",
                    _ => return None,
                });
            }
            _ => return None,
        }
        Some(())
    }

    /// A list or tuple, as a JSON array.
    fn seq(&mut self, close: char, out: &mut String, depth: usize) -> Option<()> {
        self.i += 1;
        out.push('[');
        let mut first = true;
        loop {
            self.ws();
            if self.eat(close).is_some() {
                break;
            }
            if !first {
                out.push_str(", ");
            }
            first = false;
            self.value(out, depth + 1)?;
            self.ws();
            if self.eat(',').is_none() {
                self.ws();
                self.eat(close)?;
                break;
            }
        }
        out.push(']');
        Some(())
    }

    fn dict(&mut self, out: &mut String, depth: usize) -> Option<()> {
        self.i += 1;
        out.push('{');
        let mut first = true;
        loop {
            self.ws();
            if self.eat('}').is_some() {
                break;
            }
            if !first {
                out.push_str(", ");
            }
            first = false;
            // Keys are strings in JSON: a string key as it is, any other
            // literal by its JSON text.
            let key = match self.peek()? {
                '"' | '\'' => self.string()?,
                _ => {
                    let mut k = String::new();
                    self.value(&mut k, depth + 1)?;
                    k
                }
            };
            out.push_str(&json_string(&key));
            self.ws();
            self.eat(':')?;
            self.ws();
            out.push_str(": ");
            self.value(out, depth + 1)?;
            self.ws();
            if self.eat(',').is_none() {
                self.ws();
                self.eat('}')?;
                break;
            }
        }
        out.push('}');
        Some(())
    }

    fn number(&mut self, out: &mut String) -> Option<()> {
        let start = self.i;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_digit() || matches!(c, '-' | '+' | '.' | 'e' | 'E' | '_'))
        {
            self.i += 1;
        }
        let text: String = self.s[start..self.i]
            .iter()
            .filter(|c| **c != '_')
            .collect();
        let text = text.strip_prefix('+').unwrap_or(&text);
        if is_json_number(text) {
            out.push_str(text);
            return Some(());
        }
        let n: f64 = text.parse().ok()?;
        if n.is_finite() && n.fract() == 0.0 && n.abs() < 1e15 && !text.contains(['.', 'e', 'E']) {
            out.push_str(&format!("{}", n as i64));
        } else {
            out.push_str(&serde_json::Number::from_f64(n)?.to_string());
        }
        Some(())
    }

    /// A quoted string (either quote, or tripled), Python's escapes decoded.
    fn string(&mut self) -> Option<String> {
        let q = self.peek()?;
        let triple = self.s.get(self.i + 1) == Some(&q) && self.s.get(self.i + 2) == Some(&q);
        self.i += if triple { 3 } else { 1 };
        let mut s = String::new();
        let mut high: Option<u32> = None;
        loop {
            let c = self.peek()?;
            self.i += 1;
            if c == q {
                if !triple {
                    break;
                }
                if self.s.get(self.i) == Some(&q) && self.s.get(self.i + 1) == Some(&q) {
                    self.i += 2;
                    break;
                }
            }
            if c != '\\' {
                push_code(&mut s, &mut high, c as u32);
                continue;
            }
            let e = self.peek()?;
            self.i += 1;
            let plain = match e {
                '\\' => '\\',
                '\'' => '\'',
                '"' => '"',
                '/' => '/',
                'n' => '\n',
                't' => '\t',
                'r' => '\r',
                'b' => '\u{8}',
                'f' => '\u{c}',
                'v' => '\u{b}',
                'a' => '\u{7}',
                '0' => '\0',
                '\n' => continue,
                'x' | 'u' | 'U' => {
                    let n = match e {
                        'x' => 2,
                        'u' => 4,
                        _ => 8,
                    };
                    let hex: String = self.s.get(self.i..self.i + n)?.iter().collect();
                    let code = u32::from_str_radix(&hex, 16).ok()?;
                    if !hex.chars().all(|c| c.is_ascii_hexdigit()) {
                        return None;
                    }
                    self.i += n;
                    push_code(&mut s, &mut high, code);
                    continue;
                }
                other => {
                    // Python keeps unknown escapes as written.
                    push_code(&mut s, &mut high, '\\' as u32);
                    other
                }
            };
            push_code(&mut s, &mut high, plain as u32);
        }
        if high.is_some() {
            s.push('\u{FFFD}');
        }
        Some(s)
    }
}

/// Appends a code point, pairing UTF-16 surrogates written as escapes.
fn push_code(s: &mut String, high: &mut Option<u32>, code: u32) {
    match code {
        0xD800..=0xDBFF => {
            if high.replace(code).is_some() {
                s.push('\u{FFFD}');
            }
        }
        0xDC00..=0xDFFF => match high.take() {
            Some(h) => {
                let c = 0x10000 + ((h - 0xD800) << 10) + (code - 0xDC00);
                s.push(char::from_u32(c).unwrap_or('\u{FFFD}'));
            }
            None => s.push('\u{FFFD}'),
        },
        _ => {
            if high.take().is_some() {
                s.push('\u{FFFD}');
            }
            s.push(char::from_u32(code).unwrap_or('\u{FFFD}'));
        }
    }
}

fn is_json_number(text: &str) -> bool {
    let mut j = JsonScan::default();
    !text.is_empty() && text.chars().all(|c| j.feed(c) == Step::More) && j.complete_at_end()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(src: &str) -> Option<serde_json::Value> {
        kwargs_to_json(src).map(|j| serde_json::from_str(&j).expect("valid JSON"))
    }

    #[test]
    fn python_and_json_literals_become_json() {
        assert_eq!(
            kwargs_to_json(r#"city="Paris", days=3"#).as_deref(),
            Some(r#"{"city": "Paris", "days": 3}"#)
        );
        assert_eq!(kwargs_to_json("").as_deref(), Some("{}"));
        assert_eq!(kwargs_to_json("  ").as_deref(), Some("{}"));
        assert_eq!(
            parsed(
                r#"a='it\'s', b=True, c=None, d=[1, 2.5, -3e2,], e=(1,), f={'k': "v", 2: false}, g=+1, h=1_000, i=.5"#
            ),
            Some(serde_json::json!({
                "a": "it's", "b": true, "c": null, "d": [1, 2.5, -300.0], "e": [1],
                "f": {"k": "v", "2": false}, "g": 1, "h": 1000, "i": 0.5
            }))
        );
        assert_eq!(
            parsed(r#"s="\u00e9\ud83d\ude00\n", t="""a"b""", u={"x": {"y": []}}"#),
            Some(serde_json::json!({"s": "é😀\n", "t": "a\"b", "u": {"x": {"y": []}}}))
        );
    }

    #[test]
    fn other_python_is_refused() {
        for bad in [
            "1, 2", "a", "a=", "a=b", "a=f(1)", "a=1 b=2", "a=[1", "a='x", "=1", "a=0x1f",
        ] {
            assert_eq!(kwargs_to_json(bad), None, "{bad}");
        }
        let deep = format!("a={}{}", "[".repeat(100), "]".repeat(100));
        assert_eq!(kwargs_to_json(&deep), None);
    }
}
