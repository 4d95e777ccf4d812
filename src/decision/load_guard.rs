//! The load guard: the candidates a request must not go to although they
//! may be the cheapest (`apply_load_guard`), and whether some candidate
//! holds the prompt (`holds_prompt`), which decides the rule that applies.

use crate::decision::cost::{move_ms, Cost};
use crate::decision::inputs::{region_slots, Inputs};

/// Whether some candidate holds the prompt: at least half of it beyond what
/// every other candidate holds (a system prompt held everywhere does not
/// make a holder).
pub(super) fn holds_prompt(costs: &[Cost], prompt_tokens: u64) -> bool {
    let cached = || {
        costs
            .iter()
            .filter(|c| c.candidate)
            .map(|c| c.cached_tokens)
    };
    let most = cached().max().unwrap_or(0);
    let least = cached().min().unwrap_or(0);
    most > 0 && (most - least).saturating_mul(2) >= prompt_tokens
}

/// The load guard: marks the candidates the request must not go to although
/// they may be the cheapest. Nothing is marked unless some other candidate
/// has a free slot and is within its share bound (moving to a full region
/// would only move the queue); call those "room".
///
/// * A prompt some candidate holds (`held`: at least half of it beyond what
///   every other candidate holds), at a candidate holding more of it than
///   every room region (moving forces a cache miss): marked only when the
///   move pays. It has no free slot, and its expected wait for one
///   (`wait_ms`) exceeds what the move
///   costs (`move_ms`: the prefill of the tokens not held there, plus the
///   round trip and wait difference). While the holder has a free slot, its
///   wait is 0 and the prompt stays.
/// * A prompt no region holds (a new conversation, whose later turns will
///   follow it, or one held everywhere alike), the placement bound: marked
///   when, with this request, its occupancy would exceed `(1 + ε)` times
///   its fair share (by `max_concurrency`) of all candidates' occupancy,
///   `floor × max_concurrency` (`placement_epsilon` / `_floor`) and one
///   request.
/// * A held prompt that a room region holds as much of is not marked: it
///   goes by its cost. A share bound for it paid nothing (A/B in
///   docs/ROUTING.md, "What each rule is worth").
pub(super) fn apply_load_guard(inp: &Inputs, costs: &mut [Cost], held: bool) {
    let cfg = inp.config;
    let slots = |i: usize| f64::from(region_slots(inp, i));
    let total_slots: f64 = costs
        .iter()
        .enumerate()
        .filter(|(_, c)| c.candidate)
        .map(|(i, _)| slots(i))
        .sum();
    let total_load: f64 = costs
        .iter()
        .filter(|c| c.candidate)
        .map(|c| c.occupancy)
        .sum::<f64>()
        + 1.0;
    if total_slots <= 0.0 {
        return;
    }
    let (e, f) = (cfg.cost.placement_epsilon, cfg.cost.placement_floor);
    let over_share: Vec<bool> = costs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let fair = total_load * slots(i) / total_slots;
            // At least one request: a region with nothing in flight is
            // within its share however few slots it has (a floor of a
            // quarter of 3 slots would keep it from every new prompt).
            let bound = ((1.0 + e) * fair).max(f * slots(i)).max(1.0);
            !held && c.candidate && c.occupancy + 1.0 > bound
        })
        .collect();
    let room: Vec<usize> = costs
        .iter()
        .enumerate()
        .filter(|&(i, c)| {
            c.candidate
                && !over_share.get(i).copied().unwrap_or(true)
                && c.occupancy + 1.0 <= slots(i)
        })
        .map(|(i, _)| i)
        .collect();
    if room.is_empty() {
        return;
    }
    let marks: Vec<(bool, bool)> = costs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let others = || {
                room.iter()
                    .filter(move |&&j| j != i)
                    .filter_map(|&j| costs.get(j))
            };
            if !c.candidate || others().next().is_none() {
                return (false, false);
            }
            if held && !others().any(|o| o.cached_tokens >= c.cached_tokens) {
                let cheapest_move = others()
                    .map(|o| move_ms(c, o))
                    .fold(f64::INFINITY, f64::min);
                (c.wait_ms > 0.0 && c.wait_ms > cheapest_move, true)
            } else {
                (over_share.get(i).copied().unwrap_or(false), false)
            }
        })
        .collect();
    for (c, (over, by_wait)) in costs.iter_mut().zip(marks) {
        c.over_bound = over;
        c.over_wait = over && by_wait;
    }
}

