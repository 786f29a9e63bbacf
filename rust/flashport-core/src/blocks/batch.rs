//! Appends to several sequences in one call (`KvCache::append_batch`, a
//! decode step of a batch): one row per sequence, each planned and
//! committed in order on the state the rows before it left, so that the
//! batch does exactly what separate appends in that order would do
//! (blocks taken in the same order, a prefix cached by an earlier row
//! adopted by a later one). A row that cannot be planned (the cache is
//! full, its tokens are refused) rolls back the rows before it, last
//! first: a failed batch changes nothing.
//!
//! The storage then does every row's copies, then every row's writes, in
//! one call each (on the GPU: one upload of the batch's keys and one of its
//! values, and one scatter per pool buffer). Copies first is what separate
//! appends do: a copy's source is a shared block, which no row writes
//! before it is copied (a row writes only blocks it holds alone, and a
//! block never becomes shared again within a batch except by adoption,
//! which only cached blocks are, and those are never copied or written);
//! and a copy's target is a fresh block that only its own row writes.

use super::manager::{BlockManager, Committed};
use super::plan::{AppendPlan, BlockCopy, WriteRun};
use crate::error::Result;

/// One sequence's part of a batch: its id and the token ids of its new
/// positions, if given.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    pub sid: i64,
    pub tokens: Option<&'a [i64]>,
}

/// The committed rows of a batch, in order, with what each replaced.
#[derive(Debug)]
pub struct Batch {
    rows: Vec<(AppendPlan, Committed)>,
}

impl Batch {
    /// Plans and commits the append of `n` positions to `layer` of each
    /// row's sequence, in order; on an error, rolls back the rows committed
    /// before it and returns it (the manager is then as it was). With
    /// `named`, errors name the row (`seq_ids[r]`, `tokens[r, i]`) rather
    /// than a single append's arguments.
    pub fn commit(
        manager: &mut BlockManager,
        layer: usize,
        n: usize,
        rows: &[Row<'_>],
        named: bool,
    ) -> Result<Batch> {
        let mut batch = Batch {
            rows: Vec::with_capacity(rows.len()),
        };
        for (r, row) in rows.iter().enumerate() {
            let planned = manager.plan_row(row.sid, layer, n, row.tokens, named.then_some(r));
            match planned {
                Ok(plan) => {
                    let committed = manager.commit(&plan);
                    batch.rows.push((plan, committed));
                }
                Err(e) => {
                    batch.rollback(manager);
                    return Err(e);
                }
            }
        }
        Ok(batch)
    }

    /// Every row's copy-on-write copies, row by row.
    pub fn copies(&self) -> Vec<BlockCopy> {
        self.rows
            .iter()
            .flat_map(|(plan, _)| plan.copies.iter().map(|&(_, c)| c))
            .collect()
    }

    /// Each row's writes: `writes()[r]` takes its tokens from row `r` of
    /// the batch's keys and values.
    pub fn writes(&self) -> Vec<&[WriteRun]> {
        self.rows.iter().map(|(plan, _)| &plan.writes[..]).collect()
    }

    /// Undoes the rows' commits, last first: the manager is as before
    /// [`Self::commit`].
    pub fn rollback(self, manager: &mut BlockManager) {
        for (plan, committed) in self.rows.into_iter().rev() {
            manager.rollback(&plan, committed);
        }
    }

    /// After the storage failed part way: rolls back, and forgets any
    /// cached prefix of the blocks the rows took, which may now hold
    /// partial data (as a single append's failure does).
    pub fn abandon(self, manager: &mut BlockManager) {
        let mut plans = Vec::with_capacity(self.rows.len());
        for (plan, committed) in self.rows.into_iter().rev() {
            manager.rollback(&plan, committed);
            plans.push(plan);
        }
        for plan in &plans {
            manager.abandon(plan);
        }
    }
}
