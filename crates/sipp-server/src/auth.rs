//! Bearer-token authentication. Keys are compared as SHA-256 digests in
//! constant time against every configured key, so neither the comparison nor
//! the number of keys checked reveals a prefix of a key.

use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::state::AppState;

/// The digest keys are compared by.
pub fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Whether `presented` matches any of the digests; constant time in the key.
pub fn key_matches(presented: &str, digests: &[[u8; 32]]) -> bool {
    let d = digest(presented);
    let mut ok = subtle::Choice::from(0u8);
    for k in digests {
        ok |= d.ct_eq(k);
    }
    ok.into()
}

/// Rejects requests without a valid key when keys are configured: either
/// `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's header);
/// when both come, either may hold the key. /health stays open unless
/// configured otherwise; CORS preflights pass. Refusals on the Anthropic
/// routes (`/v1/messages...`) are in Anthropic's error shape.
pub async fn require_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if state.api_key_digests.is_empty() || req.method() == Method::OPTIONS {
        return next.run(req).await;
    }
    if req.uri().path() == "/health" && !state.protect_health {
        return next.run(req).await;
    }
    let anthropic = req.uri().path().starts_with("/v1/messages");
    let refuse = |message: &str| {
        let e = ApiError::unauthorized(message);
        if anthropic {
            crate::routes::anthropic::AnthropicError(e).into_response()
        } else {
            e.into_response()
        }
    };
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let mut presented: Vec<&str> = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .into_iter()
        .collect();
    match bearer {
        None if presented.is_empty() => {
            return refuse(
                "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
            )
        }
        None => {}
        Some(h) => match h
            .strip_prefix("Bearer ")
            .or_else(|| h.strip_prefix("bearer "))
        {
            Some(k) => presented.push(k.trim()),
            None if presented.is_empty() => {
                return refuse("the Authorization header must be `Bearer <key>`")
            }
            None => {}
        },
    }
    // Every presented key is checked, matched or not.
    let ok = presented
        .iter()
        .fold(false, |ok, k| key_matches(k, &state.api_key_digests) | ok);
    if ok {
        next.run(req).await
    } else {
        refuse("invalid API key")
    }
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
    fn matches_only_exact_keys() {
        let keys = vec![digest("secret-one"), digest("secret-two")];
        assert!(key_matches("secret-two", &keys));
        assert!(!key_matches("secret-tw", &keys));
        assert!(!key_matches("secret-twoo", &keys));
        assert!(!key_matches("", &keys));
    }
}