#[cfg(test)]
mod tests {
    use crate::decision::choice::decide;
    use crate::decision::choice::tests::{cfg, eight_slots, inputs, snap};
    use crate::decision::cost::Reason;

    #[test]
    fn a_holder_with_a_free_slot_keeps_its_prompt_whatever_its_share() {
        let c = eight_slots();
        let mut s = snap(&c);
        // mid holds the prompt and runs 7 of 10 in-flight requests: far over
        // any share, but it has a free slot, so nothing is waiting there and
        // moving would only add a 1000-token prefill.
        s.regions[0].running = 2.0;
        s.regions[1].running = 7.0;
        s.regions[2].running = 1.0;
        let d = decide(&inputs(&c, &s, &[0, 62, 0], None));
        assert_eq!((d.region, d.reason), (1, Reason::Cache));
        assert!(d.costs.iter().all(|c| !c.over_bound));
        assert_eq!(d.passed_over, None);
        // Whatever the others' load, while the holder has a free slot the
        // guard never passes it over.
        for holder in 0..8 {
            for other in 0..12 {
                let mut s = snap(&c);
                s.regions[1].running = f64::from(holder);
                s.regions[0].running = f64::from(other);
                s.regions[2].running = f64::from(other / 2);
                let d = decide(&inputs(&c, &s, &[0, 62, 0], None));
                assert!(!d.costs[1].over_bound, "{holder} {other}");
                assert_ne!(d.reason, Reason::LoadOverride, "{holder} {other}");
            }
        }
    }

    #[test]
    fn a_full_holder_is_passed_over_only_when_its_wait_exceeds_the_move() {
        let c = eight_slots();
        // Moving the 1000-token prompt from mid (holds 992 tokens) to near
        // costs 0.5 ms x 992 tokens of prefill minus 35 ms of round trip:
        // 461 ms. mid's wait at occupancy n is (n + 1 - 8) / 8 x 1000 ms.
        let at = |n: f64| {
            let mut s = snap(&c);
            s.regions[1].running = 8.0;
            s.regions[1].waiting = n - 8.0;
            decide(&inputs(&c, &s, &[0, 62, 0], None))
        };
        // Full, 125 ms of wait: cheaper than the move; it stays.
        let d = at(8.0);
        assert_eq!((d.region, d.reason), (1, Reason::Cache));
        assert_eq!(d.costs[1].wait_ms, 125.0);
        // 375 ms of wait: still below the move's 461 ms; it stays.
        let d = at(10.0);
        assert_eq!((d.region, d.reason), (1, Reason::Cache));
        assert!(!d.costs[1].over_bound);
        // 625 ms of wait: the move pays, and the guard marks mid.
        let d = at(12.0);
        assert_eq!((d.region, d.reason), (0, Reason::Load));
        assert!(d.costs[1].over_bound);
        let p = d.passed_over.unwrap();
        assert_eq!((p.region, p.wait_ms, p.move_ms), (1, 625.0, 461.0));
        // Nowhere with a free slot: staying in the queue beats moving it.
        let mut s = snap(&c);
        for r in &mut s.regions {
            r.running = 8.0;
            r.waiting = 8.0;
        }
        let d = decide(&inputs(&c, &s, &[0, 62, 0], None));
        assert_eq!(d.reason, Reason::Cache);
        assert!(d.costs.iter().all(|c| !c.over_bound));
    }

