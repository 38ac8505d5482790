//! Speculative decoding's pure half: drafting tokens by n-gram lookup over a
//! slot's own tokens (its prompt and what it generated), and the per-slot
//! controller that decides how many to draft from how many were accepted.
//!
//! A draft rides in the slot's decode span after its pending token; the
//! executor samples every row in order and keeps a drafted token only while
//! it equals what was sampled before it. A draft is a point mass (q = 1 on
//! the drafted token), so that is exactly the speculative-sampling rule
//! (accept with min(1, p/q), else sample from the normalized residual): the
//! output distribution is the target model's, and a seeded request draws the
//! same random numbers as without a draft.

use crate::runtime::Token;

/// The most recent earlier occurrence of the history's last `ngram_min..=
/// ngram_max` tokens (the longest match wins, then the most recent), and up
/// to `n_max` tokens that followed it there. Empty when nothing matches.
pub fn ngram_draft(
    history: &[Token],
    ngram_min: usize,
    ngram_max: usize,
    n_max: usize,
) -> Vec<Token> {
    let len = history.len();
    let ngram_min = ngram_min.max(1);
    if n_max == 0 || len < ngram_min + 1 || ngram_max < ngram_min {
        return Vec::new();
    }
    let last = history[len - 1];
    let mut best: Option<(usize, usize)> = None; // (match length, end of match)
    for end in (0..len - 1).rev() {
        if history[end] != last {
            continue;
        }
        let m = (1..=ngram_max.min(end + 1))
            .take_while(|&k| history[end + 1 - k] == history[len - k])
            .last()
            .unwrap_or(0);
        if m >= ngram_min && best.is_none_or(|(b, _)| m > b) {
            best = Some((m, end));
            if m == ngram_max {
                break;
            }
        }
    }
    match best {
        Some((_, end)) => history[end + 1..len.min(end + 1 + n_max)].to_vec(),
        None => Vec::new(),
    }
}

/// Steps a slot decodes without a draft before it tries a one-token probe
/// (its acceptance estimate may be out of date).
const PROBE_EVERY: u32 = 32;

/// One slot's drafting record: its acceptance (the chance that a drafted
/// token is accepted, given the ones before it were), estimated with a
/// decaying count so that the text's recent behaviour counts most.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpecState {
    hits: f64,
    fails: f64,
    /// Decode steps since the last draft.
    idle: u32,
    /// Tokens drafted so far.
    pub drafted: usize,
    /// Of them, tokens accepted.
    pub accepted: usize,
}

impl Default for SpecState {
    /// A new slot probes at its first decode step.
    fn default() -> Self {
        Self {
            hits: 0.0,
            fails: 0.0,
            idle: PROBE_EVERY,
            drafted: 0,
            accepted: 0,
        }
    }
}

impl SpecState {
    /// The estimated chance that a drafted token is accepted (1/2 before
    /// any evidence).
    pub fn acceptance(&self) -> f64 {
        (self.hits + 1.0) / (self.hits + self.fails + 2.0)
    }

    /// Whether the slot should try a one-token draft whatever its estimate
    /// says: after 32 steps without a draft per slot decoding, so probes
    /// cost about one row in 32 steps however many slots decode.
    pub fn probe_due(&self, decoding: usize) -> bool {
        self.idle >= PROBE_EVERY.saturating_mul(decoding.max(1) as u32)
    }

    /// After a decode step that verified `drafted` tokens and accepted
    /// `accepted` of them (0 and 0 for a step without a draft).
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            self.idle = self.idle.saturating_add(1);
            return;
        }
        self.idle = 0;
        self.drafted += drafted;
        self.accepted += accepted;
        // Tokens after the first rejected one tell nothing.
        self.hits = 0.8 * self.hits + accepted as f64;
        self.fails = 0.8 * self.fails + f64::from(u8::from(accepted < drafted));
    }
}

