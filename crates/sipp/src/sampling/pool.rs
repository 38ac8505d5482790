//! Samplers kept for reuse, by the settings they were built for.
//!
//! Building a sampler for a constrained request parses its grammar, which costs
//! far more than resetting one; requests with the same [`SamplerCacheKey`] can
//! share built samplers one after another.

use std::collections::HashMap;

use super::SamplerCacheKey;

/// Built samplers waiting for their next request, by key. At most
/// [`SamplerPool::MAX_PER_KEY`] are kept per key; once more than
/// [`SamplerPool::MAX_KEYS`] keys have been seen, the pool is emptied.
#[derive(Debug)]
pub struct SamplerPool<S> {
    by_key: HashMap<SamplerCacheKey, Vec<S>>,
}

impl<S> Default for SamplerPool<S> {
    fn default() -> Self {
        Self {
            by_key: HashMap::new(),
        }
    }
}

impl<S> SamplerPool<S> {
    /// Samplers kept per key; more are dropped when returned.
    pub const MAX_PER_KEY: usize = 4;
    /// Keys kept; one more empties the pool.
    pub const MAX_KEYS: usize = 64;

    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// A sampler built for `key`, if one is waiting. The caller resets it for
    /// its request (seed, history) before use.
    pub fn take(&mut self, key: &SamplerCacheKey) -> Option<S> {
        self.by_key.get_mut(key).and_then(Vec::pop)
    }

    /// Returns a sampler built for `key`. It is dropped when the key already
    /// holds [`Self::MAX_PER_KEY`]; the whole pool is emptied when this makes
    /// more than [`Self::MAX_KEYS`] keys.
    pub fn put(&mut self, key: SamplerCacheKey, s: S) {
        let kept = self.by_key.entry(key).or_default();
        if kept.len() < Self::MAX_PER_KEY {
            kept.push(s);
        }
        if self.by_key.len() > Self::MAX_KEYS {
            self.by_key.clear();
        }
    }

    /// Samplers waiting, over all keys.
    pub fn len(&self) -> usize {
        self.by_key.values().map(Vec::len).sum()
    }

    /// Whether no sampler is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keys seen since the pool was last emptied (a key stays counted after
    /// its samplers are taken).
    pub fn key_count(&self) -> usize {
        self.by_key.len()
    }

    /// Drops every sampler.
    pub fn clear(&mut self) {
        self.by_key.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{OutputConstraint, SamplingParams};

    fn key(i: usize) -> SamplerCacheKey {
        let g = OutputConstraint::Grammar(format!("root ::= \"{i}\""));
        SamplerCacheKey::new(&SamplingParams::default(), Some(&g))
    }

    #[test]
    fn take_returns_what_was_put_for_that_key_only() {
        let mut pool = SamplerPool::new();
        assert!(pool.is_empty());
        assert_eq!(pool.take(&key(0)), None);
        pool.put(key(0), "a");
        pool.put(key(1), "b");
        assert_eq!(pool.len(), 2);
        assert_eq!(pool.take(&key(2)), None);
        assert_eq!(pool.take(&key(1)), Some("b"));
        assert_eq!(pool.take(&key(1)), None);
        assert_eq!(pool.take(&key(0)), Some("a"));
        assert!(pool.is_empty());
    }

    #[test]
    fn the_seed_does_not_split_keys() {
        let g = OutputConstraint::JsonObject;
        let with_seed = |seed| {
            let p = SamplingParams {
                seed: Some(seed),
                ..SamplingParams::default()
            };
            SamplerCacheKey::new(&p, Some(&g))
        };
        let mut pool = SamplerPool::new();
        pool.put(with_seed(1), 10);
        assert_eq!(pool.take(&with_seed(2)), Some(10));
    }

    #[test]
    fn at_most_four_per_key_last_in_first_out() {
        let mut pool = SamplerPool::new();
        for i in 0..6 {
            pool.put(key(0), i);
        }
        assert_eq!(pool.len(), SamplerPool::<i32>::MAX_PER_KEY);
        let taken: Vec<_> = std::iter::from_fn(|| pool.take(&key(0))).collect();
        assert_eq!(taken, vec![3, 2, 1, 0]);
        // Taking frees room for the key again.
        pool.put(key(0), 9);
        assert_eq!(pool.take(&key(0)), Some(9));
    }

    #[test]
    fn more_than_sixty_four_keys_empty_the_pool() {
        let mut pool = SamplerPool::new();
        for i in 0..SamplerPool::<usize>::MAX_KEYS {
            pool.put(key(i), i);
        }
        assert_eq!(pool.key_count(), 64);
        assert_eq!(pool.len(), 64);
        // Keys whose samplers were taken still count.
        assert_eq!(pool.take(&key(0)), Some(0));
        assert_eq!(pool.key_count(), 64);
        pool.put(key(0), 100);
        assert_eq!(pool.key_count(), 64, "a known key does not add one");
        pool.put(key(64), 64);
        assert_eq!(pool.key_count(), 0);
        assert!(pool.is_empty());
        assert_eq!(pool.take(&key(64)), None);
        assert_eq!(pool.take(&key(1)), None);
    }

    #[test]
    fn clear_drops_everything() {
        let mut pool = SamplerPool::new();
        pool.put(key(0), 1);
        pool.clear();
        assert!(pool.is_empty());
        assert_eq!(pool.key_count(), 0);
    }
}
