//! `tojson` as transformers defines it: Python's `json.dumps` with
//! `ensure_ascii=False` (", " and ": " separators, no HTML escaping, insertion
//! order), which templates rely on to reproduce the text models were trained on.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

fn escape(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

fn number(v: &Value, out: &mut String) {
    if let Some(i) = v.as_i64() {
        out.push_str(&i.to_string());
        return;
    }
    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    } else if f.fract() == 0.0 && f.abs() < 1e16 {
        out.push_str(&format!("{f:.1}"));
    } else {
        out.push_str(&format!("{f}"));
    }
}

struct Style {
    indent: Option<String>,
    sort_keys: bool,
}

fn newline(style: &Style, level: usize, out: &mut String) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write(v: &Value, style: &Style, level: usize, out: &mut String) -> Result<(), Error> {
    let item_sep = if style.indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => number(v, out),
        ValueKind::String => escape(v.as_str().unwrap_or_default(), out),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if style.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(style, level + 1, out);
                match k.as_str() {
                    Some(s) => escape(s, out),
                    None => escape(&k.to_string(), out),
                }
                out.push_str(": ");
                write(&v.get_item(k)?, style, level + 1, out)?;
            }
            newline(style, level, out);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(style, level + 1, out);
                write(item, style, level + 1, out)?;
            }
            newline(style, level, out);
            out.push(']');
        }
        ValueKind::Invalid => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "cannot serialize an invalid value",
            ))
        }
        _ => escape(&v.to_string(), out),
    }
    Ok(())
}

/// The `tojson` filter: `value | tojson(indent=None, sort_keys=False)`.
pub fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.clamp(0, 16) as usize)),
            None => Some(v.as_str().unwrap_or_default().to_string()),
        },
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let style = Style {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write(&value, &style, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}
