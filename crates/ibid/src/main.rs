//! The `ibid` command: server and management CLI.
fn main() {}
