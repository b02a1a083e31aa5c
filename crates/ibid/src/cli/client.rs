//! A blocking client of the ibid HTTP API (`/api/v1`): sends JSON, returns the answer's JSON, and
//! turns every failure into a [`CliError`] whose exit code follows the API's stable error code.

use super::error::CliError;
use super::progress::Spinner;
use serde_json::Value;
use std::time::Duration;
use ureq::http::{header, Method, Request};

/// How long to wait for a TCP connection before reporting the server unreachable. There is no
/// bound on the whole call: a full clone or copy of a large volume may legitimately take minutes.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest answer read (a listing of many volumes); above it the answer is refused.
pub const ANSWER_BYTES_MAX: u64 = 64 << 20;

/// A connection to one server.
pub struct Client {
    agent: ureq::Agent,
    /// `http://host:port`, without a trailing slash.
    base: String,
    token: Option<String>,
    /// Show a spinner on slow calls (false with `--json`).
    spinner: bool,
}

impl Client {
    /// A client of the API at `server` (`http://host:port` or `host:port`).
    pub fn new(server: &str, token: Option<String>, spinner: bool) -> Client {
        let server = server.trim().trim_end_matches('/');
        let base = if server.contains("://") {
            server.to_string()
        } else {
            format!("http://{server}")
        };
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .user_agent(concat!("ibid/", env!("CARGO_PKG_VERSION")))
            .build()
            .new_agent();
        Client {
            agent,
            base,
            token: token.filter(|t| !t.is_empty()),
            spinner,
        }
    }

    /// `GET path`.
    pub fn get(&self, path: &str, doing: &str) -> Result<Value, CliError> {
        self.call(Method::GET, path, None, doing)
    }

    /// `POST path` with a JSON body.
    pub fn post(&self, path: &str, body: Value, doing: &str) -> Result<Value, CliError> {
        self.call(Method::POST, path, Some(body), doing)
    }

    /// `PATCH path` with a JSON body.
    pub fn patch(&self, path: &str, body: Value, doing: &str) -> Result<Value, CliError> {
        self.call(Method::PATCH, path, Some(body), doing)
    }

    /// `PUT path` with a JSON body.
    pub fn put(&self, path: &str, body: Value, doing: &str) -> Result<Value, CliError> {
        self.call(Method::PUT, path, Some(body), doing)
    }

    /// `DELETE path`.
    pub fn delete(&self, path: &str, doing: &str) -> Result<Value, CliError> {
        self.call(Method::DELETE, path, None, doing)
    }

    /// Sends one request under a spinner labelled `doing`; the answer's JSON (`Null` for an empty
    /// `204`), or the API's error.
    fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        doing: &str,
    ) -> Result<Value, CliError> {
        let mut req = Request::builder()
            .method(method.clone())
            .uri(format!("{}/api/v1{path}", self.base))
            .header(header::ACCEPT, "application/json");
        if let Some(t) = &self.token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        if method != Method::GET {
            // The server refuses state changes without it (what a hostile web page's
            // requests cannot carry).
            req = req.header("x-ibid-request", "1");
        }
        let body = match body {
            Some(b) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                b.to_string()
            }
            None => String::new(),
        };
        let req = req
            .body(body)
            .map_err(|e| CliError::usage(format!("bad server URL {:?}: {e}", self.base)))?;
        let _spinner = Spinner::start(doing.to_string(), self.spinner);
        let mut resp = self.agent.run(req).map_err(|e| self.transport_error(e))?;
        let status = resp.status().as_u16();
        let text = resp
            .body_mut()
            .with_config()
            .limit(ANSWER_BYTES_MAX)
            .read_to_string()
            .map_err(|e| self.transport_error(e))?;
        answer(status, &text)
    }

    fn transport_error(&self, e: ureq::Error) -> CliError {
        match e {
            ureq::Error::BadUri(_) | ureq::Error::Http(_) => {
                CliError::usage(format!("bad server URL {:?}: {e}", self.base))
            }
            ureq::Error::BodyExceedsLimit(_) => CliError::bad_response(format!(
                "the answer is larger than {ANSWER_BYTES_MAX} bytes"
            )),
            _ => CliError::cannot_connect(&self.base, e),
        }
    }
}

/// Reads an answer: JSON on success (`Null` if empty), else the API's `{"code","message"}` error
/// (or one named after the HTTP status when the body is not the API's).
fn answer(status: u16, text: &str) -> Result<Value, CliError> {
    let json: Option<Value> = serde_json::from_str(text).ok();
    if (200..300).contains(&status) {
        return match json {
            Some(v) => Ok(v),
            None if text.trim().is_empty() => Ok(Value::Null),
            None => Err(CliError::bad_response(format!(
                "the server answered {status} with a body that is not JSON (is --server an ibid API?)"
            ))),
        };
    }
    let (code, message) = match &json {
        Some(v) => (v["code"].as_str(), v["message"].as_str()),
        None => (None, None),
    };
    let code = code.map_or_else(|| format!("http_{status}"), str::to_string);
    let message = message.map_or_else(
        || format!("the server answered HTTP {status}: {}", text.trim()),
        str::to_string,
    );
    Err(CliError::api(status, &code, &message))
}

/// Percent-encodes one path segment (a volume or snapshot name), so that an odd name reaches the
/// server's validation instead of another route.
pub fn segment(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::error::Exit;

    #[test]
    fn answers_and_errors_are_read_by_code() {
        assert_eq!(answer(204, "").ok(), Some(Value::Null));
        assert_eq!(
            answer(200, r#"{"a":1}"#).ok().map(|v| v["a"].clone()),
            Some(1.into())
        );
        let e = answer(409, r#"{"code":"cannot_reserve","message":"no"}"#).unwrap_err();
        assert_eq!(
            (e.code.as_str(), e.exit),
            ("cannot_reserve", Exit::Conflict)
        );
        let e = answer(404, "Not Found").unwrap_err();
        assert_eq!((e.code.as_str(), e.exit), ("http_404", Exit::NotFound));
        assert_eq!(answer(200, "<html>").unwrap_err().exit, Exit::Failed);
    }

    #[test]
    fn names_are_encoded_as_one_segment() {
        assert_eq!(segment("vm-1.a_b"), "vm-1.a_b");
        assert_eq!(segment("a/b c"), "a%2Fb%20c");
    }
}
