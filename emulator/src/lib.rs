//! engine-emulator: a stand-in for one vLLM or SGLang replica, faithful
//! enough in queueing, prefix caching, prefill/decode timing and metrics that
//! llm-geo-router's routing quality can be measured against it.
//!
//! Pure parts: `model` is the engine model (shared with simulators),
//! `pacing` the decode schedule of a streamed answer, `openai`,
//! `responses`, `embeddings`, `refusal` and `metrics` the wire formats.
//! I/O: `server` is the HTTP/1.1 server (hyper on tokio) that drives the
//! model with real time, `body` its paced response bodies; `config` is the
//! command line (clap).

pub mod body;
pub mod config;
pub mod embeddings;
pub mod metrics;
pub mod model;
pub mod openai;
pub mod pacing;
pub mod refusal;
pub mod responses;
pub mod server;
pub mod tokenizer;
