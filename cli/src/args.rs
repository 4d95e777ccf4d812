//! Command-line parsing shared by every subcommand: each subcommand declares
//! its options once, as a `clap` (derive) `Args` struct, and clap refuses
//! anything wrong (unknown, repeated, missing or valueless options, stray
//! words) with exit status 2, naming the option. The value parsers here hold
//! numbers to their ranges, so a value out of range is refused the same way,
//! with what the option takes.

use std::str::FromStr;

/// The range a number must fall in, with the phrase used when it does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Domain {
    /// (0, ∞)
    Positive,
    /// [0, ∞)
    NonNegative,
    /// [0, 1): a queue utilisation with a steady state.
    Utilization,
    /// (0, 1]
    Fraction,
}

impl Domain {
    fn contains(self, x: f64) -> bool {
        x.is_finite()
            && match self {
                Domain::Positive => x > 0.0,
                Domain::NonNegative => x >= 0.0,
                Domain::Utilization => (0.0..1.0).contains(&x),
                Domain::Fraction => x > 0.0 && x <= 1.0,
            }
    }

    fn describe(self) -> &'static str {
        match self {
            Domain::Positive => "a positive number",
            Domain::NonNegative => "a number >= 0",
            Domain::Utilization => "a utilisation in [0, 1)",
            Domain::Fraction => "a fraction in (0, 1]",
        }
    }
}

/// A real number in `domain`. Accepts exponents (`70e9`) and surrounding
/// blanks; refuses `inf` and `NaN`.
pub fn number(raw: &str, domain: Domain) -> Result<f64, String> {
    match raw.trim().parse::<f64>() {
        Ok(x) if domain.contains(x) => Ok(x),
        _ => Err(format!("must be {}", domain.describe())),
    }
}

/// Value parser: a number > 0.
pub fn positive(raw: &str) -> Result<f64, String> {
    number(raw, Domain::Positive)
}

/// Value parser: a number >= 0.
pub fn non_negative(raw: &str) -> Result<f64, String> {
    number(raw, Domain::NonNegative)
}

/// Value parser: a utilisation in [0, 1).
pub fn utilization(raw: &str) -> Result<f64, String> {
    number(raw, Domain::Utilization)
}

/// Value parser: a fraction in (0, 1].
pub fn fraction(raw: &str) -> Result<f64, String> {
    number(raw, Domain::Fraction)
}

/// Value parser: a finite number, any sign (checked later, e.g. by the
/// plugin's own validation).
pub fn finite(raw: &str) -> Result<f64, String> {
    raw.trim()
        .parse::<f64>()
        .ok()
        .filter(|x| x.is_finite())
        .ok_or_else(|| "must be a number".to_string())
}

fn whole_number<T>(raw: &str, positive: bool) -> Result<T, String>
where
    T: FromStr + PartialEq + Default,
{
    match raw.trim().parse::<T>() {
        Ok(n) if !(positive && n == T::default()) => Ok(n),
        _ => Err(if positive {
            "must be a whole number > 0".to_string()
        } else {
            "must be a whole number >= 0".to_string()
        }),
    }
}

/// Value parser: a whole number >= 0 (`u32`, `u64`, ...).
pub fn whole<T>(raw: &str) -> Result<T, String>
where
    T: FromStr + PartialEq + Default,
{
    whole_number(raw, false)
}

/// Value parser: a whole number > 0.
pub fn positive_whole<T>(raw: &str) -> Result<T, String>
where
    T: FromStr + PartialEq + Default,
{
    whole_number(raw, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;
    use clap::Parser;

    /// A subcommand's shape: two valued options and a flag.
    #[derive(Parser, Debug)]
    #[command(name = "t")]
    struct T {
        #[arg(long, value_parser = positive, allow_negative_numbers = true)]
        rtt_ms: Option<f64>,
        #[arg(long, value_parser = positive_whole::<u32>)]
        layers: Option<u32>,
        #[arg(long)]
        json: bool,
    }

    fn parse(line: &str) -> Result<T, clap::Error> {
        T::try_parse_from(std::iter::once("t").chain(line.split_whitespace()))
    }

    fn kind(line: &str) -> ErrorKind {
        match parse(line) {
            Err(e) => {
                assert_eq!(e.exit_code(), 2, "{line}");
                e.kind()
            }
            Ok(t) => panic!("{line}: parsed {t:?}"),
        }
    }

    #[test]
    fn both_value_spellings_and_flags() {
        let t = parse("--rtt-ms 70 --layers=80 --json").unwrap();
        assert_eq!((t.rtt_ms, t.layers, t.json), (Some(70.0), Some(80), true));
        let t = parse("--rtt-ms 7e1").unwrap();
        assert_eq!((t.rtt_ms, t.layers, t.json), (Some(70.0), None, false));
    }

    #[test]
    fn refusals_exit_2_naming_the_option() {
        assert_eq!(kind("--rtt"), ErrorKind::UnknownArgument);
        assert_eq!(kind("--rtt-ms"), ErrorKind::InvalidValue);
        assert_eq!(kind("--rtt-ms --json"), ErrorKind::InvalidValue);
        assert_eq!(kind("--json --json"), ErrorKind::ArgumentConflict);
        assert_eq!(kind("--rtt-ms 1 --rtt-ms 2"), ErrorKind::ArgumentConflict);
        assert_eq!(kind("--json=1"), ErrorKind::TooManyValues);
        assert_eq!(kind("70"), ErrorKind::UnknownArgument);
        assert_eq!(kind("--rtt-ms inf"), ErrorKind::ValueValidation);
        assert_eq!(kind("--rtt-ms -5"), ErrorKind::ValueValidation);
        assert_eq!(kind("--layers 8e1"), ErrorKind::ValueValidation);
        assert_eq!(kind("--layers 0"), ErrorKind::ValueValidation);
        let e = parse("--rtt-ms fast").unwrap_err().to_string();
        assert!(
            e.contains("invalid value 'fast' for '--rtt-ms <RTT_MS>': must be a positive number"),
            "{e}"
        );
        let e = parse("--json --json").unwrap_err().to_string();
        assert!(e.contains("'--json' cannot be used multiple times"), "{e}");
    }

    #[test]
    fn domains() {
        assert_eq!(number(" 0 ", Domain::NonNegative), Ok(0.0));
        assert!(number("0", Domain::Positive).is_err());
        assert!(number("1", Domain::Utilization).is_err());
        assert_eq!(number("1", Domain::Fraction), Ok(1.0));
        assert_eq!(
            number("NaN", Domain::Fraction),
            Err("must be a fraction in (0, 1]".into())
        );
        assert_eq!(finite("-1"), Ok(-1.0));
        assert!(finite("inf").is_err());
        assert_eq!(whole::<u64>("0"), Ok(0));
        assert_eq!(
            positive_whole::<u32>("0"),
            Err("must be a whole number > 0".into())
        );
    }
}
