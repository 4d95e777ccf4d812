//! A multi-tenant prefix tree over segments, for the baselines that keep
//! their own approximate view of what each region caches (SGLang's
//! `cache_aware`, GORGO): one tree for all regions, each node remembering
//! when each region last had a prompt through it and which region's insert
//! created it. A region that holds a node holds its whole path (inserts
//! stamp every node on the way), as in SGLang's approximate radix tree.
//!
//! Segments are the unit: two prompts share a prefix exactly when they share
//! leading segments, so matching whole segments is matching text.

use std::collections::HashMap;

#[derive(Debug, Clone)]
struct Node {
    children: HashMap<u32, usize>,
    /// Per region: the insert counter when it last went through, 0 = never.
    stamps: Vec<u64>,
    /// The region whose insert created the node (`None` for the root).
    creator: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct Trie {
    nodes: Vec<Node>,
    regions: usize,
    clock: u64,
}

/// The longest match of a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Match {
    /// Tokens of the deepest node any region holds.
    pub tokens: u64,
    /// The region whose insert created that node, if any node matched:
    /// SGLang's `last_tenant`, which a node gets when an insert creates it
    /// (a node split off an older one keeps the older one's) and keeps
    /// while that tenant holds it, whoever goes through it later.
    pub owner: Option<usize>,
    /// Per region: tokens of the longest prefix it holds.
    pub per_region: Vec<u64>,
}

impl Trie {
    pub fn new(regions: usize) -> Self {
        Trie {
            nodes: vec![Node {
                children: HashMap::new(),
                stamps: vec![0; regions],
                creator: None,
            }],
            regions,
            clock: 0,
        }
    }

    /// `segments`: (interned id, tokens) in prompt order.
    pub fn lookup(&self, segments: &[(u32, u32)]) -> Match {
        let mut m = Match {
            tokens: 0,
            owner: None,
            per_region: vec![0; self.regions],
        };
        let mut at = 0usize;
        let mut depth = 0u64;
        for (id, n) in segments {
            let Some(&next) = self.nodes.get(at).and_then(|node| node.children.get(id)) else {
                break;
            };
            at = next;
            depth += u64::from(*n);
            let Some(node) = self.nodes.get(at) else {
                break;
            };
            let mut held = false;
            for (r, &s) in node.stamps.iter().enumerate() {
                if s > 0 {
                    held = true;
                    if let Some(t) = m.per_region.get_mut(r) {
                        *t = depth;
                    }
                }
            }
            if held {
                m.tokens = depth;
                m.owner = node.creator;
            }
        }
        m
    }

    /// Records that `region` now holds the whole prompt.
    pub fn insert(&mut self, segments: &[(u32, u32)], region: usize) {
        self.clock += 1;
        let stamp = self.clock;
        let mut at = 0usize;
        for (id, _) in segments {
            let existing = self.nodes.get(at).and_then(|n| n.children.get(id)).copied();
            let next = match existing {
                Some(next) => next,
                None => {
                    let next = self.nodes.len();
                    self.nodes.push(Node {
                        children: HashMap::new(),
                        stamps: vec![0; self.regions],
                        creator: Some(region),
                    });
                    if let Some(n) = self.nodes.get_mut(at) {
                        n.children.insert(*id, next);
                    }
                    next
                }
            };
            at = next;
            if let Some(s) = self
                .nodes
                .get_mut(at)
                .and_then(|n| n.stamps.get_mut(region))
            {
                *s = stamp;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_match_per_region_and_the_creator_of_its_node() {
        let mut t = Trie::new(2);
        t.insert(&[(1, 100), (2, 50)], 0);
        t.insert(&[(1, 100), (3, 10)], 1);
        let m = t.lookup(&[(1, 100), (2, 50), (4, 5)]);
        assert_eq!((m.tokens, m.owner), (150, Some(0)));
        assert_eq!(m.per_region, vec![150, 100]);
        // Both hold segment 1; region 0's insert created it, and the later
        // pass of region 1 does not change that.
        let m = t.lookup(&[(1, 100), (9, 5)]);
        assert_eq!((m.tokens, m.owner), (100, Some(0)));
        let m = t.lookup(&[(1, 100), (3, 10)]);
        assert_eq!((m.tokens, m.owner), (110, Some(1)));
        let m = t.lookup(&[(7, 1)]);
        assert_eq!((m.tokens, m.owner, m.per_region), (0, None, vec![0, 0]));
    }
}
