//! The traffic policy's configuration in `[server]`: API keys with roles and
//! model lists, rate and concurrency limits per key and per client address,
//! and IP allow / deny lists. Values that can be checked alone (a CIDR, a
//! rate of zero, overlapping CIDRs) are checked while the TOML is read, so
//! the parse error names the line and the field.

use std::fmt;
use std::num::NonZeroU32;

use ipnet::IpNet;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

/// What a key may do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Everything, including the dashboard's data.
    Admin,
    /// The APIs, on the key's models (all when it lists none).
    #[default]
    User,
}

/// One API key: a plain string (full access: an admin key with every model,
/// as plain keys always were) or a table.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ApiKey {
    /// A key with full access.
    Plain(String),
    /// A key with a role, models and limits.
    Entry(ApiKeyEntry),
}

impl From<&str> for ApiKey {
    fn from(key: &str) -> Self {
        ApiKey::Plain(key.to_string())
    }
}

impl From<String> for ApiKey {
    fn from(key: String) -> Self {
        ApiKey::Plain(key)
    }
}

impl ApiKey {
    /// The key itself.
    pub fn key(&self) -> &str {
        match self {
            ApiKey::Plain(k) => k,
            ApiKey::Entry(e) => &e.key,
        }
    }

    /// Its role (a plain key is an admin).
    pub fn role(&self) -> Role {
        match self {
            ApiKey::Plain(_) => Role::Admin,
            ApiKey::Entry(e) => e.role,
        }
    }

    /// The models it may use; empty means all.
    pub fn models(&self) -> &[toml::Spanned<String>] {
        match self {
            ApiKey::Plain(_) => &[],
            ApiKey::Entry(e) => &e.models,
        }
    }

    /// Its own limits (over `[server.limits.per_key]`).
    pub fn limits(&self) -> Limits {
        match self {
            ApiKey::Plain(_) => Limits::default(),
            ApiKey::Entry(e) => e.limits,
        }
    }

    /// How errors and the dashboard name it: its `name`, else its position.
    pub fn label(&self, index: usize) -> String {
        match self {
            ApiKey::Entry(ApiKeyEntry { name: Some(n), .. }) => n.clone(),
            _ => format!("key #{}", index + 1),
        }
    }
}

/// A key as a table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyEntry {
    /// The key clients send.
    pub key: String,
    /// A name for errors, logs and the dashboard (the key itself never
    /// appears there). Default: `key #N`.
    #[serde(default)]
    pub name: Option<String>,
    /// `admin` or `user` (the default for a table).
    #[serde(default)]
    pub role: Role,
    /// Target ids (or aliases) it may use; empty means every target.
    #[serde(default)]
    pub models: Vec<toml::Spanned<String>>,
    /// Limits of its own, each over the same field of
    /// `[server.limits.per_key]`.
    #[serde(default)]
    pub limits: Limits,
}

impl<'de> Deserialize<'de> for ApiKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = ApiKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key string or a table { key, role, models, limits }")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ApiKey, E> {
                Ok(ApiKey::Plain(v.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ApiKey, A::Error> {
                ApiKeyEntry::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(ApiKey::Entry)
            }
        }
        d.deserialize_any(KeyVisitor)
    }
}

/// Rate and concurrency limits; an absent field is no limit, and zero is
/// refused (say nothing to have no limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Requests per minute (a burst of this many, refilled evenly).
    pub requests_per_minute: Option<NonZeroU32>,
    /// Tokens per minute: prompt tokens are charged when a request is
    /// admitted, generated tokens as they stream.
    pub tokens_per_minute: Option<NonZeroU32>,
    /// Requests in flight at once (a stream counts until it ends).
    pub concurrent_requests: Option<NonZeroU32>,
}

impl Limits {
    /// These limits, each field that is unset taken from `base`.
    pub fn over(self, base: Limits) -> Limits {
        Limits {
            requests_per_minute: self.requests_per_minute.or(base.requests_per_minute),
            tokens_per_minute: self.tokens_per_minute.or(base.tokens_per_minute),
            concurrent_requests: self.concurrent_requests.or(base.concurrent_requests),
        }
    }
}

/// `[server.limits]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsSection {
    /// For every key (a key's own `limits` override these field by field).
    pub per_key: Limits,
    /// For every client address.
    pub per_ip: Limits,
}

