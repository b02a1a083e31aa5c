//! The web dashboard (issue 34): static pages embedded in the binary, served at `/` by the
//! API's listener. The dashboard is a client of the public API (`/api/v1`), authorized the
//! same way: it asks for the bearer token when the server requires one and keeps it in the
//! tab's session storage. Nothing is fetched from elsewhere: the pages, their script and
//! styles and the one library (uPlot, for charts) are `include_bytes!`'d from `crates/ibid/web/`.
//!
//! [`security`] guards the whole listener (Host check, no cross-site state changes, CSP).

pub mod security;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// One embedded file.
struct Asset {
    path: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

/// Every file the dashboard serves.
const ASSETS: &[Asset] = &[
    Asset {
        path: "/",
        content_type: "text/html; charset=utf-8",
        body: include_bytes!("../../web/index.html"),
    },
    Asset {
        path: "/app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../../web/app.js"),
    },
    Asset {
        path: "/app.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../../web/app.css"),
    },
    Asset {
        path: "/favicon.svg",
        content_type: "image/svg+xml",
        body: include_bytes!("../../web/favicon.svg"),
    },
    Asset {
        path: "/vendor/uPlot.iife.min.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../../web/vendor/uPlot.iife.min.js"),
    },
    Asset {
        path: "/vendor/uPlot.min.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../../web/vendor/uPlot.min.css"),
    },
];

/// Total bytes of the embedded files (uncompressed).
#[cfg(test)]
fn assets_bytes() -> usize {
    ASSETS.iter().map(|a| a.body.len()).sum()
}

/// The file at `path`, with an ETag of its content: a browser revalidates (`no-cache`) and
/// gets a 304 when it already has it.
fn serve(asset: &'static Asset, req: &Request) -> Response {
    let etag = format!("\"{}\"", &blake3::hash(asset.body).to_hex()[..16]);
    let fresh = req
        .headers()
        .get(header::IF_NONE_MATCH)
        .is_some_and(|v| v.as_bytes() == etag.as_bytes());
    let mut r = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(header::CONTENT_TYPE, asset.content_type)], asset.body).into_response()
    };
    let h = r.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(v) = HeaderValue::from_str(&etag) {
        h.insert(header::ETAG, v);
    }
    r
}

/// The dashboard's routes (no token needed: the files hold no data; every figure they show
/// comes from the API, which checks the token).
pub fn router() -> Router {
    let mut r = Router::new();
    for asset in ASSETS {
        r = r.route(
            asset.path,
            get(move |req: Request| async move { serve(asset, &req) }),
        );
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The budget: the dashboard's files stay under 300 KiB (here even uncompressed),
    /// and the page loads no script or style from elsewhere and has no inline script.
    #[test]
    fn assets_are_small_and_local() {
        assert!(assets_bytes() <= 300 << 10, "{} bytes", assets_bytes());
        let index = std::str::from_utf8(ASSETS[0].body).expect("UTF-8");
        assert!(!index.contains("http://") && !index.contains("https://"));
        for tag in index.split("<script").skip(1) {
            let open = tag.split('>').next().unwrap_or("");
            assert!(
                open.contains("src=\"/"),
                "inline or remote script: <script{open}>"
            );
        }
        assert!(
            !index.contains(" on") || !index.contains("onclick="),
            "inline handler"
        );
        assert!(!index.contains("style="), "inline style");
    }
}
