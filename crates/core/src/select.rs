//! `Strategy::Auto`: a first-match table over (bytes, world size, dtype, precision).
//!
//! Backends ship a default table; a tuner can replace it. A rule whose strategy the backend
//! cannot run for the call (no vendor library, a codec it lacks) is skipped, so one table
//! serves every backend.

use serde_json::{json, Value};

use crate::{Codec, DType, Error, Precision, Result, Strategy, TopologyClass};

/// One row: if every set condition holds, use `strategy`.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    /// Inclusive range of world sizes.
    pub world: (usize, usize),
    /// Applies to calls of at least this many bytes (0 for no lower limit).
    pub min_bytes: usize,
    /// Applies to calls of at most this many bytes (`usize::MAX` for no limit).
    pub max_bytes: usize,
    /// Only for this dtype (`None`: all).
    pub dtype: Option<DType>,
    /// Only when the caller allowed a lossy codec (`Some(true)`), only when not (`Some(false)`).
    pub lossy: Option<bool>,
    /// Only for calls allowed exactly this codec (`None`: any precision). A rule with a codec
    /// never matches an exact call.
    pub codec: Option<Codec>,
    /// Only on a group of this topology class (`None`: any, including an unknown topology).
    /// A rule with a class never matches where the backend knows no topology.
    pub topology: Option<TopologyClass>,
    pub strategy: Strategy,
}

impl Rule {
    fn matches(
        &self,
        topology: Option<TopologyClass>,
        bytes: usize,
        world: usize,
        dtype: DType,
        precision: Precision,
    ) -> bool {
        self.topology.is_none_or(|t| topology == Some(t))
            && (self.world.0..=self.world.1).contains(&world)
            && (self.min_bytes..=self.max_bytes).contains(&bytes)
            && self.dtype.is_none_or(|d| d == dtype)
            && self
                .lossy
                .is_none_or(|l| l == matches!(precision, Precision::Lossy(_)))
            && self.codec.is_none_or(|c| precision == Precision::Lossy(c))
    }
}

/// Ordered rules, first match wins; `fallback` when none matches.
#[derive(Clone, Debug, PartialEq)]
pub struct SelectionTable {
    pub rules: Vec<Rule>,
    pub fallback: Strategy,
}

impl SelectionTable {
    /// Starting thresholds from the public ones: vLLM's custom all-reduce uses one stage
    /// below 512 KiB for up to 4 ranks and below 256 KiB for up to 8, two stages above;
    /// the quantized path pays off from about 1-2 MiB (vLLM's QuickReduce minimum sizes,
    /// TensorRT-LLM's low-precision threshold of 2 MiB). Vendor takes what is larger than
    /// the custom paths' workspace, on symmetric windows where every GPU pair is on NVLink;
    /// there NCCL's symmetric kernels also take exact calls from 128 KiB at 5 ranks and more
    /// (vLLM's measured crossover at 8 GPUs). On 8 GPUs on PCIe in two NUMA groups the lossy path is
    /// hierarchical from 2 MiB, as TensorRT-LLM's low-precision all-reduce is at TP8 (flat
    /// two-shot at TP2/4).
    pub fn default_table() -> Self {
        const KIB: usize = 1024;
        const MIB: usize = 1024 * KIB;
        let rule = |world: (usize, usize), max_bytes, lossy, strategy| Rule {
            world,
            min_bytes: 0,
            max_bytes,
            dtype: None,
            lossy,
            codec: None,
            topology: None,
            strategy,
        };
        SelectionTable {
            rules: vec![
                rule((1, 1), usize::MAX, None, Strategy::OneShot),
                Rule {
                    min_bytes: 2 * MIB,
                    topology: Some(TopologyClass::PcieTwoNuma),
                    ..rule(
                        (8, 8),
                        usize::MAX,
                        Some(true),
                        Strategy::HierarchicalQuantized,
                    )
                },
                // Two ranks: one stage up to the custom paths' limit, as vLLM (its one-stage
                // kernel at every size for two ranks) and TensorRT-LLM do; measured 8-12% faster
                // than two-shot at 16-64 MiB on one H100 (docs/benchmarks.md).
                rule((2, 2), 64 * MIB, Some(false), Strategy::OneShot),
                rule((2, usize::MAX), 2 * MIB - 1, Some(true), Strategy::OneShot),
                rule(
                    (2, usize::MAX),
                    usize::MAX,
                    Some(true),
                    Strategy::QuantizedTwoShot,
                ),
                rule((3, 4), 512 * KIB - 1, None, Strategy::OneShot),
                // NCCL's symmetric kernels on NVLink at 8 GPUs (vLLM's measured crossover on
                // H100 and GB200): 1.12-6.14x faster than custom all-reduce from 128 KiB up,
                // custom faster only at 32-64 KiB. From 2 to 16 KiB they are faster too, but
                // only on buffers already in the window: a call outside it pays two copies
                // there, so small calls stay ours.
                Rule {
                    min_bytes: 128 * KIB,
                    topology: Some(TopologyClass::NvLink),
                    ..rule(
                        (5, usize::MAX),
                        usize::MAX,
                        Some(false),
                        Strategy::VendorSymmetric,
                    )
                },
                rule((5, usize::MAX), 256 * KIB - 1, None, Strategy::OneShot),
                rule((2, usize::MAX), 64 * MIB, None, Strategy::TwoShot),
                Rule {
                    topology: Some(TopologyClass::NvLink),
                    ..rule((2, usize::MAX), usize::MAX, None, Strategy::VendorSymmetric)
                },
                rule((2, usize::MAX), usize::MAX, None, Strategy::Vendor),
            ],
            fallback: Strategy::TwoShot,
        }
    }

