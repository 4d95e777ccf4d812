//! The running Envoy's version, as its node reports it, and whether that
//! build is one that loses request body frames behind this plugin's
//! filters.
//!
//! The router and the guard stop on headers and buffer the body
//! (`allow_on_headers_stop_iteration`). Before envoyproxy/envoy#46842
//! (runtime guard
//! `envoy.reloadable_features.filter_manager_forward_added_data_on_continue`),
//! a filter that moved a body frame into the buffer and then continued
//! could have that frame dropped silently. The fix is in Envoy 1.40.0 and
//! was backported to 1.39.1, 1.38.4, 1.37.6 and 1.36.10 (their
//! changelogs); 1.35 and older have no release with it.

/// An Envoy build's version: `xds.node.user_agent_build_version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvoyVersion {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
    /// A development build (`build.label` "dev"): it comes before the
    /// release of its number.
    pub dev: bool,
}

/// Per release line, the first patch release with the fix.
const FIXED: [(u64, u64); 4] = [(36, 10), (37, 6), (38, 4), (39, 1)];
/// The first minor release that has it from its first patch.
const FIXED_FROM_MINOR: u64 = 40;

impl EnvoyVersion {
    /// From the three numbers Envoy's `get_property` returns (each a u64 in
    /// 8 bytes, little-endian) and the build label; `None` when any is
    /// missing or malformed.
    pub fn from_property_bytes(
        major: Option<&[u8]>,
        minor: Option<&[u8]>,
        patch: Option<&[u8]>,
        label: Option<&[u8]>,
    ) -> Option<EnvoyVersion> {
        let n = |b: Option<&[u8]>| -> Option<u64> { Some(u64::from_le_bytes(b?.try_into().ok()?)) };
        Some(EnvoyVersion {
            major: n(major)?,
            minor: n(minor)?,
            patch: n(patch)?,
            dev: label.is_some_and(|l| l == b"dev"),
        })
    }

    /// When this build can lose a request body frame behind the plugin's
    /// filters: the first release that does not (for its line, else the
    /// oldest line with one). `None`: not affected, or not an Envoy 1.x
    /// this plugin knows of.
    pub fn body_frame_fix(&self) -> Option<String> {
        if self.major != 1 || self.minor >= FIXED_FROM_MINOR {
            return None;
        }
        match FIXED.iter().find(|(m, _)| *m == self.minor) {
            // A dev build of the fixed number predates that release.
            Some(&(_, p)) if self.patch > p || (self.patch == p && !self.dev) => None,
            Some(&(m, p)) => Some(format!("1.{m}.{p}")),
            None => FIXED.first().map(|&(m, p)| format!("1.{m}.{p}")),
        }
    }
}

impl std::fmt::Display for EnvoyVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)?;
        if self.dev {
            write!(f, "-dev")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(minor: u64, patch: u64, dev: bool) -> EnvoyVersion {
        EnvoyVersion {
            major: 1,
            minor,
            patch,
            dev,
        }
    }

    #[test]
    fn each_line_is_fixed_from_its_backport_on() {
        for (minor, fixed) in [(36, 10), (37, 6), (38, 4), (39, 1)] {
            let want = format!("1.{minor}.{fixed}");
            assert_eq!(
                v(minor, fixed - 1, false).body_frame_fix(),
                Some(want.clone())
            );
            assert_eq!(
                v(minor, fixed, true).body_frame_fix(),
                Some(want),
                "dev build"
            );
            assert_eq!(v(minor, fixed, false).body_frame_fix(), None);
            assert_eq!(
                v(minor, fixed, true).body_frame_fix(),
                Some(format!("1.{minor}.{fixed}"))
            );
            assert_eq!(v(minor, fixed + 1, true).body_frame_fix(), None);
        }
        assert_eq!(v(40, 0, false).body_frame_fix(), None);
        assert_eq!(v(40, 0, true).body_frame_fix(), None);
        assert_eq!(v(41, 3, false).body_frame_fix(), None);
        // Older lines have no release with the fix: the oldest line's.
        assert_eq!(v(35, 9, false).body_frame_fix(), Some("1.36.10".into()));
        assert_eq!(v(33, 0, false).body_frame_fix(), Some("1.36.10".into()));
        // Not an Envoy 1.x: nothing said.
        let two = EnvoyVersion {
            major: 2,
            ..v(0, 0, false)
        };
        assert_eq!(two.body_frame_fix(), None);
    }

    #[test]
    fn read_from_the_hosts_bytes() {
        let b = |n: u64| n.to_le_bytes();
        let (one, thirty_seven, six) = (b(1), b(37), b(6));
        let got = EnvoyVersion::from_property_bytes(
            Some(&one),
            Some(&thirty_seven),
            Some(&six),
            Some(b"dev"),
        );
        assert_eq!(got, Some(v(37, 6, true)));
        assert_eq!(got.unwrap().to_string(), "1.37.6-dev");
        let release =
            EnvoyVersion::from_property_bytes(Some(&one), Some(&thirty_seven), Some(&six), None);
        assert_eq!(release.unwrap().to_string(), "1.37.6");
        // Missing or of another width: unknown, never a guess.
        assert_eq!(
            EnvoyVersion::from_property_bytes(None, Some(&thirty_seven), Some(&six), None),
            None
        );
        assert_eq!(
            EnvoyVersion::from_property_bytes(Some(&one), Some(&[37, 0, 0, 0]), Some(&six), None),
            None
        );
    }
}
