//! Where a request goes: one expected time to first token per region
//! (`cost`), the router's decision pipeline around it (`pipeline`), and
//! whether a conversation's KV state is fetched or recomputed (`migration`).

pub mod cost;
pub mod migration;
pub mod pipeline;