    /// The first matching rule whose strategy `available` accepts, else the fallback, for a
    /// group whose topology is unknown (rules naming a topology class never match).
    pub fn choose(
        &self,
        bytes: usize,
        world: usize,
        dtype: DType,
        precision: Precision,
        available: impl Fn(Strategy) -> bool,
    ) -> Strategy {
        self.choose_on(None, bytes, world, dtype, precision, available)
    }

    /// [`SelectionTable::choose`] on a group of topology class `topology`.
    pub fn choose_on(
        &self,
        topology: Option<TopologyClass>,
        bytes: usize,
        world: usize,
        dtype: DType,
        precision: Precision,
        available: impl Fn(Strategy) -> bool,
    ) -> Strategy {
        // Where the fallback cannot run either (a group without peer access: several hosts,
        // or GPUs without P2P), the vendor library takes the call.
        self.rules
            .iter()
            .filter(|r| r.matches(topology, bytes, world, dtype, precision))
            .map(|r| r.strategy)
            .chain([self.fallback, Strategy::Vendor, Strategy::VendorSymmetric])
            .find(|&s| s != Strategy::Auto && available(s))
            .unwrap_or(self.fallback)
    }
}

/// The JSON form, version 1 (what `allreduce-bench --tune` writes and
/// `ALLREDUCE_SELECTION_TABLE` / `GroupConfig::selection` read):
///
/// ```json
/// { "version": 1, "fallback": "twoshot",
///   "rules": [ { "world": [2, 8], "max_bytes": 262143, "dtype": "bf16", "lossy": false,
///                "strategy": "oneshot" } ] }
/// ```
///
/// `max_bytes` may be `null` (no limit); `dtype` and `lossy` may be absent or `null` (any).
/// Two optional fields narrow a rule further: `"min_bytes": 1048576` (absent: 0) and
/// `"codec": "q6"` (absent or `null`: any precision; a codec rule never matches an exact
/// call). They are written only when set, so tables without them read and write as before.
/// So is `"topology": "pcie-2numa"` (or `"pcie"`): the rule applies only on such a group
/// ([`TopologyClass`]).
/// Extra fields (a tuner's measurements) are ignored.
impl SelectionTable {
    pub const JSON_VERSION: u64 = 1;

