//! Tool-call and reasoning parsers on any text in any split: the events are
//! the same as for the whole text at once (texts joined, argument fragments
//! joined), calls are numbered in order and never nest, text without calls
//! comes back unchanged, and nothing panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sipp::tools::parse::{merge_events, CallEvent, CallParser};
use sipp::tools::reasoning::{merge_pieces, Piece, ReasoningSplitter};
use sipp::tools::ToolFormat;

const FORMATS: [ToolFormat; 5] = [
    ToolFormat::Hermes,
    ToolFormat::Llama3,
    ToolFormat::Mistral,
    ToolFormat::Pythonic,
    ToolFormat::Generic,
];

fn calls(format: ToolFormat, chunks: &[&str]) -> Vec<CallEvent> {
    let mut p = CallParser::new(format);
    let mut all = Vec::new();
    for c in chunks {
        all.extend(p.push(c));
    }
    all.extend(p.finish());
    merge_events(all)
}

fn pieces(inside: bool, chunks: &[&str]) -> Vec<Piece> {
    let mut s = ReasoningSplitter::new(inside);
    let mut all = Vec::new();
    for c in chunks {
        all.extend(s.push(c));
    }
    all.extend(s.finish());
    merge_pieces(all)
}

fuzz_target!(|data: &[u8]| {
    // Layout: [format | inside << 7][n cuts][cuts...][text...]
    if data.len() < 2 {
        return;
    }
    let format = FORMATS[((data[0] & 0x7f) % 5) as usize];
    let inside = data[0] & 0x80 != 0;
    let n = (data[1] % 8) as usize;
    if data.len() < 2 + n {
        return;
    }
    let text = String::from_utf8_lossy(&data[2 + n..]).into_owned();
    let mut at: Vec<usize> = data[2..2 + n]
        .iter()
        .map(|b| {
            let mut i = *b as usize * text.len() / 255;
            while !text.is_char_boundary(i) {
                i += 1;
            }
            i
        })
        .collect();
    at.extend([0, text.len()]);
    at.sort_unstable();
    at.dedup();
    let chunks: Vec<&str> = at.windows(2).map(|w| &text[w[0]..w[1]]).collect();
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();

    let whole = calls(format, &[&text]);
    assert_eq!(
        calls(format, &chunks),
        whole,
        "{format:?} {text:?} {chunks:?}"
    );
    assert_eq!(
        calls(format, &chars),
        whole,
        "{format:?} {text:?} char by char"
    );
    let mut plain = String::new();
    let mut next = 0;
    let mut open = None;
    for e in &whole {
        match e {
            CallEvent::Text(s) => {
                assert!(open.is_none(), "text inside a call");
                plain.push_str(s);
            }
            CallEvent::Start { index, .. } => {
                assert!(open.is_none() && *index == next, "calls out of order");
                open = Some(*index);
                next += 1;
            }
            CallEvent::Arguments { index, .. } => assert_eq!(open, Some(*index)),
            CallEvent::End { index } => {
                assert_eq!(open, Some(*index));
                open = None;
            }
        }
    }
    assert!(open.is_none(), "a call never ended");
    if next == 0 {
        assert_eq!(plain, text, "{format:?}: text without calls changed");
    }

    let whole = pieces(inside, &[&text]);
    assert_eq!(pieces(inside, &chunks), whole, "{text:?} {chunks:?}");
    assert_eq!(pieces(inside, &chars), whole, "{text:?} char by char");
});
