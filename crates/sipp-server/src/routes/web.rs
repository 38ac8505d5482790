//! The browser pages, embedded in the binary: the chat page at `/` and the
//! operator dashboard at `/dashboard`, with their scripts and styles under
//! `/ui/`. Nothing is fetched from elsewhere; every answer carries a strict
//! Content-Security-Policy (scripts and styles from this server only, no
//! inline script, connections to this server only), so model output that
//! slips past the sanitizer still cannot run or phone home.

use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// The policy every page and asset is served with.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
form-action 'none'; frame-ancestors 'none'";

/// Every file the pages use: (path under `/ui/`, content type, bytes).
pub const ASSETS: &[(&str, &str, &str)] = &[
    ("style.css", "text/css", include_str!("../../web/style.css")),
    (
        "common.js",
        "text/javascript",
        include_str!("../../web/common.js"),
    ),
    (
        "chat.js",
        "text/javascript",
        include_str!("../../web/chat.js"),
    ),
    (
        "dashboard.js",
        "text/javascript",
        include_str!("../../web/dashboard.js"),
    ),
    (
        "vendor/marked.umd.js",
        "text/javascript",
        include_str!("../../web/vendor/marked.umd.js"),
    ),
    (
        "vendor/purify.min.js",
        "text/javascript",
        include_str!("../../web/vendor/purify.min.js"),
    ),
];

const CHAT_PAGE: &str = include_str!("../../web/index.html");
const DASHBOARD_PAGE: &str = include_str!("../../web/dashboard.html");

fn page(content_type: &'static str, body: &'static str) -> Response {
    let mut resp = (StatusCode::OK, body).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// GET /: the chat page.
pub async fn chat_page() -> Response {
    page("text/html; charset=utf-8", CHAT_PAGE)
}

/// GET /dashboard: the dashboard page (its data comes from /v1/dashboard,
/// which takes an admin key).
pub async fn dashboard_page() -> Response {
    page("text/html; charset=utf-8", DASHBOARD_PAGE)
}

/// GET /ui/{path}: a script or style of the pages.
pub async fn asset(Path(path): Path<String>) -> Response {
    match ASSETS.iter().find(|(p, _, _)| *p == path) {
        Some((_, ty, body)) => page(ty, body),
        None => super::ops::not_found().await.into_response(),
    }
}

/// Total bytes of the pages and their assets (reported by the tests).
pub fn total_bytes() -> usize {
    CHAT_PAGE.len() + DASHBOARD_PAGE.len() + ASSETS.iter().map(|(_, _, b)| b.len()).sum::<usize>()
}
