//! Token acceptance and stop rules: what one sampled token does to a
//! generation (its text, its log-probabilities, whether it ends it). Pure:
//! the vocabulary is read-only data and nothing here talks to llama.cpp.

use crate::engine::{GenerateSpec, TextDelta, TokenLogprobs};
use crate::runtime::{SampledLogprobs, Token, Vocab};
use crate::text::{FinishReason, TextEmitter};

/// A generation in progress.
#[derive(Debug)]
pub struct Generation {
    /// Its settings.
    pub spec: GenerateSpec,
    emitter: TextEmitter,
    /// Text emitted so far.
    pub text: String,
    /// Tokens sampled so far.
    pub tokens: Vec<Token>,
    /// Their log-probabilities, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
    /// Tokens to feed next instead of sampling (a reasoning budget's close).
    forced: std::collections::VecDeque<Token>,
}

/// What accepting a token produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Accepted {
    /// The delta to send.
    pub delta: TextDelta,
    /// Set when the token ends the generation.
    pub finish: Option<FinishReason>,
    /// Text is held back (it may start a stop string).
    pub buffering: bool,
}

impl Generation {
    /// A generation with these settings.
    pub fn new(spec: GenerateSpec) -> Self {
        Self {
            emitter: TextEmitter::new(&spec.stop, spec.include_stop),
            spec,
            text: String::new(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            forced: Default::default(),
        }
    }

    /// The token the next step must produce instead of sampling, if any.
    pub fn forced_next(&self) -> Option<Token> {
        self.forced.front().copied()
    }

    /// At the reasoning budget: still inside the `<think>` block, force its
    /// close. Checked once, when the generation reaches the budget.
    fn check_budget(&mut self) {
        let Some(b) = &self.spec.reasoning_budget else {
            return;
        };
        if self.tokens.len() != b.max_tokens.max(1) {
            return;
        }
        let opened = b.starts_inside || self.text.trim_start().starts_with("<think>");
        if opened && !self.text.contains("</think>") {
            self.forced = b.close.iter().copied().collect();
        }
    }

    /// Accepts a sampled token. `context_len` is the number of tokens the
    /// sequence will hold before this one is fed; the generation ends with
    /// `length` when the next position would pass `n_ctx`.
    pub fn accept(
        &mut self,
        vocab: &dyn Vocab,
        token: Token,
        logprobs: Option<SampledLogprobs>,
        context_len: usize,
        n_ctx: usize,
    ) -> Accepted {
        if self.forced.front() == Some(&token) {
            self.forced.pop_front();
        }
        self.tokens.push(token);
        let mut delta = TextDelta {
            tokens: vec![token],
            ..TextDelta::default()
        };
        if let Some(lp) = logprobs {
            let entry = TokenLogprobs {
                token,
                text: String::from_utf8_lossy(&vocab.token_bytes(token)).into_owned(),
                logprobs: lp,
            };
            self.logprobs.push(entry.clone());
            delta.logprobs.push(entry);
        }
        let finish = if vocab.is_eog(token) && !self.spec.ignore_eos {
            Some(FinishReason::Eos)
        } else {
            let bytes = if self.spec.skip_special_tokens {
                vocab.token_bytes(token)
            } else {
                vocab.token_bytes_special(token)
            };
            let scan = self.emitter.push(&bytes);
            delta.text = scan.emit;
            if scan.stopped {
                Some(FinishReason::Stop)
            } else if self.tokens.len() >= self.spec.max_tokens || context_len + 1 > n_ctx {
                Some(FinishReason::Length)
            } else {
                None
            }
        };
        self.text.push_str(&delta.text);
        self.check_budget();
        Accepted {
            delta,
            finish,
            buffering: self.emitter.is_buffering(),
        }
    }

    /// Ends the generation: text held back for a possible stop string is
    /// released when it ended by EOS or length (a matched stop, a cancel or a
    /// failure drops it). Returns that text as a delta, if any.
    pub fn end(&mut self, reason: FinishReason) -> Option<TextDelta> {
        if !matches!(reason, FinishReason::Eos | FinishReason::Length) {
            return None;
        }
        let tail = self.emitter.finish();
        if tail.is_empty() {
            return None;
        }
        self.text.push_str(&tail);
        Some(TextDelta {
            text: tail,
            ..TextDelta::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::fake::{FakeBackend, FakeConfig};
    use crate::runtime::Backend;
    use crate::sampling::SamplingParams;

    fn spec(max_tokens: usize, stop: &[&str], ignore_eos: bool) -> GenerateSpec {
        GenerateSpec {
            max_tokens,
            stop: stop.iter().map(|s| s.to_string()).collect(),
            ignore_eos,
            sampling: SamplingParams::greedy(),
            seed: 0,
            constraint: None,
            logprobs: None,
            reasoning_budget: None,
            speculative: Default::default(),
            skip_special_tokens: true,
            include_stop: false,
        }
    }

    fn vocab() -> std::sync::Arc<dyn Vocab> {
        FakeBackend::new(FakeConfig::default()).vocab()
    }

    fn token_of(v: &dyn Vocab, text: &str) -> Token {
        let t = v.tokenize(text, false, false).expect("tokenize");
        assert_eq!(t.len(), 1, "{text:?} is one token");
        t[0]
    }

    #[test]
    fn eos_ends_unless_ignored_and_its_text_is_not_emitted() {
        let v = vocab();
        let eos = v.info().eos.expect("fake has eos");
        let mut g = Generation::new(spec(10, &[], false));
        let a = g.accept(v.as_ref(), eos, None, 5, 100);
        assert_eq!(a.finish, Some(FinishReason::Eos));
        assert!(a.delta.text.is_empty());
        let mut g = Generation::new(spec(10, &[], true));
        assert_eq!(g.accept(v.as_ref(), eos, None, 5, 100).finish, None);
    }

    #[test]
    fn length_ends_at_max_tokens_or_at_the_context_edge() {
        let v = vocab();
        let a = token_of(v.as_ref(), "a");
        let mut g = Generation::new(spec(2, &[], false));
        assert_eq!(g.accept(v.as_ref(), a, None, 5, 100).finish, None);
        assert_eq!(
            g.accept(v.as_ref(), a, None, 6, 100).finish,
            Some(FinishReason::Length)
        );
        let mut g = Generation::new(spec(50, &[], false));
        assert_eq!(
            g.accept(v.as_ref(), a, None, 100, 100).finish,
            Some(FinishReason::Length),
            "the next token would need position 100 of 100"
        );
    }

    #[test]
    fn a_stop_string_is_held_back_then_dropped_and_a_false_start_released() {
        let v = vocab();
        let (x, y, z) = (
            token_of(v.as_ref(), "x"),
            token_of(v.as_ref(), "y"),
            token_of(v.as_ref(), "z"),
        );
        let mut g = Generation::new(spec(50, &["yz"], false));
        assert_eq!(g.accept(v.as_ref(), x, None, 1, 100).delta.text, "x");
        let held = g.accept(v.as_ref(), y, None, 2, 100);
        assert!(held.buffering && held.delta.text.is_empty());
        let stop = g.accept(v.as_ref(), z, None, 3, 100);
        assert_eq!(stop.finish, Some(FinishReason::Stop));
        assert_eq!(g.text, "x");
        assert_eq!(g.end(FinishReason::Stop), None);

        let mut g = Generation::new(spec(2, &["yz"], false));
        g.accept(v.as_ref(), x, None, 1, 100);
        let last = g.accept(v.as_ref(), y, None, 2, 100);
        assert_eq!(last.finish, Some(FinishReason::Length));
        let tail = g.end(FinishReason::Length).expect("held text released");
        assert_eq!(tail.text, "y");
        assert_eq!(g.text, "xy");
    }

    #[test]
    fn a_reasoning_budget_forces_the_close_once_only_inside_a_block() {
        let v = vocab();
        let (a, x, y) = (
            token_of(v.as_ref(), "a"),
            token_of(v.as_ref(), "x"),
            token_of(v.as_ref(), "y"),
        );
        let budget = |starts_inside| {
            let mut s = spec(50, &[], false);
            s.reasoning_budget = Some(crate::engine::ReasoningBudget {
                max_tokens: 2,
                close: vec![x, y],
                starts_inside,
            });
            s
        };
        // Inside the block at the budget: the close comes next, token by token.
        let mut g = Generation::new(budget(true));
        g.accept(v.as_ref(), a, None, 1, 100);
        assert_eq!(g.forced_next(), None);
        g.accept(v.as_ref(), a, None, 2, 100);
        assert_eq!(g.forced_next(), Some(x));
        g.accept(v.as_ref(), x, None, 3, 100);
        assert_eq!(g.forced_next(), Some(y));
        g.accept(v.as_ref(), y, None, 4, 100);
        assert_eq!(g.forced_next(), None);
        g.accept(v.as_ref(), a, None, 5, 100);
        assert_eq!(g.forced_next(), None, "the budget forces once");
        // No block open: nothing is forced.
        let mut g = Generation::new(budget(false));
        g.accept(v.as_ref(), a, None, 1, 100);
        g.accept(v.as_ref(), a, None, 2, 100);
        assert_eq!(g.forced_next(), None);
    }
}
