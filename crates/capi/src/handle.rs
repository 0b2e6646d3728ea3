//! Handles: what C holds instead of Rust objects.
//!
//! A handle is a token (a number that is never reused in the process, shown to C as an
//! opaque pointer), never an address. Every call looks its token up in a table; a handle
//! that is null, destroyed or made up is found missing there and refused with
//! `AR_INVALID_USAGE` instead of being dereferenced. The table hands out `Arc`s, so a handle
//! destroyed on one thread while another thread's call is running only leaves the table:
//! the object is dropped when that call returns.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use allreduce::{Communicator, FusedWorkspace};

use crate::call::Failure;

/// An opaque communicator: one rank of a group. Never dereference it.
pub struct ar_comm {
    _private: (),
}

/// A communicator handle (NCCL's `ncclComm_t`).
pub type ar_comm_t = *mut ar_comm;

/// An opaque fused workspace: one rank's. Never dereference it.
pub struct ar_fused_workspace {
    _private: (),
}

/// A fused-workspace handle.
pub type ar_fused_workspace_t = *mut ar_fused_workspace;

/// Every rank this process built together (an in-process group), or the one rank of a
/// group with one process per rank. The facade's group operations (fused workspaces) take
/// the ranks as one slice in rank order, so they stay together; the group is dropped when
/// its last rank's handle is destroyed and no call still holds it.
pub struct Group {
    pub comms: Vec<Communicator>,
    /// A rank of a group of processes keeps the rendezvous it was built with: its later
    /// collective registrations exchange over it (`ar_comm_register_graph_buffers`).
    pub bootstrap: Option<std::sync::Mutex<allreduce_bootstrap::TcpBootstrap>>,
}

/// What a communicator handle names.
#[derive(Clone)]
pub struct CommRef {
    pub group: Arc<Group>,
    pub index: usize,
}

impl CommRef {
    pub fn comm(&self) -> &Communicator {
        &self.group.comms[self.index]
    }
}

/// What a workspace handle names, and the group it was created for.
#[derive(Clone)]
pub struct WorkspaceRef {
    pub group: Arc<Group>,
    pub rank: usize,
    pub workspace: Arc<FusedWorkspace>,
}

#[derive(Default)]
struct Table {
    comms: HashMap<usize, CommRef>,
    workspaces: HashMap<usize, WorkspaceRef>,
}

static TABLE: RwLock<Option<Table>> = RwLock::new(None);
/// Starts at 1: 0 is the null handle. Shared by both kinds, so a communicator's token is
/// never a live workspace's and the other way round.
static NEXT: AtomicUsize = AtomicUsize::new(1);

fn token() -> usize {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn read<R>(f: impl FnOnce(&Table) -> R) -> R {
    // A panic while the lock was held left the table consistent (every update is one
    // insert or remove), so a poisoned lock is still usable.
    let guard = TABLE.read().unwrap_or_else(PoisonError::into_inner);
    match guard.as_ref() {
        Some(table) => f(table),
        None => f(&Table::default()),
    }
}

fn write<R>(f: impl FnOnce(&mut Table) -> R) -> R {
    let mut guard = TABLE.write().unwrap_or_else(PoisonError::into_inner);
    f(guard.get_or_insert_with(Table::default))
}

/// Handles for every rank of `group`, in rank order.
pub fn insert_group(group: Group) -> Vec<ar_comm_t> {
    let group = Arc::new(group);
    write(|t| {
        (0..group.comms.len())
            .map(|index| {
                let id = token();
                let entry = CommRef {
                    group: Arc::clone(&group),
                    index,
                };
                t.comms.insert(id, entry);
                id as ar_comm_t
            })
            .collect()
    })
}

pub fn comm(handle: ar_comm_t) -> Result<CommRef, Failure> {
    read(|t| t.comms.get(&(handle as usize)).cloned())
        .ok_or_else(|| Failure::usage(format!("{handle:p} is not a live ar_comm_t")))
}

pub fn remove_comm(handle: ar_comm_t) -> Result<(), Failure> {
    write(|t| t.comms.remove(&(handle as usize)))
        .map(drop)
        .ok_or_else(|| Failure::usage(format!("{handle:p} is not a live ar_comm_t")))
}

pub fn insert_workspace(entry: WorkspaceRef) -> ar_fused_workspace_t {
    write(|t| {
        let id = token();
        t.workspaces.insert(id, entry);
        id as ar_fused_workspace_t
    })
}

pub fn workspace(handle: ar_fused_workspace_t) -> Result<WorkspaceRef, Failure> {
    read(|t| t.workspaces.get(&(handle as usize)).cloned())
        .ok_or_else(|| Failure::usage(format!("{handle:p} is not a live ar_fused_workspace_t")))
}

pub fn remove_workspace(handle: ar_fused_workspace_t) -> Result<(), Failure> {
    write(|t| t.workspaces.remove(&(handle as usize)))
        .map(drop)
        .ok_or_else(|| Failure::usage(format!("{handle:p} is not a live ar_fused_workspace_t")))
}
