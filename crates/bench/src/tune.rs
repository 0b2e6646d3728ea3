//! `--tune FILE.json`: turn a sweep into rules of the selection table behind `Strategy::Auto`.
//!
//! For every measured size the fastest strategy wins (per precision class: exact calls, and
//! calls that allow a lossy codec, where an exact strategy may still win). Consecutive sizes
//! with the same winner become one rule reaching up to the next measured size; the last rule
//! has no upper limit. The new rules replace the file's rules for the same world size, dtype
//! and precision class and go first, so they take precedence over the defaults.

use allreduce::{DType, Precision, Rule, SelectionTable, Strategy};

use crate::runner::{Outcome, RowResult};

/// The winner per size, ascending, for one precision class.
fn winners(rows: &[RowResult], lossy: bool) -> Vec<(usize, Strategy, f64)> {
    let mut best: Vec<(usize, Strategy, f64)> = Vec::new();
    for r in rows {
        let Outcome::Done(m) = &r.outcome else {
            continue;
        };
        if matches!(r.spec.precision, Precision::Lossy(_)) != lossy || m.failed(!lossy) {
            continue;
        }
        match best.iter_mut().find(|(b, _, _)| *b == r.spec.bytes) {
            Some(entry) if m.seconds < entry.2 => *entry = (r.spec.bytes, m.ran, m.seconds),
            Some(_) => {}
            None => best.push((r.spec.bytes, m.ran, m.seconds)),
        }
    }
    best.sort_by_key(|(b, _, _)| *b);
    best
}

/// Rules for one world size and dtype from the sweep's rows.
pub fn rules(rows: &[RowResult], world: usize, dtype: DType) -> Vec<Rule> {
    let mut out = Vec::new();
    for lossy in [false, true] {
        let w = winners(rows, lossy);
        for (i, &(_, strategy, _)) in w.iter().enumerate() {
            let last_of_run = w.get(i + 1).is_none_or(|next| next.1 != strategy);
            if !last_of_run {
                continue;
            }
            let max_bytes = w.get(i + 1).map_or(usize::MAX, |next| next.0 - 1);
            out.push(Rule {
                world: (world, world),
                min_bytes: 0,
                max_bytes,
                dtype: Some(dtype),
                lossy: Some(lossy),
                codec: None,
                topology: None,
                strategy,
            });
        }
    }
    out
}

/// `existing` with its rules for this world, dtype and the classes in `new` replaced by `new`.
pub fn merge(existing: SelectionTable, new: Vec<Rule>) -> SelectionTable {
    let replaced = |r: &Rule| {
        new.iter()
            .any(|n| n.world == r.world && n.dtype == r.dtype && n.lossy == r.lossy)
    };
    let mut rules = new.clone();
    rules.extend(existing.rules.into_iter().filter(|r| !replaced(r)));
    SelectionTable {
        rules,
        fallback: existing.fallback,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Check;
    use crate::runner::{Measured, RowSpec};

    fn row(bytes: usize, strategy: Strategy, precision: Precision, seconds: f64) -> RowResult {
        RowResult {
            spec: RowSpec {
                bytes,
                count: bytes / 2,
                strategy,
                precision,
            },
            outcome: Outcome::Done(Measured {
                ran: strategy,
                data: crate::data::DataSet::Ints,
                iters: 1,
                seconds,
                check: Check::default(),
            }),
        }
    }

    #[test]
    fn runs_of_winners_become_rules() {
        let e = Precision::Exact;
        let rows = vec![
            row(8, Strategy::OneShot, e, 1.0),
            row(8, Strategy::TwoShot, e, 2.0),
            row(64, Strategy::OneShot, e, 1.0),
            row(64, Strategy::TwoShot, e, 2.0),
            row(512, Strategy::OneShot, e, 3.0),
            row(512, Strategy::TwoShot, e, 2.0),
        ];
        let r = rules(&rows, 4, DType::BF16);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].strategy, r[0].max_bytes), (Strategy::OneShot, 511));
        assert_eq!(
            (r[1].strategy, r[1].max_bytes),
            (Strategy::TwoShot, usize::MAX)
        );
        let t = merge(SelectionTable::default_table(), r);
        assert!(t.rules.iter().all(|r| r.strategy != Strategy::Auto));
        assert_eq!(
            t.choose(100, 4, DType::BF16, e, |_| true),
            Strategy::OneShot
        );
        assert_eq!(
            t.choose(600, 4, DType::BF16, e, |_| true),
            Strategy::TwoShot
        );
        // Other world sizes keep the defaults.
        assert_eq!(
            t.choose(600, 8, DType::BF16, e, |_| true),
            Strategy::OneShot
        );
        // Tuning again replaces, not duplicates.
        let again = merge(t.clone(), rules(&rows, 4, DType::BF16));
        assert_eq!(again.rules.len(), t.rules.len());
    }
}
