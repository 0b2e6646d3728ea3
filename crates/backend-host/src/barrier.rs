//! A barrier whose every wait has a deadline.
//!
//! The host backend's counterpart of the GPU flag barrier: if a rank does not arrive within
//! the group's timeout, the waiter reports `Error::Timeout` naming the ranks that had not
//! arrived and aborts the group, so every other rank (waiting now or arriving later) gets
//! `Error::Aborted` instead of hanging.
//! Waiting parks the thread (condvar), which matters when ranks outnumber cores.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use allreduce_core::{Error, Result};

pub struct DeadlineBarrier {
    parties: usize,
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    arrived: usize,
    /// Which ranks have arrived in this generation: the ones that have not are what a timeout
    /// names.
    present: Vec<bool>,
    generation: u64,
    aborted: Option<String>,
}

impl DeadlineBarrier {
    pub fn new(parties: usize) -> Self {
        DeadlineBarrier {
            parties,
            state: Mutex::new(State {
                arrived: 0,
                present: vec![false; parties],
                generation: 0,
                aborted: None,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock leaves a consistent state (plain counters).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn aborted(&self) -> Option<String> {
        self.lock().aborted.clone()
    }

    /// Fail every wait, now and later, with `Error::Aborted` naming `reason` (the first
    /// reason stays).
    pub fn abort(&self, reason: &str) {
        let mut st = self.lock();
        st.aborted.get_or_insert_with(|| reason.to_string());
        self.cv.notify_all();
    }

    /// Wait for all parties. `what` names the phase for the timeout message.
    pub fn wait(&self, rank: usize, call: u64, timeout: Duration, what: &str) -> Result<()> {
        let start = Instant::now();
        let mut st = self.lock();
        if let Some(reason) = &st.aborted {
            return Err(Error::Aborted {
                reason: reason.clone(),
            });
        }
        let generation = st.generation;
        st.arrived += 1;
        st.present[rank] = true;
        if st.arrived == self.parties {
            st.arrived = 0;
            st.present.iter_mut().for_each(|p| *p = false);
            st.generation = st.generation.wrapping_add(1);
            self.cv.notify_all();
            return Ok(());
        }
        loop {
            let waited = start.elapsed();
            if waited >= timeout {
                let missing: Vec<usize> = (0..self.parties).filter(|&r| !st.present[r]).collect();
                let err = Error::timeout(rank, call, waited, what, &missing);
                let Error::Timeout { waiting_for, .. } = &err else {
                    unreachable!("Error::timeout makes a Timeout")
                };
                st.aborted = Some(format!(
                    "rank {rank} timed out in call {call} waiting for {waiting_for}"
                ));
                self.cv.notify_all();
                return Err(err);
            }
            st = self
                .cv
                .wait_timeout(st, timeout - waited)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            if st.generation != generation {
                return Ok(());
            }
            if let Some(reason) = &st.aborted {
                return Err(Error::Aborted {
                    reason: reason.clone(),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn releases_all_parties_repeatedly() {
        let b = Arc::new(DeadlineBarrier::new(4));
        std::thread::scope(|s| {
            for r in 0..4 {
                let b = b.clone();
                s.spawn(move || {
                    for call in 0..200 {
                        b.wait(r, call, Duration::from_secs(5), "test").unwrap();
                    }
                });
            }
        });
    }

    #[test]
    fn missing_party_times_out_then_aborts() {
        let b = DeadlineBarrier::new(2);
        let err = b.wait(0, 7, Duration::from_millis(50), "peer").unwrap_err();
        assert!(err.to_string().contains("(rank 1 never arrived)"), "{err}");
        assert!(
            matches!(
                err,
                Error::Timeout {
                    rank: 0,
                    call: 7,
                    ..
                }
            ),
            "{err:?}"
        );
        let err = b.wait(1, 7, Duration::from_millis(50), "peer").unwrap_err();
        assert!(matches!(err, Error::Aborted { .. }), "{err:?}");
    }
}
