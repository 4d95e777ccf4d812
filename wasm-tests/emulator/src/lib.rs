//! engine-emulator: a stand-in for one vLLM or SGLang replica, faithful
//! enough in queueing, prefix caching, prefill/decode timing and metrics that
//! llm-geo-router's routing quality can be measured against it.
//!
//! `model` is the pure engine model (shared with simulators); `openai`,
//! `metrics` and `http` are pure wire formats; `server` drives the model with
//! real time and sockets; `config` is the command line.

pub mod config;
pub mod http;
pub mod metrics;
pub mod model;
pub mod openai;
pub mod server;
