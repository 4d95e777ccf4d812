//! llm-geo-router: a proxy-wasm plugin for Envoy that routes OpenAI-style
//! inference requests across complete model replicas in several regions by
//! expected time-to-first-token.
//!
//! Everything but `host` is the pure core: plain functions and data over
//! explicit inputs and time (`now_ms`), run identically by the .wasm, the
//! native tests and the tools. `host` (wasm32 only) is the one module that
//! talks to `proxy_wasm`.

pub mod assess;
pub mod bodywait;
pub mod calibration;
pub mod config;
pub mod context;
pub mod cost;
pub mod directory;
pub mod effects;
pub mod exchange;
pub mod fleet;
pub mod guard;
pub mod ladder;
pub mod metrics;
pub mod migration;
pub mod openai;
pub mod outcome;
pub mod prefix;
pub mod probe;
pub mod promql;
pub mod protocol;
pub mod request;
pub mod responses;
pub mod route;
pub mod router;
pub mod session;
pub mod snapshot;
pub mod store;
pub mod stream;
pub mod tuning;
pub mod usage;
pub mod view;

#[cfg(target_arch = "wasm32")]
mod host;
