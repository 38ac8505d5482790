//! The client's address: the connection's own, unless the connection comes
//! from a trusted proxy, whose forwarding header is then read. A header from
//! anyone else is ignored, so a client cannot choose its own address.

use std::net::IpAddr;

use axum::http::HeaderMap;

use super::config::CidrList;

/// The address to apply the policy to. `peer` is the connection's address
/// (none when the server runs without one, e.g. in-process tests).
///
/// Behind trusted proxies the header (`X-Forwarded-For` style, every
/// occurrence, comma-separated, appended to by each hop) is read from the
/// right: the first address that is not itself a trusted proxy is the
/// client; when every hop is trusted, the leftmost is. An unparsable entry
/// ends the walk at the hop that wrote it.
pub fn client_ip(
    peer: Option<IpAddr>,
    headers: &HeaderMap,
    header: &str,
    trusted: &CidrList,
) -> Option<IpAddr> {
    let peer = peer?;
    if trusted.is_empty() || !trusted.contains(&peer) {
        return Some(peer);
    }
    let hops: Vec<&str> = headers
        .get_all(header)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .collect();
    let mut client = peer;
    for hop in hops.iter().rev() {
        let Some(ip) = parse_hop(hop) else {
            break;
        };
        client = ip;
        if !trusted.contains(&ip) {
            break;
        }
    }
    Some(client)
}

/// An address as proxies write it: bare, `[v6]`, or with a port.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse() {
        return Some(ip);
    }
    if let Ok(sa) = hop.parse::<std::net::SocketAddr>() {
        return Some(sa.ip());
    }
    hop.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-forwarded-for", v.parse().expect("header"));
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn the_header_counts_only_from_a_trusted_proxy() {
        let trusted = CidrList::parse(&["127.0.0.1"]).expect("valid");
        let h = headers(&["203.0.113.9"]);
        // From the proxy: the header's address.
        assert_eq!(
            client_ip(Some(ip("127.0.0.1")), &h, "x-forwarded-for", &trusted),
            Some(ip("203.0.113.9"))
        );
        // From anyone else: the connection's own.
        assert_eq!(
            client_ip(Some(ip("127.0.0.2")), &h, "x-forwarded-for", &trusted),
            Some(ip("127.0.0.2"))
        );
        // No trusted proxies configured: never read.
        assert_eq!(
            client_ip(
                Some(ip("127.0.0.1")),
                &h,
                "x-forwarded-for",
                &CidrList::default()
            ),
            Some(ip("127.0.0.1"))
        );
    }

    #[test]
    fn the_rightmost_untrusted_hop_is_the_client() {
        let trusted = CidrList::parse(&["10.0.0.0/8"]).expect("valid");
        // The client put a spoofed address first; the proxies appended.
        let h = headers(&["1.1.1.1, 198.51.100.7", "10.0.0.5"]);
        assert_eq!(
            client_ip(Some(ip("10.0.0.9")), &h, "x-forwarded-for", &trusted),
            Some(ip("198.51.100.7"))
        );
        let h = headers(&["[2001:db8::1]:443, 10.0.0.4:80"]);
        assert_eq!(
            client_ip(Some(ip("10.0.0.9")), &h, "x-forwarded-for", &trusted),
            Some(ip("2001:db8::1"))
        );
        let h = headers(&["garbage"]);
        assert_eq!(
            client_ip(Some(ip("10.0.0.9")), &h, "x-forwarded-for", &trusted),
            Some(ip("10.0.0.9"))
        );
    }
}
