//! Text emission: token bytes to whole UTF-8 characters, stop strings matched
//! across token boundaries with hold-back, and finish reasons.

mod json_prefix;

pub use json_prefix::is_json_prefix;

use serde::{Deserialize, Serialize};

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop string matched.
    Stop,
    /// The model produced an end-of-generation token.
    Eos,
    /// max_tokens reached, or the context window is full.
    Length,
    /// Cancelled by the caller (or the caller went away).
    Cancelled,
}

impl FinishReason {
    /// The name OpenAI's API uses (`stop` covers both stop strings and EOS).
    pub fn openai_name(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::Eos => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }

    /// Our own name.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Eos => "eos",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Carries the bytes of an unfinished UTF-8 character from one token to the next.
#[derive(Debug, Default, Clone)]
pub struct Utf8Carry {
    /// Bytes of a character that is not complete yet.
    pub pending_utf8_bytes: Vec<u8>,
}

impl Utf8Carry {
    /// Adds a token's bytes; returns the text of every character now complete.
    /// Bytes that can never start or continue a valid character become U+FFFD.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending_utf8_bytes.extend_from_slice(bytes);
        let mut out = String::new();
        let mut buf: &[u8] = &self.pending_utf8_bytes;
        loop {
            match std::str::from_utf8(buf) {
                Ok(s) => {
                    out.push_str(s);
                    buf = &[];
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: from_utf8 validated this prefix.
                    out.push_str(std::str::from_utf8(&buf[..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            buf = &buf[valid + bad..];
                        }
                        None => {
                            buf = &buf[valid..];
                            break;
                        }
                    }
                }
            }
        }
        let rest = buf.to_vec();
        self.pending_utf8_bytes = rest;
        out
    }

    /// Ends the stream: an incomplete character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        if self.pending_utf8_bytes.is_empty() {
            String::new()
        } else {
            self.pending_utf8_bytes.clear();
            char::REPLACEMENT_CHARACTER.to_string()
        }
    }
}

/// Finds stop strings in streamed text, holding back any tail that could still
/// become one.
#[derive(Debug, Default, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// A matched stop string is emitted with the text before it.
    keep_stop: bool,
}

