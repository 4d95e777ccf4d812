//! The three roots Envoy loads from the one module: the `guard` and `router`
//! HTTP filters (a stream each per request; the router's answer side is
//! `router_answer`) and the `probe` singleton
//! service that keeps the shared data current, with what it reads from the
//! engines (`probe_engines`), its `prometheus` load source
//! (`probe_prometheus`), its side of the peer exchange (`probe_exchange`),
//! what it publishes (`probe_publish`) and whether each region's engine
//! keeps its Responses (`probe_store`).

pub mod guard;
pub mod probe;
pub mod probe_engines;
pub mod probe_exchange;
pub mod probe_prometheus;
pub mod probe_publish;
pub mod probe_store;
pub mod router;
pub mod router_answer;