/// A list of CIDRs (a bare address is a /32 or /128) in which no two overlap.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CidrList(pub Vec<IpNet>);

impl CidrList {
    /// Parses and checks a list.
    pub fn parse<S: AsRef<str>>(items: &[S]) -> Result<Self, String> {
        let mut nets: Vec<IpNet> = Vec::with_capacity(items.len());
        for item in items {
            let s = item.as_ref().trim();
            let net = s
                .parse::<IpNet>()
                .or_else(|_| s.parse::<std::net::IpAddr>().map(IpNet::from))
                .map_err(|_| format!("`{s}` is not a CIDR (e.g. 10.0.0.0/8) or an address"))?;
            if let Some(other) = nets
                .iter()
                .find(|n| n.contains(&net.network()) || net.contains(&n.network()))
            {
                return Err(format!(
                    "`{net}` overlaps `{other}` in the same list; list each range once"
                ));
            }
            nets.push(net);
        }
        Ok(CidrList(nets))
    }

    /// Whether an address is in any of the ranges.
    pub fn contains(&self, ip: &std::net::IpAddr) -> bool {
        self.0.iter().any(|n| n.contains(ip))
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<'de> Deserialize<'de> for CidrList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ListVisitor;
        impl<'de> Visitor<'de> for ListVisitor {
            type Value = CidrList;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of CIDRs such as [\"10.0.0.0/8\", \"127.0.0.1\"]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<CidrList, A::Error> {
                let mut items: Vec<String> = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    items.push(s);
                }
                CidrList::parse(&items).map_err(de::Error::custom)
            }
        }
        d.deserialize_seq(ListVisitor)
    }
}

/// `[server.ip]`: which client addresses may connect, and how the real
/// client address is found behind a proxy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IpPolicy {
    /// When not empty, only these ranges are served (others: 403).
    pub allow: CidrList,
    /// These ranges are refused (403), even inside `allow`.
    pub deny: CidrList,
    /// Proxies whose `client_ip_header` is believed. From any other peer the
    /// header is ignored and the connection's own address is the client's.
    pub trusted_proxies: CidrList,
    /// The header a trusted proxy puts the client address in. Default
    /// `x-forwarded-for` (its rightmost address that is not a trusted proxy
    /// is the client).
    pub client_ip_header: String,
}

impl Default for IpPolicy {
    fn default() -> Self {
        Self {
            allow: CidrList::default(),
            deny: CidrList::default(),
            trusted_proxies: CidrList::default(),
            client_ip_header: "x-forwarded-for".into(),
        }
    }
}

/// The 1-based line of a byte offset in `text`.
pub fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_lists_parse_addresses_and_refuse_overlaps_and_garbage() {
        let l = CidrList::parse(&["10.0.0.0/8", "127.0.0.2", "::1"]).expect("valid");
        assert!(l.contains(&"10.1.2.3".parse().expect("ip")));
        assert!(l.contains(&"127.0.0.2".parse().expect("ip")));
        assert!(!l.contains(&"127.0.0.3".parse().expect("ip")));
        assert!(l.contains(&"::1".parse().expect("ip")));
        let e = CidrList::parse(&["10.0.0.0/8", "10.1.0.0/16"]).unwrap_err();
        assert!(e.contains("overlaps"), "{e}");
        let e = CidrList::parse(&["10.1.0.0/16", "10.0.0.0/8"]).unwrap_err();
        assert!(e.contains("overlaps"), "{e}");
        let e = CidrList::parse(&["10.0.0.0/33"]).unwrap_err();
        assert!(e.contains("not a CIDR"), "{e}");
    }

    #[test]
    fn key_limits_fall_back_field_by_field() {
        let n = |v| NonZeroU32::new(v);
        let own = Limits {
            requests_per_minute: n(5),
            ..Limits::default()
        };
        let base = Limits {
            requests_per_minute: n(100),
            tokens_per_minute: n(1000),
            concurrent_requests: None,
        };
        let l = own.over(base);
        assert_eq!(l.requests_per_minute, n(5));
        assert_eq!(l.tokens_per_minute, n(1000));
        assert_eq!(l.concurrent_requests, None);
    }

    #[test]
    fn line_of_counts_newlines_before_the_offset() {
        assert_eq!(line_of("a\nb\nc", 0), 1);
        assert_eq!(line_of("a\nb\nc", 2), 2);
        assert_eq!(line_of("a\nb\nc", 4), 3);
    }
}
