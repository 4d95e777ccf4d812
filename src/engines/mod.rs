//! The engines' signals: their `/metrics` families (vLLM, SGLang,
//! llama.cpp) and the load read from a Prometheus API (`promql`).

pub mod metrics;
pub mod promql;
