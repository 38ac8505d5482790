//! Stop strings over token bytes in any split: the streamed text equals the
//! whole text cut at the first stop, and no stop string ever leaks.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sipp::text::TextEmitter;

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    // Layout: [n_stops][stop lengths...][cut stride][text bytes...]
    let n_stops = (data[0] % 4) as usize;
    if data.len() < 2 + n_stops {
        return;
    }
    let lens: Vec<usize> = data[1..1 + n_stops].iter().map(|b| (*b % 6) as usize + 1).collect();
    let stride = (data[1 + n_stops] % 7) as usize + 1;
    let mut rest = &data[2 + n_stops..];
    let mut stops = Vec::new();
    for l in lens {
        let take = l.min(rest.len());
        stops.push(String::from_utf8_lossy(&rest[..take]).into_owned());
        rest = &rest[take..];
    }
    let bytes = rest;
    // Only valid UTF-8 gives an exact oracle (replacement characters could
    // form or break a stop).
    if std::str::from_utf8(bytes).is_err() {
        let mut e = TextEmitter::new(&stops, false);
        for chunk in bytes.chunks(stride) {
            if e.push(chunk).stopped {
                return;
            }
        }
        let _ = e.finish();
        return;
    }
    let live: Vec<&String> = stops.iter().filter(|s| !s.is_empty()).collect();
    // The oracle: after each chunk, the text of the complete characters so
    // far; generation stops after the first chunk in which a stop occurs, cut
    // at the earliest start among the occurrences then visible.
    let mut expected = None;
    let mut end = 0;
    while end < bytes.len() {
        end = (end + stride).min(bytes.len());
        let mut visible = end;
        while std::str::from_utf8(&bytes[..visible]).is_err() {
            visible -= 1;
        }
        let t = std::str::from_utf8(&bytes[..visible]).expect("valid prefix");
        if let Some(cut) = live.iter().filter_map(|s| t.find(s.as_str())).min() {
            expected = Some(t[..cut].to_string());
            break;
        }
    }
    let expected = expected.unwrap_or_else(|| String::from_utf8_lossy(bytes).into_owned());
    let mut e = TextEmitter::new(&stops, false);
    let mut out = String::new();
    let mut stopped = false;
    for chunk in bytes.chunks(stride) {
        let s = e.push(chunk);
        out.push_str(&s.emit);
        if s.stopped {
            stopped = true;
            break;
        }
    }
    if !stopped {
        out.push_str(&e.finish());
    }
    assert_eq!(out, expected);
    for s in &live {
        assert!(!out.contains(s.as_str()), "stop {s:?} leaked");
    }
});
