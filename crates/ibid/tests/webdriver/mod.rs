//! A small W3C WebDriver client over `ureq` (already a dependency of the CLI), driving Debian's
//! headless `chromium` through `chromedriver`: start the driver, open a session, navigate,
//! find, click, type, run scripts, read the browser console, take screenshots. Only what the
//! dashboard tests use; a step that fails panics with the driver's message.

#![allow(dead_code)]

use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The key under which WebDriver returns an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A running `chromedriver`, killed when dropped.
pub struct Driver {
    child: Child,
    base: String,
    agent: ureq::Agent,
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .new_agent()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

impl Driver {
    /// Starts `chromedriver` on a free loopback port and waits until it is ready.
    pub fn start() -> Driver {
        let port = free_port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver (scripts/install-test-tools.sh installs it)");
        let d = Driver {
            child,
            base: format!("http://127.0.0.1:{port}"),
            agent: agent(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ready = d
                .agent
                .get(format!("{}/status", d.base))
                .call()
                .ok()
                .and_then(|mut r| r.body_mut().read_to_string().ok())
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .is_some_and(|v| v["value"]["ready"] == true);
            if ready {
                return d;
            }
            assert!(Instant::now() < deadline, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Opens a headless Chromium window of `width` × `height` CSS pixels, logging the console.
    pub fn session(&self, width: u32, height: u32) -> Session {
        self.session_with(width, height, &[])
    }

    /// [`Driver::session`] with more Chromium arguments (e.g. `--host-resolver-rules=...`).
    pub fn session_with(&self, width: u32, height: u32, extra_args: &[&str]) -> Session {
        let mut args = vec![
            "--headless=new".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-dev-shm-usage".into(),
            "--no-first-run".into(),
            format!("--window-size={width},{height}"),
        ];
        args.extend(extra_args.iter().map(|a| a.to_string()));
        let caps = json!({
            "capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {
                    "binary": "/usr/bin/chromium",
                    "args": args,
                },
                "goog:loggingPrefs": {"browser": "ALL"},
            }}
        });
        let v = send(
            &self.agent,
            "POST",
            &format!("{}/session", self.base),
            Some(caps),
        );
        let id = v["sessionId"].as_str().expect("session id").to_string();
        let s = Session {
            base: format!("{}/session/{id}", self.base),
            agent: self.agent.clone(),
        };
        s.set_viewport(width, height);
        s
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends a WebDriver command; returns its `value`, panics with the driver's error.
fn send(agent: &ureq::Agent, method: &str, url: &str, body: Option<Value>) -> Value {
    let resp = match method {
        "GET" => agent.get(url).call(),
        "DELETE" => agent.delete(url).call(),
        _ => agent
            .post(url)
            .header("content-type", "application/json")
            .send(body.unwrap_or_else(|| json!({})).to_string()),
    };
    let mut resp = resp.unwrap_or_else(|e| panic!("WebDriver {method} {url}: {e}"));
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    assert!(
        (200..300).contains(&status),
        "WebDriver {method} {url}: {status} {}",
        v["value"]
    );
    v["value"].clone()
}

/// A browser session (one window), closed when dropped.
pub struct Session {
    base: String,
    agent: ureq::Agent,
}

/// A reference to an element of the page.
#[derive(Clone, Debug)]
pub struct Element(String);

impl Session {
    fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        send(&self.agent, method, &format!("{}{path}", self.base), body)
    }

    /// Resizes the window so that the page's viewport is `width` × `height`.
    pub fn set_viewport(&self, width: u32, height: u32) {
        self.cmd(
            "POST",
            "/window/rect",
            Some(json!({"width": width, "height": height})),
        );
        // The window includes no chrome in headless mode, but make sure.
        let inner = self.script("return [window.innerWidth, window.innerHeight]", &[]);
        let dw = width as i64 - inner[0].as_i64().unwrap_or(width as i64);
        let dh = height as i64 - inner[1].as_i64().unwrap_or(height as i64);
        if dw != 0 || dh != 0 {
            self.cmd(
                "POST",
                "/window/rect",
                Some(json!({"width": width as i64 + dw, "height": height as i64 + dh})),
            );
        }
    }

    /// Navigates to `url`.
    pub fn goto(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url })));
    }

    /// Reloads the page.
    pub fn refresh(&self) {
        self.cmd("POST", "/refresh", None);
    }

    /// Runs `script` (a function body; `arguments` holds `args`) and returns its result.
    pub fn script(&self, script: &str, args: &[Value]) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": args})),
        )
    }

    /// The first element matching the CSS `selector`, if any.
    pub fn find(&self, selector: &str) -> Option<Element> {
        let url = format!("{}/elements", self.base);
        let v = send(
            &self.agent,
            "POST",
            &url,
            Some(json!({"using": "css selector", "value": selector})),
        );
        v.as_array()
            .and_then(|a| a.first())
            .and_then(|e| e[ELEMENT].as_str())
            .map(|id| Element(id.to_string()))
    }

    /// Waits up to `timeout` for an element matching `selector` and returns it.
    pub fn wait_for(&self, selector: &str, timeout: Duration) -> Element {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.find(selector) {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "no element {selector:?} after {timeout:?}; page: {}",
                self.text_of("body")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits up to `timeout` until `script` returns a truthy value; returns it.
    pub fn wait_until(&self, what: &str, script: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.script(script, &[]);
            let truthy =
                !matches!(&v, Value::Null | Value::Bool(false)) && v != json!(0) && v != json!("");
            if truthy {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not after {timeout:?}; page: {}",
                self.text_of("body")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Clicks `e`.
    pub fn click(&self, e: &Element) {
        self.cmd("POST", &format!("/element/{}/click", e.0), None);
    }

    /// Clears the field `e` and types `text` into it.
    pub fn type_into(&self, e: &Element, text: &str) {
        self.cmd("POST", &format!("/element/{}/clear", e.0), None);
        self.cmd(
            "POST",
            &format!("/element/{}/value", e.0),
            Some(json!({ "text": text })),
        );
    }

    /// Presses and releases one key on whatever has the focus (WebDriver key codes, e.g.
    /// "\u{E004}" for Tab, "\u{E007}" for Enter).
    pub fn press(&self, key: &str) {
        self.cmd(
            "POST",
            "/actions",
            Some(
                json!({"actions": [{"type": "key", "id": "keyboard", "actions": [
                {"type": "keyDown", "value": key}, {"type": "keyUp", "value": key}]}]}),
            ),
        );
    }

    /// The rendered text of the first element matching `selector` ("" if none).
    pub fn text_of(&self, selector: &str) -> String {
        self.script(
            "const e = document.querySelector(arguments[0]); return e ? e.innerText : ''",
            &[json!(selector)],
        )
        .as_str()
        .unwrap_or("")
        .to_string()
    }

    /// Whether a JavaScript dialog (alert, confirm) is open.
    pub fn alert_open(&self) -> bool {
        let url = format!("{}/alert/text", self.base);
        self.agent
            .get(url)
            .call()
            .map(|r| r.status().as_u16() == 200)
            .unwrap_or(false)
    }

    /// The browser console entries since the last call: (level, source/message).
    pub fn console(&self) -> Vec<(String, String)> {
        let v = self.cmd("POST", "/se/log", Some(json!({"type": "browser"})));
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|e| {
                        (
                            e["level"].as_str().unwrap_or("").to_string(),
                            e["message"].as_str().unwrap_or("").to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Saves a PNG of the viewport.
    pub fn screenshot(&self, path: &std::path::Path) {
        let v = self.cmd("GET", "/screenshot", None);
        let png = base64_decode(v.as_str().expect("base64 PNG"));
        std::fs::write(path, png).expect("write screenshot");
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.agent.delete(&self.base).call();
    }
}

/// Decodes standard base64 (what WebDriver returns screenshots in).
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes().filter_map(val) {
        acc = (acc << 6) | c;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}
