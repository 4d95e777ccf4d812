//! What answered requests teach: the engines' `usage` (`usage`), the
//! directory's calibration against it (`calibration`), the queue weight fitted
//! on observed TTFT (`tuning`), how each request ended (`outcome`), and how
//! long prompts wait to be used again (`reuse`).

pub mod calibration;
pub mod outcome;
pub mod reuse;
pub mod tuning;
pub mod usage;
