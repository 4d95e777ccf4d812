//! llm-geo-router: a proxy-wasm plugin for Envoy that routes OpenAI-style
//! inference requests across complete model replicas in several regions by
//! expected time-to-first-token.
//!
//! Everything but `host` is the pure core: plain functions and data over
//! explicit inputs and time (`now_ms`), run identically by the .wasm, the
//! native tests and the tools. `host` (wasm32 only) is the one module that
//! talks to `proxy_wasm`.

pub mod cache;
pub mod config;
pub mod decision;
pub mod engines;
pub mod fleet;
pub mod learning;
pub mod request;
pub mod roots;
pub mod shared;

#[cfg(target_arch = "wasm32")]
mod host;
