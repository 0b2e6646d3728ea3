//! `Bootstrap::broadcast`'s default implementation (in allreduce-core), which a user's own
//! bootstrap (MPI, torch.distributed, a store) gets by implementing only `all_gather`.

use allreduce_core::{Bootstrap, Error, Result};

/// One rank's view of a group whose other ranks contribute `peers[r]`; records what this rank
/// contributed.
struct Fake {
    rank: usize,
    peers: Vec<Vec<u8>>,
    sent: Vec<Vec<u8>>,
}

impl Bootstrap for Fake {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.peers.len()
    }
    fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.sent.push(data.to_vec());
        let mut all = self.peers.clone();
        all[self.rank] = data.to_vec();
        Ok(all)
    }
}

#[test]
fn default_broadcast_sends_only_the_roots_bytes() {
    let peers = vec![b"zero".to_vec(), vec![], b"two".to_vec()];
    let mut root = Fake {
        rank: 1,
        peers: peers.clone(),
        sent: vec![],
    };
    assert_eq!(root.broadcast(1, b"one").unwrap(), b"one");
    let mut other = Fake {
        rank: 1,
        peers,
        sent: vec![],
    };
    assert_eq!(other.broadcast(2, b"ignored").unwrap(), b"two");
    // A non-root contributes nothing.
    assert_eq!(root.sent, vec![b"one".to_vec()]);
    assert_eq!(other.sent, vec![Vec::<u8>::new()]);
    assert!(matches!(
        other.broadcast(3, b"x"),
        Err(Error::InvalidConfig(_))
    ));
    assert_eq!(
        other.sent.len(),
        1,
        "a bad root must not start a collective"
    );
}
