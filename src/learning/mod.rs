//! What answered requests teach: the engines' `usage` (`usage`), the
//! directory's calibration against it (`calibration`), the queue weight fitted
//! on observed TTFT (`tuning`), and how each request ended (`outcome`).

pub mod calibration;
pub mod outcome;
pub mod tuning;
pub mod usage;
