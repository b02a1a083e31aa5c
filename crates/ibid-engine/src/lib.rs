//! The ibid storage engine (placeholder while the engine lands).
