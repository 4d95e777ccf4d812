//! The decision header's value (`Routed::describe`): region, reason, every
//! cost term, the runner-up, the ladder level and any migration; its
//! numbers written without the formatting machinery, since it is built for
//! every request.

use crate::config::Config;
use crate::decision::pipeline::Routed;

impl Routed {
    /// The decision header's value: region, reason, every cost term, the
    /// runner-up, the ladder level and any migration.
    pub fn describe(&self, cfg: &Config, level: u8) -> String {
        let d = &self.decision;
        let name = |i: usize| cfg.regions.get(i).map_or("?", |r| r.name.as_str());
        let mut s = String::with_capacity(192);
        s.push_str("region=");
        s.push_str(name(d.region));
        s.push_str("; reason=");
        s.push_str(d.reason.as_str());
        if let Some(c) = d.costs.get(d.region) {
            for (label, v) in [
                ("; ttft_ms=", c.total_ms),
                ("; rtt_ms=", c.rtt_ms),
                ("; prefill_ms=", c.prefill_ms),
                ("; wait_ms=", c.queue_ms - c.load_ms),
                ("; load_ms=", c.load_ms),
                ("; footprint_ms=", c.footprint_ms),
            ] {
                s.push_str(label);
                push_one_decimal(&mut s, v);
            }
            s.push_str("; cached_tokens=");
            push_u64(&mut s, c.cached_tokens);
        }
        if let Some(p) = &d.passed_over {
            s.push_str("; passed_over=");
            s.push_str(name(p.region));
            s.push_str("; passed_over_wait_ms=");
            push_one_decimal(&mut s, p.wait_ms);
            s.push_str("; move_ms=");
            push_one_decimal(&mut s, p.move_ms);
        }
        if let Some((i, c)) = d.runner_up.and_then(|i| d.costs.get(i).map(|c| (i, c))) {
            s.push_str("; runner_up=");
            s.push_str(name(i));
            s.push_str("; runner_up_ttft_ms=");
            push_one_decimal(&mut s, c.total_ms);
        }
        s.push_str("; level=");
        push_u64(&mut s, u64::from(level));
        if let Some(kv) = &self.kv {
            s.push_str("; kv_action=");
            s.push_str(&kv.header_value(name(kv.from)).replace("; ", ","));
        }
        s
    }
}

/// `v` as `format!("{v:.1}")` writes it, without the formatting machinery
/// (the decision text is built for every request). Values within a hair of
/// a rounding tie, and large or non-finite ones, take the exact path.
fn push_one_decimal(s: &mut String, v: f64) {
    let tenths = v * 10.0;
    let frac = tenths - tenths.trunc();
    if !(tenths.is_finite() && tenths.abs() < 1e15) || ((frac.abs() - 0.5).abs() < 1e-6) {
        s.push_str(&format!("{v:.1}"));
        return;
    }
    if v.is_sign_negative() {
        s.push('-');
    }
    let t = tenths.round().abs() as u64;
    push_u64(s, t / 10);
    s.push('.');
    push_u64(s, t % 10);
}

fn push_u64(s: &mut String, n: u64) {
    let mut buf = [0u8; 20];
    for d in crate::shared::store::decimal(n, &mut buf) {
        s.push(char::from(*d));
    }
}

#[cfg(test)]
mod tests {
    use super::push_one_decimal;

    #[test]
    fn one_decimal_is_what_format_writes() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut values = vec![
            0.0,
            -0.0,
            0.05,
            0.15,
            0.25,
            0.35,
            0.45,
            1.25,
            2.5,
            99.95,
            123.456,
            -7.25,
            1e14,
            1e16,
            f64::INFINITY,
            f64::NAN,
        ];
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = (x % 10_000_000) as f64 / 997.0;
            values.push(v);
            values.push((x % 100_000) as f64 / 20.0);
        }
        for v in values {
            let mut s = String::new();
            push_one_decimal(&mut s, v);
            assert_eq!(s, format!("{v:.1}"), "{v:e}");
        }
    }
}
