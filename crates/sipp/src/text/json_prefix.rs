//! Whether text is the beginning of some JSON document: what constrained JSON
//! output guarantees at every point of a stream, even when `max_tokens` cuts it.

/// Where the scanner is inside a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// A value may start here (after `[`, `,` in an array, `:`, or at the top).
    Value,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After `{` : a key or `}`.
    KeyOrClose,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value: `,` or the container's close (or nothing at the top).
    CommaOrClose,
}

/// True when `text` (leading and trailing whitespace allowed) can be extended
/// into one valid JSON value. The empty string is a prefix.
pub fn is_json_prefix(text: &str) -> bool {
    let b = text.as_bytes();
    let mut stack: Vec<u8> = Vec::new();
    let mut expect = Expect::Value;
    let mut i = 0;
    let mut done = false;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if done {
            return false;
        }
        match expect {
            Expect::Value | Expect::ValueOrClose => {
                if c == b']' && expect == Expect::ValueOrClose {
                    stack.pop();
                    i += 1;
                    expect = after_value(&stack, &mut done);
                    continue;
                }
                match c {
                    b'{' => {
                        stack.push(b'{');
                        expect = Expect::KeyOrClose;
                        i += 1;
                    }
                    b'[' => {
                        stack.push(b'[');
                        expect = Expect::ValueOrClose;
                        i += 1;
                    }
                    b'"' => match scan_string(b, i) {
                        StringEnd::Closed(end) => {
                            i = end;
                            expect = after_value(&stack, &mut done);
                        }
                        StringEnd::Open => return true,
                        StringEnd::Invalid => return false,
                    },
                    b't' | b'f' | b'n' => {
                        let word: &[u8] = match c {
                            b't' => b"true",
                            b'f' => b"false",
                            _ => b"null",
                        };
                        let n = word.len().min(b.len() - i);
                        if b[i..i + n] != word[..n] {
                            return false;
                        }
                        if n < word.len() {
                            return true;
                        }
                        i += n;
                        expect = after_value(&stack, &mut done);
                    }
                    b'-' | b'0'..=b'9' => {
                        let (end, complete) = scan_number(b, i);
                        match complete {
                            NumberEnd::Invalid => return false,
                            NumberEnd::AtEnd => return true,
                            NumberEnd::Complete => {
                                i = end;
                                expect = after_value(&stack, &mut done);
                            }
                        }
                    }
                    _ => return false,
                }
            }
            Expect::KeyOrClose | Expect::Key => {
                if c == b'}' && expect == Expect::KeyOrClose {
                    stack.pop();
                    i += 1;
                    expect = after_value(&stack, &mut done);
                    continue;
                }
                if c != b'"' {
                    return false;
                }
                match scan_string(b, i) {
                    StringEnd::Closed(end) => {
                        i = end;
                        expect = Expect::Colon;
                    }
                    StringEnd::Open => return true,
                    StringEnd::Invalid => return false,
                }
            }
            Expect::Colon => {
                if c != b':' {
                    return false;
                }
                i += 1;
                expect = Expect::Value;
            }
            Expect::CommaOrClose => {
                let top = stack.last().copied();
                match (c, top) {
                    (b',', Some(b'{')) => expect = Expect::Key,
                    (b',', Some(b'[')) => expect = Expect::Value,
                    (b'}', Some(b'{')) | (b']', Some(b'[')) => {
                        stack.pop();
                        expect = after_value(&stack, &mut done);
                    }
                    _ => return false,
                }
                i += 1;
            }
        }
    }
    true
}

fn after_value(stack: &[u8], done: &mut bool) -> Expect {
    if stack.is_empty() {
        *done = true;
    }
    Expect::CommaOrClose
}

enum StringEnd {
    /// Closed; the index after the closing quote.
    Closed(usize),
    /// The text ends inside the string.
    Open,
    /// A bad escape or a raw control character.
    Invalid,
}

