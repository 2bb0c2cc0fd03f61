//! The compact tables: for one GCRA tier whose emission interval is a whole number of
//! nanoseconds, 16 bytes per key (fingerprint and TAT side by side) in an open-addressing table
//! with linear probing, so that a lookup in a large table costs one cache miss, not the two of a
//! table that keeps its control bytes apart from its entries.
//!
//! A shard's compact tables share one spin lock, and the key used most recently twice in a row
//! is kept beside that lock (the "hot" slot): a key hammered from several threads then costs
//! each decision one cache line moving between cores, not two.

/// A fingerprint's slot: `(fingerprint, TAT)`; fingerprint 0 marks an empty slot (fingerprint
/// 0 itself is stored as 1).
type Slot = (u64, u64);

/// Tables grow when more than 3/4 full: linear probing stays short below that.
const MAX_LOAD_NUM: usize = 3;
const MAX_LOAD_DEN: usize = 4;

/// One binding's keys: fingerprint to TAT (nanoseconds).
#[derive(Default)]
pub(super) struct TatTable {
    slots: Box<[Slot]>,
    len: usize,
}

/// Fingerprint 0 is the empty marker.
#[inline]
fn stored(fp: u64) -> u64 {
    fp.max(1)
}

impl TatTable {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// The slot index of `fp`, if present.
    #[inline]
    fn find(&self, fp: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let fp = stored(fp);
        let mask = self.mask();
        // The low bits pick the slot (the fingerprint is uniformly random).
        #[allow(clippy::cast_possible_truncation)] // the mask keeps it in range
        let mut i = fp as usize & mask;
        loop {
            match self.slots[i].0 {
                0 => return None,
                f if f == fp => return Some(i),
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// The TAT of `fp`, if present.
    #[inline]
    pub(super) fn get_mut(&mut self, fp: u64) -> Option<&mut u64> {
        let i = self.find(fp)?;
        Some(&mut self.slots[i].1)
    }

    /// Stores `tat` for `fp` (which must not be present).
    pub(super) fn insert(&mut self, fp: u64, tat: u64) {
        if (self.len + 1) * MAX_LOAD_DEN > self.slots.len() * MAX_LOAD_NUM {
            self.grow();
        }
        self.place(stored(fp), tat);
        self.len += 1;
    }

    fn place(&mut self, fp: u64, tat: u64) {
        let mask = self.mask();
        #[allow(clippy::cast_possible_truncation)] // the mask keeps it in range
        let mut i = fp as usize & mask;
        while self.slots[i].0 != 0 {
            i = (i + 1) & mask;
        }
        self.slots[i] = (fp, tat);
    }

    fn grow(&mut self) {
        let size = (self.slots.len() * 2).max(8);
        let old = std::mem::replace(&mut self.slots, vec![(0, 0); size].into_boxed_slice());
        for (fp, tat) in old.iter().copied().filter(|(fp, _)| *fp != 0) {
            self.place(fp, tat);
        }
    }

    /// Removes the keys for which `keep` is false; returns how many. Rebuilds the table (at the
    /// size its remaining keys need), which is also how it shrinks after a flood has gone.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) -> usize {
        let before = self.len;
        let kept: Vec<Slot> =
            self.slots.iter().copied().filter(|&(fp, tat)| fp != 0 && keep(tat)).collect();
        let mut size = 8;
        while kept.len() * MAX_LOAD_DEN > size * MAX_LOAD_NUM {
            size *= 2;
        }
        self.slots = if kept.is_empty() { Box::default() } else { vec![(0, 0); size].into() };
        self.len = kept.len();
        for (fp, tat) in kept {
            self.place(fp, tat);
        }
        before - self.len
    }
}

/// The key kept beside the lock, and which key was seen last. `repr(C)`, first in
/// [`Compact`], so that the hot key shares the lock's cache line.
#[derive(Default)]
#[repr(C)]
struct Hot {
    /// `(binding id, fingerprint, TAT)`: while present, the TAT here is the key's, and its
    /// table's entry is stale.
    key: Option<(usize, u64, u64)>,
    /// The last key looked up in a table: seen again next, it becomes the hot key.
    last: (usize, u64),
}

/// A shard's compact tables, by binding id, and its hot key.
#[derive(Default)]
#[repr(C)]
pub(super) struct Compact {
    hot: Hot,
    tables: Vec<Option<TatTable>>,
}

impl Compact {
    /// The TAT of `fp` under binding `id`, if the key is held.
    #[inline]
    pub(super) fn tat_mut(&mut self, id: usize, fp: u64) -> Option<&mut u64> {
        if matches!(self.hot.key, Some((i, f, _)) if i == id && f == fp) {
            return self.hot.key.as_mut().map(|(_, _, tat)| tat);
        }
        let slot = self.tables.get(id)?.as_ref()?.find(fp)?;
        if self.hot.last != (id, fp) {
            self.hot.last = (id, fp);
            return self.tables[id].as_mut().map(|t| &mut t.slots[slot].1);
        }
        // Seen twice in a row: it becomes the hot key, and the one before goes back.
        let tat = self.tables[id].as_ref().map_or(0, |t| t.slots[slot].1);
        self.demote();
        self.hot.key = Some((id, fp, tat));
        self.hot.key.as_mut().map(|(_, _, tat)| tat)
    }

    /// Writes the hot key's TAT back to its table.
    fn demote(&mut self) {
        if let Some((id, fp, tat)) = self.hot.key.take() {
            if let Some(slot) =
                self.tables.get_mut(id).and_then(Option::as_mut).and_then(|t| t.get_mut(fp))
            {
                *slot = tat;
            }
        }
    }

    /// Stores a new key (not held yet) of binding `id`.
    pub(super) fn insert(&mut self, id: usize, fp: u64, tat: u64) {
        if self.tables.len() <= id {
            self.tables.resize_with(id + 1, || None);
        }
        self.tables[id].get_or_insert_with(TatTable::default).insert(fp, tat);
    }

    /// Binding `id`'s keys: `(fingerprint, TAT)` (fingerprint 0 reads as 1, as it is stored).
    pub(super) fn entries(&mut self, id: usize) -> Vec<(u64, u64)> {
        self.demote();
        self.tables
            .get(id)
            .and_then(Option::as_ref)
            .map(|t| t.slots.iter().copied().filter(|(fp, _)| *fp != 0).collect())
            .unwrap_or_default()
    }

    /// How many keys binding `id` holds.
    pub(super) fn len_of(&self, id: usize) -> usize {
        self.tables.get(id).and_then(Option::as_ref).map_or(0, TatTable::len)
    }

    /// Drops binding `id`'s table; returns how many keys it held.
    pub(super) fn drop_table(&mut self, id: usize) -> usize {
        if matches!(self.hot.key, Some((i, ..)) if i == id) {
            self.hot.key = None;
        }
        self.tables.get_mut(id).and_then(Option::take).map_or(0, |t| t.len())
    }

    /// Removes the keys whose TAT is not after `now` (they decide like fresh keys); returns how
    /// many.
    pub(super) fn evict_idle(&mut self, now: u64) -> usize {
        self.demote();
        self.tables.iter_mut().flatten().map(|t| t.retain(|tat| tat > now)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_finds_what_it_holds_through_growth_and_eviction() {
        let mut t = TatTable::default();
        // Fingerprints that collide in the low bits, and 0 (stored as 1).
        let fps: Vec<u64> = (1..=1000u64).map(|i| i << 20).chain([0, 1 << 63]).collect();
        for (i, fp) in fps.iter().enumerate() {
            assert!(t.get_mut(*fp).is_none());
            t.insert(*fp, i as u64);
        }
        assert_eq!(t.len(), fps.len());
        for (i, fp) in fps.iter().enumerate() {
            assert_eq!(t.get_mut(*fp).copied(), Some(i as u64), "{fp}");
        }
        assert_eq!(t.retain(|tat| tat % 2 == 0), fps.len() / 2);
        for (i, fp) in fps.iter().enumerate() {
            assert_eq!(t.get_mut(*fp).is_some(), i % 2 == 0, "{fp}");
        }
        assert_eq!(t.retain(|_| false), fps.len() / 2);
        assert!(t.slots.is_empty(), "an emptied table gives its memory back");
    }

    #[test]
    fn the_hot_key_keeps_its_state_across_promotion_and_demotion() {
        let mut c = Compact::default();
        c.insert(0, 7, 100);
        c.insert(0, 8, 200);
        for _ in 0..3 {
            *c.tat_mut(0, 7).unwrap() += 1; // the second time it becomes hot
        }
        assert!(matches!(c.hot.key, Some((0, 7, 103))));
        *c.tat_mut(0, 8).unwrap() += 1;
        *c.tat_mut(0, 8).unwrap() += 1; // 8 becomes hot; 7 goes back to its table
        assert_eq!(c.tables[0].as_mut().unwrap().get_mut(7).copied(), Some(103));
        assert_eq!(c.tat_mut(0, 7).copied(), Some(103));
        assert_eq!(c.tat_mut(0, 8).copied(), Some(202));
        // Eviction sees the hot key's TAT, not the stale copy.
        assert_eq!(c.evict_idle(201), 1, "7 (103) is idle at 201, 8 (202) is not");
        assert_eq!(c.tat_mut(0, 8).copied(), Some(202));
        assert!(c.tat_mut(0, 7).is_none());
        assert_eq!(c.drop_table(0), 1);
        assert!(c.tat_mut(0, 8).is_none());
    }
}
