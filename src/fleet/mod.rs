//! The regions as the probe sees them (`state`: health, load, drain rate
//! (`drain`), ejection, the failback ramp, calibration, what ages a
//! modelled cache (`cache_clock`)), the degraded-mode ladder, the
//! declare-disaster assessment, the engines' restarts (`restart`), the
//! snapshot it publishes, a worker's view of that snapshot, and engine
//! tokens per byte read from it (`tokens`: the one estimate the edge's
//! limits, the guard and the cost share).

pub mod assess;
pub mod cache_clock;
pub mod drain;
pub mod ladder;
pub mod restart;
pub mod snapshot;
pub mod state;
pub mod tokens;
pub mod view;
