//! An engine's restart, as the probe sees it: a counter only a restart
//! sends back (`EngineSample::restart_counter`: the prefix-cache queries,
//! else the prompt tokens) read lower than at the scrape before. A
//! restarted engine starts with an empty prefix cache, so what the
//! directory recorded at the region before it is not there any more
//! (docs/ROUTING.md, "What the engine keeps").
//!
//! Only two readings that both had the counter are compared: a good
//! scrape without it (an exporter that leaves it out, another page that
//! has the load series) or a failed one is no reading, never a counter
//! gone to 0, and the next reading is compared with the last one that had
//! it.
//!
//! Several engines behind one region (vLLM's data-parallel `engine="N"`
//! series, or the replicas the `prometheus` source sums) are read as one
//! sum: a sum that went back is a restart of one of them at least, and
//! which one cannot be told. Forgetting the whole region is the
//! conservative choice: the prompts the restarted engine held are gone,
//! and those the others hold are served again at the cost of one prefill
//! each, where a wrong belief would send a conversation to a cold engine
//! (a full prefill) for its cache, every turn until it was refuted. With
//! the `prometheus` source, two sums are compared only over as many
//! replicas: one whose scrape failed drops out of the sum without any
//! restart. A `scrape` through an entry point that balances over several
//! replicas reads one of them at a time, so its counters go up and down
//! between scrapes: each fall reads as a restart (as the intake clock
//! already read it as a cache emptied); such a region wants the
//! `prometheus` source (docs/OPERATIONS.md, "Load from Prometheus").

use crate::engines::metrics::{EngineSample, RestartCounter};

/// A fall smaller than this (tokens) is no restart: a sum's rounding, not
/// a counter that went back.
const NOISE: f64 = 0.5;

/// One reading of the counter.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Reading {
    counter: RestartCounter,
    value: f64,
    /// Replicas the sum is over (1 for a scrape).
    replicas: u32,
}

/// What a restart read: the counter, before and after.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Restart {
    pub counter: RestartCounter,
    pub before: f64,
    pub after: f64,
    /// Replicas the sums are over.
    pub replicas: u32,
}

/// The last reading of one region's counter, and of its serving
/// process's start time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RestartWatch {
    last: Option<Reading>,
    started_s: Option<f64>,
}

/// Start times closer than this (s) are the same process (a float printed
/// twice).
const SAME_START_S: f64 = 1.0;

