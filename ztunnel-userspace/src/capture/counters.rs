//! Reads `CAPTURE_COUNTERS` (per-CPU) and sums each counter over CPUs.

use aya::{
    Ebpf,
    maps::{MapData, PerCpuArray},
};
use ztunnel_common::{Counter, MAP_COUNTERS};

use super::{CaptureError, map_err};

/// A snapshot of every capture counter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    values: Vec<(Counter, u64)>,
}

impl CounterSnapshot {
    /// The value of one counter.
    pub fn get(&self, counter: Counter) -> u64 {
        self.values
            .iter()
            .find(|(c, _)| *c == counter)
            .map_or(0, |(_, v)| *v)
    }

    /// Every counter with its value, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (Counter, u64)> + '_ {
        self.values.iter().copied()
    }
}

/// Sums each counter over all CPUs.
pub fn read(ebpf: &Ebpf) -> Result<CounterSnapshot, CaptureError> {
    let map = ebpf
        .map(MAP_COUNTERS)
        .ok_or_else(|| map_err(MAP_COUNTERS, "not in the object"))?;
    let array: PerCpuArray<&MapData, u64> =
        PerCpuArray::try_from(map).map_err(|e| map_err(MAP_COUNTERS, e))?;
    let mut values = Vec::with_capacity(Counter::ALL.len());
    for counter in Counter::ALL {
        let per_cpu = array
            .get(&(counter as u32), 0)
            .map_err(|e| map_err(MAP_COUNTERS, e))?;
        values.push((counter, per_cpu.iter().sum()));
    }
    Ok(CounterSnapshot { values })
}
