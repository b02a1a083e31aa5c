//! What can go wrong in a client command, and the exit code each outcome means. The exit code is
//! chosen from the API's stable error `code` (never from message text), so scripts can rely on it.

use std::fmt;

/// Exit codes of the client commands; the list in [`EXIT_CODES_HELP`] and the README is the
/// contract with scripts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Exit {
    /// Success.
    Ok = 0,
    /// A server-side or internal error (`internal`, an unexpected answer).
    Failed = 1,
    /// A usage error: bad arguments, refused by clap or by the server (`bad_request`,
    /// `invalid_argument`, `out_of_range`).
    Usage = 2,
    /// No such volume or snapshot (`not_found`).
    NotFound = 3,
    /// The name is taken or the state forbids it (`already_exists`, `cannot_reserve`,
    /// `wrong_format`, `read_only`, `in_use`).
    Conflict = 4,
    /// The pool is out of space (`no_space`).
    NoSpace = 5,
    /// The server could not be reached.
    CannotConnect = 6,
    /// The server wants a (different) bearer token (`unauthorized`).
    Unauthorized = 7,
    /// `pool verify` found damage (`damaged`).
    Damaged = 8,
}

/// The exit codes, for `ibid --help`.
pub const EXIT_CODES_HELP: &str = "\
Exit codes (client commands):
  0  success
  1  server-side or internal error (internal)
  2  usage error: bad arguments (bad_request, invalid_argument, out_of_range)
  3  not found: no such volume or snapshot (not_found)
  4  conflict: name taken, or the volume's state forbids it
     (already_exists, cannot_reserve, wrong_format, read_only; in_use: clients
     are connected, see delete --force)
  5  the pool is out of space (no_space)
  6  cannot connect to the server
  7  unauthorized: missing or wrong --token / IBID_API_TOKEN (unauthorized)
  8  pool verify found damage (damaged)

Client commands talk to --server (env IBID_SERVER, default http://127.0.0.1:7800);
--json prints the API's JSON for scripts, and errors as JSON on stderr:
{\"code\": CODE, \"message\": MESSAGE, \"exit\": EXIT}. --server, --token and --json go
before or after the command group.";

impl Exit {
    /// The exit code for an API error `code`; `status` decides for codes this CLI does not know
    /// (an error answer without a JSON body, or from a newer server).
    pub fn from_api(code: &str, status: u16) -> Exit {
        match code {
            "not_found" => Exit::NotFound,
            "already_exists" | "cannot_reserve" | "wrong_format" | "read_only" | "in_use"
            | "lun_in_use" | "already_exported" | "restoring" => Exit::Conflict,
            "no_space" => Exit::NoSpace,
            "unauthorized" => Exit::Unauthorized,
            "bad_request" | "invalid_argument" | "out_of_range" => Exit::Usage,
            "internal" | "pool_failed" => Exit::Failed,
            _ => match status {
                401 | 403 => Exit::Unauthorized,
                404 => Exit::NotFound,
                409 => Exit::Conflict,
                507 => Exit::NoSpace,
                400..=499 => Exit::Usage,
                _ => Exit::Failed,
            },
        }
    }
}

/// A failed client command: the API's (or a local) error code, a message, and the exit code.
#[derive(Debug)]
pub struct CliError {
    /// Stable code: the API's `code`, or a local one (`cannot_connect`, `bad_response`, `usage`).
    pub code: String,
    /// What went wrong, for a person.
    pub message: String,
    /// How the process exits.
    pub exit: Exit,
}

impl CliError {
    /// An error answer from the API.
    pub fn api(status: u16, code: &str, message: &str) -> CliError {
        CliError {
            code: code.to_string(),
            message: message.to_string(),
            exit: Exit::from_api(code, status),
        }
    }

    /// The server could not be reached (or the connection broke).
    pub fn cannot_connect(server: &str, cause: impl fmt::Display) -> CliError {
        CliError {
            code: "cannot_connect".into(),
            message: format!("cannot reach the ibid server at {server}: {cause}"),
            exit: Exit::CannotConnect,
        }
    }

    /// The server answered something this CLI cannot read.
    pub fn bad_response(message: impl Into<String>) -> CliError {
        CliError {
            code: "bad_response".into(),
            message: message.into(),
            exit: Exit::Failed,
        }
    }

    /// Arguments that are wrong in a way clap could not see.
    pub fn usage(message: impl Into<String>) -> CliError {
        CliError {
            code: "usage".into(),
            message: message.into(),
            exit: Exit::Usage,
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_codes_map_to_documented_exit_codes() {
        let cases = [
            ("not_found", 404, Exit::NotFound),
            ("already_exists", 409, Exit::Conflict),
            ("cannot_reserve", 409, Exit::Conflict),
            ("wrong_format", 409, Exit::Conflict),
            ("read_only", 409, Exit::Conflict),
            ("in_use", 409, Exit::Conflict),
            ("restoring", 409, Exit::Conflict),
            ("no_space", 507, Exit::NoSpace),
            ("unauthorized", 401, Exit::Unauthorized),
            ("invalid_argument", 400, Exit::Usage),
            ("internal", 500, Exit::Failed),
            ("pool_failed", 503, Exit::Failed),
            // Unknown codes fall back on the HTTP status.
            ("http_404", 404, Exit::NotFound),
            ("teapot", 418, Exit::Usage),
            ("http_502", 502, Exit::Failed),
        ];
        for (code, status, exit) in cases {
            assert_eq!(Exit::from_api(code, status), exit, "{code} {status}");
        }
    }
}
