//! What the roots and the host share: the names of keys, queues and stats
//! (`names`), the shared-data store, the interface the core asks of its host
//! (`host_api`), a filter's answer to each event (`flow`), and the OpenAI
//! error body (`openai_error`).

pub mod envoy_version;
pub mod flow;
pub mod host_api;
pub mod names;
pub mod openai_error;
pub mod store;
