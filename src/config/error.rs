//! The error a refused configuration gives (`field`: the JSON path of the
//! offending value, `reason`: what is wrong with it), and the value checks
//! the validation shares.

use std::fmt;

/// A configuration that failed to parse or validate: `field` is the JSON path
/// of the offending value, `reason` says what is wrong with it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl ConfigError {
    pub(super) fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid configuration: {}: {}", self.field, self.reason)
    }
}

pub(super) fn valid_name(s: &str) -> bool {
    (1..=32).contains(&s.len())
        && s.bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
}

pub(super) fn valid_header_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with(':')
        && s.bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.'))
}

pub(super) fn positive(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("{v} must be a finite number > 0"),
        ))
    }
}

pub(super) fn non_negative(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("{v} must be a finite number >= 0"),
        ))
    }
}

pub(super) fn fraction(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 && v <= 1.0 {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("{v} must be within (0, 1]"),
        ))
    }
}
