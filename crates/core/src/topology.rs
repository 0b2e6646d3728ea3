//! How the GPUs of a group are connected: per pair of ranks, the same device, NVLink, PCIe peer
//! access or nothing; per rank, the NUMA node of its GPU. GPU backends probe it when a group is
//! built ([`crate::gpu::GpuRuntime::link`], [`crate::gpu::GpuRuntime::numa_node`]); a caller or
//! test can force one ([`crate::GroupConfig::topology`], `ALLREDUCE_TOPOLOGY`).
//!
//! What it decides: without peer access between two ranks' GPUs the custom kernels cannot run
//! (they read and write each other's memory), so only the vendor library is offered, and a
//! group builds instead of failing (TensorRT-LLM crashed in cudaIpcOpenMemHandle there).

use std::fmt;

use crate::{Error, Result};

/// How one rank reaches another's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// Both ranks on one GPU (virtual ranks, or processes sharing it under MPS).
    SameDevice,
    /// Peer access over NVLink (or xGMI on AMD).
    NvLink,
    /// Peer access over PCIe (possibly across the CPU interconnect).
    Pcie,
    /// No peer access: only the vendor library can connect them.
    None,
}

impl Link {
    pub fn name(self) -> &'static str {
        match self {
            Link::SameDevice => "X",
            Link::NvLink => "NV",
            Link::Pcie => "PCI",
            Link::None => "-",
        }
    }

    pub fn has_peer_access(self) -> bool {
        !matches!(self, Link::None)
    }
}

/// What the selection table can ask of a topology ([`crate::Rule::topology`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TopologyClass {
    /// Distinct GPUs on PCIe only, in one NUMA group (or NUMA nodes unknown).
    Pcie,
    /// Distinct GPUs on PCIe only, in exactly two NUMA groups (the 2 x 4 boxes of
    /// TensorRT-LLM's low-precision all-reduce: the slow hop is between the groups).
    PcieTwoNuma,
    /// Distinct GPUs, every pair over NVLink (xGMI on AMD): where NCCL's symmetric kernels
    /// run (`Strategy::VendorSymmetric`).
    NvLink,
}

impl TopologyClass {
    pub const fn name(self) -> &'static str {
        match self {
            TopologyClass::Pcie => "pcie",
            TopologyClass::PcieTwoNuma => "pcie-2numa",
            TopologyClass::NvLink => "nvlink",
        }
    }
}

impl std::str::FromStr for TopologyClass {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "pcie" => Ok(TopologyClass::Pcie),
            "pcie-2numa" => Ok(TopologyClass::PcieTwoNuma),
            "nvlink" => Ok(TopologyClass::NvLink),
            _ => Err(format!(
                "unknown topology class `{s}` (expected pcie, pcie-2numa or nvlink)"
            )),
        }
    }
}

/// The links between every pair of ranks and each rank's NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// `links[a][b]`: how rank a reaches rank b (`SameDevice` on the diagonal).
    pub links: Vec<Vec<Link>>,
    /// NUMA node of each rank's GPU, where the platform says.
    pub numa: Vec<Option<u32>>,
    /// Forced by the caller rather than probed.
    pub forced: bool,
}

impl Topology {
    pub fn world(&self) -> usize {
        self.links.len()
    }

    /// Every rank reaches every other one's memory.
    pub fn peer_access(&self) -> bool {
        self.links.iter().flatten().all(|l| l.has_peer_access())
    }

    /// The first pair without peer access, if any.
    pub fn missing_peer_access(&self) -> Option<(usize, usize)> {
        (0..self.world()).find_map(|a| {
            (0..self.world()).find_map(|b| (!self.links[a][b].has_peer_access()).then_some((a, b)))
        })
    }

    /// Distinct GPUs talk over PCIe only (no NVLink pair): bandwidth-bound from a few hundred
    /// KiB, where the low-precision path pays.
    pub fn pcie_only(&self) -> bool {
        let mut any = false;
        for l in self.links.iter().flatten() {
            match l {
                Link::NvLink => return false,
                Link::Pcie => any = true,
                _ => {}
            }
        }
        any
    }

    /// Every pair of distinct GPUs over NVLink (and at least one such pair).
    pub fn nvlink_only(&self) -> bool {
        let mut any = false;
        for l in self.links.iter().flatten() {
            match l {
                Link::NvLink => any = true,
                Link::SameDevice => {}
                Link::Pcie | Link::None => return false,
            }
        }
        any
    }

