//! The three roots Envoy loads from the one module: the `guard` and `router`
//! HTTP filters (a stream each per request) and the `probe` singleton
//! service that keeps the shared data current.

pub mod guard;
pub mod probe;
pub mod router;