impl RestartWatch {
    /// A good scrape (or Prometheus answer) summed over `replicas`: the
    /// restart it shows, if its counter went back since the last reading
    /// of the same counter over as many replicas.
    pub fn observe(&mut self, sample: &EngineSample, replicas: u32) -> Option<Restart> {
        // A new serving process is a restart even where no counter had
        // moved before it (an engine that died before a scrape saw its
        // first request): the counters start again from there.
        if let Some(started) = sample.process_start_s.filter(|s| s.is_finite()) {
            let before = self.started_s.replace(started);
            if let Some(before) = before.filter(|b| (started - b).abs() > SAME_START_S) {
                self.last = sample.restart_counter().map(|(counter, value)| Reading {
                    counter,
                    value,
                    replicas: replicas.max(1),
                });
                return Some(Restart {
                    counter: RestartCounter::ProcessStart,
                    before,
                    after: started,
                    replicas: replicas.max(1),
                });
            }
        }
        let (counter, value) = sample.restart_counter()?;
        if !value.is_finite() || value < 0.0 {
            return None;
        }
        let now = Reading {
            counter,
            value,
            replicas: replicas.max(1),
        };
        let before = self.last.replace(now)?;
        (before.counter == now.counter
            && before.replicas == now.replicas
            && now.value + NOISE < before.value)
            .then_some(Restart {
                counter,
                before: before.value,
                after: now.value,
                replicas: now.replicas,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queries(q: f64) -> EngineSample {
        EngineSample {
            prefix_queries: Some(q),
            prompt_tokens: Some(q / 2.0),
            ..EngineSample::default()
        }
    }

    #[test]
    fn a_counter_that_went_back_between_two_readings_is_a_restart() {
        let mut w = RestartWatch::default();
        assert_eq!(w.observe(&queries(5000.0), 1), None, "nothing before");
        assert_eq!(w.observe(&queries(5000.0), 1), None, "unchanged");
        assert_eq!(w.observe(&queries(6000.0), 1), None);
        assert_eq!(
            w.observe(&queries(120.0), 1),
            Some(Restart {
                counter: RestartCounter::PrefixQueries,
                before: 6000.0,
                after: 120.0,
                replicas: 1
            })
        );
        assert_eq!(w.observe(&queries(300.0), 1), None, "counting again");
    }

    #[test]
    fn a_new_serving_process_is_a_restart_whatever_the_counters() {
        // Killed before any scrape saw its counters move: 0 before, 0
        // after, but a new process (issue 45, item 4, against real vLLM).
        let mut w = RestartWatch::default();
        let at = |start: f64, q: f64| EngineSample {
            process_start_s: Some(start),
            ..queries(q)
        };
        assert_eq!(w.observe(&at(1_796_428_336.0, 0.0), 1), None);
        assert_eq!(
            w.observe(&at(1_796_428_336.2, 0.0), 1),
            None,
            "the same process"
        );
        let r = w.observe(&at(1_796_428_999.0, 0.0), 1).unwrap();
        assert_eq!(
            (r.counter, r.before, r.after),
            (
                RestartCounter::ProcessStart,
                1_796_428_336.2,
                1_796_428_999.0
            )
        );
        // Its counters are the new base: no second restart for them.
        assert_eq!(w.observe(&at(1_796_428_999.0, 50.0), 1), None);
    }

    #[test]
    fn a_reading_without_the_counter_is_no_reading() {
        let mut w = RestartWatch::default();
        w.observe(&queries(5000.0), 1);
        // No counter at all: not read as 0, and the base stays.
        assert_eq!(w.observe(&EngineSample::default(), 1), None);
        assert_eq!(w.observe(&queries(5100.0), 1), None);
        // NaN or negative (never from the parser): no reading either.
        assert_eq!(w.observe(&queries(f64::NAN), 1), None);
        assert_eq!(w.observe(&queries(-1.0), 1), None);
        assert_eq!(w.observe(&queries(5200.0), 1), None);
        // The restart while the counter was missing is still seen.
        w.observe(&EngineSample::default(), 1);
        assert!(w.observe(&queries(10.0), 1).is_some());
    }

    #[test]
    fn another_counter_or_another_number_of_replicas_is_not_compared() {
        let mut w = RestartWatch::default();
        w.observe(&queries(5000.0), 1);
        // The prefix counters gone, the prompt tokens there: another
        // counter, a new base.
        let prompt = EngineSample {
            prompt_tokens: Some(100.0),
            ..EngineSample::default()
        };
        assert_eq!(w.observe(&prompt, 1), None);
        let restarted = EngineSample {
            prompt_tokens: Some(10.0),
            ..EngineSample::default()
        };
        assert_eq!(
            w.observe(&restarted, 1).map(|r| r.counter),
            Some(RestartCounter::PromptTokens)
        );
        // Three replicas summed, then two (one's scrape failed), then three
        // again: no restart; three whose sum fell: one.
        let mut w = RestartWatch::default();
        w.observe(&queries(9000.0), 3);
        assert_eq!(w.observe(&queries(6000.0), 2), None);
        assert_eq!(w.observe(&queries(9100.0), 3), None);
        assert_eq!(w.observe(&queries(9150.0), 3), None);
        assert_eq!(
            w.observe(&queries(6100.0), 3)
                .map(|r| (r.before, r.replicas)),
            Some((9150.0, 3))
        );
    }
}