/// The step's cost as a fixed part plus a part per batch row, estimated from
/// the batches that ran: their ratio decides which drafted tokens are worth
/// a row. On a CPU a row costs almost as much as the rest of a small step;
/// on a GPU rows are nearly free.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowCost {
    /// A fixed ratio from the config (none: estimated).
    fixed: Option<f64>,
    /// Decaying means of rows, time, rows² and rows x time.
    n: f64,
    t: f64,
    nn: f64,
    nt: f64,
    samples: u32,
}

/// The ratio assumed until enough batches ran (a CPU-like cost).
const PRIOR_RATIO: f64 = 1.0;

impl RowCost {
    /// A cost model; `fixed` > 0 pins the ratio instead of measuring it.
    pub fn new(fixed: f32) -> Self {
        Self {
            fixed: (fixed > 0.0).then_some(f64::from(fixed)),
            n: 0.0,
            t: 0.0,
            nn: 0.0,
            nt: 0.0,
            samples: 0,
        }
    }

    /// A batch of `rows` rows took `ns` nanoseconds (decode and sampling).
    pub fn observe(&mut self, rows: usize, ns: u64) {
        let (n, t) = (rows as f64, ns as f64);
        let w = if self.samples < 50 {
            1.0 / f64::from(self.samples + 1)
        } else {
            0.02
        };
        self.n += w * (n - self.n);
        self.t += w * (t - self.t);
        self.nn += w * (n * n - self.nn);
        self.nt += w * (n * t - self.nt);
        self.samples = self.samples.saturating_add(1);
    }

    /// The fixed cost of a step over the cost of one more row.
    pub fn ratio(&self) -> f64 {
        if let Some(r) = self.fixed {
            return r;
        }
        let var = self.nn - self.n * self.n;
        if self.samples < 16 || var < 0.25 {
            return PRIOR_RATIO;
        }
        let per_row = (self.nt - self.n * self.t) / var;
        let fixed = self.t - per_row * self.n;
        if per_row <= 0.0 {
            return 1000.0;
        }
        (fixed / per_row).clamp(0.05, 1000.0)
    }
}

