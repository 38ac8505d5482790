//! Reasoning blocks (`<think>...</think>`) split from the answer, as text
//! arrives.
//!
//! A block opens only at the very start of the answer (after whitespace), or
//! before it when the prompt already opened it; a later `<think>` is content.
//! The markers never come out; whitespace after `</think>` is dropped. What
//! the splitter emits depends only on the text, not on how it was cut: a
//! marker split across pieces is held back only until it is, or cannot be,
//! a marker.

/// A piece of generated text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Inside the reasoning block.
    Reasoning(String),
    /// The answer.
    Content(String),
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    /// Before anything but whitespace: a block may still open.
    Start,
    /// Inside the block.
    Inside,
    /// After `</think>`: whitespace is dropped.
    After,
    /// The answer.
    Content,
}

/// Splits `<think>` blocks off generated text.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    st: St,
    /// Held back: leading whitespace and a prefix of `<think>` (at the
    /// start), or a prefix of `</think>` (inside).
    held: String,
    out: Vec<Piece>,
}

/// Pieces with adjacent ones of the same kind joined and empty ones dropped.
/// Two piece streams of the same text cut differently are equal once merged.
pub fn merge_pieces(pieces: impl IntoIterator<Item = Piece>) -> Vec<Piece> {
    let mut out = Vec::new();
    for p in pieces {
        push_merged(&mut out, p);
    }
    out
}