/// The result of pushing text through a [`StopMatcher`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StopScan {
    /// Text safe to emit now.
    pub emit: String,
    /// Whether a stop string matched (text after it is dropped).
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for these stop strings (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            keep_stop: false,
        }
    }

    /// A matcher that keeps the stop string it matched at the end of the
    /// text (the earliest match; the longest stop among those starting there).
    pub fn keeping_stop(stops: &[String]) -> Self {
        Self {
            keep_stop: true,
            ..Self::new(stops)
        }
    }

    /// Text held back because it might start a stop string.
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Adds text; returns what can be emitted and whether a stop matched.
    pub fn push(&mut self, text: &str) -> StopScan {
        if self.stops.is_empty() {
            return StopScan {
                emit: text.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(text);
        // The earliest match; at one position, the longest stop.
        let first_match = self
            .stops
            .iter()
            .filter_map(|s| {
                self.held
                    .find(s.as_str())
                    .map(|at| (at, usize::MAX - s.len()))
            })
            .min();
        if let Some((at, rev_len)) = first_match {
            let end = if self.keep_stop {
                at + (usize::MAX - rev_len)
            } else {
                at
            };
            let emit = self.held[..end].to_string();
            self.held.clear();
            return StopScan {
                emit,
                stopped: true,
            };
        }
        let keep = self.holdback_len();
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopScan {
            emit,
            stopped: false,
        }
    }

    /// Ends the stream without a match: everything held is emitted.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest tail of `held` that is a proper prefix of a stop.
    fn holdback_len(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            let max = stop.len().saturating_sub(1).min(self.held.len());
            for len in (best + 1..=max).rev() {
                let start = self.held.len() - len;
                if self.held.is_char_boundary(start) && stop.starts_with(&self.held[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

/// Token bytes in, emittable text out: UTF-8 carry then stop matching.
#[derive(Debug, Default, Clone)]
pub struct TextEmitter {
    utf8: Utf8Carry,
    stops: StopMatcher,
}

impl TextEmitter {
    /// An emitter with these stop strings; `keep_stop` leaves a matched one
    /// at the end of the text.
    pub fn new(stops: &[String], keep_stop: bool) -> Self {
        Self {
            utf8: Utf8Carry::default(),
            stops: if keep_stop {
                StopMatcher::keeping_stop(stops)
            } else {
                StopMatcher::new(stops)
            },
        }
    }

    /// Adds one token's bytes.
    pub fn push(&mut self, bytes: &[u8]) -> StopScan {
        let text = self.utf8.push(bytes);
        if text.is_empty() {
            return StopScan::default();
        }
        self.stops.push(&text)
    }

    /// Whether text is held back (the slot is in `EmitBuffered`).
    pub fn is_buffering(&self) -> bool {
        !self.stops.held().is_empty() || !self.utf8.pending_utf8_bytes.is_empty()
    }

    /// Ends the stream without a stop match: releases everything held.
    pub fn finish(&mut self) -> String {
        let tail = self.utf8.finish();
        let mut out = if tail.is_empty() {
            String::new()
        } else {
            self.stops.push(&tail).emit
        };
        out.push_str(&self.stops.flush());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn carries_split_characters() {
        let mut c = Utf8Carry::default();
        let bytes = "日🙂".as_bytes();
        let mut out = String::new();
        for b in bytes {
            let s = c.push(&[*b]);
            assert!(s.is_empty() || s == "日" || s == "🙂");
            out.push_str(&s);
        }
        assert_eq!(out, "日🙂");
        assert!(c.pending_utf8_bytes.is_empty());
    }

    #[test]
    fn invalid_bytes_become_replacement() {
        let mut c = Utf8Carry::default();
        assert_eq!(c.push(&[b'a', 0xFF, b'b']), "a\u{FFFD}b");
        assert_eq!(c.push(&[0xE6, 0x97]), "");
        assert_eq!(c.finish(), "\u{FFFD}");
    }

    #[test]
    fn stop_across_pushes_never_leaks() {
        let mut m = StopMatcher::new(&["</end>".to_string()]);
        let mut out = String::new();
        for piece in ["hello </", "en", "d> tail"] {
            let s = m.push(piece);
            out.push_str(&s.emit);
            if s.stopped {
                break;
            }
        }
        assert_eq!(out, "hello ");
    }

    #[test]
    fn false_start_is_released() {
        let mut m = StopMatcher::new(&["STOP".to_string()]);
        assert_eq!(m.push("ab ST").emit, "ab ");
        assert_eq!(m.push("ART").emit, "START");
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let mut m = StopMatcher::new(&["cd".to_string(), "b".to_string()]);
        let s = m.push("abcd");
        assert_eq!(
            s,
            StopScan {
                emit: "a".into(),
                stopped: true
            }
        );
    }

    #[test]
    fn a_kept_stop_ends_the_text_and_the_longest_at_a_position_wins() {
        let stops = ["b".to_string(), "bcd".to_string(), "zz".to_string()];
        let mut m = StopMatcher::keeping_stop(&stops);
        assert_eq!(m.push("a").emit, "a");
        let s = m.push("bcde tail");
        assert!(s.stopped);
        assert_eq!(s.emit, "bcd");
        // Held-back text that turned out to be a stop is released with it.
        let mut m = StopMatcher::keeping_stop(&["</end>".to_string()]);
        assert_eq!(m.push("x </e").emit, "x ");
        assert_eq!(m.push("nd> y").emit, "</end>");
    }

    proptest! {
        // Streaming in any split equals matching the whole text at once,
        // with the stop trimmed or kept.
        #[test]
        fn streaming_equals_whole(text in "[abc\u{e9}\u{65e5}]{0,40}", stop in "[abc\u{e9}]{1,3}", cuts in proptest::collection::vec(0usize..50, 0..8), keep in any::<bool>()) {
            let bytes = text.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.sort_unstable();
            let mut e = TextEmitter::new(&[stop.clone()], keep);
            let mut out = String::new();
            let mut prev = 0;
            let mut stopped = false;
            for c in cuts.into_iter().chain([bytes.len()]) {
                let s = e.push(&bytes[prev..c]);
                out.push_str(&s.emit);
                prev = c;
                if s.stopped { stopped = true; break; }
            }
            if !stopped { out.push_str(&e.finish()); }
            let expected = match text.find(&stop) {
                Some(i) if keep => &text[..i + stop.len()],
                Some(i) => &text[..i],
                None => &text[..],
            };
            prop_assert_eq!(out, expected);
        }
    }
}
