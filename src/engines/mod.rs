//! The engines' signals: their `/metrics` scrape (`metrics`), read with the
//! text format (`exposition`), the families' series (vLLM, SGLang,
//! llama.cpp: `families`) and the KV-cache capacity (`capacity`), and the
//! load read from a Prometheus API (`promql`).

pub mod capacity;
pub mod exposition;
pub mod families;
pub mod metrics;
pub mod promql;
