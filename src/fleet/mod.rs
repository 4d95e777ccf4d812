//! The regions as the probe sees them (`state`: health, load, drain rate,
//! ejection, the failback ramp, calibration), the degraded-mode ladder, the
//! declare-disaster assessment, the engines' restarts (`restart`), the
//! snapshot it publishes, and a worker's view of that snapshot.

pub mod assess;
pub mod ladder;
pub mod restart;
pub mod snapshot;
pub mod state;
pub mod view;