/// How many tokens of each draft are worth their rows. A drafted token is
/// kept while its chance of being used (the slot's acceptance to the power
/// of its place in the draft) is above the step's tokens per row-cost: a row
/// that yields less than the step's average only slows every slot down.
/// `drafts` gives each slot's draft length, acceptance and whether it
/// probes (keeps one token regardless); `tokens` and `rows` are what the
/// step does without drafts.
pub fn worth_keeping(
    drafts: &[(usize, f64, bool)],
    tokens: f64,
    rows: f64,
    ratio: f64,
) -> Vec<usize> {
    let mut keep: Vec<usize> = drafts
        .iter()
        .map(|&(len, _, probe)| usize::from(probe && len > 0))
        .collect();
    let (mut tokens, mut rows) = (tokens, rows);
    for (k, &(_, a, _)) in drafts.iter().enumerate() {
        if keep[k] > 0 {
            tokens += a;
            rows += 1.0;
        }
    }
    loop {
        // The next token of the draft most likely to pay.
        let best = (0..drafts.len())
            .filter(|&k| keep[k] < drafts[k].0)
            .map(|k| (k, drafts[k].1.powi(keep[k] as i32 + 1)))
            .max_by(|x, y| x.1.total_cmp(&y.1));
        let Some((k, p)) = best else { break };
        if p <= tokens / (ratio + rows) {
            break;
        }
        keep[k] += 1;
        tokens += p;
        rows += 1.0;
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_longest_then_most_recent_match_drafts_what_followed_it() {
        // "1 2 3 9 ... 2 3 7 ... 1 2 3": the 3-gram match wins over the later 2-gram.
        let h = [1, 2, 3, 9, 9, 5, 2, 3, 7, 7, 1, 2, 3];
        assert_eq!(ngram_draft(&h, 1, 4, 2), vec![9, 9]);
        // With 2-grams at most, the most recent "2 3" wins.
        assert_eq!(ngram_draft(&h, 1, 2, 2), vec![7, 7]);
        // The draft stops at the end of the history.
        let h = [4, 5, 6, 4, 5];
        assert_eq!(ngram_draft(&h, 2, 3, 8), vec![6, 4, 5]);
    }

    #[test]
    fn no_match_or_a_too_short_one_drafts_nothing() {
        assert!(ngram_draft(&[1, 2, 3, 4], 1, 4, 8).is_empty());
        assert!(ngram_draft(&[1, 2, 9, 2], 2, 4, 8).is_empty());
        assert!(ngram_draft(&[], 1, 4, 8).is_empty());
        assert!(ngram_draft(&[1, 1], 1, 4, 0).is_empty());
        // A repeated token drafts itself.
        assert_eq!(ngram_draft(&[7, 7, 7], 1, 4, 3), vec![7]);
    }

    #[test]
    fn acceptance_follows_recent_drafts_and_idle_slots_probe() {
        let mut s = SpecState::default();
        assert_eq!(s.acceptance(), 0.5);
        assert!(s.probe_due(1), "a new slot probes");
        s.record(8, 8);
        assert!(s.acceptance() > 0.85, "{}", s.acceptance());
        for _ in 0..6 {
            s.record(4, 0);
        }
        assert!(s.acceptance() < 0.4, "{}", s.acceptance());
        assert_eq!((s.drafted, s.accepted), (32, 8));
        assert!(!s.probe_due(1));
        for _ in 0..PROBE_EVERY {
            s.record(0, 0);
        }
        assert!(s.probe_due(1) && !s.probe_due(2));
    }

    #[test]
    fn the_row_cost_ratio_is_measured_from_batches() {
        let mut c = RowCost::new(0.0);
        assert_eq!(c.ratio(), PRIOR_RATIO);
        // 5 ms fixed, 2 ms per row.
        for i in 0..200 {
            let rows = 1 + i % 9;
            c.observe(rows, 5_000_000 + 2_000_000 * rows as u64);
        }
        assert!((c.ratio() - 2.5).abs() < 0.05, "{}", c.ratio());
        assert_eq!(RowCost::new(7.0).ratio(), 7.0);
    }

    #[test]
    fn drafts_are_kept_while_they_pay_for_their_rows() {
        // Alone, rows as dear as the rest of the step: a token needs a chance
        // above 1/2; a sure draft is kept whole, a poor one dropped.
        assert_eq!(worth_keeping(&[(8, 0.99, false)], 1.0, 1.0, 1.0), vec![8]);
        assert_eq!(worth_keeping(&[(8, 0.4, false)], 1.0, 1.0, 1.0), vec![0]);
        let k = worth_keeping(&[(8, 0.8, false)], 1.0, 1.0, 1.0)[0];
        assert!((1..8).contains(&k), "{k}");
        // Eight slots decoding: the same draft must be far surer.
        assert_eq!(
            worth_keeping(&[(8, 0.8, false); 8], 8.0, 8.0, 1.0),
            vec![0; 8]
        );
        // Cheap rows (a GPU): every likely token goes in.
        assert_eq!(
            worth_keeping(&[(8, 0.8, false); 8], 8.0, 8.0, 500.0),
            vec![8; 8]
        );
        // A probe keeps one token; nothing to draft keeps none.
        assert_eq!(
            worth_keeping(&[(8, 0.1, true), (0, 0.9, true)], 2.0, 2.0, 1.0),
            vec![1, 0]
        );
    }

    proptest! {
        /// A draft is always a stretch of the history that followed an earlier
        /// occurrence of the history's last `ngram_min` tokens or more.
        #[test]
        fn a_draft_continues_an_earlier_match(
            h in proptest::collection::vec(0i32..4, 0..60),
            n_min in 1usize..4,
            n_max in 1usize..10,
        ) {
            let d = ngram_draft(&h, n_min, 4, n_max);
            prop_assert!(d.len() <= n_max);
            if !d.is_empty() {
                let found = (0..h.len() - 1).any(|end| {
                    end + 1 >= n_min
                        && h[end + 1 - n_min..=end] == h[h.len() - n_min..]
                        && h[end + 1..].starts_with(&d)
                });
                prop_assert!(found, "draft {:?} from {:?}", d, h);
            }
        }
    }
}
