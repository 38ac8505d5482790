//! Speculative decoding's pure half: drafting tokens by n-gram lookup over a
//! slot's own tokens (its prompt and what it generated), the estimates of
//! how likely drafted tokens are accepted and what a step's rows cost, and
//! the choice of how many drafted tokens a step verifies.
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
/// to `n_max` tokens that followed it there. A match close to the end of
/// the history is a loop: its continuation runs into the end and goes on
/// with the tokens it drafted itself (the loop repeating), so a short
/// period still drafts `n_max` tokens. Returns the draft and the match's
/// length (which predicts how much of the draft holds: see
/// [`NgramAcceptance`]); empty and 0 when nothing matches.
pub fn ngram_draft(
    history: &[Token],
    ngram_min: usize,
    ngram_max: usize,
    n_max: usize,
) -> (Vec<Token>, usize) {
    let len = history.len();
    let ngram_min = ngram_min.max(1);
    if n_max == 0 || len < ngram_min + 1 || ngram_max < ngram_min {
        return (Vec::new(), 0);
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
    let Some((matched, end)) = best else {
        return (Vec::new(), 0);
    };
    let mut draft: Vec<Token> = Vec::with_capacity(n_max);
    for i in 0..n_max {
        let at = end + 1 + i;
        draft.push(if at < len {
            history[at]
        } else {
            draft[at - len]
        });
    }
    (draft, matched)
}

/// How likely an n-gram draft's tokens are to be accepted, by the length of
/// the match they continue. The longer the match, the surer the draft: on
/// the grounded bench a 1-token match's tokens held 66% of the time, an 8-
/// to 15-token match's 95%, a 32-token match's (a loop) 99.7%. Kept per
/// power-of-two bucket of match lengths for the whole engine (a property of
/// the model and its traffic more than of one request), as decaying counts
/// of accepted tokens and rejections that start from a prior of
/// `1 - 0.6 / length`. Counts also fade a little every step, so a bucket
/// whose drafts stopped being verified drifts back to the prior and gets
/// tried again.
#[derive(Debug, Clone, PartialEq)]
pub struct NgramAcceptance {
    /// Per bucket: accepted tokens, rejections.
    buckets: [(f64, f64); 8],
}

/// The prior's weight, in rejections-or-acceptances.
const PRIOR_WEIGHT: f64 = 8.0;

impl Default for NgramAcceptance {
    fn default() -> Self {
        Self {
            buckets: [(0.0, 0.0); 8],
        }
    }
}

impl NgramAcceptance {
    fn bucket(matched: usize) -> usize {
        (usize::BITS - matched.max(1).leading_zeros() - 1).min(7) as usize
    }

    /// The chance that a token drafted from a match of `matched` tokens is
    /// accepted, given the ones before it were.
    pub fn estimate(&self, matched: usize) -> f64 {
        let prior = 1.0 - 0.6 / matched.max(1) as f64;
        let (hits, fails) = self.buckets[Self::bucket(matched)];
        (hits + prior * PRIOR_WEIGHT) / (hits + fails + PRIOR_WEIGHT)
    }

    /// A draft from a match of `matched` tokens verified `drafted` tokens
    /// and accepted `accepted` of them.
    pub fn record(&mut self, matched: usize, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let (hits, fails) = &mut self.buckets[Self::bucket(matched)];
        *hits = 0.99 * *hits + accepted as f64;
        *fails = 0.99 * *fails + f64::from(u8::from(accepted < drafted));
    }

    /// One decode step went by.
    pub fn tick(&mut self) {
        for (hits, fails) in &mut self.buckets {
            *hits *= 0.9995;
            *fails *= 0.9995;
        }
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

/// What a decode step costs by its number of rows, measured from the
/// steps that ran (decode and sampling, every row with logits). The curve
/// is not a line: on a CPU a one-row step runs a matrix-vector product
/// while two rows already cost about twice as much, and from there each
/// row adds less (measured here with SmolLM2-135M on 2 cores: 6, 12, 18,
/// 30, 50 and 170 ms for 1, 2, 4, 8, 16 and 64 rows); on a GPU rows are
/// nearly free. So the cost is kept per bucket of row counts and read by
/// interpolation, and drafts are cut where tokens per cost peak, not where
/// one more row stops paying for itself.
#[derive(Debug, Clone, PartialEq)]
pub struct StepCost {
    /// A fixed ratio from the config (none: measured): a step costs
    /// `ratio + rows` rows.
    fixed: Option<f64>,
    /// Per bucket of [`BUCKETS`]: decaying means of rows and nanoseconds,
    /// and how many steps fell in it.
    buckets: Vec<(f64, f64, u32)>,
}

/// The first row count of each bucket.
const BUCKETS: [usize; 20] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 1025,
];

impl StepCost {
    /// A cost model; `fixed` > 0 pins a step's fixed cost over a row's
    /// instead of measuring.
    pub fn new(fixed: f32) -> Self {
        Self {
            fixed: (fixed > 0.0).then_some(f64::from(fixed)),
            buckets: vec![(0.0, 0.0, 0); BUCKETS.len()],
        }
    }

    /// A decode step of `rows` rows took `ns` nanoseconds.
    pub fn observe(&mut self, rows: usize, ns: u64) {
        if rows == 0 {
            return;
        }
        let b = BUCKETS.partition_point(|&first| first <= rows) - 1;
        let (r, t, n) = &mut self.buckets[b];
        // The first steps set the mean; later ones move it by a tenth, so
        // a cost that drifts (a growing KV cache) is followed.
        let w = if *n < 10 {
            1.0 / f64::from(*n + 1)
        } else {
            0.1
        };
        *r += w * (rows as f64 - *r);
        *t += w * (ns as f64 - *t);
        *n = n.saturating_add(1);
    }

    /// The cost curve as measured now, to read many times ([`Curve::cost`]).
    pub fn curve(&self) -> Curve {
        Curve {
            fixed: self.fixed,
            points: self
                .buckets
                .iter()
                .filter(|b| b.2 > 0)
                .map(|b| (b.0, b.1))
                .collect(),
        }
    }
}

/// A step's cost by rows, as [`StepCost`] measured it.
#[derive(Debug, Clone, PartialEq)]
pub struct Curve {
    fixed: Option<f64>,
    /// (mean rows, mean nanoseconds) of each measured bucket, by rows.
    points: Vec<(f64, f64)>,
}

impl Curve {
    /// The estimated cost of a step of `rows` rows, in the unit of the
    /// measurements (before any: one-row steps). Between measured buckets
    /// it interpolates; past the largest it extends with the slope of the
    /// last two measured buckets of two rows or more, never steeper than
    /// half the largest bucket's cost per row. That bound is a CPU's (a row
    /// costing half a small step) and it is optimistic elsewhere, so that
    /// longer steps get tried and then measured.
    pub fn cost(&self, rows: usize) -> f64 {
        let x = rows as f64;
        if let Some(ratio) = self.fixed {
            return ratio + x;
        }
        let points = &self.points;
        let Some(&(r_hi, t_hi)) = points.last() else {
            return 1.0 + 0.5 * (x - 1.0).max(0.0);
        };
        let (r_lo, t_lo) = points[0];
        if x <= r_lo {
            return t_lo * x / r_lo;
        }
        if x <= r_hi {
            let k = points.partition_point(|p| p.0 < x);
            let (a, b) = (points[k - 1], points[k]);
            return a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0).max(1e-9);
        }
        let bound = 0.5 * t_hi / r_hi;
        let mut multi = points.iter().filter(|p| p.0 >= 2.0).rev();
        let slope = match (multi.next(), multi.next()) {
            (Some(b), Some(a)) => ((b.1 - a.1) / (b.0 - a.0).max(1e-9)).clamp(0.0, bound),
            _ => bound,
        };
        t_hi + slope * (x - r_hi)
    }
}

/// How many tokens of each draft to verify. A drafted token is used with
/// the chance its slot's acceptance to the power of its place in the draft;
/// the step keeps the drafted tokens most likely to be used, as many as
/// make the step's expected tokens per cost highest (all or none of a run
/// of tokens may pay where one alone would not: a CPU's second row is dear,
/// its tenth cheap). `drafts` gives each slot's draft length, acceptance
/// and whether it probes (keeps one token regardless); `rows` is the
/// step's rows without drafts, each yielding a token.
pub fn worth_keeping(
    drafts: &[(usize, f64, bool)],
    rows: usize,
    cost: impl Fn(usize) -> f64,
) -> Vec<usize> {
    let mut keep: Vec<usize> = drafts
        .iter()
        .map(|&(len, _, probe)| usize::from(probe && len > 0))
        .collect();
    let mut tokens = rows as f64;
    let mut rows = rows;
    for (k, &(_, a, _)) in drafts.iter().enumerate() {
        if keep[k] > 0 {
            tokens += a;
            rows += 1;
        }
    }
    let mut order = Vec::new();
    let mut best = (tokens / cost(rows).max(f64::MIN_POSITIVE), 0);
    let mut next = keep.clone();
    loop {
        // The next token of the draft most likely to be used.
        let pick = (0..drafts.len())
            .filter(|&k| next[k] < drafts[k].0)
            .map(|k| (k, drafts[k].1.powi(next[k] as i32 + 1)))
            .max_by(|x, y| x.1.total_cmp(&y.1));
        let Some((k, p)) = pick else { break };
        next[k] += 1;
        tokens += p;
        rows += 1;
        order.push(k);
        let value = tokens / cost(rows).max(f64::MIN_POSITIVE);
        if value > best.0 * (1.0 + 1e-9) {
            best = (value, order.len());
        }
    }
    for &k in &order[..best.1] {
        keep[k] += 1;
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
        assert_eq!(ngram_draft(&h, 1, 4, 2), (vec![9, 9], 3));
        // With 2-grams at most, the most recent "2 3" wins.
        assert_eq!(ngram_draft(&h, 1, 2, 2), (vec![7, 7], 2));
        // A match near the end is a loop: the draft goes on repeating it.
        let h = [4, 5, 6, 4, 5];
        assert_eq!(ngram_draft(&h, 2, 3, 8), (vec![6, 4, 5, 6, 4, 5, 6, 4], 2));
    }

    #[test]
    fn no_match_or_a_too_short_one_drafts_nothing() {
        assert_eq!(ngram_draft(&[1, 2, 3, 4], 1, 4, 8), (vec![], 0));
        assert_eq!(ngram_draft(&[1, 2, 9, 2], 2, 4, 8), (vec![], 0));
        assert_eq!(ngram_draft(&[], 1, 4, 8), (vec![], 0));
        assert_eq!(ngram_draft(&[1, 1], 1, 4, 0), (vec![], 0));
        // A repeated token drafts itself.
        assert_eq!(ngram_draft(&[7, 7, 7], 1, 4, 3), (vec![7, 7, 7], 2));
    }

    #[test]
    fn longer_matches_are_trusted_more_and_evidence_moves_and_fades() {
        let mut a = NgramAcceptance::default();
        assert!(a.estimate(1) < a.estimate(4) && a.estimate(4) < a.estimate(64));
        assert!((a.estimate(2) - 0.7).abs() < 1e-9);
        // Drafts from 2-token matches that hold: their bucket (2 and 3) rises.
        for _ in 0..20 {
            a.record(2, 8, 8);
        }
        assert!(a.estimate(3) > 0.95, "{}", a.estimate(3));
        assert!((a.estimate(4) - (1.0 - 0.6 / 4.0)).abs() < 1e-9);
        // Long matches that fail at once: their bucket falls.
        for _ in 0..20 {
            a.record(40, 16, 0);
        }
        assert!(a.estimate(40) < 0.4, "{}", a.estimate(40));
        // Unverified for long, it drifts back toward the prior.
        for _ in 0..20_000 {
            a.tick();
        }
        assert!(a.estimate(40) > 0.95, "{}", a.estimate(40));
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

    /// A CPU-like curve: one row 6 ms, then 8 ms plus 2.6 ms a row.
    fn cpu(rows: usize) -> u64 {
        if rows == 1 {
            6_000_000
        } else {
            8_000_000 + 2_600_000 * rows as u64
        }
    }

    #[test]
    fn the_step_cost_is_measured_per_row_count() {
        let mut c = StepCost::new(0.0);
        // Before any step: a row costs half a one-row step.
        assert_eq!((c.curve().cost(1), c.curve().cost(3)), (1.0, 2.0));
        for _ in 0..20 {
            c.observe(1, cpu(1));
            c.observe(2, cpu(2));
        }
        assert_eq!(c.curve().cost(1), 6e6);
        assert_eq!(c.curve().cost(2), cpu(2) as f64);
        // Past what was measured: half the largest step's cost per row,
        // not the dear second row's slope.
        assert_eq!(
            c.curve().cost(10),
            cpu(2) as f64 + 8.0 * 0.5 * cpu(2) as f64 / 2.0
        );
        for rows in [9, 17, 33, 65] {
            for _ in 0..20 {
                c.observe(rows, cpu(rows));
            }
        }
        // Measured: interpolated between buckets.
        for rows in [5, 12, 24, 40, 64] {
            let want = cpu(rows) as f64;
            assert!(
                (c.curve().cost(rows) - want).abs() < 0.02 * want,
                "{rows}: {}",
                c.curve().cost(rows)
            );
        }
        // Past them: rising, at most as steeply as measured last.
        let (c65, c100) = (c.curve().cost(65), c.curve().cost(100));
        assert!(c100 > c65 && c100 <= cpu(100) as f64, "{c100}");
        // A measured cost that drifts is followed.
        for _ in 0..60 {
            c.observe(1, 3_000_000);
        }
        assert!(
            (c.curve().cost(1) - 3e6).abs() < 1e4,
            "{}",
            c.curve().cost(1)
        );
        assert_eq!(StepCost::new(7.0).curve().cost(3), 10.0);
    }

    #[test]
    fn drafts_are_kept_where_tokens_per_cost_peak() {
        let mut c = StepCost::new(0.0);
        for rows in [1, 2, 4, 8, 16, 32, 64, 128] {
            for _ in 0..10 {
                c.observe(rows, cpu(rows));
            }
        }
        let curve = c.curve();
        let cost = |r| curve.cost(r);
        // Alone on a CPU: a sure draft is kept long, though its first row
        // alone would not pay; a likely one shorter; a poor one not at all.
        let sure = worth_keeping(&[(32, 0.99, false)], 1, cost)[0];
        assert!(sure >= 16, "{sure}");
        let likely = worth_keeping(&[(32, 0.9, false)], 1, cost)[0];
        assert!((4..sure).contains(&likely), "{likely}");
        assert_eq!(worth_keeping(&[(32, 0.5, false)], 1, cost), vec![0]);
        // Eight slots decoding: rows are cheaper from the start, and every
        // slot's likely tokens go in before anyone's unlikely ones.
        let k = worth_keeping(&[(16, 0.95, false), (16, 0.6, false)], 8, cost);
        assert!(k[0] > k[1], "{k:?}");
        // Cheap rows (a GPU): every likely token goes in.
        let gpu = |r: usize| 5.0 + 0.01 * r as f64;
        assert_eq!(worth_keeping(&[(8, 0.8, false); 8], 8, gpu), vec![8; 8]);
        // A probe keeps one token; nothing to draft keeps none.
        assert_eq!(
            worth_keeping(&[(8, 0.1, true), (0, 0.9, true)], 2, cost),
            vec![1, 0]
        );
    }

    proptest! {
        /// A draft is always what followed an earlier occurrence of the
        /// history's last `ngram_min` tokens or more, in the history and then
        /// (a loop) in the draft itself.
        #[test]
        fn a_draft_continues_an_earlier_match(
            h in proptest::collection::vec(0i32..4, 0..60),
            n_min in 1usize..4,
            n_max in 1usize..10,
        ) {
            let (d, matched) = ngram_draft(&h, n_min, 4, n_max);
            prop_assert!(d.is_empty() || d.len() == n_max);
            prop_assert!(d.is_empty() == (matched == 0) && matched <= 4);
            if !d.is_empty() {
                let ext: Vec<i32> = h.iter().chain(&d).copied().collect();
                let found = (0..h.len() - 1).any(|end| {
                    end + 1 >= matched
                        && h[end + 1 - matched..=end] == h[h.len() - matched..]
                        && ext[end + 1..].starts_with(&d)
                });
                prop_assert!(found, "draft {:?} from {:?}", d, h);
            }
        }
    }
}