    pub fn to_json(&self) -> Value {
        let rules: Vec<Value> = self
            .rules
            .iter()
            .map(|r| {
                let mut v = json!({
                    "world": [r.world.0, r.world.1],
                    "max_bytes": (r.max_bytes != usize::MAX).then_some(r.max_bytes),
                    "dtype": r.dtype.map(|d| d.name()),
                    "lossy": r.lossy,
                    "strategy": r.strategy.name(),
                });
                if r.min_bytes > 0 {
                    v["min_bytes"] = json!(r.min_bytes);
                }
                if let Some(c) = r.codec {
                    v["codec"] = json!(c.name());
                }
                if let Some(t) = r.topology {
                    v["topology"] = json!(t.name());
                }
                v
            })
            .collect();
        json!({ "version": Self::JSON_VERSION, "fallback": self.fallback.name(), "rules": rules })
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let bad = |what: String| Error::InvalidConfig(format!("selection table: {what}"));
        let v: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        match v.get("version").and_then(Value::as_u64) {
            Some(Self::JSON_VERSION) => {}
            other => {
                return Err(bad(format!(
                    "version {other:?}, expected {}",
                    Self::JSON_VERSION
                )))
            }
        }
        let strategy = |v: Option<&Value>, what: &str| -> Result<Strategy> {
            let s = v
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("{what} must be a string")))?;
            match s.parse::<Strategy>().map_err(bad)? {
                Strategy::Auto => Err(bad(format!("{what} cannot be auto"))),
                s => Ok(s),
            }
        };
        let fallback = strategy(v.get("fallback"), "fallback")?;
        let list = v
            .get("rules")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("rules must be a list".into()))?;
        let mut rules = Vec::with_capacity(list.len());
        for (i, r) in list.iter().enumerate() {
            let at = |what: &str| format!("rule {i}: {what}");
            let world = r
                .get("world")
                .and_then(Value::as_array)
                .filter(|w| w.len() == 2)
                .and_then(|w| Some((w[0].as_u64()? as usize, w[1].as_u64()? as usize)))
                .filter(|(lo, hi)| lo <= hi)
                .ok_or_else(|| bad(at("world must be [min, max] with min <= max")))?;
            // An optional field: absent or null is None.
            let field = |name: &str| r.get(name).filter(|v| !v.is_null());
            let bytes = |name: &str| -> Result<Option<usize>> {
                field(name)
                    .map(|b| {
                        b.as_u64()
                            .map(|b| b as usize)
                            .ok_or_else(|| bad(at(&format!("{name} must be a number or null"))))
                    })
                    .transpose()
            };
            fn parsed<T: std::str::FromStr<Err = String>>(
                v: Option<&Value>,
                name: &str,
                bad: impl Fn(&str) -> Error,
            ) -> Result<Option<T>> {
                v.map(|v| {
                    v.as_str()
                        .ok_or_else(|| bad(&format!("{name} must be a string")))?
                        .parse::<T>()
                        .map_err(|e| bad(&e))
                })
                .transpose()
            }
            let bad_at = |what: &str| bad(at(what));
            let max_bytes = bytes("max_bytes")?.unwrap_or(usize::MAX);
            let min_bytes = bytes("min_bytes")?.unwrap_or(0);
            let dtype = parsed::<DType>(field("dtype"), "dtype", bad_at)?;
            let codec = parsed::<Codec>(field("codec"), "codec", bad_at)?;
            let topology = parsed::<TopologyClass>(field("topology"), "topology", bad_at)?;
            let lossy = field("lossy")
                .map(|l| {
                    l.as_bool()
                        .ok_or_else(|| bad(at("lossy must be true, false or null")))
                })
                .transpose()?;
            let strategy = strategy(r.get("strategy"), &at("strategy"))?;
            rules.push(Rule {
                world,
                min_bytes,
                max_bytes,
                dtype,
                lossy,
                codec,
                topology,
                strategy,
            });
        }
        Ok(SelectionTable { rules, fallback })
    }

    /// Read a table from a JSON file.
    pub fn load(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::InvalidConfig(format!("selection table {}: {e}", path.display()))
        })?;
        Self::from_json(&text)
    }
}

