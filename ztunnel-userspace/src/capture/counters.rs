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
    sum(&array)
}

/// Reads the counters of a running (or gone) ztunnel from its pinned map,
/// e.g. `/sys/fs/bpf/ztunnel/maps/CAPTURE_COUNTERS`.
pub fn read_pinned(maps_dir: &std::path::Path) -> Result<CounterSnapshot, CaptureError> {
    let data =
        MapData::from_pin(maps_dir.join(MAP_COUNTERS)).map_err(|e| map_err(MAP_COUNTERS, e))?;
    let map = aya::maps::Map::from_map_data(data).map_err(|e| map_err(MAP_COUNTERS, e))?;
    let array: PerCpuArray<MapData, u64> =
        PerCpuArray::try_from(map).map_err(|e| map_err(MAP_COUNTERS, e))?;
    sum(&array)
}

fn sum<T: std::borrow::Borrow<MapData>>(
    array: &PerCpuArray<T, u64>,
) -> Result<CounterSnapshot, CaptureError> {
    let mut values = Vec::with_capacity(Counter::ALL.len());
    for counter in Counter::ALL {
        let total = match array.get(&(counter as u32), 0) {
            Ok(per_cpu) => per_cpu.iter().sum(),
            // A pinned map made by an older build has fewer slots; the
            // events it has no slot for were never counted.
            Err(aya::maps::MapError::OutOfBounds { .. }) => 0,
            Err(e) => return Err(map_err(MAP_COUNTERS, e)),
        };
        values.push((counter, total));
    }
    Ok(CounterSnapshot { values })
}
