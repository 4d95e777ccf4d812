//! Command-line option parsing shared by every subcommand: each subcommand
//! declares its options once, and anything wrong (unknown, repeated, missing,
//! unparsable or out of range) is refused with the option's name in the
//! message, so the operator sees exactly what to fix.

use crate::CliError;
use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

/// Whether an option takes a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `--json`
    Flag,
    /// `--rtt-ms 70` or `--rtt-ms=70`
    Value,
}

/// One declared option; `name` is spelt without the leading dashes.
#[derive(Debug, Clone, Copy)]
pub struct Opt {
    pub name: &'static str,
    pub kind: Kind,
}

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

/// A command line parsed against its declared options.
#[derive(Debug, Default)]
pub struct Parsed {
    values: BTreeMap<&'static str, String>,
    flags: BTreeSet<&'static str>,
}

/// Parses `args` (the words after the subcommand) against `spec`.
pub fn parse(args: &[String], spec: &[Opt]) -> Result<Parsed, CliError> {
    let mut parsed = Parsed::default();
    let mut words = args.iter();
    while let Some(word) = words.next() {
        let Some(body) = word.strip_prefix("--") else {
            return Err(usage(format!("unexpected argument '{word}'")));
        };
        let (name, inline) = match body.split_once('=') {
            Some((name, value)) => (name, Some(value.to_owned())),
            None => (body, None),
        };
        let Some(opt) = spec.iter().find(|o| o.name == name) else {
            return Err(usage(format!("unknown option --{name}")));
        };
        let repeated = match opt.kind {
            Kind::Flag => {
                if inline.is_some() {
                    return Err(usage(format!("--{name} takes no value")));
                }
                !parsed.flags.insert(opt.name)
            }
            Kind::Value => {
                let value = match inline {
                    Some(value) => value,
                    // A following option means this one's value was left out.
                    None => match words.next() {
                        Some(next) if !next.starts_with("--") => next.clone(),
                        _ => return Err(usage(format!("--{name} needs a value"))),
                    },
                };
                parsed.values.insert(opt.name, value).is_some()
            }
        };
        if repeated {
            return Err(usage(format!("--{name} is given more than once")));
        }
    }
    Ok(parsed)
}

fn usage(message: String) -> CliError {
    CliError::Usage(message)
}

impl Parsed {
    pub fn flag(&self, name: &str) -> bool {
        self.flags.contains(name)
    }

    pub fn has(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    /// The value as given (a file name, a header value), or `None` when the
    /// option was not given.
    pub fn text(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// Fails naming every option of `names` that was not given, at once.
    pub fn require_all(&self, names: &[&str]) -> Result<(), CliError> {
        let missing: Vec<String> = names
            .iter()
            .filter(|name| !self.has(name))
            .map(|name| format!("--{name}"))
            .collect();
        match missing.as_slice() {
            [] => Ok(()),
            [one] => Err(usage(format!("missing required option {one}"))),
            many => Err(usage(format!(
                "missing required options {}",
                many.join(", ")
            ))),
        }
    }

    /// A real number in `domain`, or `None` when the option was not given.
    /// Accepts exponents (`70e9`); refuses `inf` and `NaN`.
    pub fn number(&self, name: &str, domain: Domain) -> Result<Option<f64>, CliError> {
        let Some(raw) = self.values.get(name) else {
            return Ok(None);
        };
        match raw.trim().parse::<f64>() {
            Ok(x) if domain.contains(x) => Ok(Some(x)),
            _ => Err(usage(format!(
                "--{name} must be {}, got '{raw}'",
                domain.describe()
            ))),
        }
    }

    /// A non-negative whole number (`u32`, `u64`, ...), or `None` when the
    /// option was not given; `positive` also refuses zero.
    pub fn whole<T>(&self, name: &str, positive: bool) -> Result<Option<T>, CliError>
    where
        T: FromStr + PartialEq + Default,
    {
        let Some(raw) = self.values.get(name) else {
            return Ok(None);
        };
        match raw.trim().parse::<T>() {
            Ok(n) if !(positive && n == T::default()) => Ok(Some(n)),
            _ => {
                let what = if positive {
                    "a whole number > 0"
                } else {
                    "a whole number >= 0"
                };
                Err(usage(format!("--{name} must be {what}, got '{raw}'")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &[Opt] = &[
        Opt {
            name: "rtt-ms",
            kind: Kind::Value,
        },
        Opt {
            name: "layers",
            kind: Kind::Value,
        },
        Opt {
            name: "json",
            kind: Kind::Flag,
        },
    ];

    fn words(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_owned).collect()
    }

    fn message(result: Result<Parsed, CliError>) -> String {
        match result {
            Err(CliError::Usage(m)) => m,
            Err(other) => format!("not a usage error: {other:?}"),
            Ok(p) => format!("parsed {p:?}"),
        }
    }

    #[test]
    fn both_value_spellings_and_flags() {
        let p = parse(&words("--rtt-ms 70 --layers=80 --json"), SPEC).unwrap();
        assert_eq!(p.number("rtt-ms", Domain::Positive).unwrap(), Some(70.0));
        assert_eq!(p.whole::<u32>("layers", true).unwrap(), Some(80));
        assert!(p.flag("json"));
    }

    #[test]
    fn refusals_name_the_option() {
        let cases = [
            ("--rtt", "unknown option --rtt"),
            ("--rtt-ms", "--rtt-ms needs a value"),
            ("--rtt-ms --json", "--rtt-ms needs a value"),
            ("--json --json", "--json is given more than once"),
            ("--json=1", "--json takes no value"),
            ("70", "unexpected argument '70'"),
        ];
        for (line, expected) in cases {
            assert_eq!(message(parse(&words(line), SPEC)), expected);
        }
        let p = parse(&words("--rtt-ms inf --layers 8e1"), SPEC).unwrap();
        assert!(p.number("rtt-ms", Domain::NonNegative).is_err());
        assert!(p.whole::<u32>("layers", true).is_err());
    }
}