impl Default for SelectionTable {
    fn default() -> Self {
        Self::default_table()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_and_errors() {
        let t = SelectionTable::default_table();
        let text = t.to_json().to_string();
        assert_eq!(SelectionTable::from_json(&text).unwrap(), t);
        let mut custom = t.clone();
        custom.rules.insert(
            0,
            Rule {
                world: (4, 4),
                min_bytes: 0,
                max_bytes: 4096,
                dtype: Some(DType::BF16),
                lossy: Some(false),
                codec: None,
                topology: None,
                strategy: Strategy::TwoShot,
            },
        );
        let back = SelectionTable::from_json(&custom.to_json().to_string()).unwrap();
        assert_eq!(back, custom);
        assert_eq!(
            back.choose(4096, 4, DType::BF16, Precision::Exact, |_| true),
            Strategy::TwoShot
        );
        assert_eq!(
            back.choose(4096, 4, DType::F16, Precision::Exact, |_| true),
            Strategy::OneShot
        );
        for bad in [
            "{",
            r#"{"version": 2, "fallback": "twoshot", "rules": []}"#,
            r#"{"version": 1, "fallback": "auto", "rules": []}"#,
            r#"{"version": 1, "fallback": "twoshot", "rules": [{"world": [4, 2], "strategy": "oneshot"}]}"#,
            r#"{"version": 1, "fallback": "twoshot", "rules": [{"world": [2, 4], "strategy": "fastest"}]}"#,
            r#"{"version": 1, "fallback": "twoshot", "rules": [{"world": [2, 4], "dtype": "f64", "strategy": "oneshot"}]}"#,
            r#"{"version": 1, "fallback": "twoshot", "rules": [{"world": [2, 4], "codec": "q5", "strategy": "oneshot"}]}"#,
            r#"{"version": 1, "fallback": "twoshot", "rules": [{"world": [2, 4], "min_bytes": "1M", "strategy": "oneshot"}]}"#,
        ] {
            assert!(
                matches!(SelectionTable::from_json(bad), Err(Error::InvalidConfig(_))),
                "{bad}"
            );
        }
        // A rule's field errors name the rule and the field.
        for (field, want) in [
            (
                r#""max_bytes": -1"#,
                "rule 0: max_bytes must be a number or null",
            ),
            (r#""dtype": 16"#, "rule 0: dtype must be a string"),
            (r#""topology": "ring""#, "rule 0: "),
            (r#""lossy": 1"#, "rule 0: lossy must be true, false or null"),
        ] {
            let text = format!(
                r#"{{"version": 1, "fallback": "twoshot", "rules": [{{"world": [2, 4], {field}, "strategy": "oneshot"}}]}}"#
            );
            let e = SelectionTable::from_json(&text).unwrap_err().to_string();
            assert!(e.contains(want), "{field}: {e}");
        }
        // Null is the same as absent.
        let text = r#"{"version": 1, "fallback": "twoshot", "rules": [{"world": [2, 4], "max_bytes": null, "dtype": null, "codec": null, "topology": null, "lossy": null, "min_bytes": null, "strategy": "oneshot"}]}"#;
        let r = &SelectionTable::from_json(text).unwrap().rules[0];
        assert_eq!(
            (
                r.min_bytes,
                r.max_bytes,
                r.dtype,
                r.lossy,
                r.codec,
                r.topology
            ),
            (0, usize::MAX, None, None, None, None)
        );
    }

    #[test]
    fn default_table_follows_public_thresholds() {
        let t = SelectionTable::default_table();
        let all = |_: Strategy| true;
        let exact = Precision::Exact;
        assert_eq!(
            t.choose(4096, 8, DType::BF16, exact, all),
            Strategy::OneShot
        );
        assert_eq!(
            t.choose(256 * 1024, 8, DType::BF16, exact, all),
            Strategy::TwoShot
        );
        assert_eq!(
            t.choose(300 * 1024, 4, DType::BF16, exact, all),
            Strategy::OneShot
        );
        assert_eq!(
            t.choose(1 << 30, 8, DType::BF16, exact, all),
            Strategy::Vendor
        );
        // Two ranks stay one-shot up to the custom paths' 64 MiB.
        assert_eq!(
            t.choose(64 << 20, 2, DType::BF16, exact, all),
            Strategy::OneShot
        );
        assert_eq!(
            t.choose(65 << 20, 2, DType::BF16, exact, all),
            Strategy::Vendor
        );
        let lossy = Precision::Lossy(crate::Codec::Int4);
        assert_eq!(
            t.choose(1 << 20, 8, DType::BF16, lossy, all),
            Strategy::OneShot
        );
        assert_eq!(
            t.choose(4 << 20, 8, DType::BF16, lossy, all),
            Strategy::QuantizedTwoShot
        );
        // Without a vendor library the large exact call falls back to two-shot.
        let no_vendor = |s: Strategy| !s.is_vendor();
        assert_eq!(
            t.choose(1 << 30, 8, DType::F32, exact, no_vendor),
            Strategy::TwoShot
        );
        // On NVLink, NCCL's symmetric kernels from 128 KiB at 8 ranks, exact calls only, and
        // past the custom paths' limit at any world; small calls stay ours.
        let nv = Some(TopologyClass::NvLink);
        let pick =
            |bytes, world, precision| t.choose_on(nv, bytes, world, DType::BF16, precision, all);
        assert_eq!(pick(4096, 8, exact), Strategy::OneShot);
        assert_eq!(pick(128 << 10, 8, exact), Strategy::VendorSymmetric);
        assert_eq!(pick(128 << 10, 4, exact), Strategy::OneShot);
        assert_eq!(pick(4 << 20, 8, lossy), Strategy::QuantizedTwoShot);
        assert_eq!(pick(65 << 20, 2, exact), Strategy::VendorSymmetric);
        // Where the windows cannot be made, the plain vendor library.
        let plain = |s: Strategy| s != Strategy::VendorSymmetric;
        assert_eq!(
            t.choose_on(nv, 1 << 30, 8, DType::BF16, exact, plain),
            Strategy::Vendor
        );
        // Without peer access only the vendor strategies run: Auto takes them at any size.
        let vendor_only = |s: Strategy| s.is_vendor();
        assert_eq!(
            t.choose(4096, 8, DType::F16, exact, vendor_only),
            Strategy::Vendor
        );
        let symmetric_only = |s: Strategy| s == Strategy::VendorSymmetric;
        assert_eq!(
            t.choose(4096, 8, DType::F16, lossy, symmetric_only),
            Strategy::VendorSymmetric
        );
    }

    #[test]
    fn min_bytes_and_codec_narrow_a_rule() {
        let r = Rule {
            world: (2, 8),
            min_bytes: 1 << 20,
            max_bytes: usize::MAX,
            dtype: Some(DType::F16),
            lossy: None,
            codec: Some(crate::Codec::Int6),
            topology: None,
            strategy: Strategy::QuantizedTwoShot,
        };
        let q6 = Precision::Lossy(crate::Codec::Int6);
        let q4 = Precision::Lossy(crate::Codec::Int4);
        assert!(r.matches(None, 1 << 20, 4, DType::F16, q6));
        assert!(!r.matches(None, (1 << 20) - 1, 4, DType::F16, q6));
        assert!(!r.matches(None, 1 << 20, 4, DType::F16, q4));
        assert!(!r.matches(None, 1 << 20, 4, DType::F16, Precision::Exact));
        let t = SelectionTable {
            rules: vec![r],
            fallback: Strategy::TwoShot,
        };
        let text = t.to_json().to_string();
        assert!(text.contains(r#""codec":"q6""#) && text.contains(r#""min_bytes":1048576"#));
        assert_eq!(SelectionTable::from_json(&text).unwrap(), t);
        // Tables without the new fields still write exactly as before.
        let plain = SelectionTable {
            rules: (SelectionTable::default_table().rules.into_iter())
                .filter(|r| r.topology.is_none() && r.min_bytes == 0)
                .collect(),
            fallback: Strategy::TwoShot,
        }
        .to_json()
        .to_string();
        assert!(!plain.contains("min_bytes") && !plain.contains("codec"));
        assert!(!plain.contains("topology"));
    }

    #[test]
    fn hierarchical_only_on_eight_pcie_ranks_in_two_numa_groups_from_2_mib() {
        let t = SelectionTable::default_table();
        let all = |_: Strategy| true;
        let fp8 = Precision::Lossy(Codec::Fp8E4M3);
        let two = Some(TopologyClass::PcieTwoNuma);
        let pcie = Some(TopologyClass::Pcie);
        let mib = 1 << 20;
        let pick = |topo, bytes, world, p| t.choose_on(topo, bytes, world, DType::BF16, p, all);
        assert_eq!(pick(two, 2 * mib, 8, fp8), Strategy::HierarchicalQuantized);
        assert_eq!(pick(two, 2 * mib - 1, 8, fp8), Strategy::OneShot);
        // TP 2 and 4 on PCIe (one NUMA group or two): the flat quantized two-shot.
        for world in [2, 4] {
            for topo in [pcie, two] {
                assert_eq!(
                    pick(topo, 4 * mib, world, fp8),
                    Strategy::QuantizedTwoShot,
                    "{world} {topo:?}"
                );
            }
        }
        // Exact calls, other topologies, or no hierarchical kernels: as before.
        assert_eq!(pick(two, 4 * mib, 8, Precision::Exact), Strategy::TwoShot);
        assert_eq!(pick(None, 4 * mib, 8, fp8), Strategy::QuantizedTwoShot);
        assert_eq!(pick(pcie, 4 * mib, 8, fp8), Strategy::QuantizedTwoShot);
        let no_hier = |s: Strategy| s != Strategy::HierarchicalQuantized;
        assert_eq!(
            t.choose_on(two, 4 * mib, 8, DType::BF16, fp8, no_hier),
            Strategy::QuantizedTwoShot
        );
        // The rule survives the JSON round trip, and a tuned table can drop or move it.
        let text = t.to_json().to_string();
        assert!(text.contains(r#""topology":"pcie-2numa""#), "{text}");
        assert_eq!(SelectionTable::from_json(&text).unwrap(), t);
        let bad = r#"{"version": 1, "fallback": "twoshot", "rules": [{"world": [2, 8], "topology": "mesh", "strategy": "hierarchical"}]}"#;
        assert!(matches!(
            SelectionTable::from_json(bad),
            Err(Error::InvalidConfig(_))
        ));
    }
}
