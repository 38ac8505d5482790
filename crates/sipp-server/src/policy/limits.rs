//! The limiters: request and token rates on governor's keyed GCRA limiters,
//! and in-flight request counts. Limits hold per process: replicas behind a
//! load balancer each count their own traffic.

use std::collections::HashMap;
use std::hash::Hash;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

/// A refusal: which limit, and when to come back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverLimit {
    /// The limit's name, e.g. `requests_per_minute`.
    pub limit: &'static str,
    /// The limit's value.
    pub value: u32,
    /// Seconds until a retry can pass (at least 1).
    pub retry_after_secs: u64,
}

fn whole_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Requests per minute for each key of type `K`.
pub struct RequestRate<K: Hash + Eq + Clone> {
    per_minute: NonZeroU32,
    limiter: DefaultKeyedRateLimiter<K>,
    clock: DefaultClock,
}

impl<K: Hash + Eq + Clone> RequestRate<K> {
    /// A limiter allowing `per_minute` requests a minute to each key.
    pub fn new(per_minute: NonZeroU32) -> Self {
        Self {
            per_minute,
            limiter: RateLimiter::keyed(Quota::per_minute(per_minute)),
            clock: DefaultClock::default(),
        }
    }

    /// Counts one request for `key`, or refuses it.
    pub fn check(&self, key: &K) -> Result<(), OverLimit> {
        self.limiter.check_key(key).map_err(|not_until| OverLimit {
            limit: "requests_per_minute",
            value: self.per_minute.get(),
            retry_after_secs: whole_secs(not_until.wait_time_from(self.clock.now())).max(1),
        })
    }

    /// Forgets keys whose state has returned to full.
    pub fn forget_idle(&self) {
        self.limiter.retain_recent();
    }
}

/// Tokens per minute for each key. Prompt tokens are charged at admission
/// and refused when they do not fit; generated tokens are charged as they
/// stream and cannot be refused (the request is already running), so what
/// does not fit becomes an overdraft that must be paid back before the key's
/// next request is admitted.
pub struct TokenRate<K: Hash + Eq + Clone> {
    per_minute: NonZeroU32,
    limiter: DefaultKeyedRateLimiter<K>,
    overdraft: Mutex<HashMap<K, u64>>,
    clock: DefaultClock,
}

impl<K: Hash + Eq + Clone> TokenRate<K> {
    /// A limiter allowing `per_minute` tokens a minute to each key.
    pub fn new(per_minute: NonZeroU32) -> Self {
        Self {
            per_minute,
            limiter: RateLimiter::keyed(Quota::per_minute(per_minute)),
            overdraft: Mutex::new(HashMap::new()),
            clock: DefaultClock::default(),
        }
    }

    fn refusal(&self, wait: Duration) -> OverLimit {
        OverLimit {
            limit: "tokens_per_minute",
            value: self.per_minute.get(),
            retry_after_secs: whole_secs(wait).max(1),
        }
    }

    /// Takes `n` tokens from `key`'s allowance if they fit now (at most one
    /// minute's worth at a time).
    fn take(&self, key: &K, n: u64) -> Result<(), OverLimit> {
        let Some(n) = NonZeroU32::new(n.min(u64::from(self.per_minute.get())) as u32) else {
            return Ok(());
        };
        match self.limiter.check_key_n(key, n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(self.refusal(not_until.wait_time_from(self.clock.now()))),
            // More than the burst: cannot happen after the `min` above.
            Err(_) => Err(self.refusal(Duration::from_secs(60))),
        }
    }

    /// Pays back what the key owes, or says when it can.
    pub fn settle(&self, key: &K) -> Result<(), OverLimit> {
        let Ok(mut owed) = self.overdraft.lock() else {
            return Ok(());
        };
        while let Some(&debt) = owed.get(key) {
            let chunk = debt.min(u64::from(self.per_minute.get()));
            self.take(key, chunk)?;
            if debt == chunk {
                owed.remove(key);
            } else {
                owed.insert(key.clone(), debt - chunk);
            }
        }
        Ok(())
    }