    /// The class selection rules match on, if the topology has one.
    pub fn class(&self) -> Option<TopologyClass> {
        if self.nvlink_only() {
            return Some(TopologyClass::NvLink);
        }
        if !self.pcie_only() {
            return None;
        }
        match self.numa_groups().len() {
            1 => Some(TopologyClass::Pcie),
            2 => Some(TopologyClass::PcieTwoNuma),
            _ => None,
        }
    }

    /// Ranks grouped by NUMA node, in order of first appearance (one group when unknown).
    pub fn numa_groups(&self) -> Vec<Vec<usize>> {
        let mut groups: Vec<(Option<u32>, Vec<usize>)> = Vec::new();
        for (r, &n) in self.numa.iter().enumerate() {
            match groups.iter_mut().find(|(k, _)| *k == n) {
                Some((_, g)) => g.push(r),
                None => groups.push((n, vec![r])),
            }
        }
        groups.into_iter().map(|(_, g)| g).collect()
    }

    /// A forced topology: `nvlink`, `pcie` or `none` for every pair, optionally with NUMA
    /// groups as `pcie:2x4` (2 groups of 4 consecutive ranks).
    pub fn parse(spec: &str, world: usize) -> Result<Topology> {
        let bad = |why: &str| {
            Error::InvalidConfig(format!(
                "topology `{spec}`: {why} (expected nvlink, pcie or none, optionally :GxN)"
            ))
        };
        let (kind, shape) = match spec.split_once(':') {
            Some((k, s)) => (k, Some(s)),
            None => (spec, None),
        };
        let link = match kind.trim().to_ascii_lowercase().as_str() {
            "nvlink" | "nv" => Link::NvLink,
            "pcie" | "pci" => Link::Pcie,
            "none" => Link::None,
            _ => return Err(bad("unknown link")),
        };
        let numa = match shape {
            None => vec![Some(0); world],
            Some(s) => {
                let (g, n) = s.split_once('x').ok_or_else(|| bad("no GxN"))?;
                let g: usize = g.trim().parse().map_err(|_| bad("bad G"))?;
                let n: usize = n.trim().parse().map_err(|_| bad("bad N"))?;
                if g * n != world {
                    return Err(bad(&format!("{g}x{n} is not {world} ranks")));
                }
                (0..world).map(|r| Some((r / n) as u32)).collect()
            }
        };
        let links = (0..world)
            .map(|a| {
                (0..world)
                    .map(|b| if a == b { Link::SameDevice } else { link })
                    .collect()
            })
            .collect();
        Ok(Topology {
            links,
            numa,
            forced: true,
        })
    }
}

/// A matrix like `nvidia-smi topo -m`, then the NUMA node of each rank.
impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "      ")?;
        for b in 0..self.world() {
            write!(f, " r{b:<4}")?;
        }
        writeln!(f, "  NUMA{}", if self.forced { "  (forced)" } else { "" })?;
        for (a, row) in self.links.iter().enumerate() {
            write!(f, "r{a:<5}")?;
            for l in row {
                write!(f, " {:<5}", l.name())?;
            }
            match self.numa[a] {
                Some(n) => writeln!(f, "  {n}")?,
                None => writeln!(f, "  ?")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_topologies_parse_and_classify() {
        let t = Topology::parse("pcie:2x4", 8).unwrap();
        assert!(t.pcie_only() && t.peer_access());
        assert_eq!(t.numa_groups(), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(t.class(), Some(TopologyClass::PcieTwoNuma));
        assert_eq!(
            Topology::parse("pcie", 4).unwrap().class(),
            Some(TopologyClass::Pcie)
        );
        // NVLink is one class whatever the NUMA nodes: the symmetric kernels do not care.
        assert_eq!(
            Topology::parse("nvlink:2x2", 4).unwrap().class(),
            Some(TopologyClass::NvLink)
        );
        assert_eq!(Topology::parse("pcie:4x2", 8).unwrap().class(), None);
        let t = Topology::parse("nvlink", 4).unwrap();
        assert!(!t.pcie_only() && t.peer_access());
        assert_eq!(t.numa_groups().len(), 1);
        let t = Topology::parse("none", 2).unwrap();
        assert_eq!(t.missing_peer_access(), Some((0, 1)));
        assert!(Topology::parse("pcie:3x3", 8).is_err());
        assert!(Topology::parse("wires", 2).is_err());
        let shown = Topology::parse("pcie:2x1", 2).unwrap().to_string();
        assert!(shown.contains("PCI") && shown.contains("forced"), "{shown}");
    }

    #[test]
    fn virtual_ranks_alone_are_neither_pcie_nor_missing_access() {
        let t = Topology {
            links: vec![vec![Link::SameDevice; 3]; 3],
            numa: vec![None; 3],
            forced: false,
        };
        assert!(!t.pcie_only() && t.peer_access());
    }
}