fn push_merged(out: &mut Vec<Piece>, p: Piece) {
    match (out.last_mut(), p) {
        (_, Piece::Reasoning(s) | Piece::Content(s)) if s.is_empty() => {}
        (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
        (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
        (_, p) => out.push(p),
    }
}

impl ReasoningSplitter {
    /// A splitter; `starts_inside` when the prompt already opened the block.
    pub fn new(starts_inside: bool) -> Self {
        Self {
            st: if starts_inside { St::Inside } else { St::Start },
            held: String::new(),
            out: Vec::new(),
        }
    }

    /// The pieces the new text completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        match self.st {
            // The common case, a character at a time only where it matters.
            St::Content => push_merged(&mut self.out, Piece::Content(text.to_string())),
            _ => {
                for c in text.chars() {
                    self.feed(c);
                }
            }
        }
        std::mem::take(&mut self.out)
    }

    /// The pieces left at the end.
    pub fn finish(&mut self) -> Vec<Piece> {
        let held = std::mem::take(&mut self.held);
        match self.st {
            St::Inside => push_merged(&mut self.out, Piece::Reasoning(held)),
            St::Start | St::Content => push_merged(&mut self.out, Piece::Content(held)),
            St::After => {}
        }
        self.st = St::Content;
        std::mem::take(&mut self.out)
    }

    fn feed(&mut self, c: char) {
        match self.st {
            St::Start => {
                self.held.push(c);
                let rest = self.held.trim_start();
                if rest == OPEN {
                    self.held.clear();
                    self.st = St::Inside;
                } else if !OPEN.starts_with(rest) {
                    let held = std::mem::take(&mut self.held);
                    push_merged(&mut self.out, Piece::Content(held));
                    self.st = St::Content;
                }
            }
            St::Inside => {
                self.held.push(c);
                // The longest suffix that may still become `</think>` stays.
                loop {
                    if self.held == CLOSE {
                        self.held.clear();
                        self.st = St::After;
                        return;
                    }
                    if CLOSE.starts_with(self.held.as_str()) {
                        return;
                    }
                    let mut rest = self.held.chars();
                    let first = rest.next().map(String::from).unwrap_or_default();
                    self.held = rest.collect();
                    push_merged(&mut self.out, Piece::Reasoning(first));
                }
            }
            St::After => {
                if !c.is_whitespace() {
                    self.st = St::Content;
                    push_merged(&mut self.out, Piece::Content(c.to_string()));
                }
            }
            St::Content => push_merged(&mut self.out, Piece::Content(c.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split(starts_inside: bool, chunks: &[&str]) -> Vec<Piece> {
        let mut s = ReasoningSplitter::new(starts_inside);
        let mut all = Vec::new();
        for c in chunks {
            all.extend(s.push(c));
        }
        all.extend(s.finish());
        merge_pieces(all)
    }

    fn r(s: &str) -> Piece {
        Piece::Reasoning(s.into())
    }

    fn c(s: &str) -> Piece {
        Piece::Content(s.into())
    }

    #[test]
    fn a_leading_block_is_split_off() {
        // Qwen3 / DeepSeek-R1 style.
        let text = "<think>\nThe user wants Paris.\n</think>\n\nParis is sunny.";
        assert_eq!(
            split(false, &[text]),
            vec![r("\nThe user wants Paris.\n"), c("Paris is sunny.")]
        );
        assert_eq!(
            split(false, &["  \n<thi", "nk>a</th", "ink>", "  ", "b"]),
            vec![r("a"), c("b")]
        );
        // Qwen3 with thinking off writes an empty block.
        assert_eq!(
            split(false, &["<think>\n\n</think>\n\nHi"]),
            vec![r("\n\n"), c("Hi")]
        );
    }

    #[test]
    fn the_prompt_may_open_the_block() {
        assert_eq!(
            split(true, &["I should ", "check.</", "think>Done"]),
            vec![r("I should check."), c("Done")]
        );
        // Cut by max_tokens inside the block: all of it is reasoning.
        assert_eq!(
            split(true, &["still thinking </thi"]),
            vec![r("still thinking </thi")]
        );
        assert_eq!(split(false, &["<think>abc"]), vec![r("abc")]);
    }

    #[test]
    fn later_or_partial_markers_are_content() {
        assert_eq!(
            split(false, &["Use <think> tags.</think>"]),
            vec![c("Use <think> tags.</think>")]
        );
        assert_eq!(split(false, &["  <thin"]), vec![c("  <thin")]);
        assert_eq!(split(false, &["<b>bold</b>"]), vec![c("<b>bold</b>")]);
        assert_eq!(split(false, &["  "]), vec![c("  ")]);
        assert_eq!(split(false, &[""]), vec![]);
        // A second block after the first is content.
        assert_eq!(
            split(false, &["<think>a</think><think>b</think>"]),
            vec![r("a"), c("<think>b</think>")]
        );
        assert_eq!(split(true, &["a<</think>b"]), vec![r("a<"), c("b")]);
        assert_eq!(split(true, &["</think>"]), vec![]);
    }

    #[test]
    fn partial_markers_are_released_as_soon_as_they_cannot_be_markers() {
        let mut s = ReasoningSplitter::new(false);
        assert_eq!(s.push(" <th"), vec![]);
        assert_eq!(s.push("x"), vec![c(" <thx")]);
        let mut s = ReasoningSplitter::new(true);
        assert_eq!(s.push("ab</th"), vec![r("ab")]);
        assert_eq!(s.push("e"), vec![r("</the")]);
    }

    fn text_strategy() -> impl Strategy<Value = String> {
        let atoms = prop::collection::vec(
            prop_oneof![
                Just("<think>".to_string()),
                Just("</think>".to_string()),
                Just("<".to_string()),
                Just("</".to_string()),
                Just("<th".to_string()),
                Just("</thi".to_string()),
                Just(" ".to_string()),
                Just("\n".to_string()),
                "[a-z]{1,4}",
                "[é😀 ]{1,2}",
            ],
            0..12,
        );
        atoms.prop_map(|v| v.concat())
    }

    /// Cuts `text` at these fractions (on character boundaries).
    fn cut<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
        let bounds: Vec<usize> = (0..=text.len())
            .filter(|i| text.is_char_boundary(*i))
            .collect();
        let mut at: Vec<usize> = cuts.iter().map(|c| bounds[c % bounds.len()]).collect();
        at.push(0);
        at.push(text.len());
        at.sort_unstable();
        at.dedup();
        at.windows(2).map(|w| &text[w[0]..w[1]]).collect()
    }

    proptest! {
        #[test]
        fn any_split_gives_the_same_pieces(
            text in text_strategy(),
            cuts in prop::collection::vec(0usize..1000, 0..8),
            inside: bool,
        ) {
            let whole = split(inside, &[text.as_str()]);
            let pieces = cut(&text, &cuts);
            prop_assert_eq!(split(inside, &pieces), whole.clone());
            // Without a block, nothing is lost.
            let joined: String = whole.iter().map(|p| match p {
                Piece::Reasoning(s) | Piece::Content(s) => s.as_str(),
            }).collect();
            prop_assert!(joined.len() <= text.len());
            let opens = text.trim_start().starts_with("<think>");
            if (!inside && !opens) || (inside && !text.contains("</think>")) {
                prop_assert_eq!(joined, text);
            }
        }
    }
}