    /// Charges a prompt at admission: refused when the key still owes
    /// tokens or the prompt does not fit its allowance now. A prompt longer
    /// than a minute's allowance is charged a minute's worth.
    pub fn admit(&self, key: &K, prompt_tokens: u64) -> Result<(), OverLimit> {
        self.settle(key)?;
        self.take(key, prompt_tokens)
    }

    /// Charges generated tokens; what does not fit is owed.
    pub fn charge(&self, key: &K, tokens: u64) {
        if self.take(key, tokens).is_err() {
            if let Ok(mut owed) = self.overdraft.lock() {
                *owed.entry(key.clone()).or_insert(0) += tokens;
            }
        }
    }

    /// Forgets keys whose state has returned to full.
    pub fn forget_idle(&self) {
        self.limiter.retain_recent();
    }
}

/// Requests in flight for each key, capped.
pub struct InFlight<K: Hash + Eq + Clone> {
    cap: NonZeroU32,
    counts: Arc<Mutex<HashMap<K, u32>>>,
}

/// One request's place in an [`InFlight`] count, given back on drop.
pub struct InFlightGuard<K: Hash + Eq + Clone> {
    key: K,
    counts: Arc<Mutex<HashMap<K, u32>>>,
}

impl<K: Hash + Eq + Clone> Drop for InFlightGuard<K> {
    fn drop(&mut self) {
        if let Ok(mut c) = self.counts.lock() {
            if let Some(n) = c.get_mut(&self.key) {
                *n -= 1;
                if *n == 0 {
                    c.remove(&self.key);
                }
            }
        }
    }
}

impl<K: Hash + Eq + Clone> InFlight<K> {
    /// At most `cap` requests in flight per key.
    pub fn new(cap: NonZeroU32) -> Self {
        Self {
            cap,
            counts: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// A place for one more request of `key`, or a refusal.
    pub fn enter(&self, key: &K) -> Result<InFlightGuard<K>, OverLimit> {
        let mut c = self.counts.lock().map_err(|_| OverLimit {
            limit: "concurrent_requests",
            value: self.cap.get(),
            retry_after_secs: 1,
        })?;
        let n = c.entry(key.clone()).or_insert(0);
        if *n >= self.cap.get() {
            return Err(OverLimit {
                limit: "concurrent_requests",
                value: self.cap.get(),
                retry_after_secs: 1,
            });
        }
        *n += 1;
        Ok(InFlightGuard {
            key: key.clone(),
            counts: self.counts.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).expect("nonzero")
    }

    #[test]
    fn request_rate_allows_a_burst_then_refuses_per_key() {
        let r = RequestRate::new(nz(3));
        for _ in 0..3 {
            r.check(&"a").expect("within the burst");
        }
        let e = r.check(&"a").unwrap_err();
        assert_eq!(e.limit, "requests_per_minute");
        assert_eq!(e.value, 3);
        // One request per 20 s refills.
        assert!((1..=20).contains(&e.retry_after_secs), "{e:?}");
        r.check(&"b").expect("another key has its own allowance");
    }

    #[test]
    fn token_rate_refuses_prompts_that_do_not_fit_and_owes_generated_tokens() {
        let t = TokenRate::new(nz(100));
        t.admit(&"k", 60).expect("fits");
        let e = t.admit(&"k", 60).unwrap_err();
        assert_eq!(e.limit, "tokens_per_minute");
        // 40 left: generated tokens beyond them are owed, and a key that
        // owes is refused even a one-token prompt.
        t.charge(&"k", 30);
        t.charge(&"k", 30);
        assert!(t.admit(&"k", 1).is_err());
        // Another key is untouched.
        t.admit(&"j", 100).expect("its own allowance");
        // A prompt over a minute's worth is charged a minute's worth.
        t.admit(&"m", 10_000).expect("capped at the burst");
    }

    #[test]
    fn in_flight_caps_per_key_and_frees_on_drop() {
        let f = InFlight::new(nz(2));
        let a = f.enter(&"k").expect("1");
        let _b = f.enter(&"k").expect("2");
        assert_eq!(
            f.enter(&"k").err().map(|e| e.limit),
            Some("concurrent_requests")
        );
        let _other = f.enter(&"j").expect("another key");
        drop(a);
        let _c = f.enter(&"k").expect("freed by drop");
    }
}
