//! What keeps a web page the admin happens to visit from using the HTTP listener: every
//! request (dashboard, API, metrics) passes [`guard`] first.
//!
//! - **Host check** (DNS rebinding): a page on `evil.example` whose name the attacker
//!   re-points to 127.0.0.1 is same-origin with the listener, but its requests carry
//!   `Host: evil.example`. Accepted: an IP literal that is the listen address (any IP when
//!   listening on 0.0.0.0 or ::, any loopback IP when listening on one), `localhost` when
//!   listening on loopback, each with the listen port; and the names given with
//!   `--http-allowed-host` (any port: a reverse proxy's). An IP literal cannot be rebound.
//! - **No cross-site state changes** (CSRF): a method other than GET and HEAD must carry
//!   `X-Ibid-Request: 1`, and a body must be `application/json`. A page on another origin can
//!   send neither without a CORS preflight, and preflights ([`OPTIONS`](axum::http::Method))
//!   are answered 403 with no `Access-Control-Allow-*` grant. An `Origin` header, when sent,
//!   must name the same host, and a state change with `Sec-Fetch-Site: cross-site` is refused outright (a link
//!   from another site to the dashboard still opens it).
//! - **Response headers**: a Content-Security-Policy allowing scripts, styles and connections
//!   from this origin only (no inline script or style, no `eval`, no frames), `nosniff`,
//!   no referrer, no framing.

use crate::api::ApiError;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// The header a state-changing request must carry (value `1`).
pub const REQUEST_HEADER: &str = "x-ibid-request";

/// The Content-Security-Policy of every answer.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; font-src 'self'; base-uri 'none'; \
     form-action 'self'; frame-ancestors 'none'";

/// Which `Host` headers the listener answers.
#[derive(Clone, Debug)]
pub struct Hosts {
    listen: SocketAddr,
    /// Extra names, lower case, without port.
    names: Vec<String>,
}

impl Hosts {
    /// The listener's own address, plus `names` (e.g. `array.example.com`) from
    /// `--http-allowed-host`.
    pub fn new(listen: SocketAddr, names: &[String]) -> Hosts {
        Hosts {
            listen,
            names: names
                .iter()
                .map(|n| n.trim().trim_end_matches('.').to_ascii_lowercase())
                .filter(|n| !n.is_empty())
                .collect(),
        }
    }

    /// Whether a request with this `Host` header is for us.
    pub fn allows(&self, host: &str) -> bool {
        let Some((name, port)) = split_host(host) else {
            return false;
        };
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        if self.names.contains(&name) {
            return true;
        }
        if port.unwrap_or(80) != self.listen.port() {
            return false;
        }
        let listen_ip = self.listen.ip();
        if name == "localhost" {
            return listen_ip.is_loopback() || listen_ip.is_unspecified();
        }
        let Ok(ip) = name
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        else {
            return false;
        };
        listen_ip.is_unspecified()
            || ip == listen_ip
            || (listen_ip.is_loopback() && ip.is_loopback())
    }
}

/// Splits `host[:port]` or `[v6]:port`; `None` if the port is not a number.
fn split_host(host: &str) -> Option<(&str, Option<u16>)> {
    let host = host.trim();
    if host.is_empty() {
        return None;
    }
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let end = rest.find(']')?;
        let after = &rest[end + 1..];
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => return None,
        };
        (&host[..end + 2], port)
    } else {
        match host.rsplit_once(':') {
            // A bare IPv6 address without brackets is not a valid Host.
            Some((n, _)) if n.contains(':') => return None,
            Some((n, p)) => (n, Some(p)),
            None => (host, None),
        }
    };
    let port = match port {
        Some(p) => Some(p.parse::<u16>().ok()?),
        None => None,
    };
    Some((name, port))
}

fn refuse(status: StatusCode, code: &'static str, message: String) -> Response {
    ApiError::new(status, code, message).into_response()
}

/// The media type of a `Content-Type` value, lower case, without parameters.
fn media_type(v: &HeaderValue) -> String {
    v.to_str()
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// Whether the request carries a body (a non-zero length, or a chunked one).
fn has_body(headers: &HeaderMap) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0)
}

