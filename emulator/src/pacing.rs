//! Decode pacing of a streamed answer, pure: from how many token events were
//! sent and how long ago the stream started, which events are due now or how
//! long to wait for the next one. Token i is due at i × per-token time after
//! the start (token 0 at once: prefill produced it); events that fall due
//! together (sub-millisecond decode) go out in one batch.

/// Shortest wait between batches, so fast decode batches instead of
/// busy-looping.
pub const MIN_WAIT_MS: f64 = 1.0;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pace {
    /// Send token events `from..to` now.
    Emit { from: usize, to: usize },
    /// Nothing is due; look again after this many milliseconds.
    Wait { ms: f64 },
    /// All `tokens` events were sent.
    Done,
}

/// The next step after `sent` of `tokens` events, `elapsed_ms` after the
/// stream started.
pub fn next(sent: usize, tokens: usize, per_token_ms: f64, elapsed_ms: f64) -> Pace {
    if sent >= tokens {
        return Pace::Done;
    }
    let due = if per_token_ms > 0.0 {
        // A float-to-int `as` saturates (NaN gives 0): no overflow here.
        ((elapsed_ms / per_token_ms).floor() as usize)
            .saturating_add(1)
            .min(tokens)
    } else {
        tokens
    };
    if due > sent {
        Pace::Emit {
            from: sent,
            to: due,
        }
    } else {
        let next_at_ms = sent as f64 * per_token_ms;
        Pace::Wait {
            ms: (next_at_ms - elapsed_ms).max(MIN_WAIT_MS),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_token_at_once_then_one_per_interval() {
        assert_eq!(next(0, 3, 2.0, 0.0), Pace::Emit { from: 0, to: 1 });
        assert_eq!(next(1, 3, 2.0, 0.5), Pace::Wait { ms: 1.5 });
        assert_eq!(next(1, 3, 2.0, 2.0), Pace::Emit { from: 1, to: 2 });
        assert_eq!(next(2, 3, 2.0, 9.0), Pace::Emit { from: 2, to: 3 });
        assert_eq!(next(3, 3, 2.0, 9.0), Pace::Done);
    }

    #[test]
    fn late_or_fast_decode_batches() {
        // A late wake-up sends everything due at once, never more than all.
        assert_eq!(next(1, 10, 2.0, 7.0), Pace::Emit { from: 1, to: 4 });
        assert_eq!(next(0, 10, 2.0, 1e9), Pace::Emit { from: 0, to: 10 });
        // Sub-millisecond decode waits at least MIN_WAIT_MS.
        assert_eq!(next(1, 10, 0.1, 0.0), Pace::Wait { ms: MIN_WAIT_MS });
        // Zero decode time: all at once.
        assert_eq!(next(0, 5, 0.0, 0.0), Pace::Emit { from: 0, to: 5 });
        assert_eq!(next(0, 0, 1.0, 0.0), Pace::Done);
    }
}
