//! Where a request goes. The decision over explicit inputs: what it reads
//! (`inputs`), one expected time to
//! first token per region (`cost`), the cache a prefill takes priced
//! (`footprint`), the load guard (`load_guard`), and the
//! choice of region and its reason (`choice`). The router's decision
//! pipeline around it: one request end to end (`pipeline`), a request
//! whose body is not read (`placement`), the decision header (`header`),
//! and what a served request teaches (`recording`). Whether a
//! conversation's KV state is fetched or recomputed (`migration`).

pub mod choice;
pub mod cost;
pub mod footprint;
pub mod header;
pub mod inputs;
pub mod load_guard;
pub mod migration;
pub mod pipeline;
pub mod placement;
pub mod recording;
