//! API keys: which configured key a request presents. Keys are compared as
//! SHA-256 digests in constant time against every configured key, so neither
//! the comparison nor the number of keys checked reveals a prefix of a key.
//! The policy ([`crate::policy::gate`]) decides what a key may do.

use axum::http::{header, HeaderMap};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The digest keys are compared by.
pub fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Whether `presented` matches any of the digests; constant time in the key.
pub fn key_matches(presented: &str, digests: &[[u8; 32]]) -> bool {
    key_index(presented, digests).is_some()
}

/// Which digest `presented` matches. Every digest is compared, in constant
/// time, and the index is chosen without a branch on the comparison.
pub fn key_index(presented: &str, digests: &[[u8; 32]]) -> Option<usize> {
    use subtle::ConditionallySelectable;
    let d = digest(presented);
    let mut found = subtle::Choice::from(0u8);
    let mut index = 0u64;
    for (i, k) in digests.iter().enumerate() {
        let eq = d.ct_eq(k);
        index = u64::conditional_select(&index, &(i as u64), eq);
        found |= eq;
    }
    bool::from(found).then_some(index as usize)
}

/// The configured key a request presents, as its index in `digests`:
/// `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's header);
/// when both come, either may hold the key, and every presented key is
/// checked, matched or not. The error is the message for a 401.
pub fn presented_key(headers: &HeaderMap, digests: &[[u8; 32]]) -> Result<usize, &'static str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let mut presented: Vec<&str> = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .into_iter()
        .collect();
    match bearer {
        None if presented.is_empty() => {
            return Err("missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")
        }
        None => {}
        Some(h) => match h
            .strip_prefix("Bearer ")
            .or_else(|| h.strip_prefix("bearer "))
        {
            Some(k) => presented.push(k.trim()),
            None if presented.is_empty() => {
                return Err("the Authorization header must be `Bearer <key>`")
            }
            None => {}
        },
    }
    presented
        .iter()
        .fold(None, |found, k| key_index(k, digests).or(found))
        .ok_or("invalid API key")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wrong key sharing 31 of 32 characters with the real one takes as long
    /// to refuse as one sharing none: the comparison is on digests, in constant
    /// time, so timing cannot be used to guess a key prefix by prefix.
    /// Batches alternate so machine noise hits both sides alike; the bound is
    /// loose (a byte-wise early-exit compare of the raw key would differ by far
    /// less than noise on a 32-byte key, so this guards the design, while the
    /// digest makes the work identical by construction).
    #[test]
    fn refusal_time_does_not_depend_on_a_shared_prefix() {
        let key = "sk-0123456789abcdef0123456789abcd";
        let digests = vec![digest(key)];
        let near = "sk-0123456789abcdef0123456789abcX";
        let far = "XX-XXXXXXXXXXXXXXXXXXXXXXXXXXXXXX";
        let time = |k: &str| {
            let start = std::time::Instant::now();
            for _ in 0..2000 {
                assert!(!key_matches(
                    std::hint::black_box(k),
                    std::hint::black_box(&digests)
                ));
            }
            start.elapsed().as_nanos() as f64 / 2000.0
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..60 {
            a.push(time(near));
            b.push(time(far));
        }
        a.sort_by(f64::total_cmp);
        b.sort_by(f64::total_cmp);
        let (ma, mb) = (a[a.len() / 2], b[b.len() / 2]);
        let ratio = ma.max(mb) / ma.min(mb);
        assert!(
            ratio < 1.3,
            "near-prefix {ma:.1} ns vs no-prefix {mb:.1} ns per check"
        );
    }

    #[test]
    fn the_index_names_the_matching_key() {
        let keys = vec![digest("a"), digest("b"), digest("c")];
        assert_eq!(key_index("c", &keys), Some(2));
        assert_eq!(key_index("a", &keys), Some(0));
        assert_eq!(key_index("d", &keys), None);
    }

    #[test]
    fn matches_only_exact_keys() {
        let keys = vec![digest("secret-one"), digest("secret-two")];
        assert!(key_matches("secret-two", &keys));
        assert!(!key_matches("secret-tw", &keys));
        assert!(!key_matches("secret-twoo", &keys));
        assert!(!key_matches("", &keys));
    }
}
