//! What the router believes each region's engines hold: the prefix
//! directory, how long an engine keeps what it served (`retention`), the
//! session records, the stored Responses API answers, and the exchange that
//! shares them between the deployment's Envoys.

pub mod directory;
pub mod exchange;
pub mod retention;
pub mod sessions;
pub mod stored_responses;