/// Scans the string whose opening quote is at `start`.
fn scan_string(b: &[u8], start: usize) -> StringEnd {
    let mut i = start + 1;
    while i < b.len() {
        match b[i] {
            b'"' => return StringEnd::Closed(i + 1),
            b'\\' => {
                if i + 1 >= b.len() {
                    return StringEnd::Open;
                }
                match b[i + 1] {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                    b'u' => {
                        let hex = &b[i + 2..b.len().min(i + 6)];
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return StringEnd::Invalid;
                        }
                        if hex.len() < 4 {
                            return StringEnd::Open;
                        }
                        i += 6;
                    }
                    _ => return StringEnd::Invalid,
                }
            }
            c if c < 0x20 => return StringEnd::Invalid,
            _ => i += 1,
        }
    }
    StringEnd::Open
}

enum NumberEnd {
    Invalid,
    AtEnd,
    Complete,
}

/// Scans a number: (index after it, how it ended).
fn scan_number(b: &[u8], start: usize) -> (usize, NumberEnd) {
    let mut i = start;
    let digits = |i: &mut usize| {
        let s = *i;
        while *i < b.len() && b[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - s
    };
    if b[i] == b'-' {
        i += 1;
        if i == b.len() {
            return (i, NumberEnd::AtEnd);
        }
    }
    if b[i] == b'0' {
        i += 1;
    } else if digits(&mut i) == 0 {
        return (i, NumberEnd::Invalid);
    }
    if i < b.len() && b[i] == b'.' {
        i += 1;
        if digits(&mut i) == 0 {
            return (
                i,
                if i == b.len() {
                    NumberEnd::AtEnd
                } else {
                    NumberEnd::Invalid
                },
            );
        }
    }
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        i += 1;
        if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return (
                i,
                if i == b.len() {
                    NumberEnd::AtEnd
                } else {
                    NumberEnd::Invalid
                },
            );
        }
    }
    if i == b.len() {
        // A number at the very end may still grow; it is a prefix either way.
        return (i, NumberEnd::AtEnd);
    }
    (i, NumberEnd::Complete)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn prefixes_of_valid_documents_pass_and_broken_text_fails() {
        let doc = r#" {"a": [1, -2.5e+3, true, null, {"b": "x\"y\u00e9"}], "c": {}, "d": []} "#;
        for end in 0..=doc.len() {
            assert!(is_json_prefix(&doc[..end]), "{:?}", &doc[..end]);
        }
        for bad in [
            "}",
            "{]",
            "[1,]",
            "{\"a\" 1}",
            "{\"a\": tru ",
            "01",
            "[1] 2",
            "{\"a\":1,}",
            "\"\\x\"",
            "[-]",
            "[1.]",
            "{1: 2}",
            "nul ",
            "[\"a\nb\"]",
            "\"\\u12g4\"",
        ] {
            assert!(!is_json_prefix(bad), "{bad:?} is not a JSON prefix");
        }
    }

    proptest! {
        #[test]
        fn every_prefix_of_serialized_json_passes(v in arb_json()) {
            let text = serde_json::to_string_pretty(&v).expect("serializes");
            for (end, _) in text.char_indices().chain([(text.len(), ' ')]) {
                prop_assert!(is_json_prefix(&text[..end]), "{:?}", &text[..end]);
            }
        }

        #[test]
        fn a_complete_document_passes_exactly_when_serde_parses_it(s in "[\\[\\]{}:,\" a0-9.eE+-]{0,16}") {
            // Whatever serde accepts whole is also a prefix.
            if serde_json::from_str::<serde_json::Value>(&s).is_ok() {
                prop_assert!(is_json_prefix(&s), "{s:?}");
            }
        }
    }

    fn arb_json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i32>().prop_map(serde_json::Value::from),
            (-1e6f64..1e6).prop_map(serde_json::Value::from),
            "\\PC{0,8}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                prop::collection::btree_map("\\PC{0,6}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }
}