    #[test]
    fn new_prompts_are_placed_within_the_tighter_placement_bound() {
        let c = eight_slots();
        let mut s = snap(&c);
        // near runs 2 of 2 in-flight requests: fair share (2+1)/3 = 1; the
        // placement bound 1.1 x 1 < 3: a prompt no region holds goes
        // elsewhere (no cache miss is forced: a spread).
        s.regions[0].running = 2.0;
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert_eq!(d.reason, Reason::Spread);
        assert_ne!(d.region, 0);
        assert!(d.costs[0].over_bound);
        assert_eq!(d.passed_over.map(|p| (p.region, p.wait_ms)), Some((0, 0.0)));
        // near holds a shared prefix of it, less than half (320 of 1000
        // tokens): it does not hold the prompt, which is placed as new.
        let d = decide(&inputs(&c, &s, &[20, 0, 0], None));
        assert_eq!(d.reason, Reason::Spread);
        // A prompt near holds stays: it has free slots.
        let d = decide(&inputs(&c, &s, &[62, 0, 0], None));
        assert_eq!((d.region, d.reason), (0, Reason::Cache));
        // A prompt held everywhere alike is placed like a new one: moving it
        // forces no miss either.
        let d = decide(&inputs(&c, &s, &[62, 62, 62], None));
        assert_eq!(d.reason, Reason::Spread);
        // Held by near and mid, not far: no share bound, whatever near's
        // share; near (5 of 8 slots, a free one) is the cheaper holder.
        s.regions[0].running = 5.0;
        let d = decide(&inputs(&c, &s, &[62, 62, 0], None));
        assert_eq!((d.region, d.reason), (0, Reason::Cache));
        assert!(d.costs.iter().all(|c| !c.over_bound));
        // With a looser placement bound (1.5 x the share, floor a half),
        // near keeps the new prompt at 2.
        let mut c = eight_slots();
        c.cost.placement_epsilon = 0.5;
        c.cost.placement_floor = 0.5;
        s.regions[0].running = 2.0;
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert_eq!((d.region, d.reason), (0, Reason::Rtt));
    }

    #[test]
    fn a_small_idle_region_takes_a_new_conversation() {
        // near has 3 slots (a small replica), mid and far 64: on an idle
        // fleet its fair share of one request is 3/131 and the floor a
        // quarter of 3 slots, both below one request; an idle region with
        // a free slot is never over its share (issue 45, item 9).
        for slots in [1, 2, 3] {
            let mut c = cfg();
            for (r, n) in c.regions.iter_mut().zip([slots, 64, 64]) {
                r.max_concurrency = n;
            }
            let s = snap(&c);
            let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
            assert_eq!((d.region, d.reason), (0, Reason::Rtt), "{slots} slots");
            assert!(d.costs.iter().all(|c| !c.over_bound), "{slots} slots");
        }
    }

    #[test]
    fn the_load_guard_never_leaves_no_candidate_and_respects_the_floor() {
        let c = cfg();
        let mut s = snap(&c);
        for r in &mut s.regions {
            r.running = 4.0;
            r.waiting = 20.0;
        }
        let d = decide(&inputs(&c, &s, &[0, 62, 0], None));
        assert!(d.costs.iter().all(|c| !c.over_bound));
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert!(d.costs.iter().all(|c| !c.over_bound));
        // Low load: a new prompt with one request in flight at near is below
        // the placement floor when it is as high as the general one (2 of 4
        // slots); at the default (a quarter: 1 of these 4 slots) it is not.
        let mut s = snap(&c);
        s.regions[0].running = 1.0;
        let d = decide(&inputs(&c, &s, &[0, 0, 0], None));
        assert_eq!((d.region, d.reason), (1, Reason::Spread));
        let mut c2 = cfg();
        c2.cost.placement_floor = 0.5;
        let d = decide(&inputs(&c2, &s, &[0, 0, 0], None));
        assert_eq!((d.region, d.reason), (0, Reason::Rtt));
    }
}
