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
    // Integers as they are (`42`), floats as Python writes them (`42.0`):
    // minijinja converts an integral float to i64 on request, so ask first.
    if v.is_integer() {
        out.push_str(&v.to_string());
        return;
    }
    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    } else {
        out.push_str(&python_float(f));
    }
}

/// Python's `repr(float)`: the shortest text that reads back as the same
/// number, positional for decimal exponents -4 to 15 (`0.0001`, `10.0`),
/// scientific otherwise (`1e-05`, `1e+16`).
fn python_float(f: f64) -> String {
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = f.to_string();
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_python_writes_them() {
        // json.dumps([10.0, 3, -0.0, 0.0001, 1e-05, 1.5e-07, 1e15, 1e16,
        //             1.2345678901234568e+17, 47.37, 2**64 - 1, -12.5e300, 0.1 + 0.2])
        let values = serde_json::json!([
            10.0,
            3,
            -0.0,
            0.0001,
            1e-05,
            1.5e-07,
            1e15,
            1e16,
            1.2345678901234568e+17,
            47.37,
            18446744073709551615u64,
            -12.5e300,
            0.30000000000000004
        ]);
        let out = tojson(
            Value::from(minijinja::value::Serde(&values)),
            Kwargs::from_iter(std::iter::empty::<(&str, Value)>()),
        )
        .expect("serializes");
        assert_eq!(
            out.as_str(),
            Some(
                "[10.0, 3, -0.0, 0.0001, 1e-05, 1.5e-07, 1000000000000000.0, 1e+16, \
                 1.2345678901234568e+17, 47.37, 18446744073709551615, -1.25e+301, 0.30000000000000004]"
            )
        );
    }
}