/// The host part of an `Origin` header (`http://127.0.0.1:7800` → `127.0.0.1:7800`).
fn origin_host(origin: &str) -> Option<&str> {
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))?;
    Some(rest.split('/').next().unwrap_or(rest))
}

/// Why a request must be refused as cross-site, if it must.
fn cross_site(req: &Request, host: &str) -> Option<(StatusCode, &'static str, String)> {
    let h = req.headers();
    if let Some(origin) = h.get(header::ORIGIN) {
        let o = origin.to_str().unwrap_or("");
        if origin_host(o).is_none_or(|oh| !oh.eq_ignore_ascii_case(host)) {
            return Some((
                StatusCode::FORBIDDEN,
                "cross_site",
                format!("requests from origin {o:?} are refused: only this server's own pages may call it"),
            ));
        }
    }
    if req.method() == Method::GET || req.method() == Method::HEAD {
        return None;
    }
    if h.get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"))
    {
        return Some((
            StatusCode::FORBIDDEN,
            "cross_site",
            "state changes from other sites' pages are refused".into(),
        ));
    }
    if h.get(REQUEST_HEADER).map(HeaderValue::as_bytes) != Some(b"1") {
        return Some((
            StatusCode::FORBIDDEN,
            "cross_site",
            format!(
                "a {} request must carry the header {REQUEST_HEADER}: 1 (which other sites' \
                 pages cannot send)",
                req.method()
            ),
        ));
    }
    let json = h
        .get(header::CONTENT_TYPE)
        .map(|v| media_type(v) == "application/json");
    if json == Some(false) || (json.is_none() && has_body(h)) {
        return Some((
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "a request body must be JSON, with Content-Type: application/json".into(),
        ));
    }
    None
}

/// Adds the security headers to an answer.
fn harden(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
    r
}

/// The middleware: Host check, CORS preflights refused, cross-site state changes refused,
/// security headers on every answer (module docs).
pub async fn guard(State(hosts): State<Arc<Hosts>>, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let Some(host) = host.filter(|h| hosts.allows(h)) else {
        return harden(refuse(
            StatusCode::FORBIDDEN,
            "forbidden_host",
            format!(
                "Host {:?} is not this server's: use its address ({}), or allow the name with \
                 `ibid serve --http-allowed-host NAME`",
                req.headers()
                    .get(header::HOST)
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                    .unwrap_or_default(),
                hosts.listen
            ),
        ));
    };
    if req.method() == Method::OPTIONS {
        return harden(refuse(
            StatusCode::FORBIDDEN,
            "cors_refused",
            "this server grants no cross-origin access".into(),
        ));
    }
    if let Some((status, code, message)) = cross_site(&req, &host) {
        return harden(refuse(status, code, message));
    }
    harden(next.run(req).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loopback listener: its own address, other loopback IPs and localhost on its port pass;
    /// other names and ports do not, unless configured.
    #[test]
    fn host_rules() {
        let h = Hosts::new("127.0.0.1:7800".parse().unwrap(), &["Array.Example".into()]);
        for ok in [
            "127.0.0.1:7800",
            "localhost:7800",
            "LOCALHOST:7800",
            "127.0.0.2:7800",
            "[::1]:7800",
            "array.example",
            "array.example:443",
        ] {
            assert!(h.allows(ok), "{ok}");
        }
        for bad in [
            "evil.example:7800",
            "127.0.0.1:7801",
            "127.0.0.1",
            "localhost",
            "10.0.0.1:7800",
            "x",
            "",
            "::1:7800",
            "127.0.0.1:port",
            "localhost.evil.example:7800",
        ] {
            assert!(!h.allows(bad), "{bad}");
        }
        let any = Hosts::new("0.0.0.0:7800".parse().unwrap(), &[]);
        assert!(any.allows("192.168.1.20:7800"));
        assert!(!any.allows("nas.local:7800"));
        let one = Hosts::new("10.0.0.5:80".parse().unwrap(), &[]);
        assert!(one.allows("10.0.0.5"));
        assert!(!one.allows("10.0.0.6"));
        assert!(!one.allows("localhost"));
    }
}
